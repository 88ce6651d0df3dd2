# SPDX-License-Identifier: MPL-2.0
# make demo   - install what is missing, build, run a producer and a consumer process
# make test   - install what is missing, then fmt, clippy and every test
# make build  - release build of the plugin and the examples

CARGO ?= cargo
PLUGIN_DIR := $(CURDIR)/target/release

.PHONY: all deps build demo test check clean

all: build

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build --release --locked --lib --examples

demo: build
	@GST_PLUGIN_PATH=$(PLUGIN_DIR) scripts/demo.sh

check: deps
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --locked -- -D warnings

# The gst-launch-1.0 tests load the plugin's .so, which `cargo test` alone does not build.
test: check
	$(CARGO) build --locked --lib
	$(CARGO) test --locked

clean:
	$(CARGO) clean
