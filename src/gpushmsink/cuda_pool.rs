// SPDX-License-Identifier: MPL-2.0
//! The pool gpushmsink proposes to a CUDA element upstream (nvh264dec and the other NVDEC
//! decoders, cudaupload, cudaconvert, cudascale) on GStreamer 1.24+: its buffers are slots of
//! the device ring, wrapped as GstCudaMemory, so that the element writes each frame straight
//! into the ring and render() publishes it without a copy. (1.22 cannot wrap device memory:
//! there each frame is copied into a slot on the GPU.)
//!
//! GStreamer's CUDA elements keep a proposed pool only if it is a `GstCudaBufferPool` of their
//! own CUDA context (`GST_IS_CUDA_BUFFER_POOL`, then `pool->context`). That type lives in
//! libgstcuda, which the plugin loads at run time (it must load without it), so this pool is a
//! subclass registered at run time, the first time one is made: its class overrides every
//! GstBufferPool method that touches buffers, and the parent's own allocator is never made.
//!
//! The slots themselves stay with the ring's [`SlotPool`]: a buffer of this pool wraps the
//! device memory of a slot buffer it acquired there, and the wrapped memory keeps that slot
//! buffer until GStreamer frees it. The slot buffer then goes back to the SlotPool, which parks
//! it while consumers hold the slot, exactly as for a frame rendered in system memory; a
//! memory that outlives its buffer (a shallow copy in a queue) keeps its slot out too.
//!
//! An element that takes the pool but pushes other buffers (an NVDEC decoder may hand its own
//! surfaces, `gst_nv_decoder_output_picture`) gets them copied on the GPU, as before.

use std::sync::{Arc, Mutex};

use gst::glib;
use gst::glib::translate::{from_glib_borrow, Borrowed, IntoGlib, IntoGlibPtr, ToGlibPtr};
use gst::prelude::*;
use once_cell::sync::OnceCell;

use super::pool::SlotPool;
use crate::cuda::gstcuda::{self, Context, Stream, WrapFor};
use gpushm::ring::producer_end::ProducerRing;

/// The registered type's name (gst-inspect and debug logs show it).
const TYPE_NAME: &std::ffi::CStr = c"GstGpuShmCudaSlotPool";

/// The pool to propose to the element upstream of `sink_pad` for frames in CUDA memory, in
/// the CUDA context that element answers a CONTEXT query with (an application may have handed
/// it its own), or this process's if it answers none (the one gpushmsink hands CUDA elements
/// that ask it). None for an element on another GPU than the ring's: the ring's memory is
/// mapped for its own GPU only, and NVDEC decoders take any CUDA pool without comparing
/// contexts; their frames are copied across instead.
pub fn for_upstream(sink_pad: &gst::Pad, slots: &SlotPool) -> Result<gst::BufferPool, String> {
    gstcuda::can_wrap()?;
    let ring = slots.ring().ok_or("no ring")?;
    let dev = crate::cuda::vmm::of(ring.attachment())
        .ok_or("the ring is not in GPU memory")?
        .device()
        .clone();
    let ctx = match gstcuda::upstream_context(sink_pad) {
        Some(c) if c.device_id() == dev.ordinal as i32 => c,
        Some(c) => {
            return Err(format!(
                "upstream runs on GPU {}, the ring is on GPU {}",
                c.device_id(),
                dev.ordinal
            ))
        }
        None => gstcuda::process_context(&dev).ok_or("no GstCudaContext for the ring's GPU")?,
    };
    new(slots, ring, &ctx)
}

/// Makes a pool lending `slots`' slots (of `ring`, a device ring) as CUDA memory of `ctx`.
fn new(
    slots: &SlotPool,
    ring: Arc<ProducerRing>,
    ctx: &Context,
) -> Result<gst::BufferPool, String> {
    let ty = pool_type()?;
    // SAFETY: a registered type id.
    let obj = glib::Object::with_type(unsafe { glib::translate::from_glib(ty) });
    let pool = obj
        .downcast::<gst::BufferPool>()
        .map_err(|_| "the CUDA slot pool type is not a buffer pool".to_string())?;
    // SAFETY: a new GstCudaBufferPool subclass instance only this thread sees, without a
    // context; the state is set once, before anyone can call the pool's methods, and lives
    // (qdata) as long as the pool.
    unsafe {
        gstcuda::set_pool_context(pool.as_ptr(), ctx);
        pool.set_qdata(
            quark(),
            Inner {
                slots: slots.clone(),
                ring,
                ctx: ctx.clone(),
                config: Mutex::default(),
            },
        );
    }
    Ok(pool)
}

