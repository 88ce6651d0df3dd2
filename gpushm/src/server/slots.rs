// SPDX-License-Identifier: MPL-2.0
//! Who holds which slot: the producer's own count of the clients that reference each slot of
//! each ring it made, and what owns the slot on the producer's side meanwhile (a GstBuffer of
//! gpushmsink's pool, a [`crate::publisher::Publisher`]'s token), parked until the last
//! client gave the slot back and then handed to the ring's [`Requeue`].
//!
//! Only the newest ring takes new frames; an older one is kept while anybody references one
//! of its slots (frames queued before a caps change), then forgotten.

use std::sync::Arc;

use crate::ring::frame::Entry;
use crate::ring::producer_end::ProducerRing;

/// Gives a parked slot owner back to whoever lends slots (a buffer pool), once no client
/// references the slot any more.
pub type Requeue<P> = Arc<dyn Fn(P) + Send + Sync>;

/// Owners whose slots came free, to be handed to their [`Requeue`] once the engine's lock is
/// released (a pool's lock must never be taken under it).
pub(super) type Back<P> = Vec<(Requeue<P>, P)>;

/// Hands every owner in `back` to its pool.
pub(super) fn give_back<P>(back: Back<P>) {
    for (requeue, b) in back {
        requeue(b);
    }
}

struct Slot<P> {
    client_refs: u32,
    /// What owns the slot on the producer's side, kept until the last client released it.
    parked: Option<P>,
}

struct Ring<P> {
    ring: Arc<ProducerRing>,
    requeue: Requeue<P>,
    slots: Vec<Slot<P>>,
}

/// Every ring still referenced, the newest last.
pub(super) struct Slots<P> {
    rings: Vec<Ring<P>>,
    next_gen: u32,
}

impl<P> Slots<P> {
    pub(super) fn new() -> Self {
        Self {
            rings: Vec::new(),
            next_gen: 1,
        }
    }

    /// The generation number of the next ring.
    pub(super) fn take_gen(&mut self) -> u32 {
        self.next_gen += 1;
        self.next_gen - 1
    }

    /// Makes `ring` the current one, every slot free.
    pub(super) fn push(&mut self, ring: Arc<ProducerRing>, requeue: Requeue<P>) {
        let slots = (0..ring.slot_count())
            .map(|_| Slot {
                client_refs: 0,
                parked: None,
            })
            .collect();
        self.rings.push(Ring {
            ring,
            requeue,
            slots,
        });
    }

    /// The ring new frames go into.
    pub(super) fn current(&self) -> Option<&Arc<ProducerRing>> {
        self.rings.last().map(|r| &r.ring)
    }

    /// Slots of the current ring (0 before the first).
    pub(super) fn count(&self) -> usize {
        self.rings.last().map_or(0, |r| r.slots.len())
    }

    /// Whether every slot of the current ring is referenced by clients (none is free to take
    /// a frame unless a client gives one back). False before the first ring.
    pub(super) fn all_held(&self) -> bool {
        self.rings
            .last()
            .is_some_and(|r| r.slots.iter().all(|s| s.client_refs > 0))
    }

    /// Why `slot` of ring `ring_gen` cannot be published now, if it cannot: only the current
    /// ring's slots are (consumers read a frame with the newest caps), and only while no
    /// consumer holds them.
    pub(super) fn refusal(&self, ring_gen: u32, slot: u32) -> Option<String> {
        let current = self.rings.last().filter(|r| r.ring.ring_gen() == ring_gen);
        Some(match current.map(|r| r.slots.get(slot as usize)) {
            None => format!("ring {ring_gen} is not the current ring"),
            Some(None) => format!("slot {slot} is not in ring {ring_gen}"),
            Some(Some(s)) if s.client_refs != 0 => {
                format!("slot {slot} is still held by consumers")
            }
            Some(Some(_)) => return None,
        })
    }

    /// One more client references `slot` of the current ring (checked by [`Self::refusal`]).
    pub(super) fn add_ref(&mut self, slot: u32) {
        if let Some(s) = self
            .rings
            .last_mut()
            .and_then(|r| r.slots.get_mut(slot as usize))
        {
            s.client_refs += 1;
        }
    }

    /// A client gave `e` back (or lost it): when it was the slot's last reader, its parked
    /// owner goes to `back`.
    pub(super) fn unref(&mut self, e: Entry, back: &mut Back<P>) {
        let Some(r) = self
            .rings
            .iter_mut()
            .find(|r| r.ring.ring_gen() == e.ring_gen)
        else {
            return;
        };
        if let Some(s) = r.slots.get_mut(e.slot as usize) {
            s.client_refs = s.client_refs.saturating_sub(1);
            if s.client_refs == 0 {
                if let Some(b) = s.parked.take() {
                    back.push((r.requeue.clone(), b));
                }
            }
        }
    }

    /// The pool got `owner` back: returned if no client holds its slot (or `free_all`, the
    /// engine stopping), otherwise parked until the last one released it.
    pub(super) fn park(&mut self, ring_gen: u32, slot: u32, owner: P, free_all: bool) -> Option<P> {
        let Some(s) = self
            .rings
            .iter_mut()
            .find(|r| r.ring.ring_gen() == ring_gen)
            .and_then(|r| r.slots.get_mut(slot as usize))
        else {
            return Some(owner);
        };
        if s.client_refs == 0 || free_all {
            Some(owner)
        } else {
            s.parked = Some(owner);
            None
        }
    }

    /// Forgets rings that are no longer current and that nobody references.
    pub(super) fn retire_idle(&mut self) {
        let n = self.rings.len();
        let mut i = 0;
        self.rings.retain(|r| {
            i += 1;
            i == n
                || r.slots
                    .iter()
                    .any(|s| s.client_refs > 0 || s.parked.is_some())
        });
    }

    /// Every parked owner, taken (the engine stops: nobody reads slots any more).
    pub(super) fn take_parked(&mut self) -> Vec<P> {
        self.rings
            .iter_mut()
            .flat_map(|r| r.slots.iter_mut().filter_map(|s| s.parked.take()))
            .collect()
    }
}
