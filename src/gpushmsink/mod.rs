// SPDX-License-Identifier: MPL-2.0
use gst::glib;
use gst::prelude::*;

mod imp;
pub mod pool;

glib::wrapper! {
    pub struct GpuShmSink(ObjectSubclass<imp::GpuShmSink>) @extends gst_base::BaseSink, gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    gst::Element::register(
        Some(plugin),
        "gpushmsink",
        gst::Rank::NONE,
        GpuShmSink::static_type(),
    )
}
