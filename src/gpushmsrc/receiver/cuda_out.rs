// SPDX-License-Identifier: MPL-2.0
//! Device-ring frames going out in CUDA memory (downstream asked for memory:CUDAMemory): the
//! ring's GPU memory wrapped in place where GStreamer can (1.24+) and the frame's layout
//! allows it (crate::cuda::textures), one device-to-device copy into the CUDA pool otherwise.

use super::frames::frame_flags;
use super::*;

impl Worker {
    /// A device-ring frame as a buffer in CUDA memory (`info`: its stream's caps): wrapped
    /// in place (the buffer holds the frame's lease until GStreamer frees the memory), or
    /// copied into the CUDA pool (the lease goes at once). Counted either way; the first
    /// copy on a runtime that can wrap says why.
    /// `held`: downstream holds as many frames as our budget allows (the count), so this one
    /// is copied, as on a host ring.
    pub(super) fn cuda_buffer_of(
        &mut self,
        out: &CudaOut,
        info: &gst_video::VideoInfo,
        frame: Frame,
        held: Option<usize>,
        conn: &Subscriber,
    ) -> Result<gst::Buffer, String> {
        let meta_flags = frame.meta.buffer_flags;
        let ring = frame.lease.ring().clone();
        let mem =
            crate::cuda::vmm::of(ring.attachment()).ok_or("the frame is not in GPU memory")?;
        let (src, _) = frame
            .device_ptr()
            .ok_or("the frame lies outside its ring's GPU memory")?;
        let geometry = frame.layout()?;
        // Err: copied, with the reason to say once (`None`: said elsewhere: GStreamer before
        // 1.24 at negotiation, a downstream holding its budget by warn_copy below).
        let wrappable = match (&out.wrap, held) {
            (Err(_), _) | (Ok(()), Some(_)) => Err(None),
            (Ok(()), None) => {
                crate::cuda::textures::wrappable(&geometry, src, mem.device()).map_err(Some)
            }
        };
        let keep = Box::new(NotifyOnRelease {
            lease: Some(frame.lease),
            shared: Arc::downgrade(&self.shared),
        });
        let keep = match wrappable {
            Ok(()) => {
                let winfo = crate::gpushmsrc::cuda::wrapped_info(info, &geometry);
                match crate::cuda::gstcuda::wrap_device_memory(
                    &out.ctx,
                    None,
                    &winfo,
                    src,
                    keep,
                    crate::cuda::gstcuda::WrapFor::Reading,
                ) {
                    Ok(m) => {
                        let mut buffer = gst::Buffer::new();
                        let b = buffer.get_mut().ok_or("a new buffer is not writable")?;
                        b.append_memory(m);
                        crate::gpushmsrc::cuda::add_video_meta(
                            b,
                            frame_flags(meta_flags),
                            info,
                            &geometry,
                        )?;
                        self.shared.cuda_wrapped.fetch_add(1, Ordering::Relaxed);
                        return Ok(buffer);
                    }
                    Err(keep) => {
                        self.say_cuda_copy("GStreamer's CUDA library refused to wrap it");
                        keep
                    }
                }
            }
            Err(why) => {
                if let Some(why) = why {
                    self.say_cuda_copy(&why);
                }
                keep
            }
        };
        let buffer = copy_to_cuda_pool(out, mem, src, &geometry)?;
        drop(keep);
        self.shared.cuda_copied.fetch_add(1, Ordering::Relaxed);
        // Copies for downstream's sake are the producer's to count, and said once.
        if let Some(held) = held.filter(|_| out.wrap.is_ok()) {
            let n = conn.count_copy();
            if !std::mem::replace(&mut self.copy_warned, true) {
                self.warn_copy(conn, held, n);
            }
        }
        Ok(buffer)
    }

    /// Says once why device-ring frames are copied into CUDA memory on a runtime that could
    /// wrap them.
    fn say_cuda_copy(&mut self, why: &str) {
        if std::mem::replace(&mut self.cuda_copy_said, true) {
            return;
        }
        if let Some(el) = self.element.upgrade() {
            gst::element_warning!(
                el,
                gst::ResourceError::Settings,
                ("Device-ring frames are copied into CUDA memory: {}", why),
                ["Frames whose planes start at multiples of the GPU's texture alignment, with strides of its pitch alignment and unpadded rows, go out without a copy"]
            );
        }
    }
}

/// Copies a device-ring frame into a buffer of `out`'s CUDA pool, plane by plane on the GPU
/// (the pool pitches its rows: its VideoMeta says how).
fn copy_to_cuda_pool(
    out: &CudaOut,
    mem: &gpushm::cuda::vmm::DeviceMemory,
    src: u64,
    geometry: &gpushm::format::FrameGeometry,
) -> Result<gst::Buffer, String> {
    let mut buffer = out
        .pool
        .acquire_buffer(None)
        .map_err(|e| format!("the CUDA buffer pool gave no buffer: {e:?}"))?;
    let b = buffer.make_mut();
    let vm = b
        .meta::<gst_video::VideoMeta>()
        .ok_or("the CUDA buffer pool's buffers have no GstVideoMeta")?;
    let (offsets, strides) = (vm.offset().to_vec(), vm.stride().to_vec());
    if offsets.len() != geometry.planes.len() {
        return Err(format!(
            "the pool's buffers have {} planes, the frame {}",
            offsets.len(),
            geometry.planes.len()
        ));
    }
    let planes: Vec<_> = geometry
        .planes
        .iter()
        .zip(offsets.iter().zip(&strides))
        .map(|(p, (&o, &st))| crate::cuda::vmm::Plane2d {
            src_offset: p.offset,
            src_pitch: p.stride as u64,
            dst_offset: o as u64,
            dst_pitch: st.max(0) as u64,
            row_bytes: p.row_bytes as u64,
            rows: p.rows as u64,
        })
        .collect();
    crate::cuda::gstcuda::with_device_map(b, true, |dst, len, stream| {
        mem.copy_planes_to_device(src, dst, len, &planes, stream)
    })
    .ok_or("cannot map the CUDA pool's buffer on the GPU")?
    .map_err(|e| e.to_string())?;
    Ok(buffer)
}
