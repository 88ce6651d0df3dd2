// SPDX-License-Identifier: MPL-2.0
//! A held frame's slot: a [`SlotLease`] gives it back to the producer when the last holder
//! drops it, on whatever thread, through the connection's release queue. The
//! [`Releaser`] the leases share outlives the connection: a closed subscriber's socket stays
//! open, owned by the leases, until the last one is gone (see "Held frames" in
//! [`crate::subscriber`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::ring::consumer_end::{ConsumerChannel, ConsumerRing};
use crate::ring::frame::Entry;
use crate::ring::shm;
use crate::wire::{Conn, Message};

/// Releases kept at most while the release queue is full: a producer that reads its release
/// queue (every frame, and at least every 100 ms) never lets it fill for long; one that does
/// not cannot make us keep every frame we give back.
const BACKLOG_MAX: usize = 1024;

/// Gives held frames back, through the release queue, and keeps what did not fit yet.
pub(super) struct Releaser {
    pub(super) ch: ConsumerChannel,
    /// Rung after releases while the producer waits for slots.
    pub(super) efd: shm::Doorbell,
    /// Releases that could not be written yet because the release queue was full.
    pub(super) backlog: Mutex<Vec<Entry>>,
    /// The backlog reached [`BACKLOG_MAX`]: the producer takes nothing back, and what we give
    /// back from then on is dropped.
    pub(super) stuck: AtomicBool,
    /// Leases alive now: frames we reference and have not given back.
    pub(super) leases: AtomicUsize,
    /// Frames copied out of the ring instead of being kept zero-copy.
    pub(super) copied: AtomicU64,
    /// The producer cut us (we read its Error on the socket).
    pub(super) cut: AtomicBool,
    /// Why, in the producer's words, once read from the socket.
    pub(super) reason: Mutex<Option<String>>,
    /// After the subscriber closed: its socket, owned by the leases (this struct) so that
    /// the producer keeps our slots while they live. Read only for the reason the producer
    /// gives when it cut us.
    pub(super) closed_link: Mutex<Option<Conn>>,
}

impl Releaser {
    pub(super) fn new(ch: ConsumerChannel, efd: shm::Doorbell) -> Self {
        Self {
            ch,
            efd,
            backlog: Mutex::new(Vec::new()),
            stuck: AtomicBool::new(false),
            leases: AtomicUsize::new(0),
            copied: AtomicU64::new(0),
            cut: AtomicBool::new(false),
            reason: Mutex::new(None),
            closed_link: Mutex::new(None),
        }
    }

    /// Whether the producer cut us and took our slots back. It says so in our control block
    /// before it does (read here without a system call, whether or not anybody reads the
    /// socket), then on the socket, with its reason.
    pub(super) fn is_revoked(&self) -> bool {
        self.ch.revoked() || self.cut.load(Ordering::Acquire)
    }

    /// Why our frames are no longer ours, if the producer cut us.
    pub(super) fn revoked(&self) -> Option<String> {
        if !self.is_revoked() {
            return None;
        }
        let mut reason = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if reason.is_none() {
            *reason = self.reason_on_socket();
        }
        Some(reason.clone().unwrap_or_else(|| {
            "the producer cut this consumer and took its frames back".to_string()
        }))
    }

    /// After the connection closed: the producer's Error message, if it is on the socket.
    /// The socket is never closed here (that would give our slots back): a message that
    /// cannot be read is left there.
    fn reason_on_socket(&self) -> Option<String> {
        let mut link = self.closed_link.lock().unwrap_or_else(|p| p.into_inner());
        let conn = link.as_mut()?;
        loop {
            match conn.try_recv() {
                Ok(Some((Message::Error { message }, _))) => return Some(message),
                // Ring, Caps or Eos sent before the producer read our Close.
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// Gives `e` back, after any release still waiting.
    #[link_section = ".text.hot.gpushm"]
    pub(super) fn release(&self, e: Entry) {
        self.leases.fetch_sub(1, Ordering::AcqRel);
        let mut backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        if backlog.len() < BACKLOG_MAX {
            backlog.push(e);
        } else {
            self.stuck.store(true, Ordering::Relaxed);
        }
        let wake = self.write(&mut backlog);
        drop(backlog);
        if wake {
            self.efd.ring();
        }
    }

    /// Writes the releases that did not fit earlier.
    pub(super) fn flush(&self) {
        let mut backlog = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        let wake = self.write(&mut backlog);
        drop(backlog);
        if wake {
            self.efd.ring();
        }
    }

    /// Moves as many releases as fit into the release queue, oldest first. True if any went
    /// in and the producer waits for slots: the caller then rings it, with the backlog's lock
    /// released (otherwise the producer picks them up itself: no system call per frame).
    fn write(&self, backlog: &mut Vec<Entry>) -> bool {
        let n = backlog.iter().take_while(|&&e| self.ch.release(e)).count();
        if n > 0 {
            backlog.drain(..n);
            return self.ch.producer_waits();
        }
        false
    }
}

/// Ownership of one slot: keeps the mapping alive and gives the slot back when dropped.
pub struct SlotLease {
    pub(super) entry: Entry,
    pub(super) ring: Arc<ConsumerRing>,
    pub(super) releaser: Arc<Releaser>,
}

impl SlotLease {
    /// The mapping the frame is in.
    pub fn ring(&self) -> &Arc<ConsumerRing> {
        &self.ring
    }

    /// Whether the frame is still ours: false once the producer cut this consumer and took its
    /// slots back (see "Held frames" in [`crate::subscriber`]). One atomic load while it is ours.
    pub fn is_valid(&self) -> bool {
        !self.releaser.is_revoked()
    }

    /// Why the frame is no longer ours (the producer's message), if it is not.
    pub fn revoked(&self) -> Option<String> {
        self.releaser.revoked()
    }
}

impl Drop for SlotLease {
    #[link_section = ".text.hot.gpushm"]
    fn drop(&mut self) {
        self.releaser.release(self.entry);
    }
}
