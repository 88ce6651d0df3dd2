// SPDX-License-Identifier: MPL-2.0
//! The library's soname: libgpushm.so.0 (the ABI major version), so that apps linked against
//! it keep loading it across compatible releases (`make install` makes the links).
fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpushm.so.{major}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,keep-text-section-prefix");
}