/// The slot of `ring` that `buffer`, a frame in CUDA memory, was rendered into (a buffer of
/// this pool, or a share of one), once the GPU work that wrote it has finished: it may then be
/// published as it is. `None` for CUDA memory of anything else.
pub fn written_slot(ring: &ProducerRing, buffer: &gst::BufferRef) -> Option<u32> {
    if buffer.n_memory() != 1 {
        return None;
    }
    let mem = buffer.peek_memory(0);
    if mem.offset() != 0 || !gstcuda::is_cuda_memory(mem) {
        return None;
    }
    let (ptr, len) = gstcuda::with_device_map(buffer, false, |p, l, _| (p, l))?;
    let slot = crate::cuda::vmm::slot_of_device_ptr(ring, ptr, len)?;
    gstcuda::sync_memory(mem);
    Some(slot)
}

/// What a pool keeps beside its GObject instance (qdata).
struct Inner {
    slots: SlotPool,
    ring: Arc<ProducerRing>,
    ctx: Context,
    config: Mutex<Config>,
}

/// What upstream's configuration decided.
#[derive(Default)]
struct Config {
    /// The frame layout of the caps (the ring's).
    info: Option<gst_video::VideoInfo>,
    /// The stream upstream writes on, given to each buffer's memory.
    stream: Option<Stream>,
}

fn quark() -> glib::Quark {
    static Q: OnceCell<glib::Quark> = OnceCell::new();
    *Q.get_or_init(|| glib::Quark::from_str("gpushm-cuda-slot-pool"))
}

/// The state of `pool`, one of ours.
///
/// # Safety
/// `pool` is a live instance of our type, borrowed for `'a`.
unsafe fn inner<'a>(pool: *mut gst::ffi::GstBufferPool) -> Option<&'a Inner> {
    // SAFETY: the caller's contract; the qdata lives as long as the pool.
    unsafe {
        let obj: Borrowed<glib::Object> = from_glib_borrow(pool as *mut glib::gobject_ffi::GObject);
        obj.qdata::<Inner>(quark()).map(|p| &*p.as_ptr())
    }
}

/// GstBufferPool's own class, whose methods ours call where the parent's (the CUDA pool's,
/// which would make its own allocator) must not run.
fn base_class() -> &'static gst::ffi::GstBufferPoolClass {
    struct Class(*const gst::ffi::GstBufferPoolClass);
    // SAFETY: a class struct, never freed once referenced.
    unsafe impl Send for Class {}
    unsafe impl Sync for Class {}
    static BASE: OnceCell<Class> = OnceCell::new();
    let c = BASE.get_or_init(|| {
        // SAFETY: a registered type; the reference keeps the class for the process's life.
        Class(unsafe {
            glib::gobject_ffi::g_type_class_ref(gst::ffi::gst_buffer_pool_get_type())
                as *const gst::ffi::GstBufferPoolClass
        })
    });
    // SAFETY: see above.
    unsafe { &*c.0 }
}

fn pool_type() -> Result<glib::ffi::GType, String> {
    static TYPE: OnceCell<Result<glib::ffi::GType, String>> = OnceCell::new();
    TYPE.get_or_init(|| {
        let parent = gstcuda::buffer_pool_type()?;
        // SAFETY: registering a subclass of a registered type, once per process (the cell);
        // the sizes are the parent's: the state is qdata, not instance fields.
        unsafe {
            if glib::gobject_ffi::g_type_from_name(TYPE_NAME.as_ptr()) != 0 {
                // Another copy of the plugin in this process registered it, with its own
                // state behind it: not ours to use.
                return Err(format!(
                    "{} is registered already (another copy of the gpushm plugin?)",
                    TYPE_NAME.to_string_lossy()
                ));
            }
            let mut q = std::mem::MaybeUninit::<glib::gobject_ffi::GTypeQuery>::zeroed();
            glib::gobject_ffi::g_type_query(parent, q.as_mut_ptr());
            let q = q.assume_init();
            if q.type_ == 0 {
                return Err("GstCudaBufferPool is not a registered type".into());
            }
            let info = glib::gobject_ffi::GTypeInfo {
                class_size: q.class_size as u16,
                base_init: None,
                base_finalize: None,
                class_init: Some(class_init),
                class_finalize: None,
                class_data: std::ptr::null(),
                instance_size: q.instance_size as u16,
                n_preallocs: 0,
                instance_init: None,
                value_table: std::ptr::null(),
            };
            let t = glib::gobject_ffi::g_type_register_static(parent, TYPE_NAME.as_ptr(), &info, 0);
            if t == 0 {
                return Err("could not register the CUDA slot pool type".into());
            }
            Ok(t)
        }
    })
    .clone()
}

