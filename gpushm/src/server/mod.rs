// SPDX-License-Identifier: MPL-2.0
//! The producer's engine, [`Server`]: the listening socket, the clients, the rings and the
//! policy that decides which client gets which frame. gpushmsink, the app-facing
//! [`crate::publisher::Publisher`], Python's and C's publishers all drive one.
//!
//! `P` is what owns a slot on the producer's side while clients still read it (a GstBuffer of
//! the sink's pool, or a plain token): it is parked until the last client released the slot,
//! then handed to the ring's [`Requeue`].
//!
//! Each part keeps its own state, and the engine (this file) holds them under one lock and
//! does what crosses them (a client cut gives its slots back, a release may free a ring):
//!
//! - `slots`: the rings and who references each slot, the owners parked meanwhile.
//! - `client`: one connected consumer as the producer sees it, and the list of them.
//! - `admission`: how many connections may be accepted now; handshakes under way.
//! - `handshake`: a connection's Hello, Query or refusal, and making room at the limits.
//! - `deliver`: the way of a frame: who is waited for, who gets it, who loses frames.
//! - `fairness`: who is cut when clients hold the ring (pure decisions, table-tested).
//! - `wake`: waking sleeping consumers ahead of a frame (wake-early, wake-ahead).
//! - `stats`: the stream's and each client's figures, the Report for tools.
//! - `socket`: binding the socket file safely, removing it at the end.
//! - `conn_thread`: the thread that polls every client's descriptors, accepts, reaps.

mod admission;
mod client;
mod conn_thread;
mod deliver;
mod fairness;
mod handshake;
mod slots;
mod socket;
mod stats;
mod wake;

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::eventfd::EventFd;

use self::admission::Admission;
use self::client::{Client, Clients};
use self::fairness::{Holding, Pressure, Starvation};
use self::slots::{give_back, Back, Slots};
use self::socket::Socket;
use self::stats::Book;
use self::wake::{AheadStep, WakeUps};
use crate::policy::check_wake_ahead;
use crate::ring::frame::Entry;
use crate::ring::producer_end::ProducerRing;
use crate::ring::shm;
use crate::wire::{Message, RING_DEVICE, RING_WRITABLE};
use crate::{Error, Result};

pub use self::slots::Requeue;
pub use self::stats::{ClientStats, Stats};

/// What [`Server::publish_frame`] did with a frame.
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

/// What the engine tells its owner (gpushmsink logs these).
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
    /// Client `id` sent an upstream event (within its rate): the producer's pipeline gets it.
    Upstream {
        id: u32,
        payload: String,
    },
    /// A client closed: it takes no more frames and keeps those it holds (`held`) until it
    /// releases them; then it is disconnected.
    Closed {
        id: u32,
        held: usize,
    },
}

/// How a server is set up, fixed at start. By default: socket permissions 0600, no writable
/// rings, 64 clients.
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

impl Default for Config {
    fn default() -> Self {
        Self {
            perms: 0o600,
            allow_writable: false,
            max_clients: 64,
        }
    }
}

/// The stream as every client hears of it.
struct Stream {
    /// The caps and their generation (frames name the generation they were published with).
    caps: Option<(u32, String)>,
    eos: bool,
    /// The seq of the next frame published.
    next_seq: u64,
    /// The metas of the next frame published, sent just before it (see
    /// [`Server::set_frame_metas`]).
    next_metas: Option<String>,
    /// The seq of the last Event sent (0: none yet); each frame carries the one before it.
    events_seq: u32,
    /// The latest event of each sticky key (seq, payload), sent to a client as it connects:
    /// what a consumer that joins late needs to know of the stream (its tags).
    sticky: Vec<(String, u32, String)>,
    /// How late (ns, see [`crate::time::lateness`]) a frame may be published while the first
    /// consumers of a wait-for-connection producer get its backlog whole: fixed at the first
    /// frame after the wait, and again at the first frame after every first consumer has
    /// started, see `deliver::backlog_goes_on`.
    backlog_limit: Option<i128>,
    /// When the stream's first frame was published: the first consumers' setting up is
    /// excused for [`crate::policy::BACKLOG_STARTUP_GRACE`] after it.
    first_frame_at: Option<std::time::Instant>,
    /// Whether a first consumer was still setting up at the last frame.
    setting_up: bool,
}

