// SPDX-License-Identifier: MPL-2.0
//! The receiver's own queue: frames taken from the ring wait here while downstream is away,
//! bounded by `max-size-*` (leaky: the oldest go; lossless: the producer waits).

use super::*;

impl Worker {
    /// Queues `item`. Past the queue's limits a leaky consumer drops its oldest frames and a
    /// lossless one waits (so the producer's back-pressure applies). False when stopping.
    pub(super) fn push(&mut self, mut item: Item) -> bool {
        // Frames dropped from the queue go after the lock (declared first, dropped last): a
        // frame's release takes the lock.
        let mut dropped = Vec::new();
        let mut q = self.shared.queue();
        if q.stale(&item) {
            q.carry(&mut item);
            q.discont = true;
            self.shared.dropped_from_queue(1);
            return !q.stopping;
        }
        if let Item::Frame(f) = &item {
            let size = f.buffer.size() as u64;
            let lossless = self
                .cfg
                .opts
                .delivery()
                .lossless_for(f.details.meta.live, &f.details.caps);
            loop {
                if q.stopping {
                    return false;
                }
                if !self.full(&q, size, f.details.arrival_ns) {
                    break;
                }
                if lossless {
                    q = self.shared.cond.wait(q).unwrap_or_else(|e| e.into_inner());
                    if q.paused {
                        q.carry(&mut item);
                        q.discont = true;
                        self.shared.dropped_from_queue(1);
                        return !q.stopping;
                    }
                    continue;
                }
                let Some(pos) = q.items.iter().position(|i| matches!(i, Item::Frame(_))) else {
                    break;
                };
                if let Some(Item::Frame(mut old)) = q.items.remove(pos) {
                    q.bytes = q.bytes.saturating_sub(old.buffer.size() as u64);
                    q.carry_events(&mut old.events);
                    dropped.push(old);
                }
                q.discont = true;
                self.shared.dropped_from_queue(1);
            }
            q.bytes += size;
        } else if q.stopping {
            return false;
        }
        q.items.push_back(item);
        drop(q);
        self.shared.cond.notify_all();
        true
    }

    /// Whether a frame of `size` bytes arriving at `arrival_ns` exceeds the queue's limits.
    pub(super) fn full(&self, q: &Queue, size: u64, arrival_ns: u64) -> bool {
        let frames = q
            .items
            .iter()
            .filter(|i| matches!(i, Item::Frame(_)))
            .count();
        if frames == 0 {
            return false;
        }
        let c = &self.cfg;
        if c.max_buffers > 0 && frames >= c.max_buffers as usize {
            return true;
        }
        if c.max_bytes > 0 && q.bytes + size > c.max_bytes {
            return true;
        }
        let oldest = q.items.iter().find_map(|i| match i {
            Item::Frame(f) => Some(f.details.arrival_ns),
            _ => None,
        });
        c.max_time > 0 && oldest.is_some_and(|o| arrival_ns.saturating_sub(o) >= c.max_time)
    }
}
