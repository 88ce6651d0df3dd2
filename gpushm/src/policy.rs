// SPDX-License-Identifier: MPL-2.0
//! What a consumer may ask for and every limit the producer holds clients to, in one place:
//! delivery modes, the per-frame [`Policy`], how much a client may hold and for how long,
//! admission limits, and the low-latency bounds. The server applies them
//! ([`crate::server`]); who is cut when the ring runs out is decided in
//! `server/fairness.rs` from the limits here.

use std::time::Duration;

use crate::{Error, Result};

/// Whether the producer may skip frames for a consumer that falls behind. One name and type
/// for every binding: gpushmsrc's `mode` property, [`ConnectOptions::mode`], Python's `mode=`.
///
/// [`ConnectOptions::mode`]: crate::subscriber::ConnectOptions::mode
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Delivery {
    /// Frames this consumer is too slow for are skipped (the newest ones win): live video
    /// for viewers and analytics.
    Leaky,
    /// The producer waits for this consumer (up to its max-wait) instead of skipping frames:
    /// recorders.
    Lossless,
    /// The default: lossless, except for live raw video, which is leaky. Audio, encoded
    /// video, data and every stream that is not live lose nothing by default; live raw
    /// video lets a slow consumer skip frames rather than hold the camera up. Of a live
    /// stream (audio, encoded), an `auto` consumer may hold the producer up at most
    /// [`LIVE_HOLD_PERCENT`] % of real time, 1 s at once (its pipeline starting, a disk
    /// stall): a consumer slower than the stream then loses what it has no room for, instead
    /// of slowing the live source, and every other consumer, to its pace.
    #[default]
    Auto,
}

impl Delivery {
    /// Whether frames of a stream that is `live` (or not) with `caps` are waited for.
    pub fn lossless_for(self, live: bool, caps: &str) -> bool {
        match self {
            Delivery::Leaky => false,
            Delivery::Lossless => true,
            Delivery::Auto => !(live && crate::format::is_raw_video(caps)),
        }
    }

    /// The name in gpushmsrc's `mode` property and Python's `mode=`.
    pub fn name(self) -> &'static str {
        match self {
            Delivery::Leaky => "leaky",
            Delivery::Lossless => "lossless",
            Delivery::Auto => "auto",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Delivery::Leaky, Delivery::Lossless, Delivery::Auto]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

/// How the producer treats clients that fall behind, for one frame.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Frames one client may reference at once (delivered and not released).
    pub budget: usize,
    /// How long a lossless client at its budget may hold the producer up, per frame.
    pub max_wait: Duration,
    /// Low-latency mode of that wait: how long the producer polls the full clients' releases
    /// before it sleeps (a wake-up through the connection thread is two thread hops). Zero:
    /// off. Spent at most once per frame, and never past `max_wait` nor a bounded client's
    /// hold credit.
    pub spin: Duration,
}

/// Frames a consumer keeps zero-copy at most with `budget`: the budget less room for frames on
/// their way to it (two when the budget allows, one otherwise). Past it, gpushmsrc and Python
/// copy what downstream keeps, so that the producer never waits for frames held downstream.
pub fn zero_copy_limit(budget: usize) -> usize {
    if budget >= 3 {
        budget - 2
    } else {
        budget.saturating_sub(1)
    }
}

/// A leaky client keeps at most this many frames it has not taken yet; older ones are taken
/// back (and counted as dropped) so that it never holds the producer up.
pub const LEAKY_BACKLOG: usize = 2;

/// An `auto` consumer of a live stream is waited for, but may hold the producer up at most
/// this share of real time (in percent), and at most [`LIVE_HOLD_BURST`] at once (a consumer
/// whose pipeline is starting, a disk stall): beyond that it loses frames like a leaky one,
/// so that one slow default consumer cannot slow a live source (and every other consumer)
/// down to its pace. `lossless` consumers are waited for without this bound.
pub const LIVE_HOLD_PERCENT: u32 = 10;
/// See [`LIVE_HOLD_PERCENT`].
pub const LIVE_HOLD_BURST: Duration = Duration::from_secs(1);

