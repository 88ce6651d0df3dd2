// SPDX-License-Identifier: MPL-2.0
//! Copies into ring slots, for buffers that upstream did not render into one: from system
//! memory (one memcpy, plane by plane, or byte for byte) and from CUDA memory (on the GPU);
//! and a device ring's host copy of a frame to its GPU memory.

use gst::prelude::*;
use gst::subclass::prelude::*;

use super::imp::GpuShmSink;
use super::metas::same_layout;
use super::pool::SlotPool;
use gpushm::ring::producer_end::ProducerRing;

impl GpuShmSink {
    /// Copies a frame in CUDA memory (`buffer`, mapped for CUDA) into a free slot of the
    /// device ring, plane by plane on the GPU; returns the pool buffer of that slot.
    pub(super) fn copy_cuda_into_slot(
        &self,
        pool: &SlotPool,
        info: &gst_video::VideoInfo,
        caps: &gst::Caps,
        buffer: &gst::Buffer,
    ) -> Result<gst::Buffer, gst::FlowError> {
        self.activate(pool, Some(info), caps)?;
        let out = pool.acquire_buffer(None)?;
        let ring = pool.ring().ok_or(gst::FlowError::Error)?;
        let slot = pool.slot_of(&out).ok_or(gst::FlowError::Error)?;
        let fail = |msg: String| {
            gst::element_imp_error!(self, gst::ResourceError::Write, ("{}", msg));
            gst::FlowError::Error
        };
        let (mem, dst) = crate::cuda::vmm::of(ring.attachment())
            .zip(crate::cuda::vmm::device_ptr_of_slot(&ring, slot))
            .ok_or_else(|| fail("CUDA memory input needs a device ring".into()))?;
        // The source planes where the buffer's VideoMeta (or the caps) put them.
        let (offsets, strides): (Vec<usize>, Vec<i32>) = match buffer.meta::<gst_video::VideoMeta>()
        {
            Some(m) => (m.offset().to_vec(), m.stride().to_vec()),
            None => (info.offset().to_vec(), info.stride().to_vec()),
        };
        let mut planes = Vec::new();
        for p in 0..info.n_planes() as usize {
            let rows = info.comp_height(p as u8) as usize;
            let row_bytes = info.comp_width(p as u8) as usize * info.comp_pstride(p as u8) as usize;
            let (so, ss) = (
                *offsets.get(p).ok_or(gst::FlowError::Error)?,
                *strides.get(p).ok_or(gst::FlowError::Error)?,
            );
            planes.push(crate::cuda::vmm::Plane2d {
                src_offset: so as u64,
                src_pitch: ss.max(0) as u64,
                dst_offset: info.offset()[p] as u64,
                dst_pitch: info.stride()[p].max(0) as u64,
                row_bytes: row_bytes as u64,
                rows: rows as u64,
            });
        }
        crate::cuda::gstcuda::with_device_map(buffer, false, |src, len, stream| {
            mem.copy_planes_from_device(dst, src, len, &planes, stream)
        })
        .ok_or_else(|| fail("Could not map a buffer in CUDA memory".into()))?
        .map_err(|e| fail(format!("Copying a frame from CUDA memory failed: {e}")))?;
        Ok(out)
    }

