// SPDX-License-Identifier: MPL-2.0
//! The producer's side, and the one place that decides which client gets which frame: the
//! listening socket, one thread that accepts clients, runs their handshake, notices them leave
//! (HUP) and takes back the slots they release, and [`Publisher::publish`], which the
//! producer calls for every frame with the per-client policy (budgets, lossless and leaky,
//! lagging clients).
//!
//! `P` is what owns a slot on the producer's side while clients still read it (a GstBuffer of
//! the sink's pool, or a plain token): it is parked until the last client released the slot,
//! then handed to the ring's [`Requeue`].

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::EventFd;
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::sys::time::TimeSpec;

use crate::client::Delivery;
use crate::layout::CLIENT_QUEUE_CAPACITY;
use crate::producer::{ClientChannel, Entry, FrameMeta, ProducerRing};
use crate::wire::{
    ClientReport, Conn, Message, StreamReport, BUSY_PREFIX, FLAG_AUTO, FLAG_DEVICE_MEMORY,
    FLAG_LOSSLESS, FLAG_WRITABLE_RING, REPORT_INTERVAL, REPORT_MAX_NAME, RING_DEVICE,
    RING_WRITABLE,
};
use crate::{shm, Error, Result};

/// A leaky client keeps at most this many frames it has not taken yet; older ones are taken
/// back (and counted as dropped) so that it never holds the producer up.
pub const LEAKY_BACKLOG: usize = 2;
/// A connection must complete its handshake within this time.
/// An `auto` consumer of a live stream is waited for, but may hold the producer up at most
/// this share of real time (in percent), and at most [`LIVE_HOLD_BURST`] at once (a consumer
/// whose pipeline is starting, a disk stall): beyond that it loses frames like a leaky one,
/// so that one slow default consumer cannot slow a live source (and every other consumer)
/// down to its pace. `lossless` consumers are waited for without this bound.
pub const LIVE_HOLD_PERCENT: u32 = 10;
/// See [`LIVE_HOLD_PERCENT`].
pub const LIVE_HOLD_BURST: Duration = Duration::from_secs(1);

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// New connections accepted per second at most, sustained: a flood of connections (a client
/// reconnecting in a loop, or one attacking) costs the producer a bounded share of a core and
/// cannot keep the connection thread, and the lock frames are published under, busy. Beyond
/// the rate, connections wait in the listen backlog.
pub const ACCEPT_RATE: u32 = 2000;
/// Connections accepted at once before [`ACCEPT_RATE`] applies (consumers started together).
pub const ACCEPT_BURST: u32 = 256;
/// Connections waiting to be accepted at most (the listen backlog).
const LISTEN_BACKLOG: i32 = 512;
/// Connections accepted in one round of the connection thread at most.
const ACCEPT_BATCH: u32 = 64;

/// A token bucket for [`ACCEPT_RATE`] / [`ACCEPT_BURST`].
struct Admission {
    tokens: f64,
    at: Instant,
}

impl Admission {
    fn new() -> Self {
        Self {
            tokens: ACCEPT_BURST as f64,
            at: Instant::now(),
        }
    }

    /// Connections that may be accepted now.
    fn available(&mut self, now: Instant) -> u32 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * ACCEPT_RATE as f64).min(ACCEPT_BURST as f64);
        self.at = now;
        self.tokens as u32
    }

    fn take(&mut self) {
        self.tokens = (self.tokens - 1.0).max(0.0);
    }

    /// When the next connection may be accepted (now if one may).
    fn next_at(&self) -> Instant {
        let missing = (1.0 - self.tokens).max(0.0);
        self.at + Duration::from_secs_f64(missing / ACCEPT_RATE as f64)
    }
}

/// What [`Publisher::publish_frame`] did with a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// It went to every client the policy gives it to.
    Sent,
    /// Unlocked or shut down: nothing was published.
    Stopped,
    /// The slot cannot be published (not in the current ring, or consumers still hold it),
    /// and why: publish a copy in another slot.
    SlotBusy(String),
}

/// Time between two looks at the clients' releases in the low-latency wait. A look takes our
/// lock and reads every client's release queue (lines its consumer writes), so not much more
/// often than this; timed, not counted in spin-loop hints, as one hint takes from 10 to 140
/// cycles depending on the CPU (100 of them, the count before, took 1.4 µs on the Intel VM and
/// 2.1 µs on the H100 machine). The clock is read every 4 hints: a gap may run over by that
/// much (up to about 250 ns where a hint is 140 cycles).
const LOOK_EVERY: Duration = Duration::from_nanos(300);

/// How publish() treats clients that fall behind.
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

#[derive(Debug, Clone)]
pub enum Event {
    /// Something to log.
    Info(String),
    /// A lossless client took no frame for max-wait: it is served like a leaky one (never
    /// waited for) until it takes frames again.
    Lagging {
        id: u32,
        waited: Duration,
        /// The first time for this client.
        first: bool,
    },
    /// A lagging client took frames again: it is lossless (waited for) again.
    CaughtUp {
        id: u32,
    },
    Connected {
        id: u32,
        pid: i32,
        uid: u32,
        name: String,
    },
    Disconnected {
        id: u32,
        reason: String,
    },
    /// A client closed: it takes no more frames and keeps those it holds (`held`) until it
    /// releases them; then it is disconnected.
    Closed {
        id: u32,
        held: usize,
    },
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub frames_sent: u64,
    pub frames_copied: u64,
    pub frames_dropped: u64,
    /// Times any lossless client was marked lagging.
    pub times_lagged: u64,
    /// Waits for a lossless client (with [`Policy::spin`]) that polling ended, and that
    /// ended asleep all the same.
    pub spin_caught: u64,
    pub spin_missed: u64,
    /// Wake-ups rung ahead of a frame ([`Publisher::wake_early`], and
    /// [`Publisher::set_wake_ahead`]'s), one per sleeping client.
    pub woken_early: u64,
    /// Of those, the ones rung by the connection thread before the frame was due
    /// ([`Publisher::set_wake_ahead`]).
    pub woken_ahead: u64,
}

/// How long since the last frame [`Publisher::wake_early`] waits before it wakes clients
/// ahead of a frame: a core idle for less is quick to wake (a few µs), one idle for a
/// millisecond or more takes tens of µs (60-80 on the H100 machine). Streams of up to 2000
/// frames a second are woken early; faster ones are not.
pub const WAKE_EARLY_GAP: Duration = Duration::from_micros(500);

/// The shortest interval between frames for which [`Publisher::set_wake_ahead`] wakes clients
/// before a frame is due: the connection thread wakes once per frame to do it, so faster
/// streams (over 500 frames a second) are only woken as each frame comes
/// ([`Publisher::wake_early`]).
pub const WAKE_AHEAD_MIN_INTERVAL: Duration = Duration::from_millis(2);

/// The longest [`Publisher::set_wake_ahead`]: a woken consumer polls 100 µs at most, so
/// that waking it more than a few hundred µs before the frame only costs it a second wake-up.
pub const MAX_WAKE_AHEAD: Duration = Duration::from_millis(1);

/// Whether `ahead` may be a [`Publisher::set_wake_ahead`]: at most [`MAX_WAKE_AHEAD`]; the
/// one check behind every way to set it (the element's property, C, Python).
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

/// How late the connection thread's timed wake-ups came (the last few, ns): it asks to be
/// woken that much earlier. Bounded: a machine too busy to keep time gets no more.
const AHEAD_LATE_HISTORY: usize = 8;
const AHEAD_LATE_MAX_NS: u64 = 300_000;

/// What the connection thread does about the next wake-up ahead of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ahead {
    /// Nothing to do (off, no clients, a stream too fast).
    Off,
    /// Nothing until the next frame is published: its cadence is not known yet, or the
    /// frame is later than it should be (a pause). publish_frame() wakes the thread.
    Park,
    /// Ring at this time (CLOCK_MONOTONIC ns; now, if it passed).
    At(u64),
}

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
    /// The name it gave when it connected (`name` of [`crate::client::ConnectOptions`]).
    pub name: String,
    /// Frames it took (of those sent; the rest were taken back or are still queued).
    pub taken: u64,
    /// Of `dropped`, frames never handed over because it held its whole budget.
    pub skipped: u64,
    /// How long ago it connected.
    pub connected: Duration,
    /// Its own latency histogram, publish to take (see [`crate::layout::latency_bucket`]).
    pub latency: Vec<u32>,
}