/// The first consumers of a `wait-for-connection` producer (those connected when its wait
/// ended, or before its first frame) get the backlog it delivers next (what its live source
/// made while it waited, see [`crate::time::is_backlog`]) whatever their mode: they are
/// waited for as lossless ones are, up to this long for each frame (a producer delivering a backlog is behind real time
/// already), until frames have come on time and each was taken before the next for
/// [`BACKLOG_SETTLE`]. A consumer that takes the frames slower than they
/// come, so that the producer falls [`BACKLOG_GROWTH`] further behind than the wait left it,
/// is under real pressure: from then on each is served as its mode says. That growth counts
/// from when each has taken its first frame: a consumer still setting up (within
/// [`BACKLOG_STARTUP_GRACE`] of the first frame) is waited for up to this long a frame.
pub const BACKLOG_MAX_WAIT: Duration = Duration::from_secs(1);
/// See [`BACKLOG_MAX_WAIT`].
pub const BACKLOG_GROWTH: Duration = Duration::from_millis(200);
/// How long after the stream's first frame a first consumer of a `wait-for-connection`
/// producer that has taken no frame yet counts as setting up (see [`BACKLOG_MAX_WAIT`]): one
/// that has not started by then is treated as any other, so a consumer that never takes a
/// frame holds a live producer up once at its start, never longer.
pub const BACKLOG_STARTUP_GRACE: Duration = Duration::from_secs(2);
/// How long a first consumer of a `wait-for-connection` producer keeps up with frames on time
/// before it is served as its mode says (see [`BACKLOG_MAX_WAIT`]). Longer than the latency
/// a consumer answers for the late start (gpushmsrc: at most 1 s and a 10 ms step): a syncing
/// sink that raised its latency for the backlog holds more frames for that long, and the
/// first frame on time is no sign it keeps up (served as leaky from there, a syncing
/// `gpushmsrc` lost a frame in about half the runs on an idle machine).
pub const BACKLOG_SETTLE: Duration = Duration::from_millis(1500);

/// Sticky events (the latest of each key: stream tags, global tags, sticky custom events by
/// name) a producer keeps for consumers that join late, at most.
pub const STICKY_EVENTS_MAX: usize = 32;
/// Events a consumer keeps received and not yet handed out (they wait for the frame they
/// precede) at most: past it the oldest go, so a producer that floods events without frames
/// costs its consumers bounded memory.
pub const EVENTS_KEPT_MAX: usize = 1024;
/// And this many bytes of them at most (an event is up to 64 KiB).
pub const EVENTS_KEPT_BYTES: usize = 4 << 20;

/// Upstream events a consumer may send a producer a second by default (see
/// [`crate::server::Server::set_upstream_rate`]): a late joiner asks for a keyframe once, a
/// consumer cannot flood the producer's encoder.
pub const UPSTREAM_EVENTS_PER_S: u32 = 10;
/// A consumer's upstream budget fills up to this many seconds of its rate (a burst).
pub const UPSTREAM_BURST_S: f64 = 1.0;
/// Messages read from one client's socket per look at it: a client that floods its socket
/// costs the connection thread no more than this before it serves the others.
pub const CLIENT_MESSAGES_PER_LOOK: usize = 64;

/// The smallest budget (frames a client may reference at once), however many clients share
/// the ring: one kept zero-copy and one in flight.
pub const CROWDED_BUDGET: usize = 2;

/// How long the producer may wait for a free slot, every slot of the ring held by clients,
/// before the client most over its share is cut (it keeps frames and never gives them back,
/// it is frozen with many, or clients take turns giving one back and taking the next). A
/// client within its share is never cut for this. Short enough that a consumer that keeps up
/// sees no gap much longer than it.
pub const STARVATION_TIMEOUT: Duration = Duration::from_millis(150);

/// At max-clients, a new consumer takes the place of the client that has had frames waiting
/// and taken none for longest, if that is at least this long (one that keeps up is never
/// pushed out).
pub const STALLED_EVICT: Duration = Duration::from_secs(1);

/// A connection must complete its handshake within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections that have not said Hello yet, at most. A new connection beyond that first
/// lets those that did say it in, then takes the place of the oldest silent one, which is
/// told to try again (a consumer sends Hello as soon as it connects: sockets that stay
/// silent cannot lock consumers out).
pub const MAX_PENDING: usize = 64;