unsafe extern "C" fn class_init(klass: glib::ffi::gpointer, _data: glib::ffi::gpointer) {
    let k = klass as *mut gst::ffi::GstBufferPoolClass;
    // SAFETY: our class struct, being initialised (a GstBufferPoolClass at its start).
    unsafe {
        (*k).get_options = Some(get_options);
        (*k).set_config = Some(set_config);
        (*k).start = Some(start);
        (*k).stop = Some(stop);
        (*k).acquire_buffer = Some(acquire_buffer);
        (*k).alloc_buffer = Some(alloc_buffer);
        (*k).release_buffer = Some(release_buffer);
        (*k).flush_start = Some(flush_start);
    }
}

/// Runs `f`, a method's body, turning a panic into `fallback`: it must not unwind into C.
fn guarded<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fallback)
}

unsafe extern "C" fn get_options(
    _pool: *mut gst::ffi::GstBufferPool,
) -> *mut *const std::ffi::c_char {
    struct Options([*const std::ffi::c_char; 2]);
    // SAFETY: pointers to static strings, only read.
    unsafe impl Sync for Options {}
    static OPTIONS: Options = Options([c"GstBufferPoolOptionVideoMeta".as_ptr(), std::ptr::null()]);
    OPTIONS.0.as_ptr() as *mut _
}

unsafe extern "C" fn set_config(
    pool: *mut gst::ffi::GstBufferPool,
    config: *mut gst::ffi::GstStructure,
) -> glib::ffi::gboolean {
    guarded(glib::ffi::GFALSE, || {
        // SAFETY: GStreamer calls with our live pool and a config it owns for the call.
        let (Some(inner), cfg) = (unsafe { inner(pool) }, unsafe {
            gst::BufferPoolConfigRef::from_glib_borrow_mut(config)
        }) else {
            return glib::ffi::GFALSE;
        };
        let Some((caps, _size, min, _max)) = cfg.params() else {
            return glib::ffi::GFALSE;
        };
        // Only raw video of the ring's size: what the ring's slots were made for.
        let Some(info) = caps
            .as_ref()
            .and_then(|c| gst_video::VideoInfo::from_caps(c).ok())
            .filter(|i| i.size() as u64 <= inner.ring.slot_size())
        else {
            return glib::ffi::GFALSE;
        };
        let n = inner.ring.slot_count();
        cfg.set_params(caps.as_ref(), info.size() as u32, min.min(n), n);
        let stream = Stream::of_pool_config(cfg);
        *inner.config.lock().unwrap_or_else(|e| e.into_inner()) = Config {
            info: Some(info),
            stream,
        };
        match base_class().set_config {
            // SAFETY: GstBufferPool's own method on our pool, with the config we were given.
            Some(f) => unsafe { f(pool, config) },
            None => glib::ffi::GTRUE,
        }
    })
}

unsafe extern "C" fn start(pool: *mut gst::ffi::GstBufferPool) -> glib::ffi::gboolean {
    guarded(glib::ffi::GFALSE, || {
        // SAFETY: our live pool.
        let Some(inner) = (unsafe { inner(pool) }) else {
            return glib::ffi::GFALSE;
        };
        // Nothing is allocated ahead (the slots are the ring's); the slot pool is made ready
        // for the caps, unless the sink's copies did so already.
        let info = inner
            .config
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .info
            .clone();
        let Some(info) = info else {
            return glib::ffi::GFALSE;
        };
        glib::ffi::gboolean::from(activate_slots(&inner.slots, &info))
    })
}

/// Configures and activates the ring's slot pool for raw video `info` if it is not active,
/// unless the sink retired it (its ring was replaced: upstream must take the new ring's pool).
fn activate_slots(slots: &SlotPool, info: &gst_video::VideoInfo) -> bool {
    if slots.is_retired() {
        return false;
    }
    if slots.is_active() {
        return true;
    }
    let Ok(caps) = info.to_caps() else {
        return false;
    };
    let mut config = slots.config();
    config.set_params(Some(&caps), info.size() as u32, 0, 0);
    config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
    // (Another thread may have activated it meanwhile: then the config is refused, fine.)
    let _ = slots.set_config(config);
    slots.set_active(true).is_ok() || slots.is_active()
}

