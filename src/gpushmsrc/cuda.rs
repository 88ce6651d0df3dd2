// SPDX-License-Identifier: MPL-2.0
//! CUDA: the GPU frames are registered with (cuda-register, or downstream asking for
//! GpuShmCudaMeta), the meta on zero-copy frames, and device-ring frames going out in CUDA
//! memory (GStreamer's CUDA context and a CUDA buffer pool) where downstream asks for it.

use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;

use super::imp::GpuShmSrc;
use super::receiver::{CudaOut, Details};
use super::CAT;
use crate::cuda::register::{device_ptr_in, register_mapping, NotRegistered};
use crate::cuda::Selected;
use crate::cuda::{gstcuda, textures};
use crate::cudameta::CudaRegister;

impl GpuShmSrc {
    /// Opens the GPU of cuda-device-id (see crate::cuda::select): `None` without one.
    pub(super) fn open_cuda(
        &self,
        id: i32,
    ) -> Result<Option<Arc<crate::cuda::Device>>, gst::ErrorMessage> {
        match crate::cuda::select(id) {
            Ok(Selected::Device(d)) => {
                gst::info!(CAT, imp = self, "{d:?}");
                Ok(Some(d))
            }
            Ok(Selected::Unavailable(e)) => {
                gst::info!(CAT, imp = self, "frames are not registered with CUDA: {e}");
                Ok(None)
            }
            Err(e) => Err(gst::error_msg!(gst::LibraryError::Init, ("{}", e))),
        }
    }

    /// Downstream asked for GpuShmCudaMeta: with cuda-register=auto, open the GPU the first
    /// time (frames get the meta from then on).
    pub(super) fn cuda_requested(&self) -> Result<(), gst::LoggableError> {
        let (mode, id) = {
            let s = self.settings();
            (s.cuda_register, s.cuda_device)
        };
        if mode != CudaRegister::Auto {
            return Ok(());
        }
        {
            let mut guard = self.state();
            match guard.as_mut() {
                Some(st) if !st.cuda_asked => st.cuda_asked = true,
                _ => return Ok(()),
            }
        }
        let dev = self.open_cuda(id).map_err(|e| {
            let msg = e.to_string();
            self.post_error_message(e);
            gst::loggable_error!(CAT, "{}", msg)
        })?;
        let mut guard = self.state();
        if let (Some(st), Some(d)) = (guard.as_mut(), dev) {
            if self.needs_writable_ring(&d) {
                st.receiver.reader.request_writable_ring();
            }
            st.cuda = Some(d);
        }
        Ok(())
    }

    /// Whether `d` needs a writable ring to read frames in place (it cannot register
    /// read-only host memory); warns once.
    pub(super) fn needs_writable_ring(&self, d: &crate::cuda::Device) -> bool {
        let needs = d.host_register && !d.host_register_read_only;
        if needs {
            gst::warning!(
                CAT,
                imp = self,
                "{} cannot register read-only host memory: asking the producer for a writable mapping (it must allow it: allow-writable-ring=true)",
                d.name
            );
        }
        needs
    }

