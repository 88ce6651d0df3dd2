// SPDX-License-Identifier: MPL-2.0
//! GStreamer's CUDA library (`libgstcuda-1.0`, public since GStreamer 1.22), loaded at run
//! time: the plugin still loads on 1.20 (JetPack 6) and without CUDA, and the few calls the
//! elements need (the CUDA context every nvcodec element shares, CUDA buffer pools) are bound
//! here with libloading, the way [`super::nvrtc`] binds NVRTC.
//!
//! The elements never touch a `GstCudaMemory` field: device addresses come from mapping a
//! buffer with [`MAP_CUDA`], plane layouts from its `GstVideoMeta`.

use std::ffi::c_int;

use gst::glib;
use gst::glib::translate::{from_glib_full, ToGlibPtr};
use gst::prelude::*;
use libloading::Library;
use once_cell::sync::OnceCell;

/// `GST_MAP_CUDA` (gst/cuda/gstcudamemory.h, 1.22: `GST_MAP_FLAG_LAST << 1`): maps a
/// GstCudaMemory to its device address instead of a host copy.
pub const MAP_CUDA: gst::ffi::GstMapFlags = gst::ffi::GST_MAP_FLAG_LAST << 1;

/// Maps `buffer` (a GstCudaMemory, or gpushm's device-slot memory) to its device address and
/// runs `f` with that address, the mapped size and the memory's CUDA stream; unmaps after.
/// `None` when it cannot be mapped on the GPU (a buffer in system memory, or read-only asked
/// for `write`).
///
/// The stream (GStreamer 1.24+, null before and for memory without one) is the one the
/// memory's owner orders its work on: its writes may still be running there (1.24+ elements
/// push frames without waiting for them, `GST_CUDA_MEMORY_TRANSFER_NEED_SYNC`), so a copy
/// queued on that stream sees them, as GStreamer's own elements do. Null means the memory is
/// ready (1.22's elements synchronize before they push).
pub fn with_device_map<R>(
    buffer: &gst::BufferRef,
    write: bool,
    f: impl FnOnce(u64, u64, u64) -> R,
) -> Option<R> {
    let stream = if buffer.n_memory() == 1 {
        memory_stream(buffer.peek_memory(0))
    } else {
        0
    };
    let flags = MAP_CUDA
        | if write {
            gst::ffi::GST_MAP_WRITE
        } else {
            gst::ffi::GST_MAP_READ
        };
    // SAFETY: a live buffer; a successful map is undone below, after `f` returned (the
    // copies `f` makes are synchronous). Writing needs a writable buffer, which GStreamer
    // checks (the map fails otherwise).
    unsafe {
        let mut map = std::mem::MaybeUninit::<gst::ffi::GstMapInfo>::zeroed();
        if gst::ffi::gst_buffer_map(buffer.as_mut_ptr(), map.as_mut_ptr(), flags)
            == glib::ffi::GFALSE
        {
            return None;
        }
        let mut map = map.assume_init();
        let r = f(map.data as u64, map.size as u64, stream);
        gst::ffi::gst_buffer_unmap(buffer.as_mut_ptr(), &mut map);
        Some(r)
    }
}

/// The caps feature of buffers in CUDA device memory.
pub const CUDA_MEMORY: &str = "memory:CUDAMemory";

/// The context type of a GstCudaContext (`GST_CUDA_CONTEXT_TYPE`).
pub const CONTEXT_TYPE: &str = "gst.cuda.context";

/// The library names tried, in order.
const LIBRARY_NAMES: [&str; 2] = ["libgstcuda-1.0.so.0", "libgstcuda-1.0.so"];

type Ctx = *mut gst::ffi::GstObject;

