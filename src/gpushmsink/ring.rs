// SPDX-License-Identifier: MPL-2.0
//! The ring of the current caps: made when caps come, made again (announced to every client)
//! when they change or a buffer does not fit its slots, with the FramePath render() takes.

use std::sync::Arc;

use gst::subclass::prelude::*;

use super::caps::{announced_caps, cuda_memory, slot_size_for, stream_kind};
use super::imp::{GpuShmSink, State, CAT};
use super::metas::frame_template;
use super::pool::SlotPool;
use super::publish::FramePath;
use crate::cudameta::RingPlacement;

impl GpuShmSink {
    /// Makes the ring match `caps`: a new ring (announced to every client) when they change.
    pub(super) fn configure(&self, caps: &gst::Caps) -> Result<(), gst::LoggableError> {
        self.make_ring(caps, 0)
    }

    /// Makes the ring match `caps`, with slots of at least `min_slot` bytes: a new ring
    /// (announced to every client like a caps change) when the caps change or a buffer does
    /// not fit the current slots.
    pub(super) fn make_ring(
        &self,
        caps: &gst::Caps,
        min_slot: u64,
    ) -> Result<(), gst::LoggableError> {
        let cuda_caps = caps.features(0).is_some_and(cuda_memory);
        // (Looked at only for caps in CUDA memory: a process that does not use the GPU loads
        // no CUDA library.)
        let info = match stream_kind(caps, cuda_caps && self.takes_cuda_memory()) {
            Ok(info) => info,
            Err(msg) => {
                gst::element_imp_error!(self, gst::CoreError::Negotiation, ("{}", msg));
                return Err(gst::loggable_error!(CAT, "{}", msg));
            }
        };
        let caps_str = match announced_caps(caps) {
            Ok(s) => s,
            Err(msg) => {
                gst::element_imp_error!(self, gst::CoreError::Negotiation, ("{}", msg));
                return Err(gst::loggable_error!(CAT, "{}", msg));
            }
        };
        let (slots, max_buffer, placement, cuda_device) = {
            let s = self.settings();
            (s.slots, s.max_buffer_size as u64, s.ring, s.cuda_device)
        };
        // A device ring: its GPU, found before anything changes.
        let ring_device = match placement {
            RingPlacement::Device => match crate::cuda::device(cuda_device) {
                Ok(d) => Some(d),
                Err(e) => {
                    let msg = format!("ring=device needs a CUDA GPU: {e}");
                    gst::element_imp_error!(self, gst::ResourceError::Settings, ("{}", msg));
                    return Err(gst::loggable_error!(CAT, "{}", msg));
                }
            },
            RingPlacement::Auto if cuda_caps => match crate::cuda::device(cuda_device) {
                Ok(d) => Some(d),
                Err(e) => {
                    let msg = format!("CUDA memory input needs a CUDA GPU: {e}");
                    gst::element_imp_error!(self, gst::ResourceError::Settings, ("{}", msg));
                    return Err(gst::loggable_error!(CAT, "{}", msg));
                }
            },
            RingPlacement::Host | RingPlacement::Auto => None,
        };
        let slots = super::properties::auto_slots(slots, ring_device.is_some());
        let slot_size = match slot_size_for(info.as_ref(), min_slot, max_buffer) {
            Ok(n) => n,
            Err(msg) => {
                gst::element_imp_error!(self, gst::ResourceError::NoSpaceLeft, ("{}", msg));
                return Err(gst::loggable_error!(CAT, "{}", msg));
            }
        };
        let mut state = self.state();
        let State::Started {
            server,
            info: cur_info,
            caps: cur_caps,
            pool,
            cuda,
            cuda_on_request,
            live,
            frames,
            ..
        } = &mut *state
        else {
            return Err(gst::loggable_error!(CAT, "Not started"));
        };
        let fits = pool
            .as_ref()
            .and_then(|p| p.ring())
            .is_some_and(|r| r.slot_size() >= min_slot);
        if fits && cur_caps.as_ref().is_some_and(|c| c == caps) {
            return Ok(());
        }
        // Slots come back to the ring's pool once no consumer references them.
        let cell: Arc<std::sync::OnceLock<SlotPool>> = Arc::default();
        let requeue = {
            let cell = cell.clone();
            Arc::new(move |b: gst::Buffer| {
                if let Some(p) = cell.get() {
                    p.requeue(b);
                }
            })
        };
        // Slots grown for a burst stay grown across caps changes of the same kind.
        let slot_size = match (&info, &cur_info, pool.as_ref().and_then(|p| p.ring())) {
            (None, None, Some(r)) if cur_caps.is_some() => slot_size.max(r.slot_size()),
            _ => slot_size,
        };
        let place = |r: &gpushm::ring::producer_end::ProducerRing| match &ring_device {
            Some(dev) => crate::cuda::vmm::place_ring(r, dev)
                .map_err(|e| gpushm::Error::Invalid(format!("GPU memory: {e}"))),
            None => Ok(()),
        };
        let ring = match server.new_ring(slots, slot_size, &caps_str, requeue, &place) {
            Ok(r) => r,
            Err(e) => {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::NoSpaceLeft,
                    (
                        "Cannot create a ring of {} slots of {} bytes: {}",
                        slots,
                        slot_size,
                        e
                    )
                );
                return Err(gst::loggable_error!(CAT, "Cannot create the ring: {}", e));
            }
        };
        let new_pool = SlotPool::new(ring, Arc::downgrade(server), *cuda_on_request);
        let _ = cell.set(new_pool.clone());
        gst::info!(
            CAT,
            imp = self,
            "new ring of {slots} slots of {slot_size} bytes for {caps}"
        );
        if let (Some(dev), Some(ring)) = (
            cuda.as_ref(),
            new_pool.ring().filter(|r| r.device().is_none()),
        ) {
            if let Err(why) = super::pool::register_ring(dev, &ring) {
                gst::warning!(CAT, imp = self, "{why}");
            }
        }
        let info = info.map(Arc::new);
        *frames = new_pool.ring().map(|ring| {
            Arc::new(FramePath {
                server: server.clone(),
                info: info.clone(),
                pool: new_pool.clone(),
                ring,
                cuda_input: info.is_some() && cuda_caps,
                template: info.as_deref().map(frame_template),
            })
        });
        if let Some(old) = pool.replace(new_pool) {
            old.retire();
        }
        *cur_info = info;
        *cur_caps = Some(caps.clone());
        *live = None;
        Ok(())
    }
}
