// SPDX-License-Identifier: MPL-2.0
//! gpushmsrc's reading of the ring: the streaming thread reads it itself while it waits in
//! `create()` (one wake-up per frame), and a receiver thread connects and takes frames as they
//! arrive whenever the streaming thread is away downstream for longer than [`GRACE`], or went
//! away leaving more frames in the ring than the one it took.
//!
//! Two rules keep downstream from ever stalling the stream or other consumers:
//! - Frames are taken from the ring as they come (by the receiver thread while downstream
//!   blocks), so a downstream element that blocks (a sink waiting on its clock, a queue with a
//!   threshold) delays only this consumer's queue, bounded by the `max-size-*` properties
//!   (leaky: the oldest queued frames go; lossless: the producer waits, up to its max-wait).
//! - A frame is kept zero-copy only while this consumer references fewer frames than the
//!   budget the producer gives it; further frames are copied into system memory (one memcpy)
//!   and their slot goes back at once. Downstream elements that keep frames (encoders, queues,
//!   sinks keeping their last buffer) therefore never make the producer skip or wait.
//!
//! By concern: this file holds the shared state, the queue's state and the threads; `link`
//! the connection to the producer (connect, reconnect, one step of reading the ring, a lost
//! producer); `queue` what this consumer keeps while downstream is away (`max-size-*`, leaky
//! or lossless); `frames` how a frame of the ring becomes a GstBuffer (zero-copy memories or
//! copies past the budget, metas made ahead, layout checks, flags).

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};

use gst::glib;
use gst::glib::translate::IntoGlib;
use gst::prelude::*;

use super::CAT;
use crate::memory::{wrap_slot_memory, wrap_slot_memory_keeping};
use gpushm::ring::consumer_end::ConsumerRing;
use gpushm::ring::layout::{MAX_PLANES, NONE_U64};
use gpushm::ring::producer_end::FrameMeta;
use gpushm::subscriber::{ConnectOptions, Frame, Link, Subscriber, Waker};
use gpushm::Error;

/// How long a lossless consumer of a producer that is not live waits for downstream to hand
/// a frame back before it copies instead.
const NON_LIVE_WAIT: Duration = Duration::from_millis(20);

/// After a [`NON_LIVE_WAIT`] that got no frame back, the receiver copies without waiting for
/// this long, doubled after each further one in a row (up to 32 times): a downstream that
/// keeps frames until it gets more (an encoder's lookahead, a sink keeping its last frame)
/// hands one back only after the next frame, and waiting for it every other frame made a
/// flat-out stream crawl (720p in a 4-slot ring to a fakesink: 95 frames a second).
const NON_LIVE_WAIT_BACKOFF: Duration = Duration::from_secs(1);

/// A zero-copy frame's lease inside its GstMemory: when downstream drops the buffer, the slot
/// goes back and a receiver waiting for that (lossless, producer not live) wakes at once.
struct NotifyOnRelease {
    lease: Option<gpushm::subscriber::SlotLease>,
    shared: std::sync::Weak<Shared>,
}

impl Drop for NotifyOnRelease {
    fn drop(&mut self) {
        // A memory made ahead that never got a frame: nothing to give back.
        let Some(lease) = self.lease.take() else {
            return;
        };
        drop(lease);
        if let Some(s) = self.shared.upgrade() {
            // Taking the lock orders this wake-up after a waiter's check of should_copy(), so
            // none is missed. The receiver never drops frames while it holds the lock.
            if s.queue().release_waiters > 0 {
                s.cond.notify_all();
            }
        }
    }
}

/// What the receiver needs to know, fixed at start().
#[derive(Clone)]
pub(super) struct Config {
    pub endpoint: gpushm::names::Endpoint,
    pub opts: ConnectOptions,
    pub reconnect: bool,
    pub max_buffers: u32,
    pub max_bytes: u64,
    pub max_time: u64,
}

