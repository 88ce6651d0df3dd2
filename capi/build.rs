// SPDX-License-Identifier: MPL-2.0
//! The library's soname: libgpushm.so.0 (the ABI major version), so that apps linked against
//! it keep loading it across compatible releases (`make install` makes the links).
fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpushm.so.{major}");
    // The frame's way in one place (functions marked `#[link_section = ".text.hot.gpushm"]`,
    // here and in the core): GNU ld groups `.text.hot.*` by itself, LLD only with this flag.
    // LLD is rustc's default linker for x86_64-unknown-linux-gnu (Rust 1.90 on); a GNU ld
    // given the flag there (a linker set by hand) warns and ignores it, and an LLD elsewhere
    // (set by hand) links without the grouping: speed only, never correctness.
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let lld_default = var("CARGO_CFG_TARGET_ARCH") == "x86_64"
        && var("CARGO_CFG_TARGET_OS") == "linux"
        && var("CARGO_CFG_TARGET_ENV") == "gnu";
    if lld_default {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,keep-text-section-prefix");
    }
}
