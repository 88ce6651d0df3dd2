// SPDX-License-Identifier: MPL-2.0
//! The way of a frame: [`Server::publish_frame`] and the per-frame policy it applies to each
//! client. A lossless client at its budget is waited for (up to the policy's max-wait, then it
//! is lagging and served like a leaky one until it takes frames again; an `auto` client of a
//! live stream only while it has hold credit); a leaky one keeps a short backlog and loses its
//! oldest untaken frames, or this frame, rather than hold the producer up. The first consumers
//! of a `wait-for-connection` producer are lossless, whatever their mode, for the backlog it
//! delivers after its wait ([`crate::policy::BACKLOG_MAX_WAIT`]).

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use super::client::Client;
use super::slots::{give_back, Back};
use super::stats::Stats;
use super::{fairness, Event, Inner, Published, Server};
use crate::policy::{
    zero_copy_limit, Policy, BACKLOG_GROWTH, BACKLOG_MAX_WAIT, BACKLOG_SETTLE,
    BACKLOG_STARTUP_GRACE, LEAKY_BACKLOG, LIVE_HOLD_BURST, LIVE_HOLD_PERCENT,
};
use crate::ring::frame::{Entry, FrameMeta};
use crate::ring::shm;
use crate::wire::Message;
use crate::Result;

/// Time between two looks at the clients' releases in the low-latency wait. A look takes our
/// lock and reads every client's release queue (lines its consumer writes), so not much more
/// often than this; timed, not counted in spin-loop hints, as one hint takes from 10 to 140
/// cycles depending on the CPU (100 of them, the count before, took 1.4 µs on the Intel VM and
/// 2.1 µs on the H100 machine). The clock is read every 4 hints: a gap may run over by that
/// much (up to about 250 ns where a hint is 140 cycles).
const LOOK_EVERY: Duration = Duration::from_nanos(300);

/// How the wait for lossless clients ended.
#[derive(Default)]
struct Waited {
    /// Unlocked or shut down while waiting.
    stopped: bool,
    /// Clients that took nothing for a whole max-wait: lagging from this frame on.
    late: Vec<u32>,
    /// Clients that held the producer up (their hold credit pays for it).
    held_by: Vec<u32>,
    /// `auto` clients that ran out of hold credit during this frame.
    spent: Vec<u32>,
}