    /// Puts a GpuShmCudaMeta on a zero-copy frame's buffer, registering its ring the first
    /// time one of its frames goes out (once per mapping, never per frame).
    pub(super) fn add_cuda_meta(
        &self,
        dev: &Arc<crate::cuda::Device>,
        b: &mut gst::BufferRef,
        f: &Details,
    ) {
        let Some((ring, ptr)) = &f.slot else {
            return;
        };
        if ring.attachment().is_none() {
            let (base, len) = ring.mapping();
            let read_only = !ring.is_writable();
            if read_only && dev.host_register && !dev.host_register_read_only {
                // The receiver reconnects for a writable ring: frames of this one are copied
                // by CUDA elements meanwhile.
                return;
            }
            // SAFETY: the registration is attached to the mapping and dropped before it.
            let att = unsafe { register_mapping(dev, base, len, read_only) };
            match att.downcast_ref::<NotRegistered>() {
                Some(why) => gst::element_imp_warning!(
                    self,
                    gst::ResourceError::Settings,
                    (
                        "Cannot register the ring with {} ({}); CUDA elements will copy each frame",
                        dev.name,
                        why.0
                    )
                ),
                None => gst::info!(
                    CAT,
                    imp = self,
                    "ring {} ({} MiB) registered {} with {}",
                    ring.ring_gen(),
                    len >> 20,
                    if read_only {
                        "read-only"
                    } else {
                        "writable (the GPU cannot register read-only memory)"
                    },
                    dev.name
                ),
            }
            ring.attach(att);
        }
        if let Some((device_ptr, device)) = device_ptr_in(ring.attachment(), *ptr as *const u8) {
            crate::cudameta::add(
                b,
                crate::cudameta::CudaPtr {
                    device,
                    device_ptr,
                    size: f.meta.payload_size,
                    read_only: !ring.is_writable(),
                },
            );
        }
    }