    /// Activates the ring's pool for `caps` if it is not yet (it is when upstream renders
    /// into it).
    fn activate(
        &self,
        pool: &SlotPool,
        info: Option<&gst_video::VideoInfo>,
        caps: &gst::Caps,
    ) -> Result<(), gst::FlowError> {
        if pool.is_active() {
            return Ok(());
        }
        let size = match info {
            Some(info) => info.size() as u32,
            None => pool.ring().map_or(0, |r| r.slot_size() as u32),
        };
        let mut config = pool.config();
        // (A stream without caps, ANY, gives the pool none: a pool's caps must be fixed.)
        config.set_params(Some(caps).filter(|c| c.is_fixed()), size, 0, 0);
        if info.is_some() {
            config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
        }
        // (A CUDA pool over the same slots may activate it meanwhile, from upstream's
        // thread: then it is active, as wanted.)
        let configured = pool.set_config(config).is_ok();
        let activated = configured && pool.set_active(true).is_ok();
        if !(activated || pool.is_active()) {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Failed,
                ("Could not activate the ring's buffer pool")
            );
            return Err(gst::FlowError::Error);
        }
        Ok(())
    }

    /// Copies `buffer` into a free slot of the pool; returns the pool buffer. Raw video
    /// (`info`) laid out as the caps say is copied in one piece, other layouts plane by plane
    /// into the pool's layout; anything else byte for byte. `device_ring`: the slot's host
    /// bytes go on to the GPU next, so they are copied plainly (see `copy_buffer_into`).
    pub(super) fn copy_into_slot(
        &self,
        pool: &SlotPool,
        info: Option<&gst_video::VideoInfo>,
        caps: &gst::Caps,
        buffer: &gst::Buffer,
        device_ring: bool,
    ) -> Result<gst::Buffer, gst::FlowError> {
        self.activate(pool, info, caps)?;
        let mut out = pool.acquire_buffer(None)?;
        let map_failed = |_| {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Failed,
                ("Could not map a ring slot")
            );
            gst::FlowError::Error
        };
        let Some(info) = info else {
            if buffer.size() == 0 {
                // An empty buffer: the slot is only its place in the stream (payload 0).
                return Ok(out);
            }
            let outref = out.get_mut().ok_or(gst::FlowError::Error)?;
            outref.set_size(buffer.size());
            let mut map = outref.map_writable().map_err(map_failed)?;
            copy_buffer_into(buffer, &mut map, device_ring).map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Read,
                    ("Could not read a buffer of {} bytes", buffer.size())
                );
                gst::FlowError::Error
            })?;
            drop(map);
            return Ok(out);
        };
        // The frame laid out as the caps say (no VideoMeta, or one that agrees): one memcpy of
        // the whole frame. GstVideoFrame copies line by line, which cost ~60 µs more per
        // 1080p NV12 frame at 30 fps (bench, 2-core VM).
        if buffer.size() >= info.size() && laid_out_as(buffer, info) {
            let outref = out.get_mut().ok_or(gst::FlowError::Error)?;
            let mut map = outref.map_writable().map_err(map_failed)?;
            if let Some(dst) = map.get_mut(..info.size()) {
                copy_buffer_into(buffer, dst, device_ring).map_err(|_| {
                    gst::element_imp_error!(
                        self,
                        gst::ResourceError::Read,
                        ("Could not read a frame of {} bytes", info.size())
                    );
                    gst::FlowError::Error
                })?;
                drop(map);
                return Ok(out);
            }
        }
        let src = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), info)
            .map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::StreamError::Format,
                    ("Input buffer does not match the caps")
                );
                gst::FlowError::Error
            })?;
        {
            let outref = out.get_mut().ok_or(gst::FlowError::Error)?;
            let mut dst = gst_video::VideoFrameRef::from_buffer_ref_writable(outref, info)
                .map_err(map_failed)?;
            src.copy(&mut dst).map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Failed,
                    ("Copying the frame failed")
                );
                gst::FlowError::Error
            })?;
        }
        Ok(out)
    }

    /// Copies the frame in `slot`'s host bytes (`payload_size` of them) to the device ring's
    /// GPU memory `mem`.
    pub(super) fn copy_slot_to_device(
        &self,
        mem: &crate::cuda::vmm::DeviceMemory,
        ring: &ProducerRing,
        slot: u32,
        payload_size: u64,
    ) -> Result<(), gst::FlowError> {
        let n = (payload_size as usize).min(ring.slot_size() as usize);
        // SAFETY: the slot is ours until published, and n bytes long at most.
        let src = unsafe { std::slice::from_raw_parts(ring.slot_ptr(slot), n) };
        let copied = crate::cuda::vmm::device_ptr_of_slot(ring, slot)
            .ok_or_else(|| "the slot is outside the ring's GPU memory".to_string())
            .and_then(|dst| mem.copy_from_host(dst, src).map_err(|e| e.0));
        if let Err(e) = copied {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Write,
                ("Copying a frame to GPU memory failed: {}", e)
            );
            return Err(gst::FlowError::Error);
        }
        Ok(())
    }
}

/// Whether `buffer`'s planes sit where `info` puts them: no VideoMeta, or one that agrees.
fn laid_out_as(buffer: &gst::BufferRef, info: &gst_video::VideoInfo) -> bool {
    buffer
        .meta::<gst_video::VideoMeta>()
        .is_none_or(|m| same_layout(&m, info))
}

/// Fills `dst` with the first `dst.len()` bytes of `buffer`, memory by memory (no merged
/// copy of a buffer of several memories), with the core's `frame_copy`: a slot the producer
/// never reads again. `device_ring`: plainly instead, the slot's host bytes go on to the GPU,
/// whose copy reads them next. Err if `buffer` is shorter or a memory cannot be mapped.
fn copy_buffer_into(buffer: &gst::BufferRef, dst: &mut [u8], device_ring: bool) -> Result<(), ()> {
    let mut at = 0;
    for mem in buffer.iter_memories() {
        if at == dst.len() {
            break;
        }
        let map = mem.map_readable().map_err(|_| ())?;
        let n = map.len().min(dst.len() - at);
        match device_ring {
            false => gpushm::frame_copy::copy_frame(&mut dst[at..at + n], &map[..n]),
            true => {
                dst[at..at + n].copy_from_slice(&map[..n]);
                n
            }
        };
        at += n;
    }
    match at == dst.len() {
        true => Ok(()),
        false => Err(()),
    }
}