/// A frame as it arrived: memory, flags and metas set, timestamps not yet (they depend on
/// the pipeline's base time when it is pushed).
pub(super) struct Received {
    pub buffer: gst::Buffer,
    pub details: Details,
    /// Stream headers from the caps to push before this buffer: it is the first one of a
    /// connection that joined a stream mid-way.
    pub headers: Vec<gst::Buffer>,
    /// The producer's tags and custom events that come before this buffer, in order.
    pub events: Vec<gst::Event>,
}

/// Where a received frame came from and what its producer said about it.
pub(super) struct Details {
    pub meta: FrameMeta,
    pub caps: Arc<str>,
    /// CLOCK_MONOTONIC when the receiver took it from the ring.
    pub arrival_ns: u64,
    /// Which connection it came from (timestamps are mapped per producer).
    pub conn_serial: u64,
    /// The ring and address of a zero-copy frame (`None`: copied), for CUDA registration.
    pub slot: Option<(Arc<ConsumerRing>, usize)>,
    /// The GPU (ordinal) of the device ring the frame came from (`None`: a host ring):
    /// downstream may take it in CUDA memory.
    pub on_device: Option<i32>,
    /// When the buffer was made (feature `stages`).
    #[cfg(feature = "stages")]
    pub built_ns: u64,
}

/// Where device-ring frames of one stream go when downstream takes CUDA memory: wrapped in
/// place as CUDA memory of the pipeline's CUDA context (GStreamer 1.24+), or copied into a
/// buffer pool of GStreamer's CUDA library (active; it allocates only when a frame is
/// copied).
pub struct CudaOut {
    pub pool: gst::BufferPool,
    /// The producer's caps the pool was made for.
    pub caps: Arc<str>,
    /// The CUDA context the pipeline shares (the pool's).
    pub ctx: crate::cuda::gstcuda::Context,
    /// Frames are wrapped without a copy where their layout allows (`Err`: why they are
    /// copied, said once).
    pub wrap: Result<(), String>,
}

impl Drop for CudaOut {
    fn drop(&mut self) {
        let _ = self.pool.set_active(false);
    }
}

/// What a caps string describes (parsed once per caps, shared by its frames).
struct Stream {
    /// Raw video: its layout. `None`: any other caps, whose buffers are opaque bytes.
    video: Option<gst_video::VideoInfo>,
    /// `streamheader` of the caps (HEADER buffers a decoder or demuxer needs first).
    headers: Vec<gst::Buffer>,
}

// Frames are the common case: boxing them would cost an allocation per frame.
#[allow(clippy::large_enum_variant)]
pub(super) enum Item {
    Frame(Received),
    /// The end of the stream, after the producer's events that follow its last frame.
    Eos(Vec<gst::Event>),
    Error(gst::ErrorMessage),
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    bytes: u64,
    flushing: bool,
    stopping: bool,
    /// The pipeline is PLAYING: connect (frames published before it started playing are
    /// never received, so none has a timestamp before its base time).
    go: bool,
    /// The pipeline went back to PAUSED: a live source produces nothing then, so frames are
    /// given back as they arrive (counted as dropped) and nobody waits for us.
    paused: bool,
    /// When (CLOCK_MONOTONIC ns) the pipeline last went back to PLAYING after a pause: frames
    /// published before, read only now, are as stale as those that arrived while paused (their
    /// timestamps would go back before the last frame pushed before the pause).
    playing_since: u64,
    /// Frames were dropped from this queue since the last one popped.
    discont: bool,
    /// The streaming thread waits in `create()` and reads the ring itself.
    present: bool,
    /// When the streaming thread last left `create()` (`None`: never came).
    away_since: Option<std::time::Instant>,
    /// The streaming thread armed the receiver's timer this many times ([`Reader::watch`]).
    arms: u64,
    /// When the streaming thread had last left `create()` as it armed the timer (the rate
    /// limit counts from there: it errs towards arming more often).
    last_arm: Option<std::time::Instant>,
    /// The value of `arms` when the receiver last saw the timer fire. While they differ, the
    /// timer is armed or its fire is still unread; while equal, it may not be armed and the
    /// receiver looks every [`GRACE`] instead.
    fired: u64,
    /// Threads waiting for downstream to drop a frame (only they need the wake-up).
    release_waiters: u32,
    /// Events of frames dropped from the queue (or stale): they go out before the next item,
    /// since a frame lost is no reason to lose the tags or markers that came with it.
    carried: Vec<gst::Event>,
    /// The streaming thread took a frame and left more in the ring (a backlog, or downstream
    /// that runs behind): the receiver takes them now, not a [`GRACE`] later. Left there
    /// while the streaming thread comes back within GRACE to pop what was queued, they were
    /// never taken (a syncing sink 300 ms behind a wait-for-connection start held the
    /// producer up until it dropped them).
    behind: bool,
}