struct Fns {
    load_library: unsafe extern "C" fn() -> glib::ffi::gboolean,
    memory_init_once: unsafe extern "C" fn(),
    ensure_element_context:
        unsafe extern "C" fn(*mut gst::ffi::GstElement, c_int, *mut Ctx) -> glib::ffi::gboolean,
    handle_set_context: unsafe extern "C" fn(
        *mut gst::ffi::GstElement,
        *mut gst::ffi::GstContext,
        c_int,
        *mut Ctx,
    ) -> glib::ffi::gboolean,
    handle_context_query: unsafe extern "C" fn(
        *mut gst::ffi::GstElement,
        *mut gst::ffi::GstQuery,
        Ctx,
    ) -> glib::ffi::gboolean,
    buffer_pool_new: unsafe extern "C" fn(Ctx) -> *mut gst::ffi::GstBufferPool,
    buffer_pool_get_type: unsafe extern "C" fn() -> glib::ffi::GType,
    context_get_type: unsafe extern "C" fn() -> glib::ffi::GType,
    is_cuda_memory: unsafe extern "C" fn(*mut gst::ffi::GstMemory) -> glib::ffi::gboolean,
    context_new_wrapped: unsafe extern "C" fn(*mut std::ffi::c_void, c_int) -> Ctx,
    context_new_cuda_context: unsafe extern "C" fn(Ctx) -> *mut gst::ffi::GstContext,
    context_push: unsafe extern "C" fn(Ctx) -> glib::ffi::gboolean,
    context_pop: unsafe extern "C" fn(*mut *mut std::ffi::c_void) -> glib::ffi::gboolean,
    /// `gst_cuda_allocator_alloc_wrapped` (GStreamer 1.24+); `None` before.
    alloc_wrapped: Option<AllocWrapped>,
    /// `gst_cuda_memory_get_stream` and `gst_cuda_stream_get_handle` (1.24+); `None` before.
    stream_of: Option<StreamOf>,
    /// What a pool of wrapped memory needs besides `alloc_wrapped` (1.24+); `None` before.
    pool_streams: Option<PoolStreams>,
}

/// `GstCudaStream *gst_buffer_pool_config_get_cuda_stream (GstStructure *)`,
/// `void gst_cuda_stream_unref (GstCudaStream *)` and
/// `void gst_cuda_memory_sync (GstCudaMemory *)`, all 1.24+.
#[derive(Clone, Copy)]
struct PoolStreams {
    config_get_cuda_stream:
        unsafe extern "C" fn(*mut gst::ffi::GstStructure) -> *mut std::ffi::c_void,
    stream_unref: unsafe extern "C" fn(*mut std::ffi::c_void),
    memory_sync: unsafe extern "C" fn(*mut gst::ffi::GstMemory),
}

/// `GstCudaStream *gst_cuda_memory_get_stream (GstCudaMemory *)` and
/// `CUstream gst_cuda_stream_get_handle (GstCudaStream *)`.
#[derive(Clone, Copy)]
struct StreamOf {
    memory_get_stream: unsafe extern "C" fn(*mut gst::ffi::GstMemory) -> *mut std::ffi::c_void,
    stream_get_handle: unsafe extern "C" fn(*mut std::ffi::c_void) -> *mut std::ffi::c_void,
}

/// `GstMemory *gst_cuda_allocator_alloc_wrapped (GstCudaAllocator *, GstCudaContext *,
/// GstCudaStream *, const GstVideoInfo *, CUdeviceptr, gpointer, GDestroyNotify)`.
type AllocWrapped = unsafe extern "C" fn(
    *mut gst::ffi::GstAllocator,
    Ctx,
    *mut std::ffi::c_void,
    *const gst_video::ffi::GstVideoInfo,
    u64,
    glib::ffi::gpointer,
    glib::ffi::GDestroyNotify,
) -> *mut gst::ffi::GstMemory;

struct GstCuda {
    /// Keeps the symbols below loaded.
    _lib: Library,
    f: Fns,
}

// SAFETY: only function pointers are stored; the library's calls are thread-safe.
unsafe impl Send for GstCuda {}
unsafe impl Sync for GstCuda {}