impl<P: Send + 'static> Server<P> {
    /// Publishes the frame in `slot` of ring `ring_gen` to every client, following `policy`
    /// (see the module's documentation). With `wait_for_clients` > 0 it first waits until a
    /// client is connected, and before the stream's first frame until `wait_for_clients` are:
    /// consumers started with the producer all get its first frame, and one leaving later
    /// does not hold the others up. A slot that cannot be published (not in the current ring, or
    /// still held by consumers) is [`Published::SlotBusy`]: the caller publishes a copy.
    pub fn publish_frame(
        &self,
        ring_gen: u32,
        slot: u32,
        mut meta: FrameMeta,
        policy: Policy,
        wait_for_clients: usize,
    ) -> Result<Published> {
        let mut guard = self.lock();
        let first_frame = guard.stream.next_seq == 1;
        let wait_for_clients = match first_frame {
            true => wait_for_clients,
            false => wait_for_clients.min(1),
        };
        // The consumers a wait-for-connection producer starts with get its backlog whole,
        // whether they came before its first frame or it waited for them: one that connected
        // first may still be setting up (mapping a device ring creates its CUDA context, a
        // few hundred ms) while a live source's frames come.
        let backlog = wait_for_clients > 0 && first_frame;
        if backlog || guard.clients.open_count() < wait_for_clients {
            while guard.clients.open_count() < wait_for_clients
                && !guard.unlocked
                && !guard.shutdown
            {
                guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            // Those that ended the wait get what the source made meanwhile.
            for c in guard.clients.iter_mut().filter(|c| !c.closed) {
                c.first_of_wait = true;
                c.on_time_since = None;
            }
            guard.stream.backlog_limit = None;
        }
        if first_frame {
            guard.stream.first_frame_at.get_or_insert_with(Instant::now);
        }
        // Refused before any wait for lossless clients: the caller publishes a copy next, which
        // may wait once (a slot consumers hold is not released by waiting for them to take).
        if let Some(why) = guard.slots.refusal(ring_gen, slot) {
            return Ok(Published::SlotBusy(why));
        }
        // No client's budget is more than its share of the ring (see fairness): consumers
        // copy what their downstream keeps past it instead of pinning slots, and one that
        // does not follow it gets no more frames than that.
        let policy = Policy {
            budget: fairness::budget(
                policy.budget,
                guard.slots.count(),
                guard.clients.open_count(),
            ),
            ..policy
        };
        let backlog = backlog_goes_on(&mut guard, &meta);
        let policy = Policy {
            max_wait: match backlog {
                true => policy.max_wait.max(BACKLOG_MAX_WAIT),
                false => policy.max_wait,
            },
            ..policy
        };
        let start = Instant::now();
        let mut waited = Waited::default();
        // What clients released since the last frame (they wake nobody for it) is taken
        // after the frame went out (off its way: reading each client's release queue is a
        // cache miss per client and a microsecond on the way of every frame) unless a client
        // may be full by the counts of the last frame: a client under the count that decides
        // its way is treated the same whatever it released since.
        let reclaimed = prepare(&mut guard, meta.live, &policy, start, &mut waited.spent);
        let mut back = Vec::new();
        if reclaimed {
            self.reclaim_locked(&mut guard, &mut back);
        }
        // Without a reclaim no client can be full (only one that may be full triggers it), so
        // the wait below ends at once and its start is not read: no clock read for it.
        let wait_start = if reclaimed { Instant::now() } else { start };
        let mut guard = self.wait_for_room(
            guard,
            &policy,
            meta.live,
            wait_start,
            &mut back,
            &mut waited,
        );
        for id in &waited.spent {
            guard.events.push(Event::Info(format!(
                "client {id} (mode auto) held this live stream up for its share ({} % of the \
                 time, {} ms at once): it loses frames it has no room for until it keeps up \
                 (mode=lossless waits for it without this bound)",
                LIVE_HOLD_PERCENT,
                LIVE_HOLD_BURST.as_millis()
            )));
        }
        if !waited.held_by.is_empty() {
            let took = wait_start.elapsed();
            for c in guard
                .clients
                .iter_mut()
                .filter(|c| waited.held_by.contains(&c.id))
            {
                if c.hold_bounded(meta.live) {
                    c.hold.left = c.hold.left.saturating_sub(took);
                }
            }
        }
        let inner = &mut *guard;
        // Looked at again: the ring may have changed while we waited.
        let refused = match waited.stopped {
            true => Some(Published::Stopped),
            false => inner.slots.refusal(ring_gen, slot).map(Published::SlotBusy),
        };
        if let Some(r) = refused {
            drop(guard);
            give_back(back);
            return Ok(r);
        }
        let seq = inner.stream.next_seq;
        inner.stream.next_seq += 1;
        if let Some(payload) = inner.stream.next_metas.take() {
            // A client without room misses them: its frame comes without these metas.
            self.send_optional(inner, &Message::FrameMetas { seq, payload });
        }
        meta.caps_gen = inner.stream.caps.as_ref().map_or(0, |c| c.0);
        meta.events_seq = inner.stream.events_seq;
        meta.publish_ns = crate::monotonic_ns();
        if let Some(ring) = inner.slots.current() {
            ring.publish(slot, seq, &meta);
        }
        inner.book.published(meta.publish_ns);
        // The connection thread waits for this frame to plan the next wake-up ahead.
        let poke = inner.wake.published(meta.publish_ns);
        let entry = Entry {
            seq,
            ring_gen,
            slot,
        };
        let wake = self.hand_out(inner, entry, &policy, &waited.late, &mut back);
        // Wake-ups first, without our lock held: what clients released since the last frame
        // is taken after (off the frame's way).
        drop(guard);
        for d in wake {
            d.ring();
        }
        if poke {
            shm::notify(&self.wake);
        }
        let mut inner = self.lock();
        if !reclaimed {
            self.reclaim_locked(&mut inner, &mut back);
        }
        let events = std::mem::take(&mut inner.events);
        // Returning buffers to their pool, without our lock held.
        drop(inner);
        give_back(back);
        self.emit(events);
        Ok(Published::Sent)
    }

    /// Back-pressure from lossless clients, bounded by max-wait. A client that held the
    /// producer up for a whole max-wait is lagging: it is not waited for again until it has
    /// caught up, so a stuck consumer costs the others one max-wait, once. An `auto` client
    /// of a live stream is waited for only while it has hold credit.
    fn wait_for_room<'a>(
        &'a self,
        mut guard: MutexGuard<'a, Inner<P>>,
        policy: &Policy,
        live: bool,
        wait_start: Instant,
        back: &mut Back<P>,
        out: &mut Waited,
    ) -> MutexGuard<'a, Inner<P>> {
        let deadline = wait_start.checked_add(policy.max_wait);
        let mut waiting = false;
        let mut spun = false;
        loop {
            let inner = &mut *guard;
            if inner.unlocked || inner.shutdown {
                out.stopped = true;
                break;
            }
            let mut full = Vec::new();
            let mut failed = Vec::new();
            // When the first bounded client runs out of credit.
            let mut credit_end: Option<Instant> = None;
            for c in inner
                .clients
                .iter_mut()
                .filter(|c| c.lossless && !c.lagging && !c.closed)
            {
                if c.refs() < policy.budget {
                    // Room: nothing to read from its queue (taking frames moves them from
                    // pending to held, the count stays; only releases lower it).
                    continue;
                }
                if let Err(e) = c.ch.sync_taken() {
                    failed.push((c.id, e.to_string()));
                    continue;
                }
                if c.hold_bounded(live) {
                    if wait_start.elapsed() >= c.hold.left {
                        // Its credit is spent: this frame skips it instead.
                        c.lossless = false;
                        if !std::mem::replace(&mut c.hold.spent, true) {
                            out.spent.push(c.id);
                        }
                        continue;
                    }
                    let end = wait_start + c.hold.left;
                    credit_end = Some(credit_end.map_or(end, |e: Instant| e.min(end)));
                }
                if !out.held_by.contains(&c.id) {
                    out.held_by.push(c.id);
                }
                full.push(c.id);
            }
            for (id, why) in failed {
                self.drop_client(inner, id, why);
            }
            if full.is_empty() {
                break;
            }
            if !spun && !policy.spin.is_zero() {
                spun = true;
                // Never past max-wait, nor past a bounded client's hold credit.
                let until = [deadline, credit_end]
                    .into_iter()
                    .flatten()
                    .fold(Instant::now() + policy.spin, Instant::min);
                let caught;
                (guard, caught) = self.spin_for_releases(guard, &full, policy.budget, until, back);
                match caught {
                    true => guard.book.stats.spin_caught += 1,
                    false => guard.book.stats.spin_missed += 1,
                }
                continue;
            }
            if !waiting {
                // Clients wake the connection thread on releases from now on; what they
                // released before they saw that is taken here.
                waiting = true;
                if inner.clients.add_release_waiter(true) {
                    // Its poll may not be watching the doorbells (rung for nothing before).
                    shm::notify(&self.wake);
                }
                self.reclaim_locked(inner, back);
                continue;
            }
            let now = Instant::now();
            // Wake up when a bounded client's credit ends, to skip it from then on.
            let deadline = match (deadline, credit_end) {
                (Some(d), Some(e)) => Some(d.min(e)),
                (None, e) => e,
                (d, None) => d,
            };
            match deadline {
                Some(d) if now >= d && credit_end.is_some_and(|e| e <= d) => continue,
                Some(d) if now >= d => {
                    out.late = full;
                    break;
                }
                Some(d) => {
                    guard = self
                        .released
                        .wait_timeout(guard, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => guard = self.released.wait(guard).unwrap_or_else(|e| e.into_inner()),
            }
        }
        if waiting {
            let _ = guard.clients.add_release_waiter(false);
        }
        guard
    }

    /// Low-latency mode of the wait: polls the `full` clients' releases until `until`, our
    /// lock let go between looks. True if every one of them got room (or closed).
    fn spin_for_releases<'a>(
        &'a self,
        mut guard: MutexGuard<'a, Inner<P>>,
        full: &[u32],
        budget: usize,
        until: Instant,
        back: &mut Back<P>,
    ) -> (MutexGuard<'a, Inner<P>>, bool) {
        loop {
            drop(guard);
            let next = Instant::now() + LOOK_EVERY;
            while Instant::now() < next {
                for _ in 0..4 {
                    std::hint::spin_loop();
                }
            }
            guard = self.lock();
            let inner = &mut *guard;
            if inner.unlocked || inner.shutdown {
                return (guard, false);
            }
            self.reclaim_locked(inner, back);
            if inner
                .clients
                .iter()
                .filter(|c| full.contains(&c.id))
                .all(|c| c.closed || c.refs() < budget)
            {
                return (guard, true);
            }
            if Instant::now() >= until {
                return (guard, false);
            }
        }
    }

    /// Hands frame `entry` to every open client as [`deliver_to`] decides; returns the
    /// doorbells to ring once our lock is released (clients waiting for a frame).
    fn hand_out(
        &self,
        inner: &mut Inner<P>,
        entry: Entry,
        policy: &Policy,
        late: &[u32],
        back: &mut Back<P>,
    ) -> Vec<Arc<shm::Doorbell>> {
        let mut failed = Vec::new();
        let mut released = Vec::new();
        let mut wake = Vec::new();
        for c in inner.clients.iter_mut().filter(|c| !c.closed) {
            let lagging_now = late.contains(&c.id);
            let r = deliver_to(
                c,
                entry,
                policy,
                lagging_now,
                &mut inner.book.stats,
                &mut inner.events,
                &mut released,
            );
            match r {
                Ok(true) => {
                    c.sent += 1;
                    inner.slots.add_ref(entry.slot);
                    // A client busy with earlier frames takes this one without a wake-up.
                    if c.ch.consumer_waits() {
                        wake.push(c.ready.clone());
                        inner.book.stats.woken += 1;
                    }
                }
                Ok(false) => {
                    c.ch.skip();
                    inner.book.stats.frames_dropped += 1;
                }
                Err(e) => failed.push((c.id, e.to_string())),
            }
        }
        for e in released {
            inner.slots.unref(e, back);
        }
        for (id, why) in failed {
            self.drop_client(inner, id, why);
        }
        wake
    }
}