impl Queue {
    /// The streaming thread leaves create(): the receiver thread reads from now on if it
    /// does not come back within GRACE.
    fn leave(&mut self) {
        self.present = false;
        self.away_since = Some(std::time::Instant::now());
    }

    /// Keeps the events of `item`, a frame about to be dropped, for the next item.
    fn carry(&mut self, item: &mut Item) {
        if let Item::Frame(f) = item {
            self.carry_events(&mut f.events);
        }
    }

    /// Keeps `events` of a frame dropped for the next item: the newest
    /// [`gpushm::policy::EVENTS_KEPT_MAX`] at most (a paused pipeline drops frames for as
    /// long as it stays paused).
    fn carry_events(&mut self, events: &mut Vec<gst::Event>) {
        self.carried.append(events);
        let over = self
            .carried
            .len()
            .saturating_sub(gpushm::policy::EVENTS_KEPT_MAX);
        self.carried.drain(..over);
    }

    /// Puts the events carried from dropped frames before those of `item`, the next one out.
    fn uncarry(&mut self, item: &mut Item) {
        if self.carried.is_empty() {
            return;
        }
        let events = match item {
            Item::Frame(f) => &mut f.events,
            Item::Eos(e) => e,
            Item::Error(_) => return,
        };
        let mut all = std::mem::take(&mut self.carried);
        all.append(events);
        *events = all;
    }

    /// A frame that must not be pushed: it came while the pipeline was paused, or was
    /// published before it played again.
    fn stale(&self, item: &Item) -> bool {
        matches!(item, Item::Frame(f) if self.paused || f.details.meta.publish_ns < self.playing_since)
    }
}

