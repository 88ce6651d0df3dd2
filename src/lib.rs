// SPDX-License-Identifier: MPL-2.0
#![allow(clippy::new_without_default)]
//! gpushm: share live video between processes through a shared-memory ring that CUDA can read
//! in place.
//!
//! - `gpushmsink`: serves a ring at a unix socket; upstream renders into it.
//! - `gpushmsrc`: maps a producer's ring read-only and pushes buffers that point into it.

use gst::glib;
use once_cell::sync::Lazy;

/// The plugin-wide debug category, for code shared by several elements.
pub(crate) static CAT: Lazy<gst::DebugCategory> = Lazy::new(|| {
    gst::DebugCategory::new(
        "gpushm",
        gst::DebugColorFlags::empty(),
        Some("gpushm shared code"),
    )
});

pub mod clock;
mod cpu_latency;
pub mod cuda;
pub mod cudameta;
mod cudasum;
/// Tags and custom events as they travel from gpushmsink to gpushmsrc.
pub mod events;
pub mod frame_metas;
pub mod geometry;
mod gpushmsink;
mod gpushmsrc;
pub mod memory;
pub mod pattern;
pub mod serialized_metas;
#[cfg(feature = "stages")]
pub mod stages;

pub use cudasum::planes as sum_planes;
pub use gpushmsrc::PUBLISH_TIMESTAMP_CAPS;

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    cudameta::register();
    gpushmsink::register(plugin)?;
    cudasum::register(plugin)?;
    gpushmsrc::register(plugin)?;
    Ok(())
}

gst::plugin_define!(
    gpushm,
    env!("CARGO_PKG_DESCRIPTION"),
    plugin_init,
    concat!(env!("CARGO_PKG_VERSION"), "-", env!("COMMIT_ID")),
    "MPL",
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_REPOSITORY"),
    env!("BUILD_REL_DATE")
);
