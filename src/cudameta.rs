// SPDX-License-Identifier: MPL-2.0
//! `GpuShmCudaMeta`: tells CUDA elements where a buffer's bytes are in GPU address space.
//!
//! Buffers from gpushmsrc (and from gpushmsink's pool) sit in a ring that this process
//! registered with CUDA once. When an element asked for it (see below) and a CUDA device was
//! found, each such buffer carries a
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
//!
//! ## Asking for it
//! Registering memory with CUDA creates a CUDA context (≈100 MiB of host memory on a desktop
//! GPU, more start-up time), so with `cuda-register=auto` (the default) the elements register
//! only for elements that ask:
//! - **Downstream of gpushmsrc**: list the meta's API in your answer to the ALLOCATION query
//!   (`propose_allocation`), as cudasum does. From C:
//!   `gst_query_add_allocation_meta (query, gst_meta_get_info ("GpuShmCudaMeta")->api, NULL);`
//! - **Upstream of gpushmsink**: gpushmsink lists the same API in its ALLOCATION answer and
//!   offers its pool; set the option `GstBufferPoolOptionGpuShmCudaMeta` in the pool's config
//!   (`gst_buffer_pool_config_add_option`) and its buffers carry the meta.
//!
//! `cuda-register=always` registers every ring whoever asks, `never` never does.
//!
//! ## Coherency
//! On Jetson (Xavier, Orin) the GPU snoops the CPU's caches but the CPU does not snoop the
//! GPU's. So a CUDA element that writes a frame into gpushmsink's pool must synchronize (its
//! stream, or the context) before it pushes the buffer, and an element that reads frames from
//! gpushmsrc with kernels must wait for them to finish before it lets the buffer go: once the
//! buffer is dropped, the producer may render the next frame into the same memory. cudasum
//! does both (it waits for its kernels before returning the buffer).

use gst::glib;

pub const CUDA_META_NAME: &str = "GpuShmCudaMeta";

/// The buffer pool option an upstream element sets on gpushmsink's pool to get device
/// pointers on its buffers.
pub const POOL_OPTION_CUDA_META: &str = "GstBufferPoolOptionGpuShmCudaMeta";

/// When the gpushm elements register their rings with CUDA.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstGpuShmCudaRegister")]
pub enum CudaRegister {
    #[enum_value(
        name = "Only when another element asks for GpuShmCudaMeta (ALLOCATION query or pool option)",
        nick = "auto"
    )]
    Auto = 0,
    #[enum_value(name = "Always, when a GPU is found", nick = "always")]
    Always = 1,
    #[enum_value(name = "Never (no CUDA context in this process)", nick = "never")]
    Never = 2,
}

/// Where gpushmsink keeps its ring's pixels.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstGpuShmRing")]
pub enum RingPlacement {
    #[enum_value(
        name = "Host memory (a memfd, registered with CUDA where asked): every consumer",
        nick = "host"
    )]
    Host = 0,
    #[enum_value(
        name = "GPU memory of cuda-device-id (a device ring): consumers read frames on the GPU",
        nick = "device"
    )]
    Device = 1,
    #[enum_value(
        name = "GPU memory for input in CUDA memory on a discrete GPU, host memory otherwise",
        nick = "auto"
    )]
    Auto = 2,
}

/// The meta's API type, for ALLOCATION queries:
/// `query.add_allocation_meta::<CudaMetaApi>(None)`, `query.find_allocation_meta::<CudaMetaApi>()`.
pub struct CudaMetaApi;

// SAFETY: meta_api() returns the API type GStreamer registered for the custom meta.
unsafe impl gst::meta::MetaAPI for CudaMetaApi {
    type GstType = gst::ffi::GstCustomMeta;

    fn meta_api() -> glib::Type {
        use glib::translate::from_glib;
        register();
        // SAFETY: registered above; GstMetaInfo lives for the whole process.
        unsafe {
            let info = gst::ffi::gst_meta_get_info(c"GpuShmCudaMeta".as_ptr());
            if info.is_null() {
                return glib::Type::INVALID;
            }
            from_glib((*info).api)
        }
    }
}

/// Registers the meta type (once per process; needs gst::init).
///
/// The meta follows its buffer's memory: a copy of the buffer keeps it only where the copy
/// holds the same memory (a shallow copy, or a share of it), never where the memory itself was
/// copied (a deep copy, `make_writable` of a frame, a memory that cannot be shared): there the
/// device address would point at the ring's slot, which the copy does not keep.
pub fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if !gst::meta::CustomMeta::is_registered(CUDA_META_NAME) {
            gst::meta::CustomMeta::register_with_transform(
                CUDA_META_NAME,
                &["memory"],
                |dest, meta, src, kind| {
                    if kind != <gst::meta::MetaTransformCopy as gst::meta::MetaTransform>::quark()
                        || !same_memory(dest, src)
                    {
                        return false;
                    }
                    let s = meta.structure();
                    let p = CudaPtr {
                        device: s.get("cuda-device").unwrap_or(-1),
                        device_ptr: s.get("device-ptr").unwrap_or(0),
                        size: s.get("size").unwrap_or(0),
                        read_only: s.get("read-only").unwrap_or(true),
                    };
                    if p.device_ptr != 0 {
                        add(dest, p);
                    }
                    true
                },
            );
        }
    });
}

/// Whether `dest` (a copy of `src`) holds `src`'s first memory itself, or a share of it.
fn same_memory(dest: &gst::BufferRef, src: &gst::BufferRef) -> bool {
    if dest.n_memory() != 1 || src.n_memory() != 1 {
        return false;
    }
    let (d, s) = (dest.peek_memory(0).as_ptr(), src.peek_memory(0).as_ptr());
    // SAFETY: both memories are alive (their buffers are); `parent` is a plain field.
    let (dp, sp) = unsafe { ((*d).parent, (*s).parent) };
    d == s || (!dp.is_null() && (std::ptr::eq(dp, s) || dp == sp))
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
