// SPDX-License-Identifier: MPL-2.0
//! What create() pushes: the next frame from the receiver with the pad's caps, in the pad's
//! memory, with its CUDA meta and timestamps (stream headers first after joining mid-stream),
//! and what low-latency mode reads of the element while it polls for that frame.

use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::base_src::CreateSuccess;

use super::imp::GpuShmSrc;
use super::receiver::{Item, Received};
use super::timing::{Timing, TIMING_STALE_NS};
use super::CAT;

impl GpuShmSrc {
    /// Low-latency mode: reads what create() and GstBaseSrc read of the element and its pads
    /// on a frame's way, while the streaming thread polls for the frame (see
    /// `Worker::warm_up`). Takes only object locks (held by anyone for a few reads), and our
    /// state's lock only if it is free.
    pub(super) fn warm_up(&self) {
        if let Ok(g) = self.state.try_lock() {
            std::hint::black_box(g.as_ref().map(|s| {
                s.timestamps.warm_up();
                s.pad_caps.is_some()
            }));
        }
        let obj = self.obj();
        std::hint::black_box((obj.is_live(), obj.does_timestamp()));
        let bs = obj.upcast_ref::<gst_base::BaseSrc>().as_ptr();
        {
            let _lock = obj.object_lock();
            // SAFETY: GstBaseSrc's segment, read under the object lock as GstBaseSrc reads it.
            std::hint::black_box(unsafe { (*bs).segment.format });
        }
        let pad = obj.src_pad();
        std::hint::black_box((
            pad.is_active(),
            pad.needs_reconfigure(),
            pad.has_current_caps(),
        ));
        if let Some(peer) = pad.peer() {
            std::hint::black_box((peer.is_active(), peer.needs_reconfigure()));
        }
    }

    /// Sends the producer's events on downstream. Before a buffer, tags and custom events go
    /// through GstBaseSrc, which pushes them after the segment and before the buffer; at the
    /// end (`last`), and for sticky custom events it does not take, straight on the pad.
    fn send_producer_events(&self, events: Vec<gst::Event>, last: bool) {
        let obj = self.obj();
        for e in events {
            gst::debug!(CAT, imp = self, "producer's event: {e:?}");
            let ok = match last || e.type_() == gst::EventType::CustomDownstreamSticky {
                true => obj.src_pad().push_event(e),
                false => obj.send_event(e),
            };
            if !ok {
                gst::debug!(
                    CAT,
                    imp = self,
                    "downstream did not take the producer's event"
                );
            }
        }
    }