/// # Safety
/// `lib` must be GStreamer's CUDA library (these C signatures are those of 1.22 and later).
unsafe fn bind(lib: &Library) -> Result<Fns, libloading::Error> {
    // SAFETY: the caller's contract.
    unsafe {
        Ok(Fns {
            load_library: *lib.get(b"gst_cuda_load_library\0")?,
            memory_init_once: *lib.get(b"gst_cuda_memory_init_once\0")?,
            ensure_element_context: *lib.get(b"gst_cuda_ensure_element_context\0")?,
            handle_set_context: *lib.get(b"gst_cuda_handle_set_context\0")?,
            handle_context_query: *lib.get(b"gst_cuda_handle_context_query\0")?,
            buffer_pool_new: *lib.get(b"gst_cuda_buffer_pool_new\0")?,
            buffer_pool_get_type: *lib.get(b"gst_cuda_buffer_pool_get_type\0")?,
            context_get_type: *lib.get(b"gst_cuda_context_get_type\0")?,
            is_cuda_memory: *lib.get(b"gst_is_cuda_memory\0")?,
            context_new_wrapped: *lib.get(b"gst_cuda_context_new_wrapped\0")?,
            context_new_cuda_context: *lib.get(b"gst_context_new_cuda_context\0")?,
            context_push: *lib.get(b"gst_cuda_context_push\0")?,
            context_pop: *lib.get(b"gst_cuda_context_pop\0")?,
            alloc_wrapped: lib
                .get::<AllocWrapped>(b"gst_cuda_allocator_alloc_wrapped\0")
                .ok()
                .map(|f| *f),
            stream_of: lib
                .get(b"gst_cuda_memory_get_stream\0")
                .and_then(|m| Ok((*m, *lib.get(b"gst_cuda_stream_get_handle\0")?)))
                .ok()
                .map(|(memory_get_stream, stream_get_handle)| StreamOf {
                    memory_get_stream,
                    stream_get_handle,
                }),
            pool_streams: (|| -> Result<PoolStreams, libloading::Error> {
                Ok(PoolStreams {
                    config_get_cuda_stream: *lib
                        .get(b"gst_buffer_pool_config_get_cuda_stream\0")?,
                    stream_unref: *lib.get(b"gst_cuda_stream_unref\0")?,
                    memory_sync: *lib.get(b"gst_cuda_memory_sync\0")?,
                })
            })()
            .ok(),
        })
    }
}

fn open() -> Result<GstCuda, String> {
    let mut tried = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: a GStreamer library: its initialisers only register types.
        let lib = match unsafe { Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
        };
        // SAFETY: the library is GStreamer's CUDA library by name.
        match unsafe { bind(&lib) } {
            Ok(f) => {
                // SAFETY: plain calls, once per process (guarded by the OnceCell below).
                unsafe {
                    if (f.load_library)() == glib::ffi::GFALSE {
                        return Err(format!("{name} could not load libcuda"));
                    }
                    (f.memory_init_once)();
                }
                return Ok(GstCuda { _lib: lib, f });
            }
            Err(e) => tried.push(format!("{name}: {e} (GStreamer older than 1.22?)")),
        }
    }
    Err(format!(
        "GStreamer's CUDA library (libgstcuda-1.0, GStreamer ≥ 1.22 with nvcodec) is not usable: {}",
        tried.join("; ")
    ))
}

fn lib() -> Result<&'static GstCuda, String> {
    static LIB: OnceCell<Result<GstCuda, String>> = OnceCell::new();
    LIB.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// Whether GStreamer's CUDA library loads here (and found libcuda): CUDA memory caps are
/// offered only then. The reason otherwise.
pub fn available() -> Result<(), String> {
    lib().map(|_| ())
}

/// A `GstCudaContext`: the CUDA context GStreamer's CUDA elements of a pipeline share.
#[derive(Clone, Debug)]
pub struct Context(gst::Object);

impl Context {
    /// The device ordinal it is on (its `cuda-device-id`).
    pub fn device_id(&self) -> i32 {
        let v = self.0.property_value("cuda-device-id");
        v.get::<u32>()
            .map(|d| d as i32)
            .or_else(|_| v.get::<i32>())
            .unwrap_or(-1)
    }