/// State shared between the receiver thread, the streaming thread and property reads.
#[derive(Default)]
pub(super) struct Shared {
    q: Mutex<Queue>,
    cond: Condvar,
    /// The newest caps the producer announced, for caps queries.
    pub caps: Mutex<Option<Arc<str>>>,
    /// Events downstream sent for the producer, waiting for the thread that reads the ring
    /// (the only one that uses the connection) to send them.
    upstream: Mutex<VecDeque<String>>,
    /// The producer pipeline's latency from its newest frame (`NONE_U64`: unknown).
    pub latency: AtomicU64,
    /// The producer's pipeline is live, as its newest frame says.
    pub producer_live: AtomicBool,
    /// Frames the producer did not hand us, over every connection.
    pub producer_dropped: AtomicU64,
    /// Frames dropped from our own queue (leaky, downstream blocked past max-size-*).
    pub queue_dropped: AtomicU64,
    /// Frames copied out of the ring because downstream kept our zero-copy ones.
    pub copied: AtomicU64,
    /// Device-ring frames that went out in CUDA memory wrapping the ring's GPU memory, and
    /// those copied into the CUDA pool instead.
    pub cuda_wrapped: AtomicU64,
    pub cuda_copied: AtomicU64,
    /// Frames of an encoded stream skipped while waiting for a keyframe.
    pub skipped: AtomicU64,
    /// Low-latency mode: frames that came while the ring was polled, and polls that ended
    /// without one (over every connection).
    pub spin_caught: AtomicU64,
    pub spin_missed: AtomicU64,
    /// Frames were dropped from our queue: the keyframe gate closes again.
    regate: AtomicBool,
    pub received: AtomicU64,
    /// Downstream asked for GpuShmCudaMeta and the GPU cannot register read-only memory:
    /// reconnect asking for a writable ring.
    want_writable: AtomicBool,
    /// A connection is up (no connect or reconnect under way): only then is the receiver
    /// asked to hand the ring back, since interrupting a handshake would drop it.
    connected: AtomicBool,
    /// The streaming thread reads the ring (or connects) itself: a flush must wake it.
    streaming_reads: AtomicBool,
    /// Downstream takes device-ring frames in CUDA memory (set by the streaming thread once
    /// it negotiated that).
    cuda_out: Mutex<Option<Arc<CudaOut>>>,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Device-ring frames of `caps` go into this CUDA pool from now on (`None`: system
    /// memory).
    pub fn set_cuda_out(&self, out: Option<CudaOut>) {
        let new = out.map(Arc::new);
        let old = std::mem::replace(
            &mut *self.cuda_out.lock().unwrap_or_else(|e| e.into_inner()),
            new,
        );
        drop(old);
    }

    /// Where device-ring frames of `caps` go, if downstream takes them in CUDA memory.
    pub fn cuda_out_for(&self, caps: &Arc<str>) -> Option<Arc<CudaOut>> {
        self.cuda_out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|o| o.caps == *caps)
            .cloned()
    }

    /// The pipeline goes to PLAYING: the receiver connects (the first time) and queues
    /// frames again.
    pub fn go(&self) {
        let mut q = self.queue();
        q.go = true;
        if std::mem::take(&mut q.paused) {
            q.playing_since = gpushm::monotonic_ns();
        }
        drop(q);
        self.cond.notify_all();
    }

    /// The pipeline goes from PLAYING to PAUSED: queued frames are stale by the time it plays
    /// again (their timestamps would go backwards), so they go, and so do frames arriving
    /// while paused.
    pub fn pause(&self) {
        let mut q = self.queue();
        q.paused = true;
        // Frames are dropped after the lock is released (their release takes it).
        let (frames, rest): (VecDeque<Item>, VecDeque<Item>) = std::mem::take(&mut q.items)
            .into_iter()
            .partition(|i| matches!(i, Item::Frame(_)));
        q.items = rest;
        let gone = frames.len() as u64;
        if gone > 0 {
            q.discont = true;
            q.bytes = 0;
            self.dropped_from_queue(gone);
        }
        drop(q);
        drop(frames);
        self.cond.notify_all();
    }

    /// Waits up to `timeout` for downstream to drop a frame (NotifyOnRelease wakes only
    /// waiters counted here), or for any other news on the queue.
    fn wait_release<'a>(
        &self,
        mut q: MutexGuard<'a, Queue>,
        timeout: Duration,
    ) -> MutexGuard<'a, Queue> {
        q.release_waiters += 1;
        q = self
            .cond
            .wait_timeout(q, timeout)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        q.release_waiters -= 1;
        q
    }

    fn set_flushing(&self, flushing: bool) {
        self.queue().flushing = flushing;
        self.cond.notify_all();
    }

    /// Counts `n` frames dropped from our queue. What follows a gap cannot be decoded
    /// without what was dropped: an encoded stream waits for a keyframe again.
    fn dropped_from_queue(&self, n: u64) {
        self.queue_dropped.fetch_add(n, Ordering::Relaxed);
        self.regate.store(true, Ordering::Relaxed);
    }

    pub fn dropped(&self) -> u64 {
        self.producer_dropped.load(Ordering::Relaxed) + self.queue_dropped.load(Ordering::Relaxed)
    }
}

/// How long the streaming thread may stay away (pushing a frame downstream) before the
/// receiver thread takes frames from the ring in its place.
const GRACE: Duration = Duration::from_millis(50);

