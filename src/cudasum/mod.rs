// SPDX-License-Identifier: MPL-2.0
use gst::glib;
use gst::prelude::*;

mod imp;
pub mod planes;

glib::wrapper! {
    pub struct CudaSum(ObjectSubclass<imp::CudaSum>) @extends gst_base::BaseTransform, gst::Element, gst::Object;
}

#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstGpuShmCudaSumBackend")]
pub enum Backend {
    #[enum_value(
        name = "Auto: CUDA when a GPU is present, else the CPU (with a warning)",
        nick = "auto"
    )]
    Auto = 0,
    #[enum_value(name = "CUDA: fail at NULL->READY without a GPU", nick = "cuda")]
    Cuda = 1,
    #[enum_value(name = "CPU reference", nick = "cpu")]
    Cpu = 2,
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    #[cfg(feature = "doc")]
    Backend::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    gst::Element::register(
        Some(plugin),
        "cudasum",
        gst::Rank::NONE,
        CudaSum::static_type(),
    )
}
