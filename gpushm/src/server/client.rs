// SPDX-License-Identifier: MPL-2.0
//! One connected consumer as the producer sees it (its socket, its control block, its
//! doorbells, what it asked for and how it has behaved), and the list of them.
//!
//! Nothing a client writes is believed: [`ClientChannel`] checks every position and release
//! against the producer's own record of what it handed over.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::policy::{Delivery, LIVE_HOLD_BURST, LIVE_HOLD_PERCENT};
use crate::ring::producer_end::ClientChannel;
use crate::ring::shm;
use crate::wire::Conn;

pub(super) struct Client {
    pub id: u32,
    pub pid: i32,
    pub uid: u32,
    /// The name it gave in Hello, cut to [`crate::wire::REPORT_MAX_NAME`] bytes.
    pub name: String,
    pub since: Instant,
    pub conn: Conn,
    pub ch: ClientChannel,
    /// Our end of its frame-ready doorbell, rung (outside the engine's lock) after a delivery
    /// while it waits.
    pub ready: Arc<shm::Doorbell>,
    /// Our end of its slot-released doorbell, polled by the connection thread.
    pub release: shm::Doorbell,
    /// Whether the connection thread polls that doorbell: always while the producer waits for
    /// releases (the only time it is rung for), otherwise until it rings for nothing once. A
    /// client that rings it in a loop then costs one round per wait, not one per ring.
    pub release_armed: bool,
    /// What it asked for.
    pub mode: Delivery,
    /// Whether it is waited for: its mode applied to the stream (caps, live), as of the
    /// last frame.
    pub lossless: bool,
    pub sent: u64,
    pub lagging: bool,
    pub times_lagged: u64,
    /// Frames it had taken when it was marked lagging.
    pub taken_at_lag: u64,
    /// Gets a writable ring descriptor (asked for by GPUs that cannot register read-only).
    pub writable: bool,
    /// It can map GPU memory: it may be served a device ring.
    pub device_memory: bool,
    /// It sent Close: it takes no more frames and only keeps those it holds, never waited
    /// for, until it releases them or its socket closes.
    pub closed: bool,
    /// How long it may still hold a live producer up (`auto` only).
    pub hold: HoldCredit,
    /// It ended a `wait-for-connection` wait and has not yet kept up with frames on time for
    /// [`crate::policy::BACKLOG_SETTLE`]: it gets the backlog as a lossless client would (see
    /// [`crate::policy::BACKLOG_MAX_WAIT`]).
    pub first_of_wait: bool,
    /// Since when frames come on time and it took each before the next (while
    /// `first_of_wait`).
    pub on_time_since: Option<Instant>,
    /// Since when it has frames waiting and took none (see
    /// [`crate::policy::STALLED_EVICT`]).
    pub stalled_since: Option<Instant>,
    /// Frames it had taken when last looked at.
    pub taken_seen: u64,
    /// Its upstream events: the budget left (see [`crate::policy::UPSTREAM_BURST_S`]), when
    /// it was last refilled, and whether dropping one was logged.
    pub upstream_tokens: f64,
    pub upstream_at: Option<Instant>,
    pub upstream_dropped: bool,
}

impl Client {
    /// Takes one upstream event from its budget of `rate` a second (a token bucket of
    /// [`crate::policy::UPSTREAM_BURST_S`] seconds, full at first): false if none is left.
    pub fn take_upstream_token(&mut self, rate: u32, now: Instant) -> bool {
        if rate == 0 {
            return false;
        }
        let cap = (rate as f64 * crate::policy::UPSTREAM_BURST_S).max(1.0);
        self.upstream_tokens = match self.upstream_at {
            None => cap,
            Some(t) => {
                (self.upstream_tokens + now.duration_since(t).as_secs_f64() * rate as f64).min(cap)
            }
        };
        self.upstream_at = Some(now);
        if self.upstream_tokens < 1.0 {
            return false;
        }
        self.upstream_tokens -= 1.0;
        true
    }

    /// Frames this client references: handed over and not yet released.
    pub fn refs(&self) -> usize {
        self.ch.pending_len() + self.ch.held_len()
    }

    /// What counts against a client's share of a crowded or starved ring: the frames it
    /// took and keeps. Frames handed over but not yet taken are the producer's doing (a
    /// consumer that keeps up has one in flight now and then), so an open client is not cut
    /// for them; a closed client takes no more, so everything it references counts.
    pub fn share_count(&self) -> usize {
        if self.closed {
            self.refs()
        } else {
            self.ch.held_len()
        }
    }

    /// Whether the time this client holds the producer up is bounded by its [`HoldCredit`]:
    /// an `auto` client of a live stream.
    pub fn hold_bounded(&self, live: bool) -> bool {
        live && self.mode == Delivery::Auto
    }

