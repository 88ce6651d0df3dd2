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
    // Caps strings from the producer name GstVideo's types (multiview-flags of video caps,
    // raw or encoded, is a GstVideoMultiviewFlagsSet): they must be registered before the
    // first caps are parsed, or parsing fails in a process whose pipeline has not touched
    // them yet.
    // SAFETY: a plain GType getter, callable any time after gst_init().
    let _ = unsafe { gst_video::ffi::gst_video_multiview_flagset_get_type() };
    let _ = gst_video::VideoMultiviewFlags::static_type();
    let _ = gst_video::VideoMultiviewMode::static_type();
    gst::Element::register(
        Some(plugin),
        "gpushmsrc",
        gst::Rank::NONE,
        GpuShmSrc::static_type(),
    )
}