    /// The GstCudaContext object itself.
    pub fn object(&self) -> &gst::Object {
        &self.0
    }

    fn as_ptr(&self) -> Ctx {
        self.0.to_glib_none().0
    }
}

/// This process's CUDA context on GPU `dev` (the primary context gpushm's own CUDA work
/// runs in) as a GstCudaContext, made once per GPU and shared by every gpushm element. They
/// hand it to GStreamer's CUDA elements (answering their context query, or as the context
/// they find none for), which then run in it too: a CUDA context costs hundreds of MiB of GPU
/// memory, and a process sharing frames with CUDA elements then has one, not two. GStreamer
/// never destroys a wrapped context; ours lives as long as the process.
pub fn process_context(dev: &crate::cuda::Device) -> Option<Context> {
    static CONTEXTS: std::sync::LazyLock<
        std::sync::Mutex<std::collections::HashMap<usize, Context>>,
    > = std::sync::LazyLock::new(Default::default);
    let l = lib().ok()?;
    let mut contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = contexts.get(&dev.ordinal) {
        return Some(c.clone());
    }
    // SAFETY: a live context of `dev`'s device (the device cache keeps it for the process's
    // life); the library returns a new (full) reference or NULL.
    let c = unsafe {
        let p = (l.f.context_new_wrapped)(
            dev.ctx.cu_ctx() as *mut std::ffi::c_void,
            dev.ctx.cu_device(),
        );
        if p.is_null() {
            return None;
        }
        Context(from_glib_full(p))
    };
    contexts.insert(dev.ordinal, c.clone());
    Some(c)
}

/// A GstContext carrying `ctx` (for HAVE_CONTEXT messages and set_context).
pub fn gst_context(ctx: &Context) -> Option<gst::Context> {
    let l = lib().ok()?;
    // SAFETY: a live GstCudaContext; a new (full) GstContext comes back, or NULL.
    unsafe {
        let p = (l.f.context_new_cuda_context)(ctx.as_ptr());
        (!p.is_null()).then(|| from_glib_full(p))
    }
}

/// Calls `f` with `ctx` as a `GstCudaContext **` in/out argument, taking over what it leaves
/// there when it replaced it.
fn with_slot(ctx: &mut Option<Context>, f: impl FnOnce(*mut Ctx) -> bool) -> bool {
    let old = ctx.as_ref().map_or(std::ptr::null_mut(), Context::as_ptr);
    let mut slot = old;
    let ok = f(&mut slot);
    if slot != old && !slot.is_null() {
        // SAFETY: the library hands a new (full) reference in the slot.
        *ctx = Some(Context(unsafe { from_glib_full(slot) }));
    }
    ok
}

/// Finds the CUDA context of `device` (-1: any) the way GStreamer's CUDA elements do: from
/// `ctx` if set, a neighbour (CONTEXT query), the application (NEED_CONTEXT), or a new one it
/// then shares (HAVE_CONTEXT). `false` when none could be had.
pub fn ensure_element_context(
    element: &gst::Element,
    device: i32,
    ctx: &mut Option<Context>,
) -> bool {
    let Ok(l) = lib() else { return false };
    with_slot(ctx, |slot| {
        // SAFETY: a live element; `slot` is a valid in/out pointer.
        unsafe { (l.f.ensure_element_context)(element.to_glib_none().0, device, slot) != 0 }
    })
}

/// `GstElement::set_context`: takes a CUDA context of `device` (-1: any) handed by the
/// application or a neighbour, unless `ctx` is set already.
pub fn handle_set_context(
    element: &gst::Element,
    context: &gst::Context,
    device: i32,
    ctx: &mut Option<Context>,
) -> bool {
    let Ok(l) = lib() else { return false };
    with_slot(ctx, |slot| {
        // SAFETY: live objects; `slot` is a valid in/out pointer.
        unsafe {
            (l.f.handle_set_context)(
                element.to_glib_none().0,
                context.to_glib_none().0,
                device,
                slot,
            ) != 0
        }
    })
}

