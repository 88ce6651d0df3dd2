// SPDX-License-Identifier: MPL-2.0
use gst::glib;
use gst::prelude::*;

/// The pad's caps: the producer's, set as its frames come, and downstream refusing them.
mod caps;
/// What create() pushes: the next frame, in the pad's memory, with its meta and timestamps.
mod create;
/// CUDA: registering frames with the GPU, GpuShmCudaMeta, output in CUDA memory.
mod cuda;
/// The element glue: Settings, State, GObject, GstElement and GstBaseSrc methods.
mod imp;
/// Property defaults, specs (gst-inspect's docs) and their setters and getters.
mod properties;
mod receiver;
/// Timestamps mapped from the producer's clock, and the latency answered.
mod timing;

/// The element's debug category, shared by its streaming side (imp) and its receiver.
static CAT: once_cell::sync::Lazy<gst::DebugCategory> = once_cell::sync::Lazy::new(|| {
    gst::DebugCategory::new(
        "gpushmsrc",
        gst::DebugColorFlags::empty(),
        Some("GPU shared-memory video source"),
    )
});
pub use timing::PUBLISH_TIMESTAMP_CAPS;

/// gpushmsrc's `mode`: the core crate's [`gpushm::policy::Delivery`] as a GStreamer enum.
#[derive(Debug, Eq, PartialEq, Hash, Clone, Copy, glib::Enum, Default)]
#[repr(u32)]
#[enum_type(name = "GstGpuShmDelivery")]
pub enum DeliveryMode {
    #[enum_value(
        name = "Leaky: frames this consumer is too slow for are skipped",
        nick = "leaky"
    )]
    Leaky = 0,
    #[enum_value(
        name = "Lossless: the producer waits for this consumer (up to its max-wait)",
        nick = "lossless"
    )]
    Lossless = 1,
    #[enum_value(
        name = "Auto: lossless, except for live raw video (leaky); of a live stream, waited for at most 10 % of the time (1 s at once)",
        nick = "auto"
    )]
    #[default]
    Auto = 2,
}

impl From<DeliveryMode> for gpushm::policy::Delivery {
    fn from(m: DeliveryMode) -> Self {
        match m {
            DeliveryMode::Leaky => Self::Leaky,
            DeliveryMode::Lossless => Self::Lossless,
            DeliveryMode::Auto => Self::Auto,
        }
    }
}

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
