// SPDX-License-Identifier: MPL-2.0
//! The producer's figures: counts of the stream and of each client, the publish rate, and
//! the Report a tool's Query is answered with (built at most once per
//! [`REPORT_INTERVAL`], however many tools ask).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::Client;
use crate::policy::Delivery;
use crate::wire::{ClientReport, StreamReport, REPORT_INTERVAL};

/// The stream's counts.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub frames_sent: u64,
    pub frames_copied: u64,
    pub frames_dropped: u64,
    /// Times any lossless client was marked lagging.
    pub times_lagged: u64,
    /// Waits for a lossless client (with [`crate::policy::Policy::spin`]) that polling ended,
    /// and that ended asleep all the same.
    pub spin_caught: u64,
    pub spin_missed: u64,
    /// Wake-ups rung for frames delivered, one per client and frame: to clients asleep (one busy
    /// with earlier frames, or polling for the next, takes it without one), and to every frame
    /// of a client whose event loop polls its doorbell.
    pub woken: u64,
    /// Wake-ups rung ahead of a frame (wake-early and wake-ahead), one per sleeping client.
    pub woken_early: u64,
    /// Of those, the ones rung by the connection thread before the frame was due
    /// (wake-ahead).
    pub woken_ahead: u64,
    /// Connections accepted (consumers and tools), at most [`crate::policy::ACCEPT_RATE`] a
    /// second after a burst of [`crate::policy::ACCEPT_BURST`], whatever connects.
    pub connections_accepted: u64,
    /// Reports built for tools' queries, at most one per [`REPORT_INTERVAL`] however many
    /// ask.
    pub reports_built: u64,
}

/// One client's figures.
#[derive(Debug, Clone)]
pub struct ClientStats {
    pub id: u32,
    pub pid: i32,
    /// What the client asked for.
    pub mode: Delivery,
    /// Whether it is waited for now (its mode applied to the stream).
    pub lossless: bool,
    pub sent: u64,
    pub dropped: u64,
    pub held: usize,
    /// Frames the client copied out of the ring because downstream kept its zero-copy ones.
    pub copied: u64,
    pub lagging: bool,
    pub times_lagged: u64,
    /// It closed (takes no more frames) and keeps frames it still holds.
    pub closed: bool,
    /// The user it runs as.
    pub uid: u32,
    /// The name it gave when it connected (`name` of
    /// [`crate::subscriber::ConnectOptions`]).
    pub name: String,
    /// Frames it took (of those sent; the rest were taken back or are still queued).
    pub taken: u64,
    /// Of `dropped`, frames never handed over because it held its whole budget.
    pub skipped: u64,
    /// How long ago it connected.
    pub connected: Duration,
    /// Its own latency histogram, publish to take (see
    /// [`crate::ring::layout::latency_bucket`]).
    pub latency: Vec<u32>,
}

impl ClientStats {
    pub(super) fn of(c: &Client, now: Instant) -> Self {
        Self {
            id: c.id,
            pid: c.pid,
            mode: c.mode,
            lossless: c.lossless,
            sent: c.sent,
            dropped: c.ch.dropped(),
            held: c.refs(),
            copied: c.ch.copied(),
            lagging: c.lagging,
            times_lagged: c.times_lagged,
            closed: c.closed,
            uid: c.uid,
            name: c.name.clone(),
            taken: c.ch.taken(),
            skipped: c.ch.skipped(),
            connected: now.saturating_duration_since(c.since),
            latency: c.ch.latency_histogram(),
        }
    }

    /// Half the frames it took reached it within this (ns), per its histogram.
    pub fn latency_p50_ns(&self) -> Option<u64> {
        crate::ring::layout::latency_percentile(&self.latency, 50.0)
    }

    /// 99 % of the frames it took reached it within this (ns), per its histogram.
    pub fn latency_p99_ns(&self) -> Option<u64> {
        crate::ring::layout::latency_percentile(&self.latency, 99.0)
    }

    fn report(self) -> ClientReport {
        ClientReport {
            id: self.id,
            pid: self.pid,
            uid: self.uid,
            name: self.name,
            mode: self.mode.name().to_string(),
            lossless: self.lossless,
            lagging: self.lagging,
            closed: self.closed,
            sent: self.sent,
            taken: self.taken,
            dropped: self.dropped,
            skipped: self.skipped,
            copied: self.copied,
            times_lagged: self.times_lagged,
            held: self.held.min(u32::MAX as usize) as u32,
            connected_ns: self.connected.as_nanos() as u64,
            latency: self.latency,
        }
    }
}

