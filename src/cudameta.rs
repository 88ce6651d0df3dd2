// SPDX-License-Identifier: MPL-2.0
//! `GpuShmCudaMeta`: tells CUDA elements where a buffer's bytes are in GPU address space.
//!
//! Buffers from gpushmsrc (and from gpushmsink's pool) sit in a ring that this process
//! registered with CUDA once. When a CUDA device was found, each such buffer carries a
//! GstCustomMeta named `GpuShmCudaMeta` (GStreamer ≥ 1.20) whose structure holds:
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `cuda-device` | gint | ordinal of the device the memory is registered for |
//! | `device-ptr` | guint64 | CUdeviceptr of the buffer's first byte (memory 0, offset 0) |
//! | `size` | guint64 | bytes readable from `device-ptr` |
//! | `read-only` | gboolean | registered with CU_MEMHOSTREGISTER_READ_ONLY: kernels must not write |
//!
//! The device address of plane *i* is `device-ptr + GstVideoMeta.offset[i]`. It is valid in any
//! CUDA context on that device (the registration is PORTABLE) for as long as the buffer lives.
//! The meta is tagged "memory", so it is dropped whenever the memory is copied or replaced.
//!
//! From C: `gst_buffer_get_custom_meta (buf, "GpuShmCudaMeta")` then
//! `gst_custom_meta_get_structure()`.

pub const CUDA_META_NAME: &str = "GpuShmCudaMeta";

/// Registers the meta type (once per process; needs gst::init).
pub fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if !gst::meta::CustomMeta::is_registered(CUDA_META_NAME) {
            gst::meta::CustomMeta::register(CUDA_META_NAME, &["memory"]);
        }
    });
}

/// What a `GpuShmCudaMeta` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaPtr {
    pub device: i32,
    pub device_ptr: u64,
    pub size: u64,
    pub read_only: bool,
}

pub fn add(buffer: &mut gst::BufferRef, p: CudaPtr) {
    register();
    if let Ok(mut meta) = gst::meta::CustomMeta::add(buffer, CUDA_META_NAME) {
        let s = meta.mut_structure();
        s.set("cuda-device", p.device);
        s.set("device-ptr", p.device_ptr);
        s.set("size", p.size);
        s.set("read-only", p.read_only);
    }
}

pub fn get(buffer: &gst::BufferRef) -> Option<CudaPtr> {
    let meta = gst::meta::CustomMeta::from_buffer(buffer, CUDA_META_NAME).ok()?;
    let s = meta.structure();
    Some(CudaPtr {
        device: s.get("cuda-device").ok()?,
        device_ptr: s.get("device-ptr").ok()?,
        size: s.get("size").ok()?,
        read_only: s.get("read-only").unwrap_or(true),
    })
}