/// New connections accepted per second at most, sustained: a flood of connections (a client
/// reconnecting in a loop, or one attacking) costs the producer a bounded share of a core and
/// cannot keep the connection thread, and the lock frames are published under, busy. Beyond
/// the rate, connections wait in the listen backlog.
pub const ACCEPT_RATE: u32 = 2000;
/// Connections accepted at once before [`ACCEPT_RATE`] applies (consumers started together).
pub const ACCEPT_BURST: u32 = 256;
/// Connections waiting to be accepted at most (the listen backlog).
pub const LISTEN_BACKLOG: i32 = 512;
/// Connections accepted in one round of the connection thread at most.
pub const ACCEPT_BATCH: u32 = 64;

/// The largest low-latency budget ([`ConnectOptions::spin`], a publisher's spin): 100 ms of
/// polling a frame (more is refused, as an error that says so).
///
/// [`ConnectOptions::spin`]: crate::subscriber::ConnectOptions::spin
pub const MAX_SPIN: Duration = Duration::from_millis(100);

/// Refuses a low-latency budget over [`MAX_SPIN`], saying why: the one check behind every
/// way to set one (subscribers, publishers, the elements' bounded properties aside).
pub fn check_spin(spin: Duration) -> Result<()> {
    if spin > MAX_SPIN {
        return Err(Error::Invalid(format!(
            "a low-latency budget (spin, spin-us, spin_us) of {} µs is more than the {} µs of \
             polling a frame allowed (0 turns the mode off)",
            spin.as_micros(),
            MAX_SPIN.as_micros()
        )));
    }
    Ok(())
}

/// How long a subscriber woken with no frame yet polls for it (see
/// [`crate::server::Server::wake_early`]), at most once per frame it takes.
pub const EARLY_WAKE_POLL: Duration = Duration::from_micros(100);

/// A subscriber that took a frame of a stream that is not live, whose frames come less than
/// this apart, polls the ring for the next one for up to twice their interval (at most this)
/// before it sleeps. A producer flat out (a file, a transcode) then delivers without waking it:
/// a wake-up is a system call and an interrupt to the sleeping core on the producer's thread,
/// 10-20 µs a frame in a VM, a tenth of a 720p frame's time. Live streams and slower ones
/// never poll; a stream that slows down or pauses costs one poll. A process that may run on one
/// CPU only never polls (it would keep the producer from the CPU), and after
/// [`BACK_TO_BACK_MISSES`] polls in a row that ended without a frame the next
/// [`BACK_TO_BACK_PAUSE`] frames are waited for asleep. Measured with `bench throughput`
/// (docs/benchmarks.md).
pub const BACK_TO_BACK_POLL: Duration = Duration::from_micros(500);

/// See [`BACK_TO_BACK_POLL`]: polls in a row that ended without a frame before polling pauses.
pub const BACK_TO_BACK_MISSES: u32 = 4;

/// See [`BACK_TO_BACK_POLL`]: frames taken without polling once it paused.
pub const BACK_TO_BACK_PAUSE: u32 = 64;

/// How long since the last frame [`crate::server::Server::wake_early`] waits before it wakes
/// clients ahead of a frame: a core idle for less is quick to wake (a few µs), one idle for a
/// millisecond or more takes tens of µs (60-80 on the H100 machine). Streams of up to 2000
/// frames a second are woken early; faster ones are not.
pub const WAKE_EARLY_GAP: Duration = Duration::from_micros(500);

/// The shortest interval between frames for which a wake-up ahead
/// ([`crate::server::Server::set_wake_ahead`]) is rung before a frame is due: the connection
/// thread wakes once per frame to do it, so faster streams (over 500 frames a second) are
/// only woken as each frame comes (wake-early).
pub const WAKE_AHEAD_MIN_INTERVAL: Duration = Duration::from_millis(2);

/// The longest wake-up ahead: a woken consumer polls [`EARLY_WAKE_POLL`] at most, so that
/// waking it more than a few hundred µs before the frame only costs it a second wake-up.
pub const MAX_WAKE_AHEAD: Duration = Duration::from_millis(1);

/// Whether `ahead` may be a wake-up ahead: at most [`MAX_WAKE_AHEAD`]; the one check behind
/// every way to set it (the element's property, C, Python).
pub fn check_wake_ahead(ahead: Duration) -> Result<()> {
    if ahead > MAX_WAKE_AHEAD {
        return Err(Error::Invalid(format!(
            "a wake-up ahead of {} µs is over the most, {} µs",
            ahead.as_micros(),
            MAX_WAKE_AHEAD.as_micros()
        )));
    }
    Ok(())
}
