// SPDX-License-Identifier: MPL-2.0
//! What render() does with a buffer: publishes the slot upstream rendered into, or a copy of
//! the buffer in a free slot, under the publishing policy of the settings; a buffer larger
//! than the slots gets a new ring first.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_video::prelude::*;

use super::imp::{GpuShmSink, Settings, State, CAT};
use super::metas::{describe_layout, timecode};
use super::pool::{Server, SlotPool};
use super::properties::MAX_WAIT_NOT_LIVE;
use gpushm::policy::Policy;
use gpushm::ring::producer_end::FrameMeta;
use gpushm::server::Published;

/// What render() needs for each frame of the current caps, found once per ring and taken with
/// one reference: after the producer slept, every lock, caps lookup, plane computation or
/// reference count on the way of a frame costs cold cache and TLB misses.
pub(super) struct FramePath {
    pub(super) server: Arc<Server>,
    /// The caps' raw video layout (`None`: opaque buffers), as in the state.
    pub(super) info: Option<Arc<gst_video::VideoInfo>>,
    pub(super) pool: SlotPool,
    /// The pool's ring (the pool itself is behind its own lock).
    pub(super) ring: Arc<gpushm::ring::producer_end::ProducerRing>,
    /// Raw video in CUDA memory, as the caps say (nvcodec's elements also hand GstCudaMemory,
    /// mapped for the CPU, under system-memory caps: those are copied as system memory).
    pub(super) cuda_input: bool,
    /// Format, size and planes of the caps' own layout, for a frame laid out that way.
    pub(super) template: Option<FrameMeta>,
}