    /// This process's CUDA context on GPU `device` (-1: the first) as a GstCudaContext (see
    /// gstcuda::process_context), kept as this element's when it has none. Asked for by a
    /// CUDA element of the pipeline, which uses the GPU then. `None` without a GPU or
    /// GStreamer's CUDA library.
    pub(super) fn process_cuda_context(&self, device: i32) -> Option<gstcuda::Context> {
        gstcuda::available().ok()?;
        let d = crate::cuda::device(device).ok()?;
        let ctx = gstcuda::process_context(&d)?;
        let mut slot = self.cuda_ctx.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(ctx.clone());
        }
        Some(ctx)
    }

    /// Whether downstream takes device-ring frames of `caps` (GPU `device`) in CUDA memory:
    /// it names memory:CUDAMemory in its caps (an element taking ANY gets system memory, as
    /// from nvcodec's decoders) and GStreamer's CUDA library is here. Then the pipeline's
    /// CUDA context for that GPU, how frames go out (wrapped in place on GStreamer 1.24+, an
    /// active CUDA buffer pool for copies), and the caps in CUDA memory.
    pub(super) fn cuda_output(
        &self,
        caps: &gst::Caps,
        caps_str: &Arc<str>,
        device: i32,
    ) -> Option<(CudaOut, gst::Caps)> {
        let obj = self.obj();
        let pad = obj.src_pad();
        let cuda_caps = gstcuda::with_cuda_feature(caps);
        // Unfiltered: an element taking ANY would otherwise answer the filter itself.
        let peer = pad.peer_query_caps(None);
        let asks = !peer.is_any()
            && peer
                .iter_with_features()
                .any(|(_, f)| !f.is_any() && f.contains(gstcuda::CUDA_MEMORY))
            && peer.can_intersect(&cuda_caps);
        if !asks {
            return None;
        }
        if let Err(why) = gstcuda::available() {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Init,
                (
                    "Downstream asks for CUDA memory but {}: frames go out in system memory",
                    why
                )
            );
            return None;
        }
        if !pad.peer_query_accept_caps(&cuda_caps) {
            return None;
        }
        let info = gst_video::VideoInfo::from_caps(caps).ok()?;
        // Outside our lock: finding the context may call set_context() on us.
        let mut ctx = self
            .cuda_ctx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .filter(|c| c.device_id() == device);
        let element = obj.upcast_ref::<gst::Element>();
        if ctx.is_none() {
            // A neighbour's first (downstream may have one of its own, or the application's).
            let mut q = gst::query::Context::new(gstcuda::CONTEXT_TYPE);
            if pad.peer_query(&mut q) {
                if let Some(c) = q.context_owned() {
                    gstcuda::handle_set_context(element, &c, device, &mut ctx);
                }
            }
        }
        if ctx.as_ref().is_none_or(|c| c.device_id() != device) {
            // Otherwise this process's, shared with the pipeline (HAVE_CONTEXT), rather than
            // a new one next to the context the frames are imported in.
            ctx = self.process_cuda_context(device);
            if let Some(c) = ctx.as_ref().and_then(gstcuda::gst_context) {
                let _ = element
                    .post_message(gst::message::HaveContext::builder(c).src(element).build());
            }
        }
        if !gstcuda::ensure_element_context(element, device, &mut ctx) {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Init,
                (
                    "No CUDA context for GPU {}: frames go out in system memory",
                    device
                )
            );
            return None;
        }
        let ctx = ctx.filter(|c| c.device_id() == device)?;
        *self.cuda_ctx.lock().unwrap_or_else(|e| e.into_inner()) = Some(ctx.clone());
        let pool = gstcuda::buffer_pool(&ctx)?;
        let mut config = pool.config();
        config.set_params(Some(&cuda_caps), info.size() as u32, 0, 0);
        config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
        if pool.set_config(config).is_err() || pool.set_active(true).is_err() {
            gst::element_imp_warning!(
                self,
                gst::ResourceError::NoSpaceLeft,
                (
                    "Cannot allocate CUDA memory for {}: frames go out in system memory",
                    caps
                )
            );
            return None;
        }
        let out = CudaOut {
            pool,
            caps: caps_str.clone(),
            ctx,
            wrap: gstcuda::can_wrap(),
        };
        Some((out, cuda_caps))
    }

    /// A frame queued before the pad's memory changed (CUDA memory negotiated, or given up)
    /// is copied into the memory the caps now say.
    pub(super) fn to_pad_memory(
        &self,
        buffer: gst::Buffer,
        f: &Details,
        cuda: bool,
    ) -> Result<gst::Buffer, gst::FlowError> {
        let is_cuda = buffer.n_memory() > 0 && gstcuda::is_cuda_memory(buffer.peek_memory(0));
        if is_cuda == cuda || !gpushm::format::is_raw_video(&f.caps) {
            return Ok(buffer);
        }
        let fail = |what: &str| {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Failed,
                ("Cannot copy a frame into {}", what)
            );
            gst::FlowError::Error
        };
        let caps = gst::Caps::from_str(&f.caps).map_err(|_| fail("the caps' memory"))?;
        let info = gst_video::VideoInfo::from_caps(&caps).map_err(|_| fail("the caps' memory"))?;
        let shared = self.shared();
        let cuda_out = shared
            .as_ref()
            .and_then(|s| s.cuda_out_for(&f.caps))
            .filter(|_| cuda);
        if let (Some(out), Some(sh)) = (&cuda_out, &shared) {
            if let Some(wrapped) = self.rewrap_in_cuda_memory(out, &buffer, &info, f) {
                sh.cuda_wrapped.fetch_add(1, Ordering::Relaxed);
                return Ok(wrapped);
            }
            sh.cuda_copied.fetch_add(1, Ordering::Relaxed);
        }
        let mut out = if cuda {
            let pool = cuda_out
                .map(|o| o.pool.clone())
                .ok_or_else(|| fail("CUDA memory"))?;
            pool.acquire_buffer(None).map_err(|_| fail("CUDA memory"))?
        } else {
            let mut b = gst::Buffer::with_size(info.size()).map_err(|_| fail("system memory"))?;
            let bm = b.get_mut().ok_or_else(|| fail("system memory"))?;
            crate::geometry::add_caps_layout_meta(bm, &info).map_err(|_| fail("system memory"))?;
            b
        };
        {
            let src = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), &info)
                .map_err(|_| fail("a frame of the new memory"))?;
            let om = out.make_mut();
            let mut dst = gst_video::VideoFrameRef::from_buffer_ref_writable(om, &info)
                .map_err(|_| fail("a frame of the new memory"))?;
            src.copy(&mut dst)
                .map_err(|_| fail("a frame of the new memory"))?;
        }
        copy_buffer_fields(&buffer, out.make_mut());
        Ok(out)
    }

    /// A frame queued in place in a device ring's memory, wrapped as CUDA memory instead
    /// (GStreamer 1.24+, planes aligned for textures): the new memory keeps `buffer`, so the
    /// frame's slot stays held until GStreamer frees it. `None` where it cannot be.
    fn rewrap_in_cuda_memory(
        &self,
        out: &CudaOut,
        buffer: &gst::Buffer,
        info: &gst_video::VideoInfo,
        f: &Details,
    ) -> Option<gst::Buffer> {
        out.wrap.as_ref().ok()?;
        let (ring, ptr) = f.slot.as_ref()?;
        let mem = crate::cuda::vmm::of(ring.attachment())?;
        let src = mem.device_ptr_of(*ptr as *const u8)?;
        let geometry = gpushm::format::FrameGeometry::of_frame(&f.meta, &f.caps).ok()?;
        textures::wrappable(&geometry, src, mem.device()).ok()?;
        let winfo = wrapped_info(info, &geometry);
        let m = gstcuda::wrap_device_memory(
            &out.ctx,
            None,
            &winfo,
            src,
            Box::new(buffer.clone()),
            gstcuda::WrapFor::Reading,
        )
        .ok()?;
        let mut wrapped = gst::Buffer::new();
        let b = wrapped.get_mut()?;
        b.append_memory(m);
        let flags = buffer
            .meta::<gst_video::VideoMeta>()
            .map_or(gst_video::VideoFrameFlags::empty(), |m| {
                m.video_frame_flags()
            });
        add_video_meta(b, flags, info, &geometry).ok()?;
        copy_buffer_fields(buffer, b);
        gst::debug!(CAT, imp = self, "a queued frame wrapped as CUDA memory");
        Some(wrapped)
    }
}

