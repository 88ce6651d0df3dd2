// SPDX-License-Identifier: MPL-2.0
//! The library's soname: libgpushm.so.0 (the ABI major version), so that apps linked against
//! it keep loading it across compatible releases (`make install` makes the links).
fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpushm.so.{major}");
    // The frame's way in one place (functions marked `#[link_section = ".text.hot.gpushm"]`,
    // here and in the core): GNU ld groups `.text.hot.*` by itself, LLD (rustc's default
    // linker on x86_64 Linux) only with this flag.
    let lld_default = std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64")
        && std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
    if lld_default {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,keep-text-section-prefix");
    }
}
