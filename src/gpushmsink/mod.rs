// SPDX-License-Identifier: MPL-2.0
use gst::glib;
use gst::prelude::*;

/// What a stream is from its caps, the caps accepted, the ring's caps and slot size.
mod caps;
/// Copies of buffers into ring slots (system and CUDA memory), and to a device ring's GPU.
mod copy;
/// The pool CUDA elements upstream render into: device-ring slots as CUDA memory (1.24+).
mod cuda_pool;
/// The direct chain around GstBaseSink's chain function, its clipping and positions.
mod direct;
/// Tags and custom events passed on to consumers in order with the buffers.
mod events;
/// The element glue: Settings, State, GObject, GstElement and GstBaseSink methods.
mod imp;
/// The FrameMeta of a buffer: times on CLOCK_MONOTONIC, planes, time code.
mod metas;
/// The buffer pool over the ring's slots, and the server type.
pub mod pool;
/// Property defaults, specs (gst-inspect's docs) and their setters and getters.
mod properties;
/// What render() does with a buffer: publish its slot, or a copy.
mod publish;
/// The ring of the current caps, made again on a caps change or a buffer too large.
mod ring;
/// The `stats` property's structure.
mod stats;

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

/// The frame description gpushmsink publishes for frames laid out as `info`, for the
/// consumer-side tests of what it reads.
#[cfg(test)]
pub(crate) fn frame_template_for_tests(
    info: &gst_video::VideoInfo,
) -> gpushm::ring::producer_end::FrameMeta {
    metas::frame_template(info)
}