/// Answers a CONTEXT query for the CUDA context with `ctx`; `false` for other queries.
pub fn handle_context_query(
    element: &gst::Element,
    query: &mut gst::QueryRef,
    ctx: Option<&Context>,
) -> bool {
    let (Ok(l), Some(ctx)) = (lib(), ctx) else {
        return false;
    };
    // SAFETY: live objects; the query is writable (we hold it mutably).
    unsafe {
        (l.f.handle_context_query)(element.to_glib_none().0, query.as_mut_ptr(), ctx.as_ptr()) != 0
    }
}

/// A `GstCudaBufferPool` allocating CUDA memory in `ctx` (buffers carry a GstVideoMeta with
/// the pool's pitched layout).
pub fn buffer_pool(ctx: &Context) -> Option<gst::BufferPool> {
    let l = lib().ok()?;
    // SAFETY: a live GstCudaContext; the pool comes with a full (sunk) reference.
    unsafe {
        let p = (l.f.buffer_pool_new)(ctx.as_ptr());
        (!p.is_null()).then(|| from_glib_full(p))
    }
}

/// Whether `mem` is a GstCudaMemory.
pub fn is_cuda_memory(mem: &gst::MemoryRef) -> bool {
    lib().is_ok_and(|l| {
        // SAFETY: a live memory.
        unsafe { (l.f.is_cuda_memory)(mem.as_mut_ptr()) != 0 }
    })
}

/// The CUstream `mem` (a GstCudaMemory) orders its work on; 0 for none (GStreamer before
/// 1.24, memory of another kind, or a memory without a stream).
fn memory_stream(mem: &gst::MemoryRef) -> u64 {
    let Some(s) = lib().ok().and_then(|l| l.f.stream_of) else {
        return 0;
    };
    if !is_cuda_memory(mem) {
        return 0;
    }
    // SAFETY: a live GstCudaMemory; the stream is borrowed (transfer none) and lives as long
    // as the memory, which the caller holds across its use.
    unsafe {
        let stream = (s.memory_get_stream)(mem.as_mut_ptr());
        if stream.is_null() {
            0
        } else {
            (s.stream_get_handle)(stream) as u64
        }
    }
}

/// Whether GStreamer's CUDA library here wraps device memory it did not allocate
/// (`gst_cuda_allocator_alloc_wrapped`, GStreamer 1.24+): device-ring frames then go out in
/// CUDA memory without a copy, and upstream CUDA elements render into device-ring slots. The
/// reason otherwise.
pub fn can_wrap() -> Result<(), String> {
    let l = lib()?;
    match (l.f.alloc_wrapped, l.f.pool_streams) {
        (Some(_), Some(_)) => Ok(()),
        _ => Err(format!(
            "GStreamer {} cannot wrap device memory (gst_cuda_allocator_alloc_wrapped is 1.24+)",
            gst::version_string()
        )),
    }
}

/// Who a wrapped memory is for ([`wrap_device_memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrapFor {
    /// A frame consumers share (gpushmsrc's output): read-only, and the GPU work queued in
    /// the context is waited for before `keep` goes. GStreamer's CUDA elements let go of an
    /// input buffer as soon as they have queued the kernels that read it (cudaconvert on its
    /// output's stream), and the frame must not go back to the producer, which may overwrite
    /// it, while one of them still reads.
    Reading,
    /// A free slot lent to an upstream CUDA element to render into (gpushmsink's pool):
    /// writable, and `keep` goes as soon as the memory is freed. Its writes are waited for
    /// before the frame is published ([`sync_memory`]). A memory freed unpublished with
    /// writes still queued (NEED_SYNC) is waited for by GStreamer's allocator before it calls
    /// the notify that lets `keep` go (1.24+); one without a stream was written synchronously.
    Writing,
}

/// A `GstCudaStream` reference (1.24+): the stream a CUDA element orders its work on.
pub struct Stream(std::ptr::NonNull<std::ffi::c_void>);

