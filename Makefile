# SPDX-License-Identifier: MPL-2.0
# make demo   - install what is missing, build, run a producer and a consumer process
# make test   - install what is missing, then fmt, clippy and every test
# make build  - release build of the plugin and the examples

CARGO ?= cargo
PLUGIN_DIR := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)/release

.PHONY: all deps build demo test check clean python-test

all: build

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build --release --locked --lib --examples

demo: build
	@GST_PLUGIN_PATH=$(PLUGIN_DIR) scripts/demo.sh

check: deps
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

# meson builds the plugin's .so (the gst-launch-1.0 tests load it), `meson test` runs
# `cargo test`, and the install into a scratch DESTDIR is checked.
test: check
	[ -d builddir ] || meson setup builddir --buildtype=debug
	meson compile -C builddir
	meson test -C builddir --verbose
	scratch=$$(mktemp -d) && DESTDIR=$$scratch meson install -C builddir --no-rebuild --quiet && \
	  find $$scratch -path '*/gstreamer-1.0/libgstgpushm.so' | grep -q . && rm -rf $$scratch
	$(MAKE) python-test

# The Python package, installed as the README says (pip install ./python) into a venv of its
# own, then its tests (the GPU ones are marked and deselected here).
PYVENV := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)/pyvenv
python-test:
	[ -x $(PYVENV)/bin/pip ] || python3 -m venv $(PYVENV)
	$(PYVENV)/bin/pip install -q pytest numpy
	$(PYVENV)/bin/pip install -q --force-reinstall --no-deps ./python
	cd python/tests && $(PYVENV)/bin/pytest -q -p no:cacheprovider -m "not gpu" .

clean:
	$(CARGO) clean
