// SPDX-License-Identifier: MPL-2.0
//! What views keep alive: a received frame's data and lease ([`FrameData`]), or a
//! publisher's slot being filled ([`WritableSlot`]). The types below `view`, `frame`,
//! `publisher` and `cuda`, so that none of those needs another's internals.

use std::sync::Mutex;

use gpushm::publisher::Slot as CoreSlot;
use gpushm::ring::frame::FrameMeta;
use gpushm::subscriber::SlotLease;
use pyo3::prelude::*;

use crate::errors::FrameRevoked;

/// A frame's lease, held by the frame and by every view of it: the slot goes back to the
/// producer when the last of them is gone.
pub struct FrameData {
    pub meta: FrameMeta,
    /// Address of the first byte (inside the lease's mapping).
    pub ptr: usize,
    pub lease: LeaseHolder,
    pub cuda_device: i32,
    /// The bytes are in GPU memory (a device ring): no host view, DLPack/CUDA views only.
    pub on_device: bool,
}

pub struct LeaseHolder(pub SlotLease);

// SAFETY: the lease is only read (its ring, for CUDA registration, which the ring guards with
// its own once-cell; its validity) and dropped; SlotLease's drop may run on any thread.
unsafe impl Sync for LeaseHolder {}
// SAFETY: as above; the raw frame pointer lives in FrameData as an address.
unsafe impl Send for LeaseHolder {}

impl FrameData {
    /// An error once the producer cut the subscriber and took the frame back.
    pub fn check(&self) -> PyResult<()> {
        match self.lease.0.revoked() {
            None => Ok(()),
            Some(why) => Err(FrameRevoked::new_err(format!(
                "this frame is no longer ours: the producer cut the subscriber ({why}); its memory may hold another frame now, and views made before may show it"
            ))),
        }
    }
}

/// A slot lent to a Python publisher, to fill in place.
pub struct WritableSlot {
    pub lease: Mutex<Option<CoreSlot>>,
    pub ptr: usize,
}
