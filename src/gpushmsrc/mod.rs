// SPDX-License-Identifier: MPL-2.0
use gst::glib;
use gst::prelude::*;

mod imp;
mod receiver;
pub use imp::PUBLISH_TIMESTAMP_CAPS;

glib::wrapper! {
    pub struct GpuShmSrc(ObjectSubclass<imp::GpuShmSrc>) @extends gst_base::PushSrc, gst_base::BaseSrc, gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    gst::Element::register(
        Some(plugin),
        "gpushmsrc",
        gst::Rank::NONE,
        GpuShmSrc::static_type(),
    )
}