    /// Notes whether it keeps taking the frames delivered to it (see `stalled_since`).
    pub fn note_progress(&mut self, now: Instant) {
        let taken = self.ch.taken();
        if taken != self.taken_seen || self.ch.pending_len() == 0 || self.closed {
            self.taken_seen = taken;
            self.stalled_since = None;
        } else if self.stalled_since.is_none() {
            self.stalled_since = Some(now);
        }
    }
}

/// What an `auto` consumer of a live stream may still hold the producer up: a bucket of
/// [`LIVE_HOLD_BURST`] refilled at [`LIVE_HOLD_PERCENT`] of real time.
#[derive(Debug, Clone, Copy)]
pub(super) struct HoldCredit {
    pub left: Duration,
    at: Instant,
    /// Whether it ran out (and was said so) since it last had credit.
    pub spent: bool,
}

impl HoldCredit {
    pub fn new() -> Self {
        Self {
            left: LIVE_HOLD_BURST,
            at: Instant::now(),
            spent: false,
        }
    }

    pub fn refill(&mut self, now: Instant) {
        let earned = now.saturating_duration_since(self.at) * LIVE_HOLD_PERCENT / 100;
        self.left = (self.left + earned).min(LIVE_HOLD_BURST);
        self.at = now;
    }
}

/// The connected clients, those being closed, and whether the producer waits for releases.
pub(super) struct Clients {
    list: Vec<Client>,
    next_id: u32,
    /// Clients removed by other threads, whose descriptors the connection thread may still
    /// be polling: only that thread drops them, between two polls.
    closing: Vec<Client>,
    /// Threads waiting for slots to come back: while there are any, clients write their
    /// slot-released doorbell after each release (see [`Self::add_release_waiter`]).
    release_waiters: usize,
}

impl Clients {
    pub fn new() -> Self {
        Self {
            list: Vec::new(),
            next_id: 1,
            closing: Vec::new(),
            release_waiters: 0,
        }
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Client> {
        self.list.iter()
    }

    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Client> {
        self.list.iter_mut()
    }

    /// Clients that take frames (not closed).
    pub fn open(&self) -> impl Iterator<Item = &Client> {
        self.list.iter().filter(|c| !c.closed)
    }

    pub fn open_count(&self) -> usize {
        self.open().count()
    }

    /// Clients connected, closed ones still holding frames included (what max-clients
    /// counts).
    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut Client> {
        self.list.iter_mut().find(|c| c.id == id)
    }

    /// The id the next client gets.
    pub fn next_id(&self) -> u32 {
        self.next_id
    }

    /// Adds a client that completed its handshake (with [`Self::next_id`]).
    pub fn add(&mut self, c: Client) {
        self.next_id += 1;
        c.ch.set_producer_waits(self.release_waiters > 0);
        self.list.push(c);
    }

    /// Takes client `id` out of the list; its descriptors are the caller's to close.
    pub fn remove(&mut self, id: u32) -> Option<Client> {
        let i = self.list.iter().position(|c| c.id == id)?;
        Some(self.list.swap_remove(i))
    }

    /// Keeps a removed client's descriptors open until the connection thread's next round.
    pub fn close_later(&mut self, c: Client) {
        self.closing.push(c);
    }

    /// Removed clients whose descriptors no poll uses any more (the connection thread, between
    /// two polls).
    pub fn take_closing(&mut self) -> Vec<Client> {
        std::mem::take(&mut self.closing)
    }

    /// Forgets every client (the engine stops).
    pub fn clear(&mut self) {
        self.list.clear();
        self.closing.clear();
    }

    /// Counts a thread that starts (`true`) or stops waiting for slots to come back. While
    /// one waits, clients write their slot-released doorbell after each release. True when
    /// the first one starts: the connection thread must then poll every doorbell (the caller
    /// wakes it to look again).
    #[must_use = "the first waiter wakes the connection thread"]
    pub fn add_release_waiter(&mut self, start: bool) -> bool {
        let before = self.release_waiters > 0;
        if start {
            self.release_waiters += 1;
        } else {
            self.release_waiters = self.release_waiters.saturating_sub(1);
        }
        let now = self.release_waiters > 0;
        if before != now {
            for c in self.list.iter_mut() {
                c.ch.set_producer_waits(now);
                c.release_armed |= now;
            }
        }
        now && !before
    }

    /// Whether a thread waits for slots to come back now.
    pub fn producer_waits(&self) -> bool {
        self.release_waiters > 0
    }

    /// The doorbells of the open clients asleep in a subscriber's wait on another CPU than
    /// `cpu` (the frame's way runs there), each told that `cpu` rang it ahead of the frame.
    pub fn sleeping_elsewhere(&self, cpu: u32) -> Vec<Arc<shm::Doorbell>> {
        let mut wake = Vec::new();
        for c in self.open() {
            if c.ch.consumer_sleeps_off(cpu) {
                c.ch.set_early_wake_cpu(cpu);
                wake.push(c.ready.clone());
            }
        }
        wake
    }
}