struct Inner<P> {
    slots: Slots<P>,
    clients: Clients,
    admission: Admission,
    stream: Stream,
    book: Book,
    wake: WakeUps,
    starvation: Starvation,
    shutdown: bool,
    unlocked: bool,
    /// For the owner's `on_event`, called once the lock is released.
    events: Vec<Event>,
    /// What [`Server::reclaim_locked`] reads from release queues, kept between frames so that
    /// the way of a frame allocates nothing.
    released: Vec<Entry>,
}

impl<P> Inner<P> {
    /// Whether a stream runs (not at EOS) with a client taking frames.
    fn active(&self) -> bool {
        !self.stream.eos && self.clients.open_count() > 0
    }

    /// What [`fairness`] reads of each client.
    fn holdings(&self) -> Vec<Holding> {
        let gen = self.slots.current().map(|r| r.ring_gen());
        self.clients
            .iter()
            .map(|c| Holding {
                id: c.id,
                closed: c.closed,
                kept: c.share_count(),
                refs: c.refs(),
                oldest: c
                    .ch
                    .outstanding()
                    .filter(|e| Some(e.ring_gen) == gen)
                    .map(|e| e.seq)
                    .min(),
            })
            .collect()
    }
}

pub struct Server<P: Send + 'static> {
    inner: Mutex<Inner<P>>,
    config: Config,
    /// Closed to make room for one accept() when the process runs out of descriptors, so
    /// that the refused client hears why instead of the listener spinning.
    reserve: Mutex<Option<std::fs::File>>,
    /// Signalled when a client connects, or on unlock/shutdown (wait-for-connection).
    changed: Condvar,
    /// Signalled when slots come back (releases, disconnects) or on unlock/shutdown.
    released: Condvar,
    /// Wakes the connection thread (a client removed, a plan to make, shutdown).
    wake: EventFd,
    socket: Socket,
    on_event: Box<dyn Fn(Event) + Send + Sync>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Whatever holds a client's descriptors is dropped on this thread: closing a descriptor
    /// a hostile client sent can block (a socket lingering, a file on its FUSE mount), and
    /// neither the connection thread nor the producer may wait for that.
    reaper: Mutex<std::sync::mpsc::Sender<Box<dyn Send>>>,
    /// The connection thread's id (0 until it runs), for tests that watch it.
    connection_tid: AtomicI32,
    /// See [`Server::set_upstream_rate`].
    upstream_rate: std::sync::atomic::AtomicU32,
}

/// See [`Server::want_releases`]: clients stop waking the producer for each release when
/// the last of these is dropped.
pub struct ReleaseWait<'a, P: Send + 'static>(&'a Server<P>);

impl<P: Send + 'static> Drop for ReleaseWait<'_, P> {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        let _ = inner.clients.add_release_waiter(false);
        inner.starvation.producer_waits(false, Instant::now());
    }
}