impl ClientStats {
    /// Half the frames it took reached it within this (ns), per its histogram.
    pub fn latency_p50_ns(&self) -> Option<u64> {
        crate::layout::latency_percentile(&self.latency, 50.0)
    }
    /// 99 % of the frames it took reached it within this (ns), per its histogram.
    pub fn latency_p99_ns(&self) -> Option<u64> {
        crate::layout::latency_percentile(&self.latency, 99.0)
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

/// Gives a parked slot owner back to whoever lends slots (a buffer pool), once no client
/// references the slot any more.
pub type Requeue<P> = Arc<dyn Fn(P) + Send + Sync>;

struct SlotState<P> {
    client_refs: u32,
    /// What owns the slot on the producer's side, kept until the last client released it.
    parked: Option<P>,
}

struct RingState<P> {
    ring: Arc<ProducerRing>,
    requeue: Requeue<P>,
    slots: Vec<SlotState<P>>,
}

struct Client {
    id: u32,
    pid: i32,
    uid: u32,
    /// The name it gave in Hello, cut to [`REPORT_MAX_NAME`] bytes.
    name: String,
    since: Instant,
    conn: Conn,
    ch: ClientChannel,
    /// Our end of its frame-ready doorbell, rung (outside our lock) after a delivery while
    /// it waits.
    ready: Arc<shm::Doorbell>,
    /// Our end of its slot-released doorbell, polled by the connection thread.
    release: shm::Doorbell,
    /// What it asked for.
    mode: Delivery,
    /// Whether it is waited for: its mode applied to the stream (caps, live), as of the
    /// last frame.
    lossless: bool,
    sent: u64,
    lagging: bool,
    times_lagged: u64,
    /// Frames it had taken when it was marked lagging.
    taken_at_lag: u64,
    /// Gets a writable ring descriptor (asked for by GPUs that cannot register read-only).
    writable: bool,
    /// It can map GPU memory: it may be served a device ring.
    device_memory: bool,
    /// It sent Close: it takes no more frames and only keeps those it holds, never waited
    /// for, until it releases them or its socket closes.
    closed: bool,
    /// How long it may still hold a live producer up (`auto` only).
    hold: HoldCredit,
    /// Since when it has frames waiting and took none (see [`STALLED_EVICT`]).
    stalled_since: Option<Instant>,
    /// Frames it had taken when last looked at.
    taken_seen: u64,
}

/// What an `auto` consumer of a live stream may still hold the producer up: a bucket of
/// [`LIVE_HOLD_BURST`] refilled at [`LIVE_HOLD_PERCENT`] of real time.
#[derive(Debug, Clone, Copy)]
struct HoldCredit {
    left: Duration,
    at: Instant,
    /// Whether it ran out (and was said so) since it last had credit.
    spent: bool,
}

impl HoldCredit {
    fn new() -> Self {
        Self {
            left: LIVE_HOLD_BURST,
            at: Instant::now(),
            spent: false,
        }
    }

    fn refill(&mut self, now: Instant) {
        let earned = now.saturating_duration_since(self.at) * LIVE_HOLD_PERCENT / 100;
        self.left = (self.left + earned).min(LIVE_HOLD_BURST);
        self.at = now;
    }
}

impl Client {
    /// Frames this client references: handed over and not yet released.
    fn refs(&self) -> usize {
        self.ch.pending_len() + self.ch.held_len()
    }

    /// What counts against a client's share of a crowded or starved ring: the frames it
    /// took and keeps. Frames handed over but not yet taken are the producer's doing (a
    /// consumer that keeps up has one in flight now and then), so an open client is not cut
    /// for them; a closed client takes no more, so everything it references counts.
    fn share_count(&self) -> usize {
        if self.closed {
            self.refs()
        } else {
            self.ch.held_len()
        }
    }
}

/// Every client's budget (frames it may reference at once) while the ring is crowded (see
/// [`Publisher::relieve_overcrowding`]): one kept zero-copy and one in flight.
const CROWDED_BUDGET: usize = 2;

/// A connection that has not said Hello yet.
struct Pending {
    conn: Conn,
    since: Instant,
    pid: i32,
    uid: u32,
}

struct Inner<P> {
    rings: Vec<RingState<P>>,
    clients: Vec<Client>,
    pending: Vec<Pending>,
    caps: Option<(u32, String)>,
    eos: bool,
    next_seq: u64,
    next_client_id: u32,
    next_ring_gen: u32,
    stats: Stats,
    shutdown: bool,
    unlocked: bool,
    events: Vec<Event>,
    /// Clients removed by other threads, whose descriptors the connection thread may still
    /// be polling: only that thread drops them, between two polls.
    closing: Vec<Client>,
    /// Since when every slot of the current ring is referenced by clients and no client gave a
    /// frame back.
    starved_since: Option<Instant>,
    /// Threads waiting for slots to come back: while there are any, clients write their
    /// slot-released eventfd after each release (see [`Publisher::want_releases`]).
    release_waiters: usize,
    /// How many new connections may be accepted (connection thread only).
    admission: Admission,
    started: Instant,
    rate: RateMeter,
    /// The frame (its seq) that [`Publisher::wake_early`] woke clients for last.
    woken_early_for: u64,
    /// The publish times of the last frames (the last one's, 0 before the first frame of a
    /// stream): when the next one is due.
    cadence: crate::cadence::Cadence,
    /// The CPU (1 + it, see [`crate::layout::this_cpu`]) the last frame was published from.
    publish_cpu: u32,
    /// [`Publisher::set_wake_ahead`]: how long before a frame is due, ns (0: off).
    wake_ahead_ns: u64,
    /// The time the connection thread asked its poll to end at for a wake-up ahead (0: none).
    ahead_asked_ns: u64,
    /// How late those polls ended (the last [`AHEAD_LATE_HISTORY`], ns): `ahead_late_n` of
    /// them, the next going at `ahead_late_at`.
    ahead_late: [u64; AHEAD_LATE_HISTORY],
    ahead_late_n: usize,
    ahead_late_at: usize,
    /// The frame (its seq) the connection thread rang ahead of last.
    ahead_for: u64,
    /// The frame that ring woke clients for (its seq), and when (CLOCK_MONOTONIC ns).
    ahead_woke: (u64, u64),
    /// The connection thread waits for the next publish to plan a wake-up ahead: that
    /// publish wakes it.
    ahead_parked: bool,
    /// The last Report built, sent again to queries within [`REPORT_INTERVAL`].
    report: Option<(Instant, Arc<StreamReport>)>,
    /// What [`Publisher::reclaim_locked`] reads from release queues, kept between frames so
    /// that the way of a frame allocates nothing.
    released: Vec<Entry>,
}

/// How a server is set up, fixed at start.
/// Socket permissions 0600, no writable rings, 64 clients.
#[derive(Debug, Clone)]
pub struct Config {
    /// Permissions of the socket file.
    pub perms: u32,
    /// Clients that ask for a writable ring get one (rings are then not sealed against
    /// writes); otherwise every client gets the read-only ring.
    pub allow_writable: bool,
    /// Connected clients at most; more are refused with an Error message.
    pub max_clients: usize,
}

pub struct Publisher<P: Send + 'static> {
    inner: Mutex<Inner<P>>,
    config: Config,
    /// Closed to make room for one accept() when the process runs out of descriptors, so
    /// that the refused client hears why instead of the listener spinning.
    reserve: Mutex<Option<std::fs::File>>,
    /// Signalled when a client connects, or on unlock/shutdown (wait-for-connection).
    changed: Condvar,
    /// Signalled when slots come back (releases, disconnects) or on unlock/shutdown.
    released: Condvar,
    wake: EventFd,
    listener: UnixListener,
    path: PathBuf,
    inode: u64,
    on_event: Box<dyn Fn(Event) + Send + Sync>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Whatever holds a client's descriptors is dropped on this thread: closing a descriptor
    /// a hostile client sent can block (a socket lingering, a file on its FUSE mount), and
    /// neither the connection thread nor the producer may wait for that.
    reaper: Mutex<std::sync::mpsc::Sender<Box<dyn Send>>>,
    /// The connection thread's id (0 until it runs), for tests that watch it.
    connection_tid: std::sync::atomic::AtomicI32,
}

/// See [`Publisher::want_releases`]: clients stop waking the producer for each release when
/// the last of these is dropped.
pub struct ReleaseWait<'a, P: Send + 'static>(&'a Publisher<P>);

impl<P: Send + 'static> Drop for ReleaseWait<'_, P> {
    fn drop(&mut self) {
        Publisher::add_release_waiter(&mut lock(&self.0.inner), false);
    }
}

/// Connections that have not said Hello yet, at most. A new connection beyond that first
/// lets those that did say it in, then takes the place of the oldest silent one, which is
/// told to try again (a consumer sends Hello as soon as it connects: sockets that stay
/// silent cannot lock consumers out).
pub const MAX_PENDING: usize = 64;
/// At max-clients, a new consumer takes the place of the client that has had frames waiting
/// and taken none for longest, if that is at least this long (one that keeps up is never
/// pushed out).
pub const STALLED_EVICT: Duration = Duration::from_secs(1);
/// How long every slot of the ring may be held by clients, with none of them giving a frame
/// back, before the client holding most is disconnected (it takes frames and never gives them
/// back, or it is frozen with many). Slow clients that still release frames are never cut.
pub const STARVATION_TIMEOUT: Duration = Duration::from_millis(500);

fn lock<P>(m: &Mutex<Inner<P>>) -> MutexGuard<'_, Inner<P>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds `path`, replacing a stale socket file nobody listens on. A live producer on the path
/// is an error, and so is a socket whose owner cannot be checked.
///
/// The socket is bound and given `perms` inside a private directory (mode 0700) next to
/// `path`, then moved into place: nobody can connect to it before it has its final
/// permissions, whatever the umask.
fn bind(path: &Path, perms: u32) -> Result<UnixListener> {
    use std::os::unix::ffi::OsStrExt;
    let len = path.as_os_str().as_bytes().len();
    if len > crate::MAX_SOCKET_PATH {
        return Err(Error::Invalid(format!(
            "socket-path {} is {len} bytes long: unix socket paths hold at most {} bytes",
            path.display(),
            crate::MAX_SOCKET_PATH
        )));
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Error::Invalid(format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            )));
        }
        match UnixStream::connect(path) {
            Ok(_) => {
                return Err(Error::Invalid(format!(
                    "another producer is already serving {}; stop it or pick another socket-path",
                    path.display()
                )))
            }
            // Only "nobody listens" means stale: left by a producer that died.
            Err(e) if errno(&e) == nix::errno::Errno::ECONNREFUSED => {
                let _ = std::fs::remove_file(path);
            }
            Err(e) => {
                return Err(Error::os(
                    format!(
                        "{} exists and cannot be checked (is another user's producer serving it?)",
                        path.display()
                    ),
                    errno(&e),
                ))
            }
        }
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if path.file_name().is_none() {
        return Err(Error::Invalid(format!(
            "socket-path {} names no file",
            path.display()
        )));
    }
    // mkdtemp makes it with mode 0700. In a shared directory (0777, no sticky bit) another
    // user can rename it away and put one of theirs in its place before we open it, whose
    // `s` links to a file of ours: everything below works through the descriptor of the
    // directory we checked is ours (O_NOFOLLOW, owned by us, 0700: nobody else can add,
    // remove or swap entries in it), never by its path.
    // A swapped directory is refused; another is made, a few times, before giving up.
    let mut attempt = 0;
    let private = loop {
        let made = nix::unistd::mkdtemp(&dir.join(".gpushm-XXXXXX")).map_err(|e| {
            Error::os(
                format!("cannot create a directory next to {}", path.display()),
                e,
            )
        })?;
        match PrivateDir::open(&made) {
            Ok(p) => break p,
            Err(e) => {
                // Ours or not, an empty directory of that name goes; a full one stays.
                let _ = std::fs::remove_dir(&made);
                attempt += 1;
                if attempt == 5 {
                    return Err(e);
                }
            }
        }
    };
    // Bind through the directory's descriptor: the temporary path is short, whatever the
    // length of the final one.
    let short = PathBuf::from(format!("/proc/self/fd/{}/s", private.fd.as_raw_fd()));
    let listener = UnixListener::bind(&short).map_err(|e| {
        Error::os(
            format!("cannot create socket {}", path.display()),
            errno(&e),
        )
    })?;
    let created = (|| -> nix::Result<()> {
        use nix::sys::stat::{fchmodat, FchmodatFlags, Mode};
        // A shorter queue than the system's (often 4096): connections beyond ACCEPT_RATE
        // wait there, and a consumer that connects during a flood waits behind at most
        // this many (a quarter of a second).
        nix::sys::socket::listen(
            &listener,
            nix::sys::socket::Backlog::new(LISTEN_BACKLOG)
                .unwrap_or(nix::sys::socket::Backlog::MAXCONN),
        )?;
        // Inside a directory only we can change: `s` is the socket just bound.
        fchmodat(
            &private.fd,
            "s",
            Mode::from_bits_truncate(perms & 0o777),
            FchmodatFlags::FollowSymlink,
        )?;
        nix::fcntl::renameat(&private.fd, "s", nix::fcntl::AT_FDCWD, path)
    })();
    created.map_err(|e| Error::os(format!("cannot create socket {}", path.display()), e))?;
    drop(private);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::os("fcntl", errno(&e)))?;
    Ok(listener)
}

/// The private directory `bind` makes, opened and checked to be the one it made.
struct PrivateDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl PrivateDir {
    /// Opens `path` without following a link, and refuses it unless it is a directory of
    /// ours that nobody else can write (what mkdtemp made).
    fn open(path: &Path) -> Result<Self> {
        use nix::fcntl::{open, OFlag};
        use nix::sys::stat::{fstat, Mode, SFlag};
        let fd = open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Error::os(format!("open {}", path.display()), e))?;
        let st = fstat(&fd).map_err(|e| Error::os("fstat", e))?;
        let me = nix::unistd::geteuid().as_raw();
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind != SFlag::S_IFDIR || st.st_uid != me || st.st_mode & 0o077 != 0 {
            return Err(Error::Invalid(format!(
                "{} is not the private directory just made (owner uid {}, mode {:o}): another user swapped it; refusing to create the socket through it",
                path.display(),
                st.st_uid,
                st.st_mode & 0o7777
            )));
        }
        Ok(Self {
            fd,
            path: path.to_owned(),
        })
    }
}

impl Drop for PrivateDir {
    /// Removes what is left in it (a socket not renamed, on an error) and then the directory
    /// under its name (which fails, harmlessly, for anything but an empty directory).
    fn drop(&mut self) {
        let _ = nix::unistd::unlinkat(&self.fd, "s", nix::unistd::UnlinkatFlags::NoRemoveDir);
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// When to ring clients ahead of the frame after the one published at `last` (CLOCK_MONOTONIC
/// ns, like `now`): `lead` before it is due, frames coming every `interval` (once known), and
/// `rung` if that frame was rung for already.
fn plan_ahead(lead: u64, interval: Option<u64>, last: u64, rung: bool, now: u64) -> Ahead {
    let Some(iv) = interval else {
        return Ahead::Park;
    };
    if iv < WAKE_AHEAD_MIN_INTERVAL.as_nanos() as u64 {
        return Ahead::Off;
    }
    let due = last.saturating_add(iv);
    // Rung for the coming frame already: plan for the one after.
    let at = due
        .saturating_add(if rung { iv } else { 0 })
        .saturating_sub(lead);
    if at > now {
        Ahead::At(at)
    } else if rung || now > due.saturating_add(iv / 2) {
        // The coming frame is late (rung for, or half an interval past due): a pause.
        Ahead::Park
    } else {
        Ahead::At(at)
    }
}

fn errno(e: &std::io::Error) -> nix::errno::Errno {
    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0))
}