// SAFETY: a GstCudaStream is a refcounted mini object; its calls are thread-safe.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    /// The stream a buffer pool `config` carries (`gst_buffer_pool_config_get_cuda_stream`,
    /// set by the CUDA element that configures the pool); `None` without one or before 1.24.
    pub fn of_pool_config(config: &gst::StructureRef) -> Option<Stream> {
        let s = lib().ok()?.f.pool_streams?;
        // SAFETY: a live structure, only read; a new (full) reference or NULL comes back.
        let p = unsafe { (s.config_get_cuda_stream)(config.as_ptr() as *mut _) };
        std::ptr::NonNull::new(p).map(Stream)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(s) = lib().ok().and_then(|l| l.f.pool_streams) {
            // SAFETY: the reference this holds, given back once.
            unsafe { (s.stream_unref)(self.0.as_ptr()) };
        }
    }
}

/// Waits for the GPU work queued on `mem`'s stream that wrote it
/// (`gst_cuda_memory_sync`, 1.24+): a frame an upstream CUDA element rendered into a slot is
/// published only once it is written. Nothing to wait for on a memory without a stream (its
/// writer synchronized), of another kind, or before 1.24.
pub fn sync_memory(mem: &gst::MemoryRef) {
    let Some(s) = lib().ok().and_then(|l| l.f.pool_streams) else {
        return;
    };
    if is_cuda_memory(mem) {
        // SAFETY: a live GstCudaMemory; the call takes its own lock.
        unsafe { (s.memory_sync)(mem.as_mut_ptr()) };
    }
}

/// Wraps device memory at `dev_ptr`, laid out as `info` says (its offsets, strides and size
/// are the frame's), in a GstCudaMemory of `ctx` ordered on `stream`, without copying. `keep`
/// is dropped when GStreamer frees the memory (and its shares): it keeps `dev_ptr` valid until
/// then. `keep` comes back when the memory cannot be made (GStreamer before 1.24, or a
/// refusal). `what` says whether the memory is a frame to read or a slot to write.
pub fn wrap_device_memory<K: Send + 'static>(
    ctx: &Context,
    stream: Option<&Stream>,
    info: &gst_video::ffi::GstVideoInfo,
    dev_ptr: u64,
    keep: Box<K>,
    what: WrapFor,
) -> Result<gst::Memory, Box<K>> {
    struct Kept<K> {
        ctx: Context,
        what: WrapFor,
        keep: Box<K>,
    }
    unsafe extern "C" fn destroy<K>(data: glib::ffi::gpointer) {
        // SAFETY: `data` is the Box leaked below, given back exactly once by GStreamer.
        let kept = unsafe { Box::from_raw(data as *mut Kept<K>) };
        if kept.what == WrapFor::Reading {
            finish_queued_work(&kept.ctx);
        }
        drop(kept);
    }
    let Some(f) = lib().ok().and_then(|l| l.f.alloc_wrapped) else {
        return Err(keep);
    };
    let data = Box::into_raw(Box::new(Kept {
        ctx: ctx.clone(),
        what,
        keep,
    }));
    // SAFETY: a live context, stream and info; `dev_ptr` stays valid while `keep` lives,
    // which GStreamer drops only when it frees the memory (it calls `destroy` then, and never
    // frees `dev_ptr` itself when a notify is given). The memory takes its own reference to
    // the stream.
    let mem = unsafe {
        f(
            std::ptr::null_mut(),
            ctx.as_ptr(),
            stream.map_or(std::ptr::null_mut(), |s| s.0.as_ptr()),
            info,
            dev_ptr,
            data as glib::ffi::gpointer,
            Some(destroy::<K>),
        )
    };
    if mem.is_null() {
        // SAFETY: GStreamer refused before taking `data`: it is still ours.
        return Err(unsafe { Box::from_raw(data) }.keep);
    }
    if what == WrapFor::Reading {
        // SAFETY: a new memory we hold the only reference to. Read-only: the frame is shared
        // with every consumer (and the ring is mapped read-only on the GPU), so a writable
        // map fails and elements that write make their own copy.
        unsafe { (*mem).mini_object.flags |= gst::ffi::GST_MEMORY_FLAG_READONLY };
    }
    // SAFETY: a new memory, whose one reference is ours.
    Ok(unsafe { from_glib_full(mem) })
}