impl<P: Send + 'static> Server<P> {
    /// Serves `path`: binds it (see `socket.rs`), then starts the connection thread.
    pub fn start(
        path: &Path,
        config: Config,
        on_event: Box<dyn Fn(Event) + Send + Sync>,
    ) -> Result<Arc<Self>> {
        let socket = Socket::bind(path, config.perms)?;
        let (reap_tx, reap_rx) = std::sync::mpsc::channel::<Box<dyn Send>>();
        std::thread::Builder::new()
            .name("gpushm-reaper".into())
            .spawn(move || {
                // Ends when the server (the only sender) is gone.
                while let Ok(x) = reap_rx.recv() {
                    drop(x);
                }
            })
            .map_err(|e| Error::os("spawning the reaper thread", socket::errno(&e)))?;
        let server = Arc::new(Self {
            inner: Mutex::new(Inner {
                slots: Slots::new(),
                clients: Clients::new(),
                admission: Admission::new(),
                stream: Stream {
                    caps: None,
                    eos: false,
                    next_seq: 1,
                    next_metas: None,
                    events_seq: 0,
                    sticky: Vec::new(),
                    backlog_limit: None,
                    first_frame_at: None,
                    setting_up: false,
                },
                book: Book::new(),
                wake: WakeUps::default(),
                starvation: Starvation::default(),
                shutdown: false,
                unlocked: false,
                events: Vec::new(),
                released: Vec::new(),
            }),
            config,
            reserve: Mutex::new(std::fs::File::open("/dev/null").ok()),
            changed: Condvar::new(),
            released: Condvar::new(),
            wake: shm::new_eventfd()?,
            socket,
            on_event,
            thread: Mutex::new(None),
            reaper: Mutex::new(reap_tx),
            connection_tid: AtomicI32::new(0),
            upstream_rate: std::sync::atomic::AtomicU32::new(crate::policy::UPSTREAM_EVENTS_PER_S),
        });
        let handle = conn_thread::spawn(Arc::downgrade(&server))?;
        *server.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(server)
    }

    fn lock(&self) -> MutexGuard<'_, Inner<P>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the connection thread, disconnects every client and removes the socket file.
    pub fn stop(&self) {
        self.lock().shutdown = true;
        shm::notify(&self.wake);
        self.changed.notify_all();
        self.released.notify_all();
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
        let parked: Vec<P> = {
            let mut inner = self.lock();
            inner.clients.clear();
            inner.admission.clear();
            inner.slots.take_parked()
        };
        drop(parked);
        self.socket.remove();
    }

    pub fn set_unlocked(&self, unlocked: bool) {
        self.lock().unlocked = unlocked;
        self.changed.notify_all();
        self.released.notify_all();
    }

    /// Consumers connected and taking frames (closed ones that still hold frames are not
    /// counted; [`Self::stats`] lists them).
    pub fn num_clients(&self) -> usize {
        self.lock().clients.open_count()
    }

    /// The stream's figures and each client's: what gpushmsink's `stats` property and
    /// `gpushm top` (through its Report) show.
    pub fn stats(&self) -> (Stats, Vec<ClientStats>) {
        // Releases not taken yet would show as held.
        self.reclaim();
        let inner = self.lock();
        let now = Instant::now();
        let clients = inner
            .clients
            .iter()
            .map(|c| ClientStats::of(c, now))
            .collect();
        (inner.book.stats, clients)
    }

    /// Counts a frame the producer copied into a slot (the stream's `frames_copied`).
    pub fn count_copy(&self) {
        self.lock().book.stats.frames_copied += 1;
    }

    /// The connection thread's id, once it runs (0 before).
    pub fn connection_tid(&self) -> i32 {
        self.connection_tid.load(Ordering::Relaxed)
    }

    /// Creates a ring of `slots` slots for frames of `frame_size` bytes with `caps`, runs
    /// `prepare` on it before anyone hears of it (to put its pixels in GPU memory:
    /// [`crate::cuda::vmm::place_ring`]), makes it current and announces it to every client.
    pub fn new_ring(
        &self,
        slots: u32,
        frame_size: u64,
        caps: &str,
        requeue: Requeue<P>,
        prepare: &dyn Fn(&ProducerRing) -> Result<()>,
    ) -> Result<Arc<ProducerRing>> {
        // The ring is made (and prepared: GPU allocations take milliseconds) without the
        // lock that frames are published under.
        let gen = self.lock().slots.take_gen();
        let ring = ProducerRing::create(gen, slots, frame_size, self.config.allow_writable)?;
        prepare(&ring)?;
        let ring = Arc::new(ring);
        let mut inner = self.lock();
        let caps_gen = inner.stream.caps.as_ref().map_or(1, |c| c.0 + 1);
        inner.stream.caps = Some((caps_gen, caps.to_string()));
        inner.slots.push(ring.clone(), requeue);
        // Closed clients take no more frames: they need no new ring.
        let failed: Vec<(u32, String)> = inner
            .clients
            .open()
            .filter_map(|c| {
                send_ring_and_caps(&inner, c)
                    .err()
                    .map(|e| (c.id, e.to_string()))
            })
            .collect();
        for (id, why) in failed {
            self.drop_client(&mut inner, id, why);
        }
        inner.slots.retire_idle();
        self.unlock_and_emit(inner);
        Ok(ring)
    }

    /// Tells every client the stream ended (after every frame published so far).
    pub fn send_eos(&self) {
        let mut inner = self.lock();
        inner.stream.eos = true;
        let failed: Vec<(u32, String)> = inner
            .clients
            .open()
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
        self.unlock_and_emit(inner);
    }

    /// Sends an event of the stream (its payload is the caller's encoding, see [`crate::wire`])
    /// to every client: each hands it out before the frames published after this call. With
    /// `sticky_key`, it also replaces what is kept under that key for clients that connect
    /// later ([`crate::policy::STICKY_EVENTS_MAX`] keys at most: past it the oldest goes).
    pub fn send_event(&self, payload: &str, sticky_key: Option<&str>) {
        let mut inner = self.lock();
        let seq = inner.stream.events_seq.wrapping_add(1).max(1);
        inner.stream.events_seq = seq;
        if let Some(key) = sticky_key {
            let sticky = &mut inner.stream.sticky;
            sticky.retain(|(k, _, _)| k != key);
            if sticky.len() >= crate::policy::STICKY_EVENTS_MAX {
                sticky.remove(0);
            }
            sticky.push((key.to_string(), seq, payload.to_string()));
        }
        let msg = Message::Event {
            seq,
            payload: payload.to_string(),
        };
        let missed = self.send_optional(&mut inner, &msg);
        for id in missed {
            inner.events.push(Event::Info(format!(
                "client {id} does not read its socket: it misses an event of the stream \
                 (tags or a custom event)"
            )));
        }
        self.unlock_and_emit(inner);
    }

    /// Sets the metas of the next frame published (their payload is the caller's encoding,
    /// see [`crate::wire`]; `None`: it has none); the caller publishes that frame with
    /// [`crate::ring::frame::FrameMeta::has_metas`] set. [`Self::publish_frame`] sends them
    /// to every client with room on its socket just before the frame, under the same lock:
    /// a client that connects while the producer waits (wait-for-connection, or room in
    /// lossless clients) gets them too.
    pub fn set_frame_metas(&self, payload: Option<&str>) {
        self.lock().stream.next_metas = payload.map(str::to_string);
    }

    /// Sends `msg`, one a client can do without, to every open client with room on its
    /// socket ([`crate::wire::Conn::send_if_room`]); drops those whose send fails. Returns
    /// the clients that had no room.
    fn send_optional(&self, inner: &mut Inner<P>, msg: &Message) -> Vec<u32> {
        let (mut failed, mut missed) = (Vec::new(), Vec::new());
        for c in inner.clients.open() {
            match c.conn.send_if_room(msg) {
                Ok(true) => {}
                Ok(false) => missed.push(c.id),
                Err(e) => failed.push((c.id, e.to_string())),
            }
        }
        for (id, why) in failed {
            self.drop_client(inner, id, why);
        }
        missed
    }

    /// Consumers' upstream events taken a second per consumer at most (0: none; see
    /// [`crate::policy::UPSTREAM_EVENTS_PER_S`]).
    pub fn set_upstream_rate(&self, per_s: u32) {
        self.upstream_rate.store(per_s, Ordering::Relaxed);
    }

    pub(crate) fn upstream_rate(&self) -> u32 {
        self.upstream_rate.load(Ordering::Relaxed)
    }

    /// Forgets the events kept for clients that connect later: a new stream starts, and
    /// what described the old one (its tags) does not describe it.
    pub fn forget_sticky_events(&self) {
        self.lock().stream.sticky.clear();
    }

    /// A new stream starts (flush or restart after EOS).
    pub fn clear_eos(&self) {
        let mut inner = self.lock();
        inner.stream.eos = false;
        // A new stream: its cadence is learnt afresh, and the connection thread plans again.
        inner.wake.new_stream();
        drop(inner);
        shm::notify(&self.wake);
    }

    /// Wakes the clients that sleep until a frame comes, ahead of the next frame: called as
    /// it starts its last steps to [`Self::publish_frame`] (gpushmsink: as it reaches the sink
    /// pad, or render() after GstBaseSink's clock wait), so that their wake-up, which takes
    /// tens of µs on a core that idled, runs while those steps do instead of after them.
    ///
    /// A client quicker than those steps finds no frame yet and polls the ring for it (at
    /// most [`crate::policy::EARLY_WAKE_POLL`], once per frame; it sleeps again if it woke
    /// on our CPU) until the frame comes or its own wake-up does (it loses nothing, and no
    /// frame is later than without this); one still asleep when the frame is published is
    /// woken twice and takes it on the first.
    ///
    /// So it is done only after a gap of [`crate::policy::WAKE_EARLY_GAP`] since the last
    /// frame (the cores of a faster stream do not idle deep, and the second wake-up is a
    /// system call more per frame and client), at most once per frame (not within 200 µs of
    /// a wake-up ahead of the same frame, [`Self::set_wake_ahead`]: its clients are still
    /// waking or polling), and only for clients that sleep in a subscriber's wait (not those
    /// polling the doorbell in an event loop, which would see it readable for nothing) on
    /// another CPU than ours (a unix socket's wake-up asks the scheduler to run the woken
    /// thread on the waker's CPU, where it would take that CPU from the frame's way). Clients
    /// older than this wake-up (they say nothing of their CPU) are never woken early. Never
    /// blocks: the doorbells are rung without our lock held.
    pub fn wake_early(&self) {
        let wake = {
            let mut guard = self.lock();
            let inner = &mut *guard;
            if !inner
                .wake
                .early_due(inner.stream.next_seq, crate::monotonic_ns())
            {
                return;
            }
            let wake = inner
                .clients
                .sleeping_elsewhere(crate::ring::layout::this_cpu());
            inner.book.stats.woken_early += wake.len() as u64;
            wake
        };
        for d in wake {
            d.ring();
        }
    }

    /// Wakes the clients that sleep until a frame comes `ahead` before each frame is due,
    /// from the connection thread (`Duration::ZERO`, the default: never). When a frame is
    /// due is learnt from the publish times of the last ones (their median interval), for
    /// streams of at most one frame every [`crate::policy::WAKE_AHEAD_MIN_INTERVAL`].
    ///
    /// A consumer's wake-up from a sleep of a few ms takes tens of µs (60-80 on the H100
    /// machine); woken `ahead` before the frame, it is awake and polling the ring when the
    /// frame lands, as with its own low-latency mode
    /// ([`crate::subscriber::ConnectOptions::spin`]), but the producer keeps the time for
    /// every client. The rules of [`Self::wake_early`] hold (once per frame: that one rings
    /// again only for a frame that comes over 200 µs after its wake-up ahead, when its
    /// clients have polled and slept again; only clients asleep in a subscriber's wait, on
    /// another CPU than the one the last frame was published from; a woken client polls at
    /// most [`crate::policy::EARLY_WAKE_POLL`] once per frame it takes, then sleeps again):
    /// a wrong guess costs a client that much CPU, never a frame or a later one (a frame
    /// later than the poll is still rung for as it comes, by [`Self::wake_early`], and woken
    /// for by its publish). A stream that stops costs one wake-up ahead, for the frame that
    /// does not come: none is rung for a frame already half an interval late. At most
    /// [`crate::policy::MAX_WAKE_AHEAD`] (else [`Error::Invalid`], see [`check_wake_ahead`]).
    pub fn set_wake_ahead(&self, ahead: Duration) -> Result<()> {
        check_wake_ahead(ahead)?;
        if self.lock().wake.set_ahead(ahead.as_nanos() as u64) {
            // The connection thread plans again.
            shm::notify(&self.wake);
        }
        Ok(())
    }

    /// The connection thread's wake-up ahead of a frame, under our lock: the doorbells to
    /// ring now (`Ok`, rung by the caller once the lock is released), or when to look again
    /// (`Err(Some(ns))`, CLOCK_MONOTONIC). `timed_out`: the poll that asked for it ended by
    /// its timeout.
    fn ahead_step(
        inner: &mut Inner<P>,
        timed_out: bool,
    ) -> std::result::Result<Vec<Arc<shm::Doorbell>>, Option<u64>> {
        let next_seq = inner.stream.next_seq;
        let active = inner.active();
        match inner.wake.ahead_step(next_seq, active, timed_out) {
            AheadStep::Ring { cpu, now } => {
                let wake = inner.clients.sleeping_elsewhere(cpu);
                inner.wake.rang_ahead(next_seq, now, wake.len());
                inner.book.stats.woken_early += wake.len() as u64;
                inner.book.stats.woken_ahead += wake.len() as u64;
                Ok(wake)
            }
            AheadStep::Later(at) => Err(at),
        }
    }

    /// Takes back what clients released, in every client's release queue: slots whose last
    /// reader is done come free, and their parked owners go to `back`. Costs no system call;
    /// runs for every frame and every round of the connection thread.
    fn reclaim_locked(&self, inner: &mut Inner<P>, back: &mut Back<P>) {
        let mut released = std::mem::take(&mut inner.released);
        let mut failed = Vec::new();
        for c in inner.clients.iter_mut() {
            if let Err(e) = c.ch.take_releases_into(&mut released) {
                failed.push((c.id, e.to_string()));
            }
        }
        for e in released.drain(..) {
            inner.slots.unref(e, back);
        }
        inner.released = released;
        for (id, why) in failed {
            self.drop_client(inner, id, why);
        }
    }

    /// Takes back at once what clients released (they do not wake the producer for each
    /// release): owners of slots whose last reader is done go back to their pools.
    pub fn reclaim(&self) {
        let mut inner = self.lock();
        let mut back = Vec::new();
        self.reclaim_locked(&mut inner, &mut back);
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        give_back(back);
        self.emit(events);
    }

    /// For a thread about to wait for a slot (a pool with none free): while the returned
    /// guard lives, clients wake the connection thread on each release, which gives slots
    /// back as they come. What they released already is taken back at once.
    pub fn want_releases(&self) -> ReleaseWait<'_, P> {
        let first = {
            let mut inner = self.lock();
            inner.starvation.producer_waits(true, Instant::now());
            inner.clients.add_release_waiter(true)
        };
        if first {
            // The connection thread watches every doorbell from now on, and times the wait
            // (see fairness::Starvation).
            shm::notify(&self.wake);
        }
        self.reclaim();
        let mut inner = self.lock();
        self.relieve_overcrowding(&mut inner);
        self.unlock_and_emit(inner);
        ReleaseWait(self)
    }

    /// The producer waits for a slot: if every slot is held by a crowded ring's clients, the
    /// one [`fairness`] chooses gives way at once.
    fn relieve_overcrowding(&self, inner: &mut Inner<P>) {
        if !inner.slots.all_held() {
            return;
        }
        let slots = inner.slots.count();
        for cut in fairness::choose(slots, &inner.holdings(), Pressure::Waiting) {
            self.drop_client(inner, cut.id, cut.why);
        }
    }

    /// Clients that keep every slot of the ring (one that never gives back, or several that
    /// take turns) would stop the producer for good: once it has waited the starvation
    /// timeout for a slot, the one [`fairness`] chooses is cut.
    fn check_starvation(&self, inner: &mut Inner<P>, now: Instant) {
        if inner.clients.producer_waits() {
            self.relieve_overcrowding(inner);
        }
        if !inner.starvation.starved(inner.slots.all_held(), now) {
            return;
        }
        let slots = inner.slots.count();
        for cut in fairness::choose(slots, &inner.holdings(), Pressure::Starved) {
            self.drop_client(inner, cut.id, cut.why);
        }
    }

    /// The pool got `owner` back. Returns it if no client holds its slot, otherwise parks it
    /// until the last one released it.
    pub fn buffer_returned(&self, ring_gen: u32, slot: u32, owner: P) -> Option<P> {
        let mut inner = self.lock();
        let shutdown = inner.shutdown;
        inner.slots.park(ring_gen, slot, owner, shutdown)
    }

    /// Cuts client `id`, telling it `reason`: its slots come back (the frames it still holds
    /// may be overwritten, which its control block says first).
    fn drop_client(&self, inner: &mut Inner<P>, id: u32, reason: String) {
        let Some(c) = inner.clients.remove(id) else {
            return;
        };
        // Said in shared memory first, where the client reads it without a system call,
        // whether it still reads its socket or not (and whatever the socket can still carry).
        c.ch.mark_revoked();
        let mut back = Vec::new();
        for e in c.ch.outstanding() {
            inner.slots.unref(*e, &mut back);
        }
        let _ = c.conn.send(
            &Message::Error {
                message: reason.clone(),
            },
            &[],
        );
        // Its descriptors close in the connection thread, which may be polling them now.
        inner.clients.close_later(c);
        shm::notify(&self.wake);
        // Parked buffers go back to their pools right away; safe here because requeueing
        // never calls back into the server.
        give_back(back);
        inner.slots.retire_idle();
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

    /// Rings every client's frame-ready doorbell as a wake-up ahead of a frame from a CPU no
    /// client runs on, publishing nothing: what a hostile producer can do (tests).
    #[cfg(test)]
    pub(crate) fn ring_every_client_from_nowhere(&self) {
        for c in self.lock().clients.iter() {
            c.ch.set_early_wake_cpu(u32::MAX);
            c.ready.ring();
        }
    }

    /// Releases the lock, then tells the owner what happened under it.
    fn unlock_and_emit(&self, mut inner: MutexGuard<'_, Inner<P>>) {
        let events = std::mem::take(&mut inner.events);
        drop(inner);
        self.emit(events);
    }
}

