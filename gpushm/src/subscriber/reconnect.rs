// SPDX-License-Identifier: MPL-2.0
//! A consumer that outlives its producer: [`Link`] holds the current [`Subscriber`] of an
//! endpoint, and after the producer went away (or the caller gave the connection up) connects
//! again on the next call, waiting for a producer to come back. gpushmsrc (`reconnect=true`)
//! and the C API (`reconnect` in `gpushm_subscriber_options`) follow their producer this way;
//! the counts a caller shows (frames the producer dropped, the low-latency polls) go on across
//! connections.

use std::time::{Duration, Instant};

use super::{ConnectOptions, SpinStats, Subscriber, Waker};
use crate::names::Endpoint;
use crate::Result;

pub struct Link {
    endpoint: Endpoint,
    opts: ConnectOptions,
    waker: Waker,
    sub: Option<Box<Subscriber>>,
    /// Connections made so far.
    connections: u64,
    /// When the last connection ended (none made since).
    gone_since: Option<Instant>,
    /// What the connections that ended counted.
    dropped_before: u64,
    spin_before: SpinStats,
}

impl Link {
    /// A link to `endpoint`, not connected yet; `waker` interrupts its waits
    /// (`Err(Error::Interrupted)`).
    pub fn new(endpoint: Endpoint, opts: ConnectOptions, waker: Waker) -> Self {
        Self {
            endpoint,
            opts,
            waker,
            sub: None,
            connections: 0,
            gone_since: None,
            dropped_before: 0,
            spin_before: SpinStats::default(),
        }
    }

    /// Connects now if there is no connection: the first waits the options' timeout for a
    /// producer to appear, a later one (after the producer went away) `wait` (`None`: as long
    /// as it takes, until woken).
    pub fn connect(&mut self, wait: Option<Duration>) -> Result<()> {
        if self.sub.is_some() {
            return Ok(());
        }
        let mut opts = self.opts.clone();
        if self.connections > 0 {
            opts.timeout = wait.unwrap_or(Duration::MAX);
        }
        let sub = Subscriber::connect_to(&self.endpoint, &opts, &self.waker)?;
        self.connections += 1;
        self.gone_since = None;
        self.sub = Some(Box::new(sub));
        Ok(())
    }

    /// The current connection, if there is one.
    pub fn current(&self) -> Option<&Subscriber> {
        self.sub.as_deref()
    }

    /// The current connection, if there is one, to take frames from.
    pub fn current_mut(&mut self) -> Option<&mut Subscriber> {
        self.sub.as_deref_mut()
    }

    /// Takes the current connection out, to work on it beside the caller's other state; give
    /// it back with [`Self::restore`], or [`Self::lost`] when it ended. Boxed: a pointer moves,
    /// not the subscriber.
    pub fn take(&mut self) -> Option<Box<Subscriber>> {
        self.sub.take()
    }

    /// Gives back a connection [`Self::take`] took out.
    pub fn restore(&mut self, sub: Box<Subscriber>) {
        self.sub = Some(sub);
    }

    /// Connection `sub` (taken out, or `None`: the current one) ended, or is given up: its
    /// counts are kept, and the next [`Self::connect`] waits for a producer. Frames it still
    /// holds stay valid.
    pub fn lost(&mut self, sub: Option<Box<Subscriber>>) {
        let Some(sub) = sub.or_else(|| self.sub.take()) else {
            return;
        };
        self.dropped_before += sub.dropped();
        let s = sub.spin_stats();
        self.spin_before.caught += s.caught;
        self.spin_before.missed += s.missed;
        self.gone_since = Some(Instant::now());
    }

    /// The options connections are made with.
    pub fn options(&self) -> &ConnectOptions {
        &self.opts
    }

    /// The options the next connection is made with (asking for a writable ring, say).
    pub fn options_mut(&mut self) -> &mut ConnectOptions {
        &mut self.opts
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Connections made so far (1 after the first; each reconnection adds one).
    pub fn connections(&self) -> u64 {
        self.connections
    }

    /// Since when no producer has been connected, after one went away.
    pub fn gone_since(&self) -> Option<Instant> {
        self.gone_since
    }

    /// Frames the producers did not hand us, over every connection.
    pub fn dropped(&self) -> u64 {
        self.dropped_before + self.sub.as_ref().map_or(0, |s| s.dropped())
    }

    /// [`Self::dropped`] and [`Self::spin_stats`] while connection `sub` is taken out
    /// ([`Self::take`]).
    pub fn counts_with(&self, sub: &Subscriber) -> (u64, SpinStats) {
        let s = sub.spin_stats();
        (
            self.dropped_before + sub.dropped(),
            SpinStats {
                caught: self.spin_before.caught + s.caught,
                missed: self.spin_before.missed + s.missed,
            },
        )
    }

    /// The low-latency mode's polls, over every connection.
    pub fn spin_stats(&self) -> SpinStats {
        let now = self
            .sub
            .as_ref()
            .map(|s| s.spin_stats())
            .unwrap_or_default();
        SpinStats {
            caught: self.spin_before.caught + now.caught,
            missed: self.spin_before.missed + now.missed,
        }
    }
}