/// Whether the first consumers of a wait-for-connection producer still get its backlog
/// whole (see [`BACKLOG_MAX_WAIT`]) with frame `meta`: it ends for each of them once frames
/// have come on time and it took each before the next for [`BACKLOG_SETTLE`] (served as leaky
/// again with frames untaken, or while its downstream still holds what the backlog made it
/// hold, it could lose them); a backlog grown by [`BACKLOG_GROWTH`] ends it for all.
fn backlog_goes_on<P>(inner: &mut Inner<P>, meta: &FrameMeta) -> bool {
    if !inner.clients.iter().any(|c| c.first_of_wait) {
        return false;
    }
    let late = crate::time::lateness(meta, crate::monotonic_ns()).unwrap_or(0);
    // A first consumer that has taken no frame yet, within BACKLOG_STARTUP_GRACE of the
    // first frame, is still setting up (one mapping a device ring creates its CUDA context:
    // hundreds of ms): how late the frames it makes wait get is no pressure, and the limit
    // counts from the first frame after every one has started. Not one that is lagging or
    // has spent its hold credit (an `auto` consumer of a live stream): those are served as
    // their mode says already.
    let now = Instant::now();
    let grace = inner
        .stream
        .first_frame_at
        .is_some_and(|t| now.duration_since(t) < BACKLOG_STARTUP_GRACE);
    let setting_up = grace
        && inner
            .clients
            .iter_mut()
            .filter(|c| c.first_of_wait && !c.closed && !c.lagging && !c.hold.spent)
            .any(|c| c.ch.sync_taken().is_ok() && c.ch.taken() == 0);
    let was_setting_up = std::mem::replace(&mut inner.stream.setting_up, setting_up);
    let growth = late.saturating_add(BACKLOG_GROWTH.as_nanos() as i128);
    let limit = match setting_up || was_setting_up {
        true => *inner.stream.backlog_limit.insert(growth),
        false => *inner.stream.backlog_limit.get_or_insert(growth),
    };
    if late > limit {
        // Held further behind than the wait left it: real pressure, not a backlog.
        for c in inner.clients.iter_mut() {
            c.first_of_wait = false;
        }
        return false;
    }
    for c in inner.clients.iter_mut().filter(|c| c.first_of_wait) {
        // A position it moved out of bounds is reported when the frame is handed out.
        let _ = c.ch.sync_taken();
        if c.closed {
            c.first_of_wait = false;
        } else if late > crate::time::BACKLOG_SLACK || c.ch.pending_len() > 0 {
            c.on_time_since = None;
        } else {
            let since = *c.on_time_since.get_or_insert(now);
            c.first_of_wait = now.duration_since(since) < BACKLOG_SETTLE;
        }
    }
    inner.clients.iter().any(|c| c.first_of_wait)
}