impl GpuShmSink {
    /// render()'s work: publishes the slot upstream rendered `buffer` into, or a copy of it in
    /// a free slot.
    pub(super) fn publish(&self, buffer: &gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        #[cfg(feature = "stages")]
        let render_ns = gpushm::monotonic_ns();
        let start = buffer.dts().or(buffer.pts());
        self.direct.note_position(
            &self.obj(),
            start,
            buffer
                .duration()
                .and_then(|d| Some(start?.saturating_add(d))),
        );
        // The caps are cloned only where they are needed (a new ring, a copy): off the way of a
        // frame rendered into our pool.
        let caps_of = || match &*self.state() {
            State::Started {
                caps: Some(caps), ..
            } => Ok(caps.clone()),
            _ => Err(gst::FlowError::Flushing),
        };
        // One look at the state for everything a frame of our pool needs (see FramePath).
        let found = match &*self.state() {
            State::Started {
                caps: Some(_),
                pool: Some(_),
                live,
                frames: Some(f),
                ..
            } => Some((f.clone(), *live)),
            State::Started { caps: None, .. } => None,
            _ => {
                gst::element_imp_error!(
                    self,
                    gst::CoreError::Negotiation,
                    ("Got a buffer before caps")
                );
                return Err(gst::FlowError::NotNegotiated);
            }
        };
        let Some((path, live)) = found else {
            // A stream without caps: shared as bytes (consumers push them without caps, or
            // with a capsfilter's), as shmsink does.
            gst::info!(CAT, imp = self, "a buffer without caps: shared as bytes");
            self.configure(&gst::Caps::new_any()).map_err(|e| {
                e.log_with_imp(self);
                gst::FlowError::NotNegotiated
            })?;
            return self.publish(buffer);
        };
        let FramePath {
            server,
            info,
            pool,
            ring,
            cuda_input,
            template,
        } = &*path;
        let cuda_input = *cuda_input;
        // wake-early on GstBaseSink's way: the clock wait is behind us (once per frame: on the
        // direct way, chain() woke them already).
        if self.wake_early.load(Ordering::Relaxed) {
            server.wake_early();
        }
        if info.is_none() && buffer.size() as u64 > ring.slot_size() {
            // Never cut or refuse a large buffer: a new ring with larger slots, announced to
            // consumers like a caps change. Then render again into it.
            gst::info!(
                CAT,
                imp = self,
                "a buffer of {} bytes does not fit slots of {}: new ring",
                buffer.size(),
                ring.slot_size()
            );
            self.make_ring(&caps_of()?, buffer.size() as u64)
                .map_err(|e| {
                    e.log_with_imp(self);
                    gst::FlowError::Error
                })?;
            return self.publish(buffer);
        }
        let live = live.unwrap_or_else(|| {
            let live = self
                .obj()
                .query_latency()
                .map(|(_, upstream_live, _, _)| upstream_live)
                .unwrap_or(false);
            if let State::Started { live: l, .. } = &mut *self.state() {
                *l = Some(live);
            }
            live
        });
        let duration = buffer.duration().or_else(|| {
            let fps = info.as_ref()?.fps();
            (fps.numer() > 0).then(|| {
                gst::ClockTime::SECOND
                    .mul_div_floor(fps.denom() as u64, fps.numer() as u64)
                    .unwrap_or(gst::ClockTime::ZERO)
            })
        });
        let (wait, policy) = {
            let s = self.settings();
            let wait = match s.wait_for_connection {
                true => s.wait_for_clients.max(1) as usize,
                false => 0,
            };
            (wait, policy(&s, ring.slot_count(), live, duration))
        };
        let gen = ring.ring_gen();
        // Metas travel beside the frame (the ring has no field for them).
        let (frame_metas, left_out) = crate::frame_metas::encode(buffer);
        if !left_out.is_empty() {
            let mut warned = self.warned_metas.lock().unwrap_or_else(|e| e.into_inner());
            // Once per name (a stream puts the same metas on every frame), a few names at most.
            let new: Vec<&String> = left_out.iter().filter(|n| !warned.contains(*n)).collect();
            if !new.is_empty() && warned.len() < 64 {
                gst::warning!(
                    CAT,
                    imp = self,
                    "metas too large to travel (over {} bytes a frame, or {} one) stay home: {new:?}",
                    crate::frame_metas::MAX_METAS_PAYLOAD,
                    crate::serialized_metas::MAX_SERIALIZED
                );
                warned.extend(new.into_iter().cloned());
            }
        }
        // A device ring: a frame in a slot's host bytes goes on to the GPU.
        let device_mem = crate::cuda::vmm::of(ring.attachment());
        let publish = |slot: u32, mut meta: FrameMeta| {
            meta.has_metas = frame_metas.is_some();
            server.set_frame_metas(frame_metas.as_deref());
            if info.is_none() {
                meta.payload_size = buffer.size() as u64;
            }
            meta.live = live;
            if cuda_input {
                // Copied on the GPU already (copy_cuda_into_slot).
            } else if let Some(mem) = device_mem {
                self.copy_slot_to_device(mem, ring, slot, meta.payload_size)?;
            }
            server
                .publish_frame(gen, slot, meta, policy, wait)
                .map_err(|e| {
                    gst::element_imp_error!(
                        self,
                        gst::ResourceError::Write,
                        ("Publishing a frame failed: {}", e)
                    );
                    gst::FlowError::Error
                })
        };
        // Upstream rendered into one of our slots: published as it is, unless consumers
        // still hold that slot (upstream pushed the same buffer again) or it is of an
        // earlier ring. In CUDA memory, once the GPU wrote it (cuda_pool).
        let rendered = match cuda_input {
            true => super::cuda_pool::written_slot(ring, buffer),
            false => super::pool::slot_of_buffer(ring, buffer),
        };
        if let Some(slot) = rendered {
            let meta =
                self.timing
                    .frame_meta(&self.obj(), buffer, info.as_deref(), template.as_ref());
            #[cfg(feature = "stages")]
            if meta.payload_size >= 32 && ring.slot_size() >= 32 {
                let t = [
                    crate::stages::CHAIN_NS.with(|c| c.get()),
                    render_ns,
                    gpushm::monotonic_ns(),
                ];
                // SAFETY: the slot is ours until published, and at least 32 bytes long.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        t.as_ptr() as *const u8,
                        ring.slot_ptr(slot).add(crate::stages::PRODUCER_OFFSET),
                        24,
                    )
                };
            }
            match publish(slot, meta)? {
                Published::Sent => {
                    // (Not CUDA memory: the CUDA pool never lends a buffer again, and
                    // GstCudaMemory changes its own flags under its lock.)
                    if !cuda_input {
                        super::pool::lock_published(buffer);
                    }
                    return Ok(gst::FlowSuccess::Ok);
                }
                Published::Stopped => return Err(gst::FlowError::Flushing),
                Published::SlotBusy(why) => {
                    gst::trace!(CAT, imp = self, "copying a frame of our pool: {why}");
                }
            }
        }
        let mut out = match (&info, cuda_input) {
            (Some(i), true) => self.copy_cuda_into_slot(pool, i, &caps_of()?, buffer)?,
            _ => self.copy_into_slot(
                pool,
                info.as_deref(),
                &caps_of()?,
                buffer,
                device_mem.is_some(),
            )?,
        };
        server.count_copy();
        let slot = pool.slot_of(&out).ok_or(gst::FlowError::Error)?;
        gst::trace!(CAT, imp = self, "copied a foreign buffer into slot {slot}");
        // Keep timestamps and flags of the original.
        {
            let o = out.make_mut();
            let _ = buffer.copy_into(
                o,
                gst::BufferCopyFlags::FLAGS | gst::BufferCopyFlags::TIMESTAMPS,
                ..,
            );
        }
        let mut meta =
            self.timing
                .frame_meta(&self.obj(), &out, info.as_deref(), template.as_ref());
        // Metas stay on the original.
        meta.timecode = timecode(buffer);
        // The copy has the pool's default layout.
        if let Some(info) = &info {
            describe_layout(info, info.offset(), info.stride(), &mut meta);
        }
        match publish(slot, meta)? {
            Published::Sent => {}
            Published::Stopped => return Err(gst::FlowError::Flushing),
            Published::SlotBusy(why) => {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Write,
                    ("Publishing a frame failed: {}", why)
                );
                return Err(gst::FlowError::Error);
            }
        }
        drop(out);
        Ok(gst::FlowSuccess::Ok)
    }
}

/// The publishing policy for a frame of `frame_duration` in a stream that is `live` or not,
/// in a ring of `slots` slots.
fn policy(s: &Settings, slots: u32, live: bool, frame_duration: Option<gst::ClockTime>) -> Policy {
    let max_wait = match s.max_wait {
        // A live source drops frames for everyone while the producer waits: wait about
        // one frame for a stuck lossless consumer, not more.
        -1 if live => frame_duration
            .map(|d| std::time::Duration::from_nanos(d.nseconds()))
            .unwrap_or(std::time::Duration::from_millis(40))
            .clamp(
                std::time::Duration::from_millis(40),
                std::time::Duration::from_millis(200),
            ),
        -1 => MAX_WAIT_NOT_LIVE,
        n if n >= 0 => std::time::Duration::from_nanos(n as u64),
        _ => MAX_WAIT_NOT_LIVE,
    };
    Policy {
        budget: if s.client_budget == 0 {
            (slots / 2).max(1)
        } else {
            s.client_budget.min(slots)
        } as usize,
        max_wait,
        spin: std::time::Duration::from_micros(s.spin_us as u64),
    }
}