/// Upstream events waiting to be sent at most (see [`Reader::send_upstream`]).
const UPSTREAM_QUEUED: usize = 64;

/// How long the receiver thread sleeps at most while the streaming thread waits in
/// `create()`: normally its timer wakes it, this only bounds the wait should arming it fail.
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// What one read from the ring gave. (Moved once per frame: not worth a box.)
#[allow(clippy::large_enum_variant)]
enum Step {
    Item(Item),
    /// Nothing to hand out, read again: the wake-up descriptor fired (flushing, stopping, a
    /// writable-ring request, or the other thread wants the ring back; look at the flags), the
    /// connection was lost, or a frame was skipped while waiting for a keyframe.
    Interrupted,
    /// Nothing more comes (EOS or a fatal error was handed out).
    Done,
}

/// Who reads the ring. The streaming thread reads it itself while it waits for a frame in
/// `create()`: one wake-up per frame, as with a plain socket. While the streaming thread is
/// away pushing a frame downstream for longer than [`GRACE`] (a sink waiting on its clock, a
/// full queue, a paused pipeline), the receiver thread takes frames from the ring as they come
/// and queues them, so downstream never makes the producer skip or wait for us.
pub(super) struct Reader {
    pub shared: Arc<Shared>,
    worker: Mutex<Worker>,
    stop: Waker,
    /// Wakes the receiver thread [`GRACE`] after the streaming thread last armed it coming
    /// into `create()`. The streaming thread pushes the deadline on as it comes back, so while
    /// it keeps up the receiver sleeps without waking (a timed wait would wake it every GRACE,
    /// which at 30 frames/s cost as much CPU time as the frames themselves).
    watch: TimerFd,
}