    /// The next buffer (or list: stream headers first) to push: waits for a frame.
    pub(super) fn next_buffer(&self) -> Result<CreateSuccess, gst::FlowError> {
        // Wait without the state lock: property reads and queries never wait for frames.
        let reader = self.reader().ok_or(gst::FlowError::Flushing)?;
        // Read before waiting: after a wake-up each read costs several times more, on the
        // frame's way. Base time and clock change only while create() is not running (a live
        // source is unlocked before it pauses); read again after a long wait all the same.
        let mut timing = Timing::read(&self.obj());
        let asked = gpushm::monotonic_ns();
        let (item, discont) = reader.next_item().ok_or(gst::FlowError::Flushing)?;
        #[cfg(feature = "stages")]
        let t_next = gpushm::monotonic_ns();
        match item {
            Item::Frame(Received {
                mut buffer,
                details: mut f,
                headers,
                events,
            }) => {
                if f.arrival_ns.saturating_sub(asked) > TIMING_STALE_NS {
                    timing = Timing::read(&self.obj());
                }
                // The state lock is held only for bookkeeping: caps events, warnings and
                // messages go out without it (a bus sync handler may read our properties).
                let mut guard = self.state();
                let new_caps = {
                    let st = guard.as_ref().ok_or(gst::FlowError::Flushing)?;
                    let now = (f.caps.clone(), f.on_device);
                    (st.pad_caps.as_ref() != Some(&now)).then_some(now)
                };
                if let Some(c) = new_caps {
                    drop(guard);
                    let cuda = self.set_pad_caps(&c.0, c.1)?;
                    // The ALLOCATION query for these caps, now: downstream may ask for
                    // GpuShmCudaMeta, and this frame already gets it.
                    if !self.obj().negotiate() {
                        gst::debug!(CAT, imp = self, "allocation after new caps failed");
                    }
                    guard = self.state();
                    if let Some(st) = guard.as_mut() {
                        st.pad_caps = Some(c);
                        st.pad_cuda = cuda;
                    }
                }
                if f.on_device.is_some() {
                    let cuda = guard.as_ref().is_some_and(|st| st.pad_cuda);
                    drop(guard);
                    let before = buffer.as_ptr();
                    buffer = self.to_pad_memory(buffer, &f, cuda)?;
                    if buffer.as_ptr() != before {
                        // A copy: it does not hold the frame's slot, so no device pointer to it.
                        f.slot = None;
                    }
                    guard = self.state();
                }
                #[cfg(feature = "stages")]
                let t_caps = gpushm::monotonic_ns();
                #[cfg(feature = "stages")]
                let mut stage_times;
                let segment;
                let latency_changed = {
                    let st = guard.as_mut().ok_or(gst::FlowError::Flushing)?;
                    let b = buffer.make_mut();
                    if let Some(dev) = &st.cuda {
                        self.add_cuda_meta(dev, b, &f);
                    }
                    st.timestamps.timestamp(&timing, b, &f);
                    segment = st.timestamps.first_segment(&timing, b);
                    if discont {
                        b.set_flags(gst::BufferFlags::DISCONT);
                    }
                    st.timestamps.post_latency_if_changed(&timing);
                    #[cfg(feature = "stages")]
                    {
                        stage_times = [
                            f.arrival_ns,
                            f.built_ns,
                            t_next,
                            t_caps,
                            gpushm::monotonic_ns(),
                            0,
                        ];
                    }
                    st.timestamps.take_latency_changed()
                };
                drop(guard);
                if let Some(s) = segment {
                    // Before this buffer, in place of GstBaseSrc's own first segment.
                    if let Err(e) = self.obj().new_segment(s.upcast_ref()) {
                        gst::warning!(CAT, imp = self, "the first segment: {e}");
                    }
                }
                self.send_producer_events(events, false);
                if latency_changed {
                    let _ = self
                        .obj()
                        .post_message(gst::message::Latency::builder().src(&*self.obj()).build());
                }
                drop(f);
                if headers.is_empty() {
                    #[cfg(feature = "stages")]
                    if let Some(b) = buffer.get_mut() {
                        stage_times[5] = gpushm::monotonic_ns();
                        crate::stages::add_all(b, stage_times);
                    }
                    return Ok(CreateSuccess::NewBuffer(buffer));
                }
                // Joined mid-stream: the caps' stream headers first, as multifdsink sends
                // them to a new client.
                gst::debug!(
                    CAT,
                    imp = self,
                    "joined mid-stream: {} stream headers first",
                    headers.len()
                );
                let mut list = gst::BufferList::new_sized(headers.len() + 1);
                {
                    let l = list.get_mut().ok_or(gst::FlowError::Error)?;
                    let discont = buffer.flags().contains(gst::BufferFlags::DISCONT);
                    for (i, mut h) in headers.into_iter().enumerate() {
                        let hb = h.make_mut();
                        hb.set_pts(buffer.pts());
                        hb.set_dts(buffer.dts());
                        if i == 0 && discont {
                            hb.set_flags(gst::BufferFlags::DISCONT);
                        }
                        l.add(h);
                    }
                    l.add(buffer);
                }
                Ok(CreateSuccess::NewBufferList(list))
            }
            Item::Eos(events) => {
                self.send_producer_events(events, true);
                Err(gst::FlowError::Eos)
            }
            Item::Error(msg) => {
                self.post_error_message(msg);
                Err(gst::FlowError::Error)
            }
        }
    }
}