/// What a frame's buffer carries besides its memory and plane layout (timestamps, flags,
/// offsets, and every meta not tied to its memory: reference timestamps, timecode, the
/// producer's metas), onto `om`, the same frame in other memory. (GStreamer leaves out metas
/// tagged "memory", such as the VideoMeta, when memories are not copied.)
fn copy_buffer_fields(buffer: &gst::Buffer, om: &mut gst::BufferRef) {
    if buffer
        .copy_into(
            om,
            gst::BufferCopyFlags::FLAGS
                | gst::BufferCopyFlags::TIMESTAMPS
                | gst::BufferCopyFlags::META,
            ..,
        )
        .is_err()
    {
        gst::warning!(
            CAT,
            "a frame's metas could not be copied into its new memory"
        );
    }
}

/// `info` (the stream's caps) with the frame's own plane offsets, strides and size: the
/// layout a wrapped GstCudaMemory must describe exactly.
pub(crate) fn wrapped_info(
    info: &gst_video::VideoInfo,
    geometry: &gpushm::format::FrameGeometry,
) -> gst_video::ffi::GstVideoInfo {
    // SAFETY: a plain copy of a live GstVideoInfo (its fields are values; `finfo` points to
    // a static format table).
    let mut raw = unsafe { *gst::glib::translate::ToGlibPtr::to_glib_none(info).0 };
    for (i, p) in geometry
        .planes
        .iter()
        .enumerate()
        .take(gpushm::ring::layout::MAX_PLANES)
    {
        raw.offset[i] = p.offset as usize;
        raw.stride[i] = p.stride as i32;
    }
    raw.size = geometry.size as usize;
    raw
}

/// The GstVideoMeta that says a wrapped frame's layout to downstream.
pub(crate) fn add_video_meta(
    b: &mut gst::BufferRef,
    flags: gst_video::VideoFrameFlags,
    info: &gst_video::VideoInfo,
    geometry: &gpushm::format::FrameGeometry,
) -> Result<(), String> {
    let offsets: Vec<usize> = geometry.planes.iter().map(|p| p.offset as usize).collect();
    let strides: Vec<i32> = geometry.planes.iter().map(|p| p.stride as i32).collect();
    gst_video::VideoMeta::add_full(
        b,
        flags,
        info.format(),
        info.width(),
        info.height(),
        &offsets,
        &strides,
    )
    .map(|_| ())
    .map_err(|e| format!("cannot describe the frame's planes: {e}"))
}