/// Why a client that can map GPU memory (`device_memory`) or not cannot be served the current
/// ring, if it cannot.
fn ring_refusal<P>(slots: &Slots<P>, device_memory: bool) -> Option<String> {
    let d = slots.current()?.device()?;
    (!device_memory).then(|| {
        format!(
            "this stream's frames are in GPU memory ({} bytes on GPU {}) and this consumer did not ask for GPU memory (Python: Subscriber(device_memory=True); Rust: ConnectOptions::device_memory; gpushmsrc always does), or the producer can keep its ring in host memory (gpushmsink ring=host)",
            d.size,
            d.gpu_uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
        )
    })
}

/// Sends client `c` the current ring (its descriptor, and its GPU memory's) and caps.
fn send_ring_and_caps<P>(inner: &Inner<P>, c: &Client) -> Result<()> {
    if let Some(why) = ring_refusal(&inner.slots, c.device_memory) {
        return Err(Error::Refused(why));
    }
    if let Some(ring) = inner.slots.current() {
        let g = ring.geometry();
        let writable = c.writable && ring.is_writable();
        let fd = if writable {
            ring.read_write_fd()?
        } else {
            ring.read_only_fd()?
        };
        let device = ring.device();
        c.conn.send(
            &Message::Ring {
                ring_gen: ring.ring_gen(),
                flags: if writable { RING_WRITABLE } else { 0 }
                    | if device.is_some() { RING_DEVICE } else { 0 },
                slot_count: g.slot_count,
                slot_size: g.slot_size,
                total_size: g.total_size,
            },
            &[fd.as_fd()],
        )?;
        if let Some(d) = device {
            c.conn.send(
                &Message::DeviceMemory {
                    ring_gen: ring.ring_gen(),
                    gpu_uuid: d.gpu_uuid,
                    size: d.size,
                },
                &[d.fd.as_fd()],
            )?;
        }
    }
    if let Some((caps_gen, caps)) = &inner.stream.caps {
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