/// Before a frame: each client's mode applied to the stream (and an `auto` client's hold
/// credit), its budget written for it to read. True if a client may be full by the counts
/// that decide its way, so that its releases must be read before the frame.
fn prepare<P>(
    inner: &mut Inner<P>,
    live: bool,
    policy: &Policy,
    now: Instant,
    spent: &mut Vec<u32>,
) -> bool {
    let limit = zero_copy_limit(policy.budget);
    let caps = inner.stream.caps.as_ref().map_or("", |c| c.1.as_str());
    let mut reclaim = false;
    for c in inner.clients.iter_mut() {
        // A first consumer of a wait-for-connection producer gets its backlog whole.
        c.lossless = c.mode.lossless_for(live, caps) || c.first_of_wait;
        if c.lossless && c.hold_bounded(live) && !c.first_of_wait {
            c.hold.refill(now);
            if c.hold.left.is_zero() {
                // Held the live producer up for its share: this frame skips it if it has no
                // room.
                c.lossless = false;
                if !c.hold.spent {
                    c.hold.spent = true;
                    spent.push(c.id);
                }
            } else if c.hold.left >= LIVE_HOLD_BURST / 2 {
                c.hold.spent = false;
            }
        }
        c.ch.set_budget(policy.budget as u32);
        // Its releases change this frame's way only at the count that decides: a lossless
        // client's budget (it is waited for), a leaky or lagging one's cap (the frame skips
        // it, or its oldest go back).
        let decides = match c.lossless && !c.lagging {
            true => policy.budget,
            false => limit + 1,
        };
        reclaim |= c.refs() >= decides;
    }
    reclaim
}