impl Reader {
    fn worker(&self) -> Option<MutexGuard<'_, Worker>> {
        match self.worker.try_lock() {
            Ok(w) => Some(w),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Sets the receiver thread's timer to fire `after` from now.
    fn arm(&self, after: Duration) -> nix::Result<()> {
        self.watch.set(
            Expiration::OneShot(TimeSpec::from_duration(after)),
            TimerSetTimeFlags::empty(),
        )
    }

    /// The receiver thread sleeps until its timer fires or `timeout` ends (`None`: only a
    /// safety limit, [`IDLE_LOOK`], in case the timer could not be armed). Returns whether the
    /// timer fired (and clears it).
    fn sleep(&self, timeout: Option<Duration>) -> bool {
        let d = timeout.unwrap_or(IDLE_LOOK);
        // Rounded up: waking a little early would cost a second wake-up.
        let ms = d.as_nanos().div_ceil(1_000_000).clamp(1, i32::MAX as u128) as i32;
        let t = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
        let mut pfd = [PollFd::new(self.watch.as_fd(), PollFlags::POLLIN)];
        if !matches!(poll(&mut pfd, t), Ok(n) if n > 0) {
            return false;
        }
        let mut ticks = [0u8; 8];
        matches!(nix::unistd::read(self.watch.as_fd(), &mut ticks), Ok(8))
    }

    /// Whether the other thread reads the ring now.
    fn worker_busy(&self) -> bool {
        matches!(
            self.worker.try_lock(),
            Err(std::sync::TryLockError::WouldBlock)
        )
    }

    /// The next item for `create()`: from the queue, or straight from the ring when the queue
    /// is empty. `None` when flushing or stopping. Also says whether frames were dropped
    /// before it.
    pub fn next_item(&self) -> Option<(Item, bool)> {
        let mut asked = false;
        let mut came = false;
        let r = loop {
            let mut q = self.shared.queue();
            if q.flushing || q.stopping {
                break None;
            }
            if let Some(mut item) = q.items.pop_front() {
                if let Item::Frame(f) = &item {
                    q.bytes = q.bytes.saturating_sub(f.buffer.size() as u64);
                }
                q.uncarry(&mut item);
                let discont = std::mem::take(&mut q.discont);
                q.leave();
                drop(q);
                // A receiver waiting for room (lossless) goes on.
                self.shared.cond.notify_all();
                return Some((item, discont));
            }
            q.present = true;
            // Pushes the receiver's wake-up to GRACE from now, at most every GRACE / 4 (a
            // system call, off the way of the frame we wait for).
            let arm = !std::mem::replace(&mut came, true)
                && match (q.last_arm, q.away_since) {
                    (Some(armed), Some(left)) => left.saturating_duration_since(armed) >= GRACE / 4,
                    _ => true,
                };
            if arm {
                q.arms += 1;
                q.last_arm = Some(q.away_since.unwrap_or_else(std::time::Instant::now));
            }
            drop(q);
            if arm && self.arm(GRACE).is_err() {
                // Not armed: the receiver looks every GRACE instead.
                let mut q = self.shared.queue();
                q.fired = q.arms;
            }
            let Some(mut w) = self.worker() else {
                // The receiver thread reads: ask it once to hand the ring back, and wait for
                // that or for what it queues.
                if self.shared.connected.load(Ordering::Acquire)
                    && !std::mem::replace(&mut asked, true)
                {
                    self.stop.wake();
                }
                // The receiver lets go of the ring and then notifies under the queue lock:
                // checked under that lock, a hand-back between our try and our wait still
                // wakes us (instead of leaving frames in the ring for a whole GRACE).
                let q = self.shared.queue();
                if q.items.is_empty() && !q.flushing && !q.stopping && self.worker_busy() {
                    drop(self.shared.cond.wait_timeout(q, GRACE));
                }
                continue;
            };
            // The receiver may have queued a frame before it let go; a flush may have come
            // before we said that we read (set_flushing wakes us only once we have).
            self.shared.streaming_reads.store(true, Ordering::SeqCst);
            {
                let q = self.shared.queue();
                if !q.items.is_empty() || q.flushing || q.stopping {
                    self.shared.streaming_reads.store(false, Ordering::SeqCst);
                    continue;
                }
            }
            let step = w.step();
            self.shared.streaming_reads.store(false, Ordering::SeqCst);
            match step {
                Step::Item(item) => {
                    let behind = w.behind();
                    drop(w);
                    if behind {
                        self.hand_over();
                    }
                    let mut q = self.shared.queue();
                    if q.stale(&item) {
                        // It came after the pipeline paused (create() was on its way out):
                        // stale once it plays again, as the receiver's frames are.
                        let mut item = item;
                        q.carry(&mut item);
                        q.discont = true;
                        self.shared.dropped_from_queue(1);
                        drop(q);
                        drop(item);
                        continue;
                    }
                    let mut item = item;
                    q.uncarry(&mut item);
                    let discont = std::mem::take(&mut q.discont);
                    q.leave();
                    return Some((item, discont));
                }
                Step::Interrupted => {}
                Step::Done => {
                    drop(w);
                    // Nothing more comes: wait for a flush or the stop.
                    let mut q = self.shared.queue();
                    while q.items.is_empty() && !q.flushing && !q.stopping {
                        q = self.shared.cond.wait(q).unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
        };
        self.shared.queue().leave();
        r
    }

    /// Sends `payload` (an upstream event downstream sent us) to the producer: the thread that
    /// reads the ring sends it as it wakes. At most [`UPSTREAM_QUEUED`] wait: past it the
    /// oldest go (the producer takes few a second anyway).
    pub fn send_upstream(&self, payload: String) {
        {
            let mut q = self
                .shared
                .upstream
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if q.len() >= UPSTREAM_QUEUED {
                q.pop_front();
            }
            q.push_back(payload);
        }
        self.stop.wake();
    }

    /// Wakes the receiver thread to read the ring now (see [`Queue::behind`]).
    fn hand_over(&self) {
        self.shared.queue().behind = true;
        self.shared.cond.notify_all();
        // Zero would disarm the timer.
        let _ = self.arm(Duration::from_micros(1));
    }

    /// Flushing: `create()` returns at once, wherever it waits.
    pub fn set_flushing(&self, flushing: bool) {
        self.shared.set_flushing(flushing);
        // Only a streaming thread blocked in the ring needs the wake-up: the receiver thread
        // is not disturbed (interrupting its handshake would drop the connection).
        if flushing && self.shared.streaming_reads.load(Ordering::SeqCst) {
            self.stop.wake();
        }
    }

    /// Reconnects asking for a writable ring (for a GPU that cannot register read-only
    /// memory), unless this receiver already has one or asked.
    pub fn request_writable_ring(&self) {
        if !self.shared.want_writable.swap(true, Ordering::AcqRel) {
            self.stop.wake();
        }
    }

    /// The receiver thread: connects once the pipeline plays, then reads the ring whenever
    /// the streaming thread is away for longer than [`GRACE`].
    fn run(&self) {
        {
            let mut q = self.shared.queue();
            while !q.go && !q.stopping {
                q = self.shared.cond.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        }
        loop {
            {
                let mut q = self.shared.queue();
                loop {
                    if q.stopping {
                        return;
                    }
                    if std::mem::take(&mut q.behind) {
                        break;
                    }
                    let wait = match q.away_since {
                        // The streaming thread waits for a frame: sleep until the timer it
                        // armed as it came fires (or every GRACE once that has fired).
                        _ if q.present => (q.arms == q.fired).then_some(GRACE),
                        None => break,
                        Some(t) => match GRACE.checked_sub(t.elapsed()) {
                            Some(left) if !left.is_zero() => Some(left),
                            _ => break,
                        },
                    };
                    drop(q);
                    let fired = self.sleep(wait);
                    q = self.shared.queue();
                    if fired {
                        q.fired = q.arms;
                    }
                }
            }
            let Some(mut w) = self.worker() else {
                // The streaming thread reads (it is in create()): back to sleep, above. Only if
                // it already left again, wait a GRACE here first.
                let q = self.shared.queue();
                if !q.present && !q.stopping {
                    drop(self.shared.cond.wait_timeout(q, GRACE));
                }
                continue;
            };
            loop {
                match w.step() {
                    Step::Item(item) => {
                        if !w.push(item) {
                            return;
                        }
                    }
                    Step::Interrupted => {}
                    Step::Done => {
                        drop(w);
                        let mut q = self.shared.queue();
                        while !q.stopping {
                            q = self.shared.cond.wait(q).unwrap_or_else(|e| e.into_inner());
                        }
                        return;
                    }
                }
                let q = self.shared.queue();
                if q.stopping {
                    return;
                }
                // The streaming thread is back: it takes what we queued, then reads itself.
                if q.present {
                    break;
                }
            }
            drop(w);
            // Under the queue lock: see next_item().
            let _q = self.shared.queue();
            self.shared.cond.notify_all();
        }
    }
}

/// The receiver thread and what it shares. Dropping it stops the thread.
pub(super) struct Receiver {
    pub reader: Arc<Reader>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Receiver {
    pub fn start(element: &super::GpuShmSrc, cfg: Config) -> Result<Self, Error> {
        let shared = Arc::new(Shared {
            latency: AtomicU64::new(NONE_U64),
            ..Default::default()
        });
        let stop = Waker::new()?;
        let worker = Worker {
            element: element.downgrade(),
            shared: shared.clone(),
            link: Link::new(cfg.endpoint.clone(), cfg.opts.clone(), stop.clone()),
            stop: stop.clone(),
            done: false,
            serial: 0,
            info: None,
            checked: None,
            need_keyframe: true,
            asked_keyframe: false,
            events: Vec::new(),
            fresh: true,
            discont: true,
            dropped_seen: 0,
            copy_warned: false,
            futile_waits: 0,
            no_wait_until: None,
            writable_refusal_warned: false,
            cuda_copy_said: false,
            ahead: None,
            spares: Vec::new(),
            next_slot: Vec::new(),
            prev_slot: None,
            caps_seen: None,
            cfg,
        };
        let watch = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_CLOEXEC | TimerFlags::TFD_NONBLOCK,
        )
        .map_err(|e| Error::os("creating the receiver's timer", e))?;
        let reader = Arc::new(Reader {
            shared,
            worker: Mutex::new(worker),
            stop,
            watch,
        });
        let r = reader.clone();
        let thread = std::thread::Builder::new()
            .name("gpushmsrc-recv".into())
            .spawn(move || r.run())
            .map_err(|e| {
                Error::os(
                    "spawning the receiver thread",
                    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
                )
            })?;
        Ok(Self {
            reader,
            thread: Some(thread),
        })
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let shared = &self.reader.shared;
        shared.queue().stopping = true;
        shared.cond.notify_all();
        // The receiver may sleep on its timer alone.
        let _ = self.reader.arm(Duration::from_nanos(1));
        self.reader.stop.wake();
        if let Some(t) = self.thread.take() {
            // The thread may hold the last reference to the element for a moment: never
            // join it from itself.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // Dropped outside the lock (a frame's release takes it).
        let items = std::mem::take(&mut shared.queue().items);
        drop(items);
    }
}

struct Worker {
    element: glib::WeakRef<super::GpuShmSrc>,
    cfg: Config,
    shared: Arc<Shared>,
    stop: Waker,
    /// The connection to the producer, made again when it goes away (reconnect=true).
    link: Link,
    /// EOS or a fatal error was handed out: nothing more is read.
    done: bool,
    serial: u64,
    /// What the caps string last seen describes.
    info: Option<(Arc<str>, Arc<Stream>)>,
    /// The plane layout last checked against that stream's caps: frames laid out the same
    /// way (every frame of a pool) are not checked again.
    checked: Option<(Arc<Stream>, LayoutKey)>,
    /// Encoded streams: skip frames that depend on earlier ones (DELTA_UNIT) until a
    /// keyframe, after connecting and after frames were missed.
    need_keyframe: bool,
    /// The producer was asked for a keyframe since `need_keyframe` was last set.
    asked_keyframe: bool,
    /// The producer's events decoded and not yet attached to a frame (one read was skipped,
    /// or the end comes next).
    events: Vec<gst::Event>,
    /// No frame was built yet on this connection (stream headers go first).
    fresh: bool,
    discont: bool,
    dropped_seen: u64,
    copy_warned: bool,
    /// Waiting for downstream to hand a frame back (lossless, producer not live) timed out
    /// this many times in a row, and is not tried again before `no_wait_until`.
    futile_waits: u32,
    no_wait_until: Option<std::time::Instant>,
    writable_refusal_warned: bool,
    /// Why device-ring frames are copied into CUDA memory was said.
    cuda_copy_said: bool,
    /// The next frame's buffer, made before waiting for that frame (off its way): empty, with
    /// the metas every frame of this stream gets, which build() fills in.
    ahead: Option<Ahead>,
    /// Memories made ahead over the slots raw-video frames came in lately (a frame comes
    /// in one of them again), at most [`MAX_SPARES`]: wrapping a slot after a wake-up costs
    /// several µs more than filling in a memory made before.
    spares: Vec<SpareMemory>,
    /// For each slot a raw-video frame came in lately (its address), the slot the frame after
    /// it came in: the ring goes round in the same order, so the next frame's memory can be
    /// put in the buffer made ahead. At most [`MAX_SPARES`] entries.
    next_slot: Vec<(usize, usize)>,
    /// Where the last zero-copy raw-video frame was (address, size): a spare is made for it,
    /// and the next frame is expected in the slot that followed it last time.
    prev_slot: Option<(usize, usize)>,
    /// The producer's newest caps as last put in `Shared::caps`.
    caps_seen: Option<Arc<str>>,
}

mod cuda_out;
mod frames;
mod link;
mod queue;

use frames::{Ahead, SpareMemory};
use gpushm::ring::frame::LayoutKey;