/// Frames published per second, over windows of about a second.
#[derive(Debug, Clone, Copy)]
struct RateMeter {
    since_ns: u64,
    count: u64,
    last: f64,
}

impl RateMeter {
    const WINDOW_NS: u64 = 1_000_000_000;

    fn tick(&mut self, now_ns: u64) {
        self.count += 1;
        let span = now_ns.saturating_sub(self.since_ns);
        if span >= Self::WINDOW_NS {
            self.last = self.count as f64 * 1e9 / span as f64;
            self.count = 0;
            self.since_ns = now_ns;
        }
    }

    /// The last window's rate, or less if the stream slowed or stopped since.
    fn rate(&self, now_ns: u64) -> f64 {
        let span = now_ns.saturating_sub(self.since_ns);
        if span >= 2 * Self::WINDOW_NS {
            self.count as f64 * 1e9 / span as f64
        } else {
            self.last
        }
    }
}

/// What the report says of the stream besides the counts: given by the engine.
pub(super) struct StreamState<'a> {
    pub caps: &'a str,
    pub eos: bool,
    /// The current ring: slots, bytes a slot, bytes in all, in GPU memory.
    pub ring: (u32, u64, u64, bool),
    pub max_clients: usize,
}

/// The stream's counts, its rate, and the last report built.
pub(super) struct Book {
    pub stats: Stats,
    started: Instant,
    rate: RateMeter,
    /// The last Report built, sent again to queries within [`REPORT_INTERVAL`].
    report: Option<(Instant, Arc<StreamReport>)>,
}

impl Book {
    pub fn new() -> Self {
        Self {
            stats: Stats::default(),
            started: Instant::now(),
            rate: RateMeter {
                since_ns: crate::monotonic_ns(),
                count: 0,
                last: 0.0,
            },
            report: None,
        }
    }

    /// A frame was published at `publish_ns` (CLOCK_MONOTONIC).
    pub fn published(&mut self, publish_ns: u64) {
        self.stats.frames_sent += 1;
        self.rate.tick(publish_ns);
    }

    /// The report for a tool: the last one if it is recent, otherwise a new one of `clients`
    /// (each made to read what it took first) and `stream`.
    pub fn report<'c>(
        &mut self,
        clients: impl Iterator<Item = &'c mut Client>,
        stream: StreamState<'_>,
    ) -> Arc<StreamReport> {
        let now = Instant::now();
        if let Some((at, r)) = &self.report {
            if now.saturating_duration_since(*at) < REPORT_INTERVAL {
                return r.clone();
            }
        }
        self.stats.reports_built += 1;
        let clients = clients
            .map(|c| {
                // What each client took up to now (a client that broke its queue is dealt
                // with where frames are delivered; here it only shows its last good count).
                let _ = c.ch.sync_taken();
                ClientStats::of(c, now).report()
            })
            .collect();
        let s = self.stats;
        let (slot_count, slot_size, ring_size, device_ring) = stream.ring;
        let r = Arc::new(StreamReport {
            pid: std::process::id(),
            uptime_ns: self.started.elapsed().as_nanos() as u64,
            cpu_ns: process_cpu_ns(),
            frames_sent: s.frames_sent,
            frames_copied: s.frames_copied,
            frames_dropped: s.frames_dropped,
            times_lagged: s.times_lagged,
            fps: self.rate.rate(crate::monotonic_ns()),
            caps: stream.caps.to_string(),
            slot_count,
            slot_size,
            ring_size,
            device_ring,
            eos: stream.eos,
            max_clients: stream.max_clients.min(u32::MAX as usize) as u32,
            clients,
            clients_left_out: 0,
        });
        self.report = Some((now, r.clone()));
        r
    }
}

/// CPU time (user + system) this whole process has spent, ns.
fn process_cpu_ns() -> u64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .map(|u| {
            let ns = |t: nix::sys::time::TimeVal| {
                (t.tv_sec().max(0) as u64) * 1_000_000_000 + (t.tv_usec().max(0) as u64) * 1000
            };
            ns(u.user_time()) + ns(u.system_time())
        })
        .unwrap_or(0)
}