unsafe extern "C" fn stop(pool: *mut gst::ffi::GstBufferPool) -> glib::ffi::gboolean {
    // Every buffer is back (GstBufferPool stops only then) and none is kept: the slot pool
    // stays as it is, the sink's.
    match base_class().stop {
        // SAFETY: GstBufferPool's own method on our pool: it frees its (empty) queue.
        Some(f) => unsafe { f(pool) },
        None => glib::ffi::GTRUE,
    }
}

unsafe extern "C" fn acquire_buffer(
    pool: *mut gst::ffi::GstBufferPool,
    buffer: *mut *mut gst::ffi::GstBuffer,
    params: *mut gst::ffi::GstBufferPoolAcquireParams,
) -> gst::ffi::GstFlowReturn {
    guarded(gst::ffi::GST_FLOW_ERROR, || {
        // SAFETY: GStreamer calls with our live pool, an out pointer and optional params.
        let Some(inner) = (unsafe { inner(pool) }) else {
            return gst::ffi::GST_FLOW_ERROR;
        };
        let dontwait = !params.is_null()
            // SAFETY: non-null params GStreamer passes for the call.
            && unsafe { (*params).flags } & gst::ffi::GST_BUFFER_POOL_ACQUIRE_FLAG_DONTWAIT != 0;
        // SAFETY: our live pool, for as long as this call.
        let cancelled = || unsafe { super::pool::is_flushing(pool) };
        if cancelled() {
            return gst::ffi::GST_FLOW_FLUSHING;
        }
        match inner.lend(dontwait, &cancelled) {
            Ok(b) => {
                // SAFETY: the out pointer GStreamer gave; it takes our reference.
                unsafe { *buffer = b.into_glib_ptr() };
                gst::ffi::GST_FLOW_OK
            }
            Err(e) => gst::FlowReturn::from_error(e).into_glib(),
        }
    })
}

impl Inner {
    /// A buffer whose one memory is a free slot's GPU memory, writable, in our context.
    fn lend(
        &self,
        dontwait: bool,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<gst::Buffer, gst::FlowError> {
        let info = self
            .config
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .info
            .clone()
            .ok_or(gst::FlowError::NotNegotiated)?;
        // (Without the config's lock: this may wait for a slot.)
        let slot_buffer = self.slots.acquire_unless(dontwait, cancelled)?;
        let slot = self
            .slots
            .slot_of(&slot_buffer)
            .ok_or(gst::FlowError::Error)?;
        let dev_ptr =
            crate::cuda::vmm::device_ptr_of_slot(&self.ring, slot).ok_or(gst::FlowError::Error)?;
        let config = self.config.lock().unwrap_or_else(|e| e.into_inner());
        // The slot buffer is kept by the memory: it goes back to the slot pool (parked while
        // consumers hold the slot) when GStreamer frees the memory.
        let mem = gstcuda::wrap_device_memory(
            &self.ctx,
            config.stream.as_ref(),
            // SAFETY: the info's own struct, borrowed for the call.
            unsafe { &*info.to_glib_none().0 },
            dev_ptr,
            Box::new(slot_buffer),
            WrapFor::Writing,
        )
        .map_err(|_| gst::FlowError::Error)?;
        drop(config);
        let mut buffer = gst::Buffer::new();
        {
            let b = buffer.get_mut().ok_or(gst::FlowError::Error)?;
            b.append_memory(mem);
            crate::geometry::add_caps_layout_meta(b, &info).map_err(|_| gst::FlowError::Error)?;
        }
        Ok(buffer)
    }
}

unsafe extern "C" fn alloc_buffer(
    _pool: *mut gst::ffi::GstBufferPool,
    _buffer: *mut *mut gst::ffi::GstBuffer,
    _params: *mut gst::ffi::GstBufferPoolAcquireParams,
) -> gst::ffi::GstFlowReturn {
    // Never called: acquire_buffer lends slots and start allocates nothing ahead.
    gst::ffi::GST_FLOW_NOT_SUPPORTED
}

unsafe extern "C" fn release_buffer(
    _pool: *mut gst::ffi::GstBufferPool,
    buffer: *mut gst::ffi::GstBuffer,
) {
    // Not kept: its memory goes, and with it the slot buffer, to the slot pool, which lends
    // the slot again once no consumer holds it.
    // SAFETY: GStreamer hands us its reference to the buffer (no longer of any pool).
    unsafe { gst::ffi::gst_mini_object_unref(buffer as *mut gst::ffi::GstMiniObject) };
}

unsafe extern "C" fn flush_start(pool: *mut gst::ffi::GstBufferPool) {
    // The flushing flag is set: a wait for a slot looks at it again now.
    // SAFETY: our live pool.
    if let Some(inner) = unsafe { inner(pool) } {
        inner.slots.wake();
    }
}