/// Frame `entry` for client `c`: true if handed over, false if it skips the client. A client
/// that took nothing for a whole max-wait (`lagging_now`) is served like a leaky one from now
/// on, until it takes a frame again, and what it has not taken goes back at once (into
/// `released`), so a stuck client pins only what it really holds. A leaky (or lagging) client
/// keeps a short backlog under its cap: its oldest untaken frames go back first.
fn deliver_to(
    c: &mut Client,
    entry: Entry,
    policy: &Policy,
    lagging_now: bool,
    stats: &mut Stats,
    events: &mut Vec<Event>,
    released: &mut Vec<Entry>,
) -> Result<bool> {
    if lagging_now {
        c.lagging = true;
        c.times_lagged += 1;
        stats.times_lagged += 1;
        c.taken_at_lag = c.ch.taken();
        events.push(Event::Lagging {
            id: c.id,
            waited: policy.max_wait,
            first: c.times_lagged == 1,
        });
        while let Some(old) = c.ch.revoke_oldest()? {
            released.push(old);
            stats.frames_dropped += 1;
        }
        return Ok(false);
    }
    if c.lagging {
        c.ch.sync_taken()?;
        if c.ch.taken() > c.taken_at_lag {
            // It took frames again: lossless again.
            c.lagging = false;
            events.push(Event::CaughtUp { id: c.id });
        }
    }
    if !c.lossless || c.lagging {
        // What it took since the last frame (its releases may be taken later).
        c.ch.sync_taken()?;
        // Keep a short backlog and stay under the budget: drop the oldest frames the client
        // has not taken yet. A client that takes nothing pins at most what it keeps
        // zero-copy plus one.
        let cap = zero_copy_limit(policy.budget) + 1;
        while c.ch.pending_len() > 0 && (c.ch.pending_len() >= LEAKY_BACKLOG || c.refs() >= cap) {
            match c.ch.revoke_oldest()? {
                Some(old) => {
                    released.push(old);
                    stats.frames_dropped += 1;
                }
                None => break,
            }
        }
        if c.refs() >= cap {
            // It holds all it may: this frame skips it.
            return Ok(false);
        }
    }
    c.ch.deliver(entry)?;
    Ok(true)
}