impl<P: Send + 'static> Publisher<P> {
    pub fn start(
        path: &Path,
        config: Config,
        on_event: Box<dyn Fn(Event) + Send + Sync>,
    ) -> Result<Arc<Self>> {
        let listener = bind(path, config.perms)?;
        let (reap_tx, reap_rx) = std::sync::mpsc::channel::<Box<dyn Send>>();
        std::thread::Builder::new()
            .name("gpushm-reaper".into())
            .spawn(move || {
                // Ends when the publisher (the only sender) is gone.
                while let Ok(x) = reap_rx.recv() {
                    drop(x);
                }
            })
            .map_err(|e| Error::os("spawning the reaper thread", errno(&e)))?;
        let inode = std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0);
        let server = Arc::new(Self {
            inner: Mutex::new(Inner {
                rings: Vec::new(),
                clients: Vec::new(),
                pending: Vec::new(),
                caps: None,
                eos: false,
                next_seq: 1,
                next_client_id: 1,
                next_ring_gen: 1,
                stats: Stats::default(),
                shutdown: false,
                unlocked: false,
                events: Vec::new(),
                closing: Vec::new(),
                starved_since: None,
                admission: Admission::new(),
                release_waiters: 0,
                started: Instant::now(),
                rate: RateMeter {
                    since_ns: crate::monotonic_ns(),
                    count: 0,
                    last: 0.0,
                },
                woken_early_for: 0,
                cadence: Default::default(),
                publish_cpu: 0,
                wake_ahead_ns: 0,
                ahead_asked_ns: 0,
                ahead_late: [0; AHEAD_LATE_HISTORY],
                ahead_late_n: 0,
                ahead_late_at: 0,
                ahead_for: 0,
                ahead_woke: (0, 0),
                ahead_parked: false,
                report: None,
                released: Vec::new(),
            }),
            config,
            reserve: Mutex::new(std::fs::File::open("/dev/null").ok()),
            changed: Condvar::new(),
            released: Condvar::new(),
            wake: shm::new_eventfd()?,
            listener,
            path: path.to_owned(),
            inode,
            on_event,
            thread: Mutex::new(None),
            reaper: Mutex::new(reap_tx),
            connection_tid: std::sync::atomic::AtomicI32::new(0),
        });
        let weak = Arc::downgrade(&server);
        let handle = std::thread::Builder::new()
            .name("gpushmsink-ipc".into())
            .spawn(move || {
                // Its polls time wake-ups ahead of frames (set_wake_ahead): to the µs, not
                // within the default 50 µs of slack.
                let _ = nix::sys::prctl::set_timerslack(1_000);
                if let Some(s) = weak.upgrade() {
                    s.connection_tid.store(
                        nix::unistd::gettid().as_raw(),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                }
                while let Some(s) = weak.upgrade() {
                    if !s.serve_once() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::os("spawning the connection thread", errno(&e)))?;
        *server.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(server)
    }

    /// Stops the connection thread, disconnects every client and removes the socket file.
    pub fn stop(&self) {
        lock(&self.inner).shutdown = true;
        shm::notify(&self.wake);
        self.changed.notify_all();
        self.released.notify_all();
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
        let parked: Vec<P> = {
            let mut inner = lock(&self.inner);
            inner.clients.clear();
            inner.pending.clear();
            inner.closing.clear();
            inner
                .rings
                .iter_mut()
                .flat_map(|r| r.slots.iter_mut().filter_map(|s| s.parked.take()))
                .collect()
        };
        drop(parked);
        // Remove the socket only if it is still ours (a new producer may have replaced it).
        if std::fs::metadata(&self.path).map(|m| m.ino()).ok() == Some(self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    pub fn set_unlocked(&self, unlocked: bool) {
        lock(&self.inner).unlocked = unlocked;
        self.changed.notify_all();
        self.released.notify_all();
    }

    /// Consumers connected and taking frames (closed ones that still hold frames are not
    /// counted; [`Self::stats`] lists them).
    pub fn num_clients(&self) -> usize {
        lock(&self.inner)
            .clients
            .iter()
            .filter(|c| !c.closed)
            .count()
    }

    /// The stream's figures and each client's: what gpushmsink's `stats` property and
    /// `gpushm top` (through [`Self::report`]) show.
    pub fn stats(&self) -> (Stats, Vec<ClientStats>) {
        // Releases not taken yet would show as held.
        self.reclaim();
        Self::stats_locked(&lock(&self.inner))
    }

    fn stats_locked(inner: &Inner<P>) -> (Stats, Vec<ClientStats>) {
        let now = Instant::now();
        let clients = inner
            .clients
            .iter()
            .map(|c| ClientStats {
                id: c.id,
                pid: c.pid,
                mode: c.mode,
                lossless: c.lossless,
                sent: c.sent,
                dropped: c.ch.dropped(),
                held: c.ch.held_len() + c.ch.pending_len(),
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
            })
            .collect();
        (inner.stats, clients)
    }

    /// The stream's figures as a Report: [`Self::stats`], plus caps, ring, rates and CPU.
    fn report_locked(&self, inner: &Inner<P>) -> StreamReport {
        let (s, clients) = Self::stats_locked(inner);
        let (slot_count, slot_size, ring_size, device_ring) = inner
            .rings
            .last()
            .map(|r| {
                let g = r.ring.geometry();
                (
                    g.slot_count,
                    g.slot_size,
                    g.total_size,
                    r.ring.device().is_some(),
                )
            })
            .unwrap_or_default();
        let cpu_ns = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
            .map(|u| {
                let ns = |t: nix::sys::time::TimeVal| {
                    (t.tv_sec().max(0) as u64) * 1_000_000_000 + (t.tv_usec().max(0) as u64) * 1000
                };
                ns(u.user_time()) + ns(u.system_time())
            })
            .unwrap_or(0);
        StreamReport {
            pid: std::process::id(),
            uptime_ns: inner.started.elapsed().as_nanos() as u64,
            cpu_ns,
            frames_sent: s.frames_sent,
            frames_copied: s.frames_copied,
            frames_dropped: s.frames_dropped,
            times_lagged: s.times_lagged,
            fps: inner.rate.rate(crate::monotonic_ns()),
            caps: inner.caps.as_ref().map(|c| c.1.clone()).unwrap_or_default(),
            slot_count,
            slot_size,
            ring_size,
            device_ring,
            eos: inner.eos,
            max_clients: self.config.max_clients.min(u32::MAX as usize) as u32,
            clients: clients
                .into_iter()
                .map(|c| ClientReport {
                    id: c.id,
                    pid: c.pid,
                    uid: c.uid,
                    name: c.name,
                    mode: c.mode.name().to_string(),
                    lossless: c.lossless,
                    lagging: c.lagging,
                    closed: c.closed,
                    sent: c.sent,
                    taken: c.taken,
                    dropped: c.dropped,
                    skipped: c.skipped,
                    copied: c.copied,
                    times_lagged: c.times_lagged,
                    held: c.held.min(u32::MAX as usize) as u32,
                    connected_ns: c.connected.as_nanos() as u64,
                    latency: c.latency,
                })
                .collect(),
            clients_left_out: 0,
        }
    }

    /// Answers a tool's Query with the last report if it is recent, otherwise a new one:
    /// however many queries come, at most one report is built per [`REPORT_INTERVAL`].
    fn answer_query(&self, inner: &mut Inner<P>, conn: Conn) {
        let now = Instant::now();
        let report = match &inner.report {
            Some((at, r)) if now.saturating_duration_since(*at) < REPORT_INTERVAL => r.clone(),
            _ => {
                // What each client took up to now (a client that broke its queue is dealt
                // with where frames are delivered; here it only shows its last good count).
                for c in inner.clients.iter_mut() {
                    let _ = c.ch.sync_taken();
                }
                let r = Arc::new(self.report_locked(inner));
                inner.report = Some((now, r.clone()));
                r
            }
        };
        // Never waits: a tool that does not read its socket loses its report, nobody else
        // waits for it.
        let _ = conn.send(&Message::Report(Box::new((*report).clone())), &[]);
        self.reap(Box::new(conn));
    }

    pub fn count_copy(&self) {
        lock(&self.inner).stats.frames_copied += 1;
    }

    /// Creates a ring of `slots` slots for frames of `frame_size` bytes with `caps`, makes it
    /// current, and announces it to every client.
    pub fn new_ring(
        self: &Arc<Self>,
        slots: u32,
        frame_size: u64,
        caps: &str,
        requeue: Requeue<P>,
    ) -> Result<Arc<ProducerRing>> {
        self.new_ring_with(slots, frame_size, caps, requeue, &|_| Ok(()))
    }

    /// [`Self::new_ring`], with `prepare` run on the ring before anyone hears of it (to put
    /// its pixels in GPU memory: [`crate::cuda::vmm::place_ring`]).
    pub fn new_ring_with(
        self: &Arc<Self>,
        slots: u32,
        frame_size: u64,
        caps: &str,
        requeue: Requeue<P>,
        prepare: &dyn Fn(&ProducerRing) -> Result<()>,
    ) -> Result<Arc<ProducerRing>> {
        // The ring is made (and prepared: GPU allocations take milliseconds) without the
        // lock that frames are published under.
        let gen = {
            let mut inner = lock(&self.inner);
            inner.next_ring_gen += 1;
            inner.next_ring_gen - 1
        };
        let ring = ProducerRing::create(gen, slots, frame_size, self.config.allow_writable)?;
        prepare(&ring)?;
        let ring = Arc::new(ring);
        let mut inner = lock(&self.inner);
        let caps_gen = inner.caps.as_ref().map_or(1, |c| c.0 + 1);
        inner.caps = Some((caps_gen, caps.to_string()));
        inner.rings.push(RingState {
            ring: ring.clone(),
            requeue,
            slots: (0..slots)
                .map(|_| SlotState {
                    client_refs: 0,
                    parked: None,
                })
                .collect(),
        });
        let mut failed = Vec::new();
        // Closed clients take no more frames: they need no new ring.
        for c in inner.clients.iter().filter(|c| !c.closed) {
            if let Err(e) = Self::send_ring_and_caps(&inner, c) {
                failed.push((c.id, e.to_string()));
            }
        }
        for (id, why) in failed {
            self.drop_client(&mut inner, id, why);
        }
        Self::retire_idle_rings(&mut inner);
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        self.emit(events);
        Ok(ring)
    }

    pub fn caps_gen(&self) -> u32 {
        lock(&self.inner).caps.as_ref().map_or(0, |c| c.0)
    }

    /// Why client `c` cannot be served the current ring, if it cannot.
    fn ring_refusal(inner: &Inner<P>, device_memory: bool) -> Option<String> {
        let d = inner.rings.last()?.ring.device()?;
        (!device_memory).then(|| {
            format!(
                "this stream's frames are in GPU memory ({} bytes on GPU {}) and this consumer did not ask for GPU memory (Python: Subscriber(device_memory=True); Rust: ConnectOptions::device_memory; gpushmsrc always does), or the producer can keep its ring in host memory (gpushmsink ring=host)",
                d.size,
                d.gpu_uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
            )
        })
    }

    fn send_ring_and_caps(inner: &Inner<P>, c: &Client) -> Result<()> {
        if let Some(why) = Self::ring_refusal(inner, c.device_memory) {
            return Err(Error::Refused(why));
        }
        if let Some(r) = inner.rings.last() {
            let g = r.ring.geometry();
            let writable = c.writable && r.ring.is_writable();
            let ro = if writable {
                r.ring.read_write_fd()?
            } else {
                r.ring.read_only_fd()?
            };
            c.conn.send(
                &Message::Ring {
                    ring_gen: r.ring.ring_gen(),
                    flags: if writable { RING_WRITABLE } else { 0 }
                        | if r.ring.device().is_some() {
                            RING_DEVICE
                        } else {
                            0
                        },
                    slot_count: g.slot_count,
                    slot_size: g.slot_size,
                    total_size: g.total_size,
                },
                &[ro.as_fd()],
            )?;
            if let Some(d) = r.ring.device() {
                c.conn.send(
                    &Message::DeviceMemory {
                        ring_gen: r.ring.ring_gen(),
                        gpu_uuid: d.gpu_uuid,
                        size: d.size,
                    },
                    &[d.fd.as_fd()],
                )?;
            }
        }
        if let Some((caps_gen, caps)) = &inner.caps {
            c.conn.send(
                &Message::Caps {
                    caps_gen: *caps_gen,
                    caps: caps.clone(),
                },
                &[],
            )?;
        }
        Ok(())
    }

    /// Tells every client the stream ended (after every frame published so far).
    pub fn send_eos(&self) {
        let mut inner = lock(&self.inner);
        inner.eos = true;
        let failed: Vec<(u32, String)> = inner
            .clients
            .iter()
            .filter(|c| !c.closed)
            .filter_map(|c| {
                c.conn
                    .send(&Message::Eos, &[])
                    .err()
                    .map(|e| (c.id, e.to_string()))
            })
            .collect();
        for (id, why) in failed {
            self.drop_client(&mut inner, id, why);
        }
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        self.emit(events);
    }

    /// Wakes the clients that sleep until a frame comes, ahead of the next frame: called as
    /// it starts its last steps to [`Self::publish_frame`] (gpushmsink: as it reaches the sink
    /// pad, or render() after GstBaseSink's clock wait), so that their wake-up, which takes
    /// tens of µs on a core that idled, runs while those steps do instead of after them.
    ///
    /// A client quicker than those steps finds no frame yet and polls the ring for it (at
    /// most [`crate::client::EARLY_WAKE_POLL`], once per frame; it sleeps again if it woke
    /// on our CPU) until the frame comes or its own wake-up does (it loses nothing, and no
    /// frame is later than without this); one still asleep when the frame is published is
    /// woken twice and takes it on the first.
    ///
    /// So it is done only after a gap of [`WAKE_EARLY_GAP`] since the last frame (the cores
    /// of a faster stream do not idle deep, and the second wake-up is a system call more per
    /// frame and client), at most once per frame (not within 200 µs of a wake-up ahead of the
    /// same frame, [`Self::set_wake_ahead`]: its clients are still waking or polling), and
    /// only for clients that sleep in a
    /// subscriber's wait (not those polling the doorbell in an event loop, which would see
    /// it readable for nothing) on another CPU than ours (a unix socket's wake-up asks the
    /// scheduler to run the woken thread on the waker's CPU, where it would take that CPU from
    /// the frame's way). Clients older than this wake-up (they say nothing of their CPU) are
    /// never woken early. Never blocks: the doorbells are rung without our lock held.
    pub fn wake_early(&self) {
        let wake = {
            let mut guard = lock(&self.inner);
            let inner = &mut *guard;
            if inner.woken_early_for == inner.next_seq {
                return;
            }
            inner.woken_early_for = inner.next_seq;
            let now = crate::monotonic_ns();
            let last = inner.cadence.last();
            if last != 0 && now.saturating_sub(last) < WAKE_EARLY_GAP.as_nanos() as u64 {
                return;
            }
            // Clients woken ahead of this frame (set_wake_ahead) moments ago are waking up or
            // polling for it: ringing them again is a system call on the frame's way for
            // nothing. Rung longer ago (the frame is late), they have slept again.
            let (seq, at) = inner.ahead_woke;
            if seq == inner.next_seq
                && now.saturating_sub(at) < 2 * crate::client::EARLY_WAKE_POLL.as_nanos() as u64
            {
                return;
            }
            Self::early_wake_list(inner, crate::layout::this_cpu())
        };
        for d in wake {
            d.ring();
        }
    }

    /// The doorbells of the clients asleep in a subscriber's wait on another CPU than `cpu`
    /// (the frame's way runs there), each told that `cpu` rang it ahead of the frame.
    fn early_wake_list(inner: &mut Inner<P>, cpu: u32) -> Vec<Arc<shm::Doorbell>> {
        let mut wake = Vec::new();
        for c in inner.clients.iter().filter(|c| !c.closed) {
            if c.ch.consumer_sleeps_off(cpu) {
                c.ch.set_early_wake_cpu(cpu);
                wake.push(c.ready.clone());
            }
        }
        inner.stats.woken_early += wake.len() as u64;
        wake
    }

    /// Wakes the clients that sleep until a frame comes `ahead` before each frame is due,
    /// from the connection thread (`Duration::ZERO`, the default: never). When a frame is
    /// due is learnt from the publish times of the last ones (their median interval), for
    /// streams of at most one frame every [`WAKE_AHEAD_MIN_INTERVAL`].
    ///
    /// A consumer's wake-up from a sleep of a few ms takes tens of µs (60-80 on the H100
    /// machine); woken `ahead` before the frame, it is awake and polling the ring when the
    /// frame lands, as with its own low-latency mode
    /// ([`crate::client::ConnectOptions::spin`]), but the producer keeps the time for every
    /// client. The rules of [`Self::wake_early`] hold (once per frame: that one rings again
    /// only for a frame that comes over 200 µs after its wake-up ahead, when its clients have
    /// polled and slept again; only clients asleep in a subscriber's wait, on another CPU than
    /// the one the last frame was published from;
    /// a woken client polls at most [`crate::client::EARLY_WAKE_POLL`] once per frame it
    /// takes, then sleeps again): a wrong guess costs a client that much CPU, never a frame
    /// or a later one (a frame later than the poll is still rung for as it comes, by
    /// [`Self::wake_early`], and woken for by its publish). A stream that stops costs one
    /// wake-up ahead, for the frame that does not come: none is rung for a frame already
    /// half an interval late. At most [`MAX_WAKE_AHEAD`] (else [`Error::Invalid`], see
    /// [`check_wake_ahead`]).
    pub fn set_wake_ahead(&self, ahead: Duration) -> Result<()> {
        check_wake_ahead(ahead)?;
        let ns = ahead.as_nanos() as u64;
        let mut inner = lock(&self.inner);
        if inner.wake_ahead_ns != ns {
            inner.wake_ahead_ns = ns;
            drop(inner);
            // The connection thread plans again.
            shm::notify(&self.wake);
        }
        Ok(())
    }

    /// When the connection thread rings clients ahead of the next frame (wake_ahead_ns set).
    fn ahead_plan(inner: &Inner<P>, now: u64) -> Ahead {
        if inner.eos || inner.clients.iter().all(|c| c.closed) {
            return Ahead::Off;
        }
        plan_ahead(
            inner.wake_ahead_ns + Self::ahead_late_ns(inner),
            inner.cadence.interval(),
            inner.cadence.last(),
            inner.ahead_for == inner.next_seq,
            now,
        )
    }

    /// How late the connection thread's timed polls end (the median of the last ones).
    fn ahead_late_ns(inner: &Inner<P>) -> u64 {
        let n = inner.ahead_late_n;
        if n == 0 {
            return 0;
        }
        let mut v = inner.ahead_late;
        let v = &mut v[..n];
        v.sort_unstable();
        v[n / 2]
    }

    /// The connection thread's wake-up ahead of a frame, under our lock: the doorbells to
    /// ring now (`Ok`, rung by the caller once the lock is released), or when to look again
    /// (`Err(Some(ns))`, CLOCK_MONOTONIC). `timed_out`: the poll that asked for it ended by
    /// its timeout (how late it ended is learnt).
    fn ahead_step(
        inner: &mut Inner<P>,
        timed_out: bool,
    ) -> std::result::Result<Vec<Arc<shm::Doorbell>>, Option<u64>> {
        if inner.wake_ahead_ns == 0 {
            inner.ahead_parked = false;
            return Err(None);
        }
        let now = crate::monotonic_ns();
        let plan = Self::ahead_plan(inner, now);
        inner.ahead_parked = plan == Ahead::Park;
        match plan {
            Ahead::At(at) if at <= now => {
                if timed_out && inner.ahead_asked_ns != 0 && now >= inner.ahead_asked_ns {
                    let i = inner.ahead_late_at;
                    inner.ahead_late[i] = (now - inner.ahead_asked_ns).min(AHEAD_LATE_MAX_NS);
                    inner.ahead_late_at = (i + 1) % AHEAD_LATE_HISTORY;
                    inner.ahead_late_n = (inner.ahead_late_n + 1).min(AHEAD_LATE_HISTORY);
                }
                inner.ahead_asked_ns = 0;
                inner.ahead_for = inner.next_seq;
                let cpu = inner.publish_cpu;
                let wake = Self::early_wake_list(inner, cpu);
                if !wake.is_empty() {
                    inner.ahead_woke = (inner.next_seq, now);
                }
                inner.stats.woken_ahead += wake.len() as u64;
                Ok(wake)
            }
            Ahead::At(at) => {
                inner.ahead_asked_ns = at;
                Err(Some(at))
            }
            Ahead::Off | Ahead::Park => {
                inner.ahead_asked_ns = 0;
                Err(None)
            }
        }
    }

    /// A new stream starts (flush or restart after EOS).
    pub fn clear_eos(&self) {
        let mut inner = lock(&self.inner);
        inner.eos = false;
        // A new stream: its cadence is learnt afresh, and the connection thread plans again.
        inner.cadence = Default::default();
        drop(inner);
        shm::notify(&self.wake);
    }

    /// Publishes the frame in `slot` of ring `ring_gen` to every client, following `policy`:
    /// a lossless client at its slot budget is waited for (up to `policy.max_wait`, then this
    /// frame skips it); a leaky one loses its oldest untaken frames, or this frame.
    /// Returns false if unlocked while waiting; an error if the slot is not one of the current
    /// ring or consumers still hold it.
    pub fn publish(
        &self,
        ring_gen: u32,
        slot: u32,
        meta: FrameMeta,
        policy: Policy,
    ) -> Result<bool> {
        match self.publish_frame(ring_gen, slot, meta, policy, false)? {
            Published::Sent => Ok(true),
            Published::Stopped => Ok(false),
            Published::SlotBusy(why) => Err(Error::Invalid(why)),
        }
    }

    /// [`Self::publish`] for a producer that can fall back to another slot, in one lock:
    /// with `wait_for_client` it first waits until a client is connected, and a slot that
    /// cannot be published (not in the current ring, or still held by consumers) is
    /// [`Published::SlotBusy`] rather than an error.
    pub fn publish_frame(
        &self,
        ring_gen: u32,
        slot: u32,
        mut meta: FrameMeta,
        policy: Policy,
        wait_for_client: bool,
    ) -> Result<Published> {
        let mut guard = lock(&self.inner);
        if wait_for_client {
            while guard.clients.iter().all(|c| c.closed) && !guard.unlocked && !guard.shutdown {
                guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
        }
        // Refused before any wait for lossless clients: the caller publishes a copy next, which
        // may wait once (a slot consumers hold is not released by waiting for them to take).
        if let Some(busy) = Self::slot_refusal(&guard, ring_gen, slot) {
            return Ok(busy);
        }
        // What clients released since the last frame (they wake nobody for it). Taken after
        // the frame went out (off its way: reading each client's release queue is a cache
        // miss per client and a microsecond on the way of every frame) unless a client may
        // be full by the counts of the last frame: a client under the count that decides its
        // way (below) is treated the same whatever it released since.
        // Crowded: too many open clients for each to keep frames of its own (the ring's slots
        // less one, or more). Every client's budget is then one frame, so that consumers copy
        // what their downstream keeps instead of pinning slots (see relieve_overcrowding).
        let crowded = guard.rings.last().is_some_and(|r| {
            Self::crowded(
                guard.clients.iter().filter(|c| !c.closed).count(),
                r.slots.len(),
            )
        });
        let policy = Policy {
            budget: if crowded {
                policy.budget.min(CROWDED_BUDGET)
            } else {
                policy.budget
            },
            ..policy
        };
        let mut back = Vec::new();
        let limit = crate::layout::zero_copy_limit(policy.budget);
        let mut reclaimed = false;
        let inner = &mut *guard;
        let caps = inner.caps.as_ref().map_or("", |c| c.1.as_str());
        let start = Instant::now();
        let mut spent = Vec::new();
        for c in inner.clients.iter_mut() {
            c.lossless = c.mode.lossless_for(meta.live, caps);
            if c.lossless && Self::hold_bounded(c, meta.live) {
                c.hold.refill(start);
                if c.hold.left.is_zero() {
                    // Held the live producer up for its share: this frame skips it if it
                    // has no room.
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
            reclaimed |= c.refs() >= decides;
        }

        if reclaimed {
            self.reclaim_locked(&mut guard, &mut back);
        }
        // Back-pressure from lossless clients, bounded by max-wait. A client that held the
        // producer up for a whole max-wait is lagging: it is not waited for again until it
        // has caught up, so a stuck consumer costs the others one max-wait, once.
        // An `auto` client of a live stream is waited for only while it has hold credit.
        // Without a reclaim no client can be full (only one that may be full triggers it), so
        // the wait below ends at once and its start is not read: no clock read for it.
        let wait_start = if reclaimed { Instant::now() } else { start };
        let deadline = wait_start.checked_add(policy.max_wait);
        let mut late: Vec<u32> = Vec::new();
        let mut held_by: Vec<u32> = Vec::new();
        let mut waiting = false;
        let mut spun = false;
        let mut stopped = false;
        loop {
            let inner = &mut *guard;
            if inner.unlocked || inner.shutdown {
                stopped = true;
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
                match c.ch.sync_taken() {
                    Ok(()) => {
                        if Self::hold_bounded(c, meta.live) {
                            if wait_start.elapsed() >= c.hold.left {
                                // Its credit is spent: this frame skips it instead.
                                c.lossless = false;
                                if !std::mem::replace(&mut c.hold.spent, true) {
                                    spent.push(c.id);
                                }
                                continue;
                            }
                            let end = wait_start + c.hold.left;
                            credit_end = Some(credit_end.map_or(end, |e: Instant| e.min(end)));
                        }
                        if !held_by.contains(&c.id) {
                            held_by.push(c.id);
                        }
                        full.push(c.id)
                    }
                    Err(e) => failed.push((c.id, e.to_string())),
                }
            }
            for (id, why) in failed {
                self.drop_client(inner, id, why);
            }
            if full.is_empty() {
                break;
            }
            if !spun && !policy.spin.is_zero() {
                // Low-latency mode: poll the full clients' releases, for the budget at most,
                // before sleeping. Our lock is let go between looks.
                spun = true;
                // Never past max-wait, nor past a bounded client's hold credit.
                let until = [deadline, credit_end]
                    .into_iter()
                    .flatten()
                    .fold(Instant::now() + policy.spin, Instant::min);
                let caught = loop {
                    drop(guard);
                    let next = Instant::now() + LOOK_EVERY;
                    while Instant::now() < next {
                        for _ in 0..4 {
                            std::hint::spin_loop();
                        }
                    }
                    guard = lock(&self.inner);
                    let inner = &mut *guard;
                    if inner.unlocked || inner.shutdown {
                        break false;
                    }
                    self.reclaim_locked(inner, &mut back);
                    if inner
                        .clients
                        .iter()
                        .filter(|c| full.contains(&c.id))
                        .all(|c| c.closed || c.refs() < policy.budget)
                    {
                        break true;
                    }
                    if Instant::now() >= until {
                        break false;
                    }
                };
                match caught {
                    true => guard.stats.spin_caught += 1,
                    false => guard.stats.spin_missed += 1,
                }
                continue;
            }
            if !waiting {
                // Clients wake the connection thread on releases from now on; what they
                // released before they saw that is taken here.
                waiting = true;
                Self::add_release_waiter(inner, true);
                self.reclaim_locked(inner, &mut back);
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
                    late = full;
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
            Self::add_release_waiter(&mut guard, false);
        }
        for id in spent {
            guard.events.push(Event::Info(format!(
                "client {id} (mode auto) held this live stream up for its share ({} % of the \
                 time, {} ms at once): it loses frames it has no room for until it keeps up \
                 (mode=lossless waits for it without this bound)",
                LIVE_HOLD_PERCENT,
                LIVE_HOLD_BURST.as_millis()
            )));
        }
        if !held_by.is_empty() {
            let waited = wait_start.elapsed();
            for c in guard.clients.iter_mut().filter(|c| held_by.contains(&c.id)) {
                if Self::hold_bounded(c, meta.live) {
                    c.hold.left = c.hold.left.saturating_sub(waited);
                }
            }
        }
        let inner = &mut *guard;
        // Looked at again: the ring may have changed while we waited.
        let refused = match stopped {
            true => Some(Published::Stopped),
            false => Self::slot_refusal(inner, ring_gen, slot),
        };
        if let Some(r) = refused {
            drop(guard);
            self.give_back(back);
            return Ok(r);
        }
        // slot_refusal() found the ring last.
        let ri = inner.rings.len() - 1;
        let seq = inner.next_seq;
        inner.next_seq += 1;
        meta.caps_gen = inner.caps.as_ref().map_or(0, |c| c.0);
        meta.publish_ns = crate::monotonic_ns();
        inner.rings[ri].ring.publish(slot, seq, &meta);
        inner.stats.frames_sent += 1;
        inner.rate.tick(meta.publish_ns);
        // The CPU the frame's way runs on, for wake-ups ahead of the next frame: only after a
        // gap (they are rung for streams with one), not on every frame of a fast one.
        if meta.publish_ns.saturating_sub(inner.cadence.last()) >= WAKE_EARLY_GAP.as_nanos() as u64
        {
            inner.publish_cpu = crate::layout::this_cpu();
        }
        inner.cadence.record(meta.publish_ns);
        // The connection thread waits for this frame to plan the next wake-up ahead.
        let poke = std::mem::take(&mut inner.ahead_parked);
        let entry = Entry {
            seq,
            ring_gen,
            slot,
        };
        let mut failed = Vec::new();
        let mut released = Vec::new();
        // Rung after our lock is released.
        let mut wake: Vec<Arc<shm::Doorbell>> = Vec::new();
        for c in inner.clients.iter_mut().filter(|c| !c.closed) {
            let r = (|| -> Result<bool> {
                if late.contains(&c.id) {
                    // It took nothing for a whole max-wait: from now on it is served like a
                    // leaky client (never waited for) until it takes a frame again, and the
                    // frames it has not taken go back at once, so a stuck client pins only
                    // what it really holds.
                    c.lagging = true;
                    c.times_lagged += 1;
                    inner.stats.times_lagged += 1;
                    c.taken_at_lag = c.ch.taken();
                    inner.events.push(Event::Lagging {
                        id: c.id,
                        waited: policy.max_wait,
                        first: c.times_lagged == 1,
                    });
                    while let Some(old) = c.ch.revoke_oldest()? {
                        released.push(old);
                        inner.stats.frames_dropped += 1;
                    }
                    return Ok(false);
                }
                if c.lagging {
                    c.ch.sync_taken()?;
                    if c.ch.taken() > c.taken_at_lag {
                        // It took frames again: lossless again.
                        c.lagging = false;
                        inner.events.push(Event::CaughtUp { id: c.id });
                    }
                }
                if !c.lossless || c.lagging {
                    // What it took since the last frame (its releases may be taken later).
                    c.ch.sync_taken()?;
                    // Keep a short backlog and stay under the budget: drop the oldest frames
                    // the client has not taken yet. A client that takes nothing pins at most
                    // what it keeps zero-copy plus one.
                    let cap = crate::layout::zero_copy_limit(policy.budget) + 1;
                    while c.ch.pending_len() > 0
                        && (c.ch.pending_len() >= LEAKY_BACKLOG || c.refs() >= cap)
                    {
                        match c.ch.revoke_oldest()? {
                            Some(old) => {
                                released.push(old);
                                inner.stats.frames_dropped += 1;
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
            })();
            match r {
                Ok(true) => {
                    c.sent += 1;
                    inner.rings[ri].slots[slot as usize].client_refs += 1;
                    // A client busy with earlier frames takes this one without a wake-up.
                    if c.ch.consumer_waits() {
                        wake.push(c.ready.clone());
                    }
                }
                Ok(false) => {
                    c.ch.skip();
                    inner.stats.frames_dropped += 1;
                }
                Err(e) => failed.push((c.id, e.to_string())),
            }
        }
        for e in released {
            Self::unref_slot(inner, e, &mut back);
        }
        for (id, why) in failed {
            self.drop_client(inner, id, why);
        }
        // Wake-ups first, without our lock held: what clients released since the last frame
        // is taken after (off the frame's way).
        drop(guard);
        for d in wake {
            d.ring();
        }
        if poke {
            shm::notify(&self.wake);
        }
        let mut guard = lock(&self.inner);
        let inner = &mut *guard;
        if !reclaimed {
            self.reclaim_locked(inner, &mut back);
        }
        let events = std::mem::take(&mut inner.events);
        // Returning buffers to their pool, without our lock held.
        drop(guard);
        self.give_back(back);
        self.emit(events);
        Ok(Published::Sent)
    }

    /// Whether the time `c` holds the producer up is bounded by its [`HoldCredit`]: an `auto`
    /// client of a live stream.
    fn hold_bounded(c: &Client, live: bool) -> bool {
        live && c.mode == Delivery::Auto
    }

    /// Why `slot` of ring `ring_gen` cannot be published now, if it cannot: only the current
    /// ring's slots are (consumers read a frame with the newest caps), and only while no
    /// consumer holds them.
    fn slot_refusal(inner: &Inner<P>, ring_gen: u32, slot: u32) -> Option<Published> {
        let current = inner.rings.last().filter(|r| r.ring.ring_gen() == ring_gen);
        let why = match current.map(|r| r.slots.get(slot as usize)) {
            None => format!("ring {ring_gen} is not the current ring"),
            Some(None) => format!("slot {slot} is not in ring {ring_gen}"),
            Some(Some(s)) if s.client_refs != 0 => {
                format!("slot {slot} is still held by consumers")
            }
            Some(Some(_)) => return None,
        };
        Some(Published::SlotBusy(why))
    }

    /// Takes back what clients released, in every client's release queue: slots whose last
    /// reader is done come free, and their parked owners go to `back`. Costs no system call;
    /// runs for every frame and every round of the connection thread.
    fn reclaim_locked(&self, inner: &mut Inner<P>, back: &mut Vec<(Requeue<P>, P)>) {
        let mut released = std::mem::take(&mut inner.released);
        let mut failed = Vec::new();
        for c in inner.clients.iter_mut() {
            if let Err(e) = c.ch.take_releases_into(&mut released) {
                failed.push((c.id, e.to_string()));
            }
        }
        if !released.is_empty() {
            // Slots move: whoever holds them now is slow, not hoarding.
            inner.starved_since = None;
        }
        for e in released.drain(..) {
            Self::unref_slot(inner, e, back);
        }
        inner.released = released;
        for (id, why) in failed {
            self.drop_client(inner, id, why);
        }
    }

    /// Counts a thread that starts (`true`) or stops waiting for slots to come back. While
    /// one waits, clients write their slot-released eventfd after each release.
    fn add_release_waiter(inner: &mut Inner<P>, start: bool) {
        let before = inner.release_waiters > 0;
        if start {
            inner.release_waiters += 1;
        } else {
            inner.release_waiters = inner.release_waiters.saturating_sub(1);
        }
        let now = inner.release_waiters > 0;
        if before != now {
            for c in &inner.clients {
                c.ch.set_producer_waits(now);
            }
        }
    }

    /// Takes back at once what clients released (they do not wake the producer for each
    /// release): owners of slots whose last reader is done go back to their pools.
    pub fn reclaim(&self) {
        let mut inner = lock(&self.inner);
        let mut back = Vec::new();
        self.reclaim_locked(&mut inner, &mut back);
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        self.give_back(back);
        self.emit(events);
    }

    /// For a thread about to wait for a slot (a pool with none free): while the returned
    /// guard lives, clients wake the connection thread on each release, which gives slots
    /// back as they come. What they released already is taken back at once.
    pub fn want_releases(&self) -> ReleaseWait<'_, P> {
        Self::add_release_waiter(&mut lock(&self.inner), true);
        self.reclaim();
        let mut inner = lock(&self.inner);
        self.relieve_overcrowding(&mut inner);
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        self.emit(events);
        ReleaseWait(self)
    }

    /// Too many open clients for each to keep frames of its own: as many as the ring's slots
    /// less one, or more (two at least: one client holding a small ring whole is waited for,
    /// as its budget says).
    fn crowded(open: usize, slots: usize) -> bool {
        open >= 2 && open + 1 >= slots
    }

    /// The producer has no free slot. If every slot of the ring is held by clients and there
    /// are too many clients for each to keep one (at least the ring's slots less one), some
    /// client must give way at once, or clients that each keep one frame (each within its
    /// share) stop the stream for everybody: the clients holding the oldest frame are cut (a
    /// consumer that keeps up holds the newest ones), after a closed client still holding
    /// frames or the one most over its share, if any. While crowded, every client's budget is
    /// one frame, so consumers that follow it (gpushmsrc, Python) copy what they keep and are
    /// not the ones holding old frames.
    fn relieve_overcrowding(&self, inner: &mut Inner<P>) {
        let Some(ring) = inner.rings.last() else {
            return;
        };
        let slots = ring.slots.len();
        let gen = ring.ring.ring_gen();
        if ring.slots.iter().any(|s| s.client_refs == 0) {
            return;
        }
        let open = inner.clients.iter().filter(|c| !c.closed).count();
        if !Self::crowded(open, slots) {
            return;
        }
        // A closed client still holding frames, or the one most over its share, first (as
        // check_starvation would, later). While crowded, a client that follows its budget
        // may hold CROWDED_BUDGET frames a moment (one kept zero-copy, the next taken before
        // it is copied), even when that is more than the ring's slots over the clients: only
        // more than that is over its share here.
        let share = (slots / open.max(1)).max(CROWDED_BUDGET);
        if let Some((id, refs, share)) = inner
            .clients
            .iter()
            .map(|c| (c.id, c.share_count(), if c.closed { 0 } else { share }))
            .filter(|&(_, r, share)| r > share)
            .max_by_key(|&(_, r, share)| (share == 0, r))
        {
            self.drop_client(
                inner,
                id,
                format!(
                    "{open} consumers share a ring of {slots} slots, all held; this one held {refs}, more than its share of {share}: cut so that the producer can go on (frames it still holds may be overwritten)"
                ),
            );
            return;
        }
        let Some(oldest) = inner
            .clients
            .iter()
            .flat_map(|c| {
                c.ch.outstanding()
                    .filter(|e| e.ring_gen == gen)
                    .map(|e| e.seq)
            })
            .min()
        else {
            return;
        };
        let holders: Vec<u32> = inner
            .clients
            .iter()
            .filter(|c| c.ch.outstanding().any(|e| e.seq == oldest))
            .map(|c| c.id)
            .collect();
        for id in holders {
            self.drop_client(
                inner,
                id,
                format!(
                    "{open} consumers share a ring of {slots} slots, all held, and this one held the oldest frame: cut so that the producer can go on (frames it still holds may be overwritten)"
                ),
            );
        }
    }

    /// The pool got `buffer` back. Returns it if no client holds its slot, otherwise parks it
    /// until the last one released it.
    pub fn buffer_returned(&self, ring_gen: u32, slot: u32, buffer: P) -> Option<P> {
        let mut inner = lock(&self.inner);
        let shutdown = inner.shutdown;
        let Some(r) = inner
            .rings
            .iter_mut()
            .find(|r| r.ring.ring_gen() == ring_gen)
        else {
            return Some(buffer);
        };
        let s = &mut r.slots[slot as usize];
        if s.client_refs == 0 || shutdown {
            Some(buffer)
        } else {
            s.parked = Some(buffer);
            None
        }
    }

    fn unref_slot(inner: &mut Inner<P>, e: Entry, back: &mut Vec<(Requeue<P>, P)>) {
        if let Some(r) = inner
            .rings
            .iter_mut()
            .find(|r| r.ring.ring_gen() == e.ring_gen)
        {
            if let Some(s) = r.slots.get_mut(e.slot as usize) {
                s.client_refs = s.client_refs.saturating_sub(1);
                if s.client_refs == 0 {
                    if let Some(b) = s.parked.take() {
                        back.push((r.requeue.clone(), b));
                    }
                }
            }
        }
    }

    fn give_back(&self, back: Vec<(Requeue<P>, P)>) {
        for (requeue, b) in back {
            requeue(b);
        }
    }

    /// Forgets rings that are no longer current and that nobody references.
    fn retire_idle_rings(inner: &mut Inner<P>) {
        let n = inner.rings.len();
        let mut i = 0;
        inner.rings.retain(|r| {
            i += 1;
            i == n
                || r.slots
                    .iter()
                    .any(|s| s.client_refs > 0 || s.parked.is_some())
        });
    }

    fn drop_client(&self, inner: &mut Inner<P>, id: u32, reason: String) {
        let Some(i) = inner.clients.iter().position(|c| c.id == id) else {
            return;
        };
        let c = inner.clients.swap_remove(i);
        // Said in shared memory first, where the client reads it without a system call,
        // whether it still reads its socket or not (and whatever the socket can still carry).
        c.ch.mark_revoked();
        let mut back = Vec::new();
        let outstanding: Vec<Entry> = c.ch.outstanding().copied().collect();
        for e in outstanding {
            Self::unref_slot(inner, e, &mut back);
        }
        let _ = c.conn.send(
            &Message::Error {
                message: reason.clone(),
            },
            &[],
        );
        // Its descriptors close in the connection thread, which may be polling them now.
        inner.closing.push(c);
        shm::notify(&self.wake);
        // Parked buffers go back to their pools right away; safe here because requeueing
        // never calls back into the server.
        self.give_back(back);
        Self::retire_idle_rings(inner);
        inner.events.push(Event::Disconnected { id, reason });
    }

    /// Drops `x` on the reaper thread (see the field).
    fn reap(&self, x: Box<dyn Send>) {
        let _ = self
            .reaper
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(x);
    }

    fn emit(&self, events: Vec<Event>) {
        for e in events {
            (self.on_event)(e);
        }
    }

    /// One round of the connection thread. Returns false when it should stop.
    fn serve_once(&self) -> bool {
        // Collect what to poll under the lock, poll without it.
        let (raw, deadline, has_clients, ahead_at) = {
            let mut inner = lock(&self.inner);
            if inner.shutdown {
                return false;
            }
            // A wake-up ahead of a frame first: the poll below ends when the next one is due.
            let ahead_at = match Self::ahead_step(&mut inner, false) {
                Ok(wake) => {
                    drop(inner);
                    for d in wake {
                        d.ring();
                    }
                    return true;
                }
                Err(at) => at,
            };
            // No poll is under way: the descriptors of removed clients can close now (on
            // the reaper thread).
            let closing = std::mem::take(&mut inner.closing);
            if !closing.is_empty() {
                self.reap(Box::new(closing));
            }
            let mut raw = vec![(self.wake.as_raw_fd(), Kind::Wake)];
            // The listener is polled while a connection may be accepted, otherwise the poll
            // ends when one may.
            let admit_at = if inner.admission.available(Instant::now()) > 0 {
                raw.push((self.listener.as_raw_fd(), Kind::Listen));
                None
            } else {
                Some(inner.admission.next_at())
            };
            for c in &inner.clients {
                raw.push((c.conn.raw_fd(), Kind::Socket(c.id)));
                raw.push((c.release.as_raw_fd(), Kind::Release(c.id)));
            }
            for (i, p) in inner.pending.iter().enumerate() {
                raw.push((p.conn.raw_fd(), Kind::Pending(i)));
            }
            (
                raw,
                inner
                    .pending
                    .iter()
                    .map(|p| p.since + HANDSHAKE_TIMEOUT)
                    .chain(admit_at)
                    .min(),
                !inner.clients.is_empty(),
                ahead_at,
            )
        };
        let timeout = match deadline {
            Some(d) => Some(
                d.saturating_duration_since(Instant::now())
                    .min(Duration::from_secs(60))
                    + Duration::from_millis(1),
            ),
            None if has_clients => Some(Duration::from_millis(100)),
            None => None,
        };
        let ahead =
            ahead_at.map(|at| Duration::from_nanos(at.saturating_sub(crate::monotonic_ns())));
        let timeout = match (timeout, ahead) {
            (Some(t), Some(a)) => Some(t.min(a)),
            (t, a) => t.or(a),
        };
        // SAFETY: every fd is owned by `self` or by an entry of `inner`. Clients removed by
        // any thread wait in `inner.closing` until this thread clears it before its next
        // poll, and only this thread removes pending connections: they stay open during the
        // poll.
        let mut pfds: Vec<PollFd> = raw
            .iter()
            .map(|(fd, _)| PollFd::new(unsafe { BorrowedFd::borrow_raw(*fd) }, PollFlags::POLLIN))
            .collect();
        // ppoll: its timeout is to the ns (a wake-up ahead of a frame is timed to the µs).
        match nix::poll::ppoll(&mut pfds, timeout.map(TimeSpec::from_duration), None) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return false,
        }
        let ready: Vec<Kind> = raw
            .iter()
            .zip(pfds.iter())
            .filter(|(_, p)| p.revents().is_some_and(|r| !r.is_empty()))
            .map(|((_, k), _)| *k)
            .collect();
        drop(pfds);
        // A wake-up ahead of a frame that came due: rung first, before this round's work.
        if ahead_at.is_some_and(|at| crate::monotonic_ns() >= at) {
            let wake = Self::ahead_step(&mut lock(&self.inner), ready.is_empty());
            for d in wake.unwrap_or_default() {
                d.ring();
            }
        }

        let mut inner = lock(&self.inner);
        if inner.shutdown {
            return false;
        }
        let mut back = Vec::new();
        let mut done_pending = Vec::new();
        let mut listen = false;
        // Frames closed clients had not taken, back to the producer.
        let mut released = Vec::new();
        for k in ready {
            match k {
                Kind::Wake => shm::drain(&self.wake),
                // After the handshakes below: accepting may drop pending connections.
                Kind::Listen => listen = true,
                Kind::Pending(i) => done_pending.push(i),
                Kind::Socket(id) => {
                    // Clients send nothing after Hello but Close, once: readable means that,
                    // gone, or misbehaving.
                    let inner = &mut *inner;
                    if let Some(c) = inner.clients.iter_mut().find(|c| c.id == id) {
                        let why = loop {
                            match c.conn.try_recv() {
                                Ok(None) => break None,
                                Ok(Some((Message::Close, _))) if !c.closed => {
                                    match Self::close_client(c, &mut inner.stats) {
                                        Ok(list) => released.extend(list),
                                        Err(e) => break Some(e.to_string()),
                                    }
                                    inner.events.push(Event::Closed { id, held: c.refs() });
                                }
                                Ok(Some((m, _))) => {
                                    break Some(format!("unexpected {m:?} from the client"))
                                }
                                Err(Error::Disconnected) => {
                                    break Some("the client went away".to_string())
                                }
                                Err(e) => break Some(e.to_string()),
                            }
                        };
                        if let Some(why) = why {
                            self.drop_client(inner, id, why);
                        }
                    }
                }
                Kind::Release(id) => {
                    // Releases of every client are taken below.
                    if let Some(c) = inner.clients.iter().find(|c| c.id == id) {
                        c.release.drain();
                    }
                }
            }
        }
        for e in released {
            Self::unref_slot(&mut inner, e, &mut back);
        }
        // Every round (at least every 100 ms with clients), whether a client woke us or not:
        // clients write their eventfd only while someone waits for a slot.
        self.reclaim_locked(&mut inner, &mut back);
        // Closed clients that gave every frame back are done (one that keeps its socket open
        // holding nothing takes no client place).
        let done: Vec<u32> = inner
            .clients
            .iter()
            .filter(|c| c.closed && c.refs() == 0)
            .map(|c| c.id)
            .collect();
        for id in done {
            self.drop_client(&mut inner, id, "it closed and gave every frame back".into());
        }
        // Handshakes: from the highest index down so removals keep the others valid.
        done_pending.sort_unstable();
        for i in done_pending.into_iter().rev() {
            self.advance_handshake(&mut inner, i);
        }
        let now = Instant::now();
        Self::note_progress(&mut inner, now);
        if listen {
            self.accept_all(&mut inner);
        }
        let (alive, late): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut inner.pending)
            .into_iter()
            .partition(|p| now < p.since + HANDSHAKE_TIMEOUT);
        inner.pending = alive;
        if !late.is_empty() {
            self.reap(Box::new(late));
        }
        self.check_starvation(&mut inner, now);
        Self::retire_idle_rings(&mut inner);
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        self.give_back(back);
        // A publish() waiting for a lossless client re-checks after releases and disconnects.
        self.released.notify_all();
        self.emit(events);
        true
    }

    /// A client sent Close: it is served no more frames and never waited for; what was
    /// delivered to it and not taken goes back (returned here), what it holds stays its own.
    fn close_client(c: &mut Client, stats: &mut Stats) -> Result<Vec<Entry>> {
        c.closed = true;
        let mut back = Vec::new();
        // Each round revokes one, or finds the client took it meanwhile.
        while c.ch.pending_len() > 0 {
            if let Some(e) = c.ch.revoke_oldest()? {
                back.push(e);
                stats.frames_dropped += 1;
            }
        }
        Ok(back)
    }

    /// Clients that keep every slot of the ring (taking frames and never giving them back,
    /// or several frozen at once) would stop the producer for good: past
    /// [`STARVATION_TIMEOUT`] one is cut, which gives its slots back: a closed client holding
    /// frames first (it takes no more frames, so it has no share), else the one holding most
    /// if it holds more than its fair share (the ring's slots over the open clients, at least
    /// one). A client within its share is never cut: slots held by clients that all keep
    /// within theirs come back as they release them.
    fn check_starvation(&self, inner: &mut Inner<P>, now: Instant) {
        if inner.release_waiters > 0 {
            // The producer waits for a slot now.
            self.relieve_overcrowding(inner);
        }
        let Some(slots) = inner
            .rings
            .last()
            .filter(|r| r.slots.iter().all(|s| s.client_refs > 0))
            .map(|r| r.slots.len())
        else {
            inner.starved_since = None;
            return;
        };
        let since = *inner.starved_since.get_or_insert(now);
        if now.duration_since(since) < STARVATION_TIMEOUT {
            return;
        }
        inner.starved_since = None;
        // Closed clients take no more frames: they have no share, and go first.
        let open = inner.clients.iter().filter(|c| !c.closed).count();
        let share = (slots / open.max(1)).max(1);
        // What a client took and keeps counts first; past the timeout, frames handed over and
        // never taken count too (a client that keeps up would have taken them by now).
        let over = |count: fn(&Client) -> usize| {
            inner
                .clients
                .iter()
                .map(|c| (c.id, count(c), if c.closed { 0 } else { share }))
                .filter(|&(_, r, share)| r > share)
                .max_by_key(|&(_, r, share)| (share == 0, r))
        };
        let Some((id, refs, share)) = over(Client::share_count).or_else(|| over(Client::refs))
        else {
            return;
        };
        self.drop_client(
            inner,
            id,
            format!(
                "clients held every slot of the ring for {STARVATION_TIMEOUT:?}; this one held {refs}, more than its share of {share}: cut so that the producer can go on (frames it still holds may be overwritten)"
            ),
        );
    }

    /// Accepts what [`ACCEPT_RATE`] allows now, [`ACCEPT_BATCH`] at most.
    fn accept_all(&self, inner: &mut Inner<P>) {
        let allowed = inner.admission.available(Instant::now()).min(ACCEPT_BATCH);
        for _ in 0..allowed {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e)
                    if matches!(
                        errno(&e),
                        nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE
                    ) =>
                {
                    // Out of descriptors: make room for one, tell that client why, close it
                    // again, so that the listener does not stay readable forever.
                    let mut reserve = self.reserve.lock().unwrap_or_else(|e| e.into_inner());
                    *reserve = None;
                    if let Ok((s, _)) = self.listener.accept() {
                        let _ = s.set_nonblocking(true);
                        let conn = Conn::new(s);
                        let _ = conn.send(
                            &Message::Error {
                                message: "the producer is out of file descriptors".into(),
                            },
                            &[],
                        );
                        self.reap(Box::new(conn));
                    }
                    *reserve = std::fs::File::open("/dev/null").ok();
                    inner.events.push(Event::Disconnected {
                        id: 0,
                        reason: "refused a connection: out of file descriptors (raise the limit, ulimit -n, or lower max-clients)".into(),
                    });
                    return;
                }
                Err(_) => return,
            };
            inner.admission.take();
            let (pid, uid) = match getsockopt(&stream, PeerCredentials) {
                Ok(c) => (c.pid(), c.uid()),
                Err(_) => (-1, u32::MAX),
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let conn = Conn::new(stream).refusing_fds();
            // At max-clients, a connection is let in only if a stalled client could make room
            // for it, which it does once it said Hello (a silent socket pushes nobody out).
            let why = if inner.clients.len() >= self.config.max_clients
                && self.stalled_longest(inner).is_none()
            {
                Some(self.max_clients_busy())
            } else {
                if inner.pending.len() >= MAX_PENDING {
                    self.make_pending_room(inner);
                }
                None
            };
            if let Some(why) = why {
                let log = format!("refused pid {pid} (uid {uid}): {why}");
                self.turn_away(inner, conn, &why, log);
                continue;
            }
            inner.pending.push(Pending {
                conn,
                since: Instant::now(),
                pid,
                uid,
            });
        }
    }

    /// Tells a connection that never became a client why it is turned away (`why`, its
    /// Error message), logs `log`, and closes it on the reaper thread.
    fn turn_away(&self, inner: &mut Inner<P>, conn: Conn, why: &str, log: String) {
        let _ = conn.send(
            &Message::Error {
                message: why.to_string(),
            },
            &[],
        );
        inner
            .events
            .push(Event::Disconnected { id: 0, reason: log });
        self.reap(Box::new(conn));
    }

    /// What a consumer refused at max-clients is told: busy, try again.
    fn max_clients_busy(&self) -> String {
        format!(
            "{BUSY_PREFIX}the producer already serves its maximum of {} consumers (max-clients), none of them stalled",
            self.config.max_clients
        )
    }

    /// Pending connections are all taken: lets in those whose Hello arrived, then drops the
    /// oldest silent one (told to try again).
    fn make_pending_room(&self, inner: &mut Inner<P>) {
        let readable: Vec<usize> = {
            // SAFETY: the pending connections own their descriptors for this call.
            let mut pfds: Vec<PollFd> = inner
                .pending
                .iter()
                .map(|p| {
                    PollFd::new(
                        unsafe { BorrowedFd::borrow_raw(p.conn.raw_fd()) },
                        PollFlags::POLLIN,
                    )
                })
                .collect();
            let _ = poll(&mut pfds, PollTimeout::ZERO);
            pfds.iter()
                .enumerate()
                .filter(|(_, p)| p.revents().is_some_and(|r| !r.is_empty()))
                .map(|(i, _)| i)
                .collect()
        };
        for i in readable.into_iter().rev() {
            self.advance_handshake(inner, i);
        }
        if inner.pending.len() < MAX_PENDING {
            return;
        }
        let Some(oldest) = (0..inner.pending.len()).min_by_key(|&i| inner.pending[i].since) else {
            return;
        };
        let p = inner.pending.swap_remove(oldest);
        let why = format!(
            "{BUSY_PREFIX}{MAX_PENDING} connections are in their handshake and this one said nothing for {:?}; try again",
            p.since.elapsed()
        );
        let log = format!(
            "dropped the silent connection of pid {} (uid {}): {why}",
            p.pid, p.uid
        );
        self.turn_away(inner, p.conn, &why, log);
    }

    /// At max-clients: cuts the client stalled longest (frames waiting, none taken for at
    /// least [`STALLED_EVICT`]) to make room. False if none is.
    fn evict_stalled(&self, inner: &mut Inner<P>) -> bool {
        let now = Instant::now();
        let Some((id, since)) = self.stalled_longest(inner) else {
            return false;
        };
        self.drop_client(
            inner,
            id,
            format!(
                "the producer serves its maximum of {} consumers (max-clients) and a new one connected: this one took no frame for {:?} while frames waited, so it made room",
                self.config.max_clients,
                now.saturating_duration_since(since)
            ),
        );
        true
    }

    /// The client stalled longest, if for [`STALLED_EVICT`] at least, and since when.
    fn stalled_longest(&self, inner: &Inner<P>) -> Option<(u32, Instant)> {
        let now = Instant::now();
        inner
            .clients
            .iter()
            .filter_map(|c| c.stalled_since.map(|t| (c.id, t)))
            .filter(|&(_, t)| now.saturating_duration_since(t) >= STALLED_EVICT)
            .min_by_key(|&(_, t)| t)
    }

    /// Notes whether each client keeps taking the frames delivered to it.
    fn note_progress(inner: &mut Inner<P>, now: Instant) {
        for c in inner.clients.iter_mut() {
            let taken = c.ch.taken();
            if taken != c.taken_seen || c.ch.pending_len() == 0 || c.closed {
                c.taken_seen = taken;
                c.stalled_since = None;
            } else if c.stalled_since.is_none() {
                c.stalled_since = Some(now);
            }
        }
    }

    fn advance_handshake(&self, inner: &mut Inner<P>, i: usize) {
        let hello = match inner.pending[i].conn.try_recv() {
            Ok(None) => return,
            Ok(Some((
                Message::Hello {
                    flags,
                    pid: _,
                    name,
                },
                _,
            ))) if inner.pending[i].conn.stray_fds() == 0
                && inner.pending[i].conn.buffered() == 0 =>
            {
                Ok((flags, name))
            }
            Ok(Some((Message::Hello { .. }, _))) if inner.pending[i].conn.stray_fds() > 0 => {
                Err("the client sent file descriptors; clients never send any".to_string())
            }
            Ok(Some((Message::Hello { .. }, _))) => {
                Err("the client sent more than Hello before its Welcome".to_string())
            }
            Ok(Some((Message::Query { .. }, _)))
                if inner.pending[i].conn.stray_fds() == 0
                    && inner.pending[i].conn.buffered() == 0 =>
            {
                let p = inner.pending.swap_remove(i);
                self.answer_query(inner, p.conn);
                return;
            }
            Ok(Some((Message::Query { .. }, _))) => {
                Err("the tool sent more than Query, or descriptors".to_string())
            }
            Ok(Some((m, _))) => Err(format!("expected Hello, got {m:?}")),
            Err(e) => Err(e.to_string()),
        };
        let p = inner.pending.swap_remove(i);
        let (flags, name) = match hello {
            Ok(h) => h,
            Err(why) => {
                self.turn_away(inner, p.conn, &why, format!("handshake failed: {why}"));
                return;
            }
        };
        if inner.clients.len() >= self.config.max_clients && !self.evict_stalled(inner) {
            let why = self.max_clients_busy();
            let log = format!("refused pid {} (uid {}): {why}", p.pid, p.uid);
            self.turn_away(inner, p.conn, &why, log);
            return;
        }
        let device_memory = flags & FLAG_DEVICE_MEMORY != 0;
        if let Some(why) = Self::ring_refusal(inner, device_memory) {
            let log = format!("refused pid {} (uid {}): {why}", p.pid, p.uid);
            self.turn_away(inner, p.conn, &why, log);
            return;
        }
        let id = inner.next_client_id;
        let writable = flags & FLAG_WRITABLE_RING != 0 && self.config.allow_writable;
        if writable {
            inner.events.push(Event::Info(format!(
                "client {id} (pid {}) gets a writable ring mapping: its GPU cannot register read-only memory (allow-writable-ring=true)",
                p.pid
            )));
        } else if flags & FLAG_WRITABLE_RING != 0 {
            inner.events.push(Event::Info(format!(
                "client {id} (pid {}) asked for a writable ring (its GPU cannot register read-only memory) and gets the read-only one: allow-writable-ring is false",
                p.pid
            )));
        }
        let client = (|| -> Result<Client> {
            let ch = ClientChannel::create(CLIENT_QUEUE_CAPACITY)?;
            // Each side gets its own end of each doorbell: neither blocks on the other's
            // descriptor flags (see shm::Doorbell).
            let (ready, ready_theirs) = shm::Doorbell::pair()?;
            let (release, release_theirs) = shm::Doorbell::pair()?;
            p.conn.send(
                &Message::Welcome {
                    client_id: id,
                    queue_capacity: ch.capacity(),
                },
                &[ch.fd(), ready_theirs.as_fd(), release_theirs.as_fd()],
            )?;
            let ready = Arc::new(ready);
            let c = Client {
                id,
                pid: p.pid,
                uid: p.uid,
                name: crate::wire::cut_str(&name, REPORT_MAX_NAME),
                since: Instant::now(),
                conn: p.conn,
                ch,
                ready,
                release,
                mode: if flags & FLAG_LOSSLESS != 0 {
                    Delivery::Lossless
                } else if flags & FLAG_AUTO != 0 {
                    Delivery::Auto
                } else {
                    Delivery::Leaky
                },
                // Set from the stream at the first frame.
                lossless: flags & FLAG_LOSSLESS != 0,
                sent: 0,
                lagging: false,
                times_lagged: 0,
                taken_at_lag: 0,
                writable,
                device_memory,
                closed: false,
                hold: HoldCredit::new(),
                stalled_since: None,
                taken_seen: 0,
            };
            Self::send_ring_and_caps(inner, &c)?;
            if inner.eos {
                c.conn.send(&Message::Eos, &[])?;
            }
            Ok(c)
        })();
        match client {
            Ok(c) => {
                inner.next_client_id += 1;
                c.ch.set_producer_waits(inner.release_waiters > 0);
                inner.clients.push(c);
                inner.events.push(Event::Connected {
                    id,
                    pid: p.pid,
                    uid: p.uid,
                    name,
                });
                self.changed.notify_all();
            }
            Err(e) => inner.events.push(Event::Disconnected {
                id,
                reason: format!("handshake failed: {e}"),
            }),
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Wake,
    Listen,
    Socket(u32),
    Release(u32),
    Pending(usize),
}

/// What owns a slot of a [`FramePublisher`] while clients read it.
pub struct SlotToken(u32);

type FreeSlots = Arc<(Mutex<Vec<u32>>, Condvar)>;

/// The ring frames go into now, and its free slots (each ring has its own: slots of an older
/// ring come back to that ring's list, which is then simply dropped).
#[derive(Clone)]
struct Current {
    ring: Arc<ProducerRing>,
    layout: crate::format::FrameLayout,
    fps: (u32, u32),
    free: FreeSlots,
}

/// A producer for apps without GStreamer: serves a socket path, hands out slots to fill in
/// place ([`FramePublisher::acquire`]) and publishes them with the same per-client policy as
/// gpushmsink. gpushmsrc and [`crate::client::Subscriber`] receive its frames.
///
/// ```
/// use gpushm::format::{FrameLayout, VideoFormat};
/// use gpushm::publisher::{Config, FramePublisher};
/// # let dir = std::env::temp_dir().join(format!("gpushm-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
/// let camera = FramePublisher::new(&dir.join("cam"), layout, (30, 1), 8, Config::default()).unwrap();
/// let mut slot = camera.acquire(std::time::Duration::from_secs(1)).unwrap();
/// slot.bytes_mut().fill(128);
/// camera.publish(slot, None).unwrap();
/// # drop(camera); std::fs::remove_dir_all(&dir).ok();
/// ```
pub struct FramePublisher {
    engine: Arc<Publisher<SlotToken>>,
    current: Mutex<Current>,
    /// Where rings go: the GPU of a device ring (see [`Self::new_on_device`]).
    placement: Placement,
    slots: u32,
    start_ns: u64,
    frames: std::sync::atomic::AtomicU64,
    /// The low-latency mode of the wait for a lossless consumer at its budget, ns (see
    /// [`FramePublisher::set_spin`]; 0: off).
    spin_ns: std::sync::atomic::AtomicU64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            perms: 0o600,
            allow_writable: false,
            max_clients: 64,
        }
    }
}

/// Where a [`FramePublisher`]'s rings go: host memory, or the GPU memory of `device`.
#[derive(Clone, Default)]
struct Placement {
    #[cfg(feature = "cuda")]
    device: Option<Arc<crate::cuda::Device>>,
}

/// A slot of a [`FramePublisher`] lent to the app to fill; publish it, or drop it to give it
/// back unpublished.
pub struct SlotLease {
    cur: Current,
    slot: u32,
    published: bool,
}

impl SlotLease {
    /// The slot's bytes: the frame, laid out as [`Self::layout`] says. Empty for a slot in
    /// GPU memory ([`Self::is_on_device`]): fill that through [`Self::device_ptr`] or
    /// [`Self::fill_from_host`].
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.is_on_device() {
            return &mut [];
        }
        // SAFETY: the slot is ours alone until published (no client references it, and
        // clients only ever map the ring read-only); the layout's size fits the slot.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.cur.ring.slot_ptr(self.slot),
                self.cur.layout.size as usize,
            )
        }
    }

    /// Whether the slot is in GPU memory (a [`FramePublisher::new_on_device`] ring).
    pub fn is_on_device(&self) -> bool {
        self.cur.ring.device().is_some()
    }

    /// The slot's device address, writable until published, for a slot in GPU memory.
    #[cfg(feature = "cuda")]
    pub fn device_ptr(&self) -> Option<u64> {
        crate::cuda::vmm::device_ptr_of_slot(&self.cur.ring, self.slot)
    }

    /// Copies a whole frame (`layout().size` bytes) from GPU memory at `src` (a tensor on
    /// the ring's GPU) into a slot in GPU memory.
    #[cfg(feature = "cuda")]
    pub fn fill_from_device(&mut self, src: u64, len: usize) -> Result<()> {
        let size = self.cur.layout.size as usize;
        if len != size {
            return Err(Error::Invalid(format!(
                "a frame of this layout is {size} bytes, not {len}"
            )));
        }
        let mem = crate::cuda::vmm::of(self.cur.ring.attachment()).ok_or_else(|| {
            Error::Invalid("the slot is in host memory: fill it from the host".into())
        })?;
        let dst = self
            .device_ptr()
            .ok_or_else(|| Error::Invalid("the slot is outside its GPU memory".into()))?;
        mem.copy_from_device(dst, src, len)
            .map_err(|e| Error::Invalid(e.to_string()))
    }

    /// Copies a whole frame (`layout().size` bytes) from host memory into the slot, in
    /// host or GPU memory.
    pub fn fill_from_host(&mut self, frame: &[u8]) -> Result<()> {
        let size = self.cur.layout.size as usize;
        if frame.len() != size {
            return Err(Error::Invalid(format!(
                "a frame of this layout is {size} bytes, not {}",
                frame.len()
            )));
        }
        #[cfg(feature = "cuda")]
        if let Some(mem) = crate::cuda::vmm::of(self.cur.ring.attachment()) {
            let dst = self
                .device_ptr()
                .ok_or_else(|| Error::Invalid("the slot is outside its GPU memory".into()))?;
            return mem
                .copy_from_host(dst, frame)
                .map_err(|e| Error::Invalid(e.to_string()));
        }
        self.bytes_mut().copy_from_slice(frame);
        Ok(())
    }

    /// The layout of the frame this slot holds.
    pub fn layout(&self) -> &crate::format::FrameLayout {
        &self.cur.layout
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if !self.published {
            let (free, cond) = &*self.cur.free;
            free.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.slot);
            cond.notify_one();
        }
    }
}

impl FramePublisher {
    /// Serves `path` with a ring of `slots` frames laid out as `layout`, at `fps` (n, d).
    pub fn new(
        path: &Path,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
        config: Config,
    ) -> Result<Self> {
        Self::start(path, layout, fps, slots, config, Placement::default())
    }

    /// Like [`Self::new`], with the frames' pixels in `device`'s memory (a device ring, see
    /// [`crate::cuda::vmm`]): consumers that map GPU memory
    /// ([`crate::client::ConnectOptions::device_memory`]) read them there, on the GPU, and
    /// other consumers are turned away, told why. Fill slots with
    /// [`SlotLease::fill_from_host`] or through [`SlotLease::device_ptr`].
    #[cfg(feature = "cuda")]
    pub fn new_on_device(
        path: &Path,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
        config: Config,
        device: Arc<crate::cuda::Device>,
    ) -> Result<Self> {
        let placement = Placement {
            device: Some(device),
        };
        Self::start(path, layout, fps, slots, config, placement)
    }

    fn start(
        path: &Path,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
        config: Config,
        placement: Placement,
    ) -> Result<Self> {
        let engine: Arc<Publisher<SlotToken>> = Publisher::start(path, config, Box::new(|_| {}))?;
        let current = match Self::ring(&engine, &placement, layout, fps, slots) {
            Ok(c) => c,
            Err(e) => {
                engine.stop();
                return Err(e);
            }
        };
        Ok(Self {
            engine,
            current: Mutex::new(current),
            placement,
            slots,
            start_ns: crate::monotonic_ns(),
            frames: Default::default(),
            spin_ns: Default::default(),
        })
    }

    /// Low-latency mode of [`Self::publish`]'s wait for a lossless consumer that holds its
    /// whole budget: poll that consumer's releases for up to `spin` before sleeping (a
    /// wake-up through the connection thread is two thread hops), at most once a frame and
    /// never past the wait's bound. Pays off for small frames sent flat out. Zero (the
    /// default): off; at most [`crate::client::MAX_SPIN`]. The figures: `stats().0`'s
    /// `spin_caught` and `spin_missed`.
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        crate::client::check_spin(spin)?;
        self.spin_ns
            .store(spin.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn ring(
        engine: &Arc<Publisher<SlotToken>>,
        placement: &Placement,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
    ) -> Result<Current> {
        if fps.0 == 0 || fps.1 == 0 {
            return Err(Error::Invalid(format!(
                "frame rate {}/{} is not a rate",
                fps.0, fps.1
            )));
        }
        let free: FreeSlots = Arc::new((Mutex::new((0..slots).rev().collect()), Condvar::new()));
        let requeue: Requeue<SlotToken> = {
            let free = free.clone();
            Arc::new(move |t: SlotToken| {
                free.0.lock().unwrap_or_else(|e| e.into_inner()).push(t.0);
                free.1.notify_one();
            })
        };
        #[cfg(feature = "cuda")]
        let prepare = |r: &ProducerRing| match &placement.device {
            Some(d) => crate::cuda::vmm::place_ring(r, d)
                .map_err(|e| Error::Invalid(format!("cannot put the ring in GPU memory: {e}"))),
            None => Ok(()),
        };
        #[cfg(not(feature = "cuda"))]
        let prepare = |_: &ProducerRing| Ok(());
        #[cfg(not(feature = "cuda"))]
        let _ = placement;
        let ring = engine.new_ring_with(
            slots,
            layout.size,
            &layout.caps(fps.0, fps.1),
            requeue,
            &prepare,
        )?;
        Ok(Current {
            ring,
            layout,
            fps,
            free,
        })
    }

    /// Changes the frames' format or size: a new ring, announced to every consumer (like a
    /// caps change in GStreamer). Slots lent before are of the old ring: they can no longer be
    /// published ([`Self::publish`] says so and takes the slot back); lend new ones.
    pub fn set_layout(&self, layout: crate::format::FrameLayout, fps: (u32, u32)) -> Result<()> {
        let c = Self::ring(&self.engine, &self.placement, layout, fps, self.slots)?;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = c;
        Ok(())
    }

    pub fn layout(&self) -> crate::format::FrameLayout {
        self.cur().layout
    }

    fn cur(&self) -> Current {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Consumers connected now.
    pub fn num_clients(&self) -> usize {
        self.engine.num_clients()
    }

    /// Wakes the consumers that sleep until a frame comes, ahead of the next one: call it
    /// when a frame is a few µs from [`Self::publish`] (its last step starts), so that their
    /// wake-up runs meanwhile. See [`Publisher::wake_early`] for when it wakes nobody.
    pub fn wake_early(&self) {
        self.engine.wake_early();
    }

    /// The connection thread's id, once it runs (0 before).
    #[cfg(test)]
    pub(crate) fn connection_tid(&self) -> i32 {
        self.engine
            .connection_tid
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Wakes the consumers that sleep until a frame comes `ahead` before each frame is due,
    /// as learnt from the last frames' publish times (`Duration::ZERO`, the default: never).
    /// See [`Publisher::set_wake_ahead`].
    pub fn set_wake_ahead(&self, ahead: Duration) -> Result<()> {
        self.engine.set_wake_ahead(ahead)
    }

    /// Whether frames go into GPU memory ([`Self::new_on_device`]).
    pub fn is_on_device(&self) -> bool {
        self.cur().ring.device().is_some()
    }

    pub fn stats(&self) -> (Stats, Vec<ClientStats>) {
        self.engine.stats()
    }

    /// A free slot to fill, waiting up to `timeout` for one (consumers hold them all).
    pub fn acquire(&self, timeout: Duration) -> Result<SlotLease> {
        let cur = self.cur();
        // A timeout too large to add waits for a century.
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400));
        let mut f = cur.free.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut waiting = None;
        loop {
            if let Some(slot) = f.pop() {
                drop(f);
                return Ok(SlotLease {
                    cur,
                    slot,
                    published: false,
                });
            }
            if waiting.is_none() {
                // Consumers wake the connection thread on releases while we wait; what they
                // released already comes back now (into `free`, hence without its lock).
                drop(f);
                waiting = Some(self.engine.want_releases());
                f = cur.free.0.lock().unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(
                    "every slot is still held by consumers".into(),
                ));
            }
            f = cur
                .free
                .1
                .wait_timeout(f, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Publishes a filled slot to every consumer. `capture_ns` is when the frame was captured
    /// (CLOCK_MONOTONIC, see [`crate::monotonic_ns`]); `None` means now.
    pub fn publish(&self, mut lease: SlotLease, capture_ns: Option<u64>) -> Result<()> {
        let cur = lease.cur.clone();
        let n = self
            .frames
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = capture_ns.unwrap_or_else(crate::monotonic_ns);
        let frame_ns = 1_000_000_000u64 * cur.fps.1 as u64 / cur.fps.0 as u64;
        let mut meta = FrameMeta {
            pts: t.saturating_sub(self.start_ns),
            dts: crate::layout::NONE_U64,
            duration: frame_ns,
            offset: n,
            offset_end: n + 1,
            pts_clock: t,
            dts_clock: crate::layout::NONE_U64,
            latency: 0,
            live: true,
            ..Default::default()
        };
        cur.layout.describe(&mut meta);
        let gen = cur.ring.ring_gen();
        let slot = lease.slot;
        lease.published = true;
        drop(lease);
        let policy = Policy {
            budget: (self.slots as usize / 2).max(1),
            max_wait: Duration::from_nanos(frame_ns.clamp(40_000_000, 200_000_000)),
            spin: Duration::from_nanos(self.spin_ns.load(std::sync::atomic::Ordering::Relaxed)),
        };
        let result = match self.engine.publish_frame(gen, slot, meta, policy, false) {
            Ok(Published::SlotBusy(why)) => Err(Error::Invalid(format!(
                "{why}: a frame lent before set_layout() cannot be published; lend a new one"
            ))),
            r => r.map(|_| ()),
        };
        // The slot comes back when the last consumer releases it (at once if none holds it).
        if let Some(t) = self.engine.buffer_returned(gen, slot, SlotToken(slot)) {
            let (free, cond) = &*cur.free;
            free.lock().unwrap_or_else(|e| e.into_inner()).push(t.0);
            cond.notify_one();
        }
        result
    }

    /// Tells every consumer the stream ended.
    pub fn send_eos(&self) {
        self.engine.send_eos();
    }
}

impl Drop for FramePublisher {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{FrameLayout, VideoFormat};

    fn thread_cpu() -> Duration {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap();
        Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32)
    }

    /// When the connection thread rings ahead of a frame: `lead` before it is due, the frame
    /// after if the coming one was rung for, never for a frame half an interval late (a
    /// pause) or a stream too fast, and not before its cadence is known.
    #[test]
    fn plans_wake_ups_ahead_of_frames_due_and_none_in_a_pause() {
        const MS: u64 = 1_000_000;
        let (lead, iv, last) = (MS / 10, 33 * MS, 1_000 * MS);
        let plan = |rung, now| plan_ahead(lead, Some(iv), last, rung, now);
        // The coming frame is due at last + iv.
        assert_eq!(plan(false, last + MS), Ahead::At(last + iv - lead));
        // Its time passed, the frame has not come: ring now, until it is half an interval late.
        assert_eq!(plan(false, last + iv), Ahead::At(last + iv - lead));
        assert_eq!(plan(false, last + iv + iv / 2), Ahead::At(last + iv - lead));
        assert_eq!(plan(false, last + iv + iv / 2 + 1), Ahead::Park);
        // Rung for it: the one after, once the coming one is published (a pause until then).
        assert_eq!(plan(true, last + iv), Ahead::At(last + 2 * iv - lead));
        assert_eq!(plan(true, last + 2 * iv - lead), Ahead::Park);
        // Cadence not known yet: wait for the next frame.
        assert_eq!(plan_ahead(lead, None, last, false, last), Ahead::Park);
        // Faster than one frame every WAKE_AHEAD_MIN_INTERVAL: never.
        let fast = WAKE_AHEAD_MIN_INTERVAL.as_nanos() as u64 - 1;
        assert_eq!(plan_ahead(lead, Some(fast), last, false, last), Ahead::Off);
        // A lead longer than the interval rings at once (it is due now), never in the past.
        assert_eq!(
            plan_ahead(2 * iv, Some(iv), last, false, last + 1),
            Ahead::At(last.saturating_sub(iv))
        );
    }

    /// A hostile producer that says it woke a subscriber ahead of a frame, from another CPU,
    /// and rings its doorbell without end, never publishing: the subscriber polls once (it
    /// polls once per frame it takes), spends little CPU, and times out as asked.
    #[test]
    fn a_producer_ringing_early_without_end_costs_a_subscriber_one_poll() {
        let _serial = crate::timing_test();
        let dir = std::env::temp_dir().join(format!("gpushm-pub-ring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
        let cam =
            FramePublisher::new(&dir.join("cam"), layout, (30, 1), 4, Config::default()).unwrap();
        let path = dir.join("cam");
        let consumer = std::thread::spawn(move || {
            let mut sub = crate::client::Subscriber::connect(&path, Default::default()).unwrap();
            let cpu0 = thread_cpu();
            let start = Instant::now();
            let r = sub.next_frame(Some(Duration::from_secs(1)));
            (
                r.map(|f| f.is_some()),
                start.elapsed(),
                thread_cpu() - cpu0,
                sub.early_polls(),
            )
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while cam.num_clients() == 0 {
            assert!(Instant::now() < deadline, "no client");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut rings = 0u64;
        while !consumer.is_finished() {
            {
                let inner = lock(&cam.engine.inner);
                for c in &inner.clients {
                    // "From another CPU" (no CPU has this number): the subscriber may poll.
                    c.ch.set_early_wake_cpu(u32::MAX);
                    c.ready.ring();
                }
            }
            rings += 1;
            std::thread::sleep(Duration::from_micros(100));
        }
        let (r, took, cpu, polls) = consumer.join().unwrap();
        eprintln!("{rings} rings: {took:?}, {cpu:?} of CPU, early polls {polls:?}");
        assert!(
            matches!(r, Err(crate::Error::Timeout(_))),
            "the subscriber's wait ended otherwise: {r:?}"
        );
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert!(rings > 100, "the producer rang only {rings} times");
        assert_eq!(polls.caught + polls.missed, 1, "one poll: {polls:?}");
        assert!(
            cpu < Duration::from_millis(500),
            "{cpu:?} of CPU for 1 s of rings"
        );
        drop(cam);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A frame lent before set_layout() is of the old ring: publishing it says why (it would
    /// carry the new caps over the old layout), and frames of the new layout go out.
    #[test]
    fn a_frame_lent_before_a_layout_change_is_refused_with_a_reason() {
        let dir = std::env::temp_dir().join(format!("gpushm-pub-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
        let cam =
            FramePublisher::new(&dir.join("cam"), layout, (30, 1), 4, Config::default()).unwrap();
        let old = cam.acquire(Duration::from_secs(1)).unwrap();
        let smaller = FrameLayout::new(VideoFormat::Gray8, 32, 24).unwrap();
        cam.set_layout(smaller, (30, 1)).unwrap();
        let err = cam.publish(old, None).unwrap_err().to_string();
        assert!(
            err.contains("not the current ring") && err.contains("set_layout"),
            "{err}"
        );
        let new = cam.acquire(Duration::from_secs(1)).unwrap();
        cam.publish(new, None).unwrap();
        drop(cam);
        std::fs::remove_dir_all(&dir).ok();
    }
}
