// SPDX-License-Identifier: MPL-2.0
//! Who may come in: how many new connections may be accepted now (a token bucket of
//! [`ACCEPT_RATE`] / [`ACCEPT_BURST`]), and the connections accepted that have not said Hello
//! yet, each with its deadline ([`HANDSHAKE_TIMEOUT`]). What a Hello leads to is
//! [`super::handshake`]'s business.

use std::time::{Duration, Instant};

use crate::policy::{ACCEPT_BURST, ACCEPT_RATE, HANDSHAKE_TIMEOUT};
use crate::wire::Conn;

/// A connection that has not said Hello yet.
pub(super) struct Pending {
    pub conn: Conn,
    pub since: Instant,
    pub pid: i32,
    pub uid: u32,
}

pub(super) struct Admission {
    tokens: f64,
    at: Instant,
    pending: Vec<Pending>,
}

impl Admission {
    pub fn new() -> Self {
        Self {
            tokens: ACCEPT_BURST as f64,
            at: Instant::now(),
            pending: Vec::new(),
        }
    }

    /// Connections that may be accepted now.
    pub fn available(&mut self, now: Instant) -> u32 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * ACCEPT_RATE as f64).min(ACCEPT_BURST as f64);
        self.at = now;
        self.tokens as u32
    }

    /// One connection was accepted.
    pub fn take(&mut self) {
        self.tokens = (self.tokens - 1.0).max(0.0);
    }

    /// When the next connection may be accepted (now if one may).
    pub fn next_at(&self) -> Instant {
        let missing = (1.0 - self.tokens).max(0.0);
        self.at + Duration::from_secs_f64(missing / ACCEPT_RATE as f64)
    }

    pub fn pending(&self) -> &[Pending] {
        &self.pending
    }

    pub fn pending_mut(&mut self, i: usize) -> &mut Pending {
        &mut self.pending[i]
    }

    pub fn add_pending(&mut self, p: Pending) {
        self.pending.push(p);
    }

    /// Takes pending connection `i` out (to become a client, or be turned away).
    pub fn take_pending(&mut self, i: usize) -> Pending {
        self.pending.swap_remove(i)
    }

    /// The pending connection waiting longest, if any.
    pub fn oldest_pending(&self) -> Option<usize> {
        (0..self.pending.len()).min_by_key(|&i| self.pending[i].since)
    }

    /// When the first pending handshake runs out of time.
    pub fn handshake_deadline(&self) -> Option<Instant> {
        self.pending
            .iter()
            .map(|p| p.since + HANDSHAKE_TIMEOUT)
            .min()
    }

    /// Takes out the connections whose handshake ran out of time at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Pending> {
        let (alive, late) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| now < p.since + HANDSHAKE_TIMEOUT);
        self.pending = alive;
        late
    }

    /// Forgets every pending connection (the engine stops).
    pub fn clear(&mut self) {
        self.pending.clear();
    }
}