/// The GstCudaContext a GstContext (`gst.cuda.context`) carries.
pub fn context_of(context: &gst::Context) -> Option<Context> {
    let l = lib().ok()?;
    if context.context_type() != CONTEXT_TYPE {
        return None;
    }
    // SAFETY: a plain type getter.
    let ty: glib::Type = unsafe { glib::translate::from_glib((l.f.context_get_type)()) };
    context
        .structure()
        .get::<gst::Object>(CONTEXT_TYPE)
        .ok()
        .filter(|o| o.type_().is_a(ty))
        .map(Context)
}

/// The CUDA context the element upstream of `pad` runs in, if it answers a CONTEXT query
/// (GStreamer's CUDA elements do, once they have one).
pub fn upstream_context(pad: &gst::Pad) -> Option<Context> {
    lib().ok()?;
    let mut q = gst::query::Context::new(CONTEXT_TYPE);
    if !pad.peer_query(&mut q) {
        return None;
    }
    q.context().and_then(|c| context_of(&c.to_owned()))
}

/// The `GstCudaBufferPool` type, the parent of a pool CUDA elements accept
/// (`GST_IS_CUDA_BUFFER_POOL`).
pub fn buffer_pool_type() -> Result<glib::ffi::GType, String> {
    let l = lib()?;
    // SAFETY: a plain type getter.
    Ok(unsafe { (l.f.buffer_pool_get_type)() })
}

/// The public instance struct of a `GstCudaBufferPool` (gstcudabufferpool.h, 1.22 to 1.26).
#[repr(C)]
struct CudaBufferPoolFields {
    parent: gst::ffi::GstBufferPool,
    context: Ctx,
    priv_: glib::ffi::gpointer,
}

/// Sets the context of `pool`, a new instance of a `GstCudaBufferPool` subclass, as
/// `gst_cuda_buffer_pool_new` does: CUDA elements keep a pool proposed to them only when its
/// context is theirs. The pool's dispose lets go of it.
///
/// # Safety
/// `pool` is a `GstCudaBufferPool` (or subclass) no other thread sees yet, with no context.
pub unsafe fn set_pool_context(pool: *mut gst::ffi::GstBufferPool, ctx: &Context) {
    // SAFETY: the caller's contract; the struct is the public one of the header.
    unsafe {
        let fields = pool as *mut CudaBufferPoolFields;
        (*fields).context = gst::ffi::gst_object_ref(ctx.as_ptr() as *mut _) as Ctx;
    }
}

/// Waits for the work queued on every stream of `ctx` (kernels that may still read a
/// frame whose memory is being freed). A failure leaves nothing to wait for: the context is
/// gone or broken, and with it the work.
fn finish_queued_work(ctx: &Context) {
    let Ok(l) = lib() else { return };
    // SAFETY: a live context, pushed on this thread and popped after; cuCtxSynchronize is a
    // plain driver call on it (libcuda is loaded: the context exists).
    unsafe {
        if (l.f.context_push)(ctx.as_ptr()) == glib::ffi::GFALSE {
            return;
        }
        cudarc::driver::sys::cuCtxSynchronize();
        (l.f.context_pop)(std::ptr::null_mut());
    }
}

/// `caps` with every structure's features replaced by memory:CUDAMemory.
pub fn with_cuda_feature(caps: &gst::Caps) -> gst::Caps {
    let mut c = caps.copy();
    if let Some(c) = c.get_mut() {
        for i in 0..c.size() {
            c.set_features(i, Some(gst::CapsFeatures::new([CUDA_MEMORY])));
        }
    }
    c
}
