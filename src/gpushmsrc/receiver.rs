// SPDX-License-Identifier: MPL-2.0
//! gpushmsrc's reading of the ring: the streaming thread reads it itself while it waits in
//! `create()` (one wake-up per frame), and a receiver thread connects and takes frames as they
//! arrive whenever the streaming thread is away downstream for longer than [`GRACE`].
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

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::path::PathBuf;
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
use crate::ring::client::{ConnectOptions, Frame, Subscriber, Waker};
use crate::ring::consumer::ConsumerRing;
use crate::ring::layout::{MAX_PLANES, NONE_U64};
use crate::ring::producer::FrameMeta;
use crate::ring::Error;

/// How long a lossless consumer of a producer that is not live waits for downstream to hand
/// a frame back before it copies instead.
const NON_LIVE_WAIT: Duration = Duration::from_millis(20);

/// A zero-copy frame's lease inside its GstMemory: when downstream drops the buffer, the slot
/// goes back and a receiver waiting for that (lossless, producer not live) wakes at once.
struct NotifyOnRelease {
    lease: Option<crate::ring::client::SlotLease>,
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
    pub path: PathBuf,
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
    Eos,
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
}

impl Queue {
    /// The streaming thread leaves create(): the receiver thread reads from now on if it
    /// does not come back within GRACE.
    fn leave(&mut self) {
        self.present = false;
        self.away_since = Some(std::time::Instant::now());
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
    /// Frames of an encoded stream skipped while waiting for a keyframe.
    pub skipped: AtomicU64,
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
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pipeline goes to PLAYING: the receiver connects (the first time) and queues
    /// frames again.
    pub fn go(&self) {
        let mut q = self.queue();
        q.go = true;
        if std::mem::take(&mut q.paused) {
            q.playing_since = crate::ring::monotonic_ns();
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
            if let Some(item) = q.items.pop_front() {
                if let Item::Frame(f) = &item {
                    q.bytes = q.bytes.saturating_sub(f.buffer.size() as u64);
                }
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
                    drop(w);
                    let mut q = self.shared.queue();
                    if q.stale(&item) {
                        // It came after the pipeline paused (create() was on its way out):
                        // stale once it plays again, as the receiver's frames are.
                        q.discont = true;
                        self.shared.dropped_from_queue(1);
                        drop(q);
                        drop(item);
                        continue;
                    }
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
            cfg,
            shared: shared.clone(),
            stop: stop.clone(),
            conn: None,
            connected_once: false,
            done: false,
            serial: 0,
            info: None,
            checked: None,
            need_keyframe: true,
            fresh: true,
            discont: true,
            dropped_seen: 0,
            dropped_base: 0,
            copy_warned: false,
            gave_up_waiting: false,
            writable_refusal_warned: false,
            ahead: None,
            spares: Vec::new(),
            next_slot: Vec::new(),
            prev_slot: None,
            caps_seen: None,
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
    conn: Option<Subscriber>,
    connected_once: bool,
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
    /// No frame was built yet on this connection (stream headers go first).
    fresh: bool,
    discont: bool,
    dropped_seen: u64,
    dropped_base: u64,
    copy_warned: bool,
    /// Waiting for downstream to hand frames back timed out (lossless, producer not live).
    gave_up_waiting: bool,
    writable_refusal_warned: bool,
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

/// The buffer made ahead for the next frame of `stream`, with the memory of the slot that
/// frame is expected in (`slot`) when there is one.
struct Ahead {
    stream: Arc<Stream>,
    buffer: gst::Buffer,
    slot: Option<AheadSlot>,
    metas: AheadMetas,
}

/// The metas of the buffer made ahead, filled in through these pointers when its frame comes
/// (looking them up after the wake-up costs ~1 µs each on the frame's way, 2-core VM).
#[derive(Clone, Copy)]
struct AheadMetas {
    /// Raw video: its VideoMeta.
    video: Option<std::ptr::NonNull<gst_video::ffi::GstVideoMeta>>,
    /// The publish-time ReferenceTimestampMeta.
    publish: std::ptr::NonNull<gst::ffi::GstReferenceTimestampMeta>,
}

// SAFETY: the metas belong to the buffer made ahead, which only the Worker holding it (its
// only reference) reads or writes.
unsafe impl Send for AheadMetas {}

/// A spare memory ([`SpareMemory`]) put in the buffer made ahead: that buffer holds its only
/// reference, and the Worker the buffer's.
struct AheadSlot {
    ptr: usize,
    size: usize,
    notify: *mut NotifyOnRelease,
}

// SAFETY: see SpareMemory: `notify` points into the Box owned by the memory in the buffer made
// ahead, written only by the Worker, which holds that buffer's only reference.
unsafe impl Send for AheadSlot {}

/// Spare memories kept at most (more than any ring has slots in practice).
const MAX_SPARES: usize = 64;

/// A GstMemory over `size` bytes at `ptr`, with no lease yet: [`SpareMemory::fill`] puts in
/// the lease of the frame that comes there, before the memory goes anywhere (until then nothing
/// maps it, and nothing keeps that address mapped). A raw pointer rather than a shared cell:
/// the fill is on the frame's way, and a plain store costs least there.
struct SpareMemory {
    ptr: usize,
    size: usize,
    mem: gst::Memory,
    notify: *mut NotifyOnRelease,
}

// SAFETY: `notify` points into the Box that `mem` owns (freed only with `mem`); only the
// holder of this SpareMemory, which holds `mem`'s only reference, writes through it.
unsafe impl Send for SpareMemory {}

impl SpareMemory {
    /// Puts `lease` in and hands the memory out (once: it consumes the spare).
    fn fill(self, lease: crate::ring::client::SlotLease) -> gst::Memory {
        // SAFETY: `self.mem` holds its only reference (made ahead, never handed out), so the
        // NotifyOnRelease it owns is alive and nothing else reads or writes it; the lease
        // keeps `ptr` mapped from here on.
        unsafe { (*self.notify).lease = Some(lease) };
        self.mem
    }
}

impl Worker {
    /// One read from the ring (connecting or reconnecting first when needed). Blocks until
    /// something comes or the wake-up descriptor fires.
    fn step(&mut self) -> Step {
        if self.done {
            return Step::Done;
        }
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => match self.open() {
                Ok(c) => c,
                Err(step) => return step,
            },
        };
        // The spare of the last frame's slot first: the next frame may come in it again.
        self.make_spare();
        self.make_ahead();
        let step = match conn.next_frame(None) {
            Ok(Some(frame)) => {
                self.shared
                    .producer_dropped
                    .store(self.dropped_base + conn.dropped(), Ordering::Relaxed);
                if let Some(c) = conn.caps() {
                    // Our copy first: the shared one's lock only when the caps changed.
                    if self
                        .caps_seen
                        .as_ref()
                        .is_none_or(|cur| !Arc::ptr_eq(cur, &c))
                    {
                        self.caps_seen = Some(c.clone());
                        *self.shared.caps.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
                    }
                }
                let arrival_ns = crate::ring::monotonic_ns();
                match self.build(&conn, frame, arrival_ns) {
                    Ok(Some(r)) => Step::Item(Item::Frame(r)),
                    // Skipped (waiting for a keyframe): read on.
                    Ok(None) => Step::Interrupted,
                    Err(e) => {
                        self.done = true;
                        Step::Item(Item::Error(e))
                    }
                }
            }
            Ok(None) => {
                gst::debug!(CAT, "producer sent EOS");
                self.done = true;
                Step::Item(Item::Eos)
            }
            Err(Error::Interrupted) => {
                if self.shared.want_writable.load(Ordering::Acquire) && !self.cfg.opts.writable_ring
                {
                    self.cfg.opts.writable_ring = true;
                    self.lost(
                        conn,
                        "Downstream reads frames with CUDA and this GPU cannot register read-only memory: reconnecting to ask the producer for a writable ring (frames published meanwhile are missed)",
                    );
                    return Step::Interrupted;
                }
                Step::Interrupted
            }
            Err(e) => {
                let received = self.shared.received.load(Ordering::Relaxed);
                let why = match e {
                    Error::Disconnected => format!(
                        "The producer went away (gpushmsink stopped or crashed) after {received} frames"
                    ),
                    e => format!("Receiving from the producer failed: {e}"),
                };
                if !self.cfg.reconnect {
                    self.done = true;
                    return Step::Item(Item::Error(gst::error_msg!(
                        gst::ResourceError::Read,
                        ("{}", why)
                    )));
                }
                self.lost(conn, &why);
                return Step::Interrupted;
            }
        };
        self.conn = Some(conn);
        step
    }

    /// The connection ended (or is given up for a writable one): the next step waits for a
    /// producer on the same path. Buffers of the old producer stay valid downstream: they
    /// keep their mapping alive.
    fn lost(&mut self, conn: Subscriber, why: &str) {
        self.shared.connected.store(false, Ordering::Release);
        // Memories made ahead over the old rings' slots.
        self.spares.clear();
        self.ahead = None;
        self.next_slot.clear();
        self.prev_slot = None;
        self.dropped_base += conn.dropped();
        drop(conn);
        if let Some(el) = self.element.upgrade() {
            gst::element_warning!(
                el,
                gst::ResourceError::Read,
                (
                    "{}; waiting for a producer on {} (reconnect=true)",
                    why,
                    self.cfg.path.display()
                )
            );
        }
    }

    /// Connects (the first time with the configured timeout, later waiting as long as it
    /// takes). A wake is a stop, a flush, or a request for a writable ring: the caller looks
    /// at the flags and calls again.
    #[allow(clippy::result_large_err)]
    fn open(&mut self) -> Result<Subscriber, Step> {
        if self.shared.want_writable.load(Ordering::Acquire) {
            self.cfg.opts.writable_ring = true;
        }
        let mut opts = self.cfg.opts.clone();
        if self.connected_once {
            opts.timeout = Duration::MAX;
        }
        match Subscriber::connect_with_waker(&self.cfg.path, &opts, &self.stop) {
            Ok(conn) => {
                gst::info!(
                    CAT,
                    "{} {} as client {}",
                    if self.connected_once {
                        "reconnected to"
                    } else {
                        "connected to"
                    },
                    self.cfg.path.display(),
                    conn.client_id()
                );
                if self.connected_once {
                    self.serial += 1;
                    self.discont = true;
                    self.dropped_seen = 0;
                }
                self.need_keyframe = true;
                self.fresh = true;
                self.connected_once = true;
                self.shared.connected.store(true, Ordering::Release);
                Ok(conn)
            }
            Err(Error::Interrupted) => {
                self.stop.clear();
                Err(Step::Interrupted)
            }
            Err(e) => {
                self.done = true;
                Err(Step::Item(Item::Error(if self.connected_once {
                    gst::error_msg!(gst::ResourceError::OpenRead, ("Reconnecting failed: {}", e))
                } else {
                    gst::error_msg!(
                        gst::ResourceError::OpenRead,
                        (
                            "Could not connect to a gpushmsink at {}: {}",
                            self.cfg.path.display(),
                            e
                        )
                    )
                })))
            }
        }
    }

    /// Queues `item`. Past the queue's limits a leaky consumer drops its oldest frames and a
    /// lossless one waits (so the producer's back-pressure applies). False when stopping.
    fn push(&mut self, item: Item) -> bool {
        // Frames dropped from the queue go after the lock (declared first, dropped last): a
        // frame's release takes the lock.
        let mut dropped = Vec::new();
        let mut q = self.shared.queue();
        if q.stale(&item) {
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
                        q.discont = true;
                        self.shared.dropped_from_queue(1);
                        return !q.stopping;
                    }
                    continue;
                }
                let Some(pos) = q.items.iter().position(|i| matches!(i, Item::Frame(_))) else {
                    break;
                };
                if let Some(Item::Frame(old)) = q.items.remove(pos) {
                    q.bytes = q.bytes.saturating_sub(old.buffer.size() as u64);
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
    fn full(&self, q: &Queue, size: u64, arrival_ns: u64) -> bool {
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

    fn stream(&mut self, caps: &Arc<str>) -> Result<Arc<Stream>, gst::ErrorMessage> {
        if let Some((c, stream)) = &self.info {
            if c == caps {
                return Ok(stream.clone());
            }
        }
        let parsed = gst::Caps::from_str(caps).map_err(|_| {
            gst::error_msg!(
                gst::StreamError::Format,
                ("The producer sent unparsable caps {}", caps)
            )
        })?;
        let st = parsed.structure(0).ok_or_else(|| {
            gst::error_msg!(
                gst::StreamError::Format,
                ("The producer sent empty caps {}", caps)
            )
        })?;
        let video = if st.name() == "video/x-raw" {
            // The producer sends planes for what GstVideo knows, and opaque bytes otherwise.
            gst_video::VideoInfo::from_caps(&parsed).ok()
        } else {
            None
        };
        let headers = st
            .get::<gst::Array>("streamheader")
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.get::<gst::Buffer>().ok())
                    .map(|mut b| {
                        b.make_mut().set_flags(gst::BufferFlags::HEADER);
                        b
                    })
                    .collect()
            })
            .unwrap_or_default();
        let stream = Arc::new(Stream { video, headers });
        self.info = Some((caps.clone(), stream.clone()));
        Ok(stream)
    }

    /// Makes the next frame's buffer and metas now, while no frame waits: after a wake-up
    /// they cost several times more (cold caches), on the way of the frame.
    fn make_ahead(&mut self) {
        let Some((_, stream)) = &self.info else {
            return;
        };
        if !self
            .ahead
            .as_ref()
            .is_some_and(|a| Arc::ptr_eq(&a.stream, stream))
        {
            self.ahead = Self::new_ahead(stream);
        }
        self.put_expected_slot();
    }

    /// An empty buffer with the metas every frame of `stream` gets.
    fn new_ahead(stream: &Arc<Stream>) -> Option<Ahead> {
        let mut buffer = gst::Buffer::new();
        let b = buffer.get_mut()?;
        let video = match &stream.video {
            Some(info) => {
                let n = info.n_planes() as usize;
                let mut vm = gst_video::VideoMeta::add_full(
                    b,
                    gst_video::VideoFrameFlags::empty(),
                    info.format(),
                    info.width(),
                    info.height(),
                    &info.offset()[..n],
                    &info.stride()[..n],
                )
                .ok()?;
                Some(std::ptr::NonNull::new(vm.as_mut_ptr())?)
            }
            None => None,
        };
        let mut publish =
            gst::ReferenceTimestampMeta::add(b, &publish_caps(), gst::ClockTime::ZERO, None);
        let publish = std::ptr::NonNull::new(publish.as_mut_ptr())?;
        Some(Ahead {
            stream: stream.clone(),
            buffer,
            slot: None,
            metas: AheadMetas { video, publish },
        })
    }

    /// Puts the spare memory of the slot the next frame is expected in (the one that followed
    /// the last frame's slot last time) in the buffer made ahead: appending a memory after
    /// the wake-up costs ~3 µs on the frame's way (2-core VM).
    fn put_expected_slot(&mut self) {
        let Some(ahead) = self.ahead.as_mut() else {
            return;
        };
        if ahead.slot.is_some() || ahead.stream.video.is_none() {
            return;
        }
        let Some((prev, _)) = self.prev_slot else {
            return;
        };
        let Some(&(_, next)) = self.next_slot.iter().find(|(from, _)| *from == prev) else {
            return;
        };
        let Some(i) = self.spares.iter().position(|s| s.ptr == next) else {
            return;
        };
        let Some(b) = ahead.buffer.get_mut() else {
            return;
        };
        let spare = self.spares.swap_remove(i);
        ahead.slot = Some(AheadSlot {
            ptr: spare.ptr,
            size: spare.size,
            notify: spare.notify,
        });
        b.append_memory(spare.mem);
    }

    /// A zero-copy raw-video frame came at `ptr`: learns which slot follows which.
    fn note_slot(&mut self, ptr: usize, size: usize) {
        if let Some((prev, _)) = self.prev_slot.replace((ptr, size)) {
            match self.next_slot.iter_mut().find(|(from, _)| *from == prev) {
                Some(e) => e.1 = ptr,
                None => {
                    if self.next_slot.len() >= MAX_SPARES {
                        self.next_slot.remove(0);
                    }
                    self.next_slot.push((prev, ptr));
                }
            }
        }
    }

    /// Makes a memory ahead over the slot of the last zero-copy frame, for the next frame
    /// that comes in it.
    fn make_spare(&mut self) {
        let Some((ptr, size)) = self.prev_slot else {
            return;
        };
        if self.spares.iter().any(|s| s.ptr == ptr && s.size == size) {
            return;
        }
        if self.spares.len() >= MAX_SPARES {
            self.spares.remove(0);
        }
        // SAFETY: `notify` is written only by SpareMemory::fill, while the spare holds the
        // memory's only reference.
        let (mem, notify) = unsafe {
            wrap_slot_memory_keeping(
                ptr as *mut u8,
                size,
                size,
                true,
                Box::new(NotifyOnRelease {
                    lease: None,
                    shared: Arc::downgrade(&self.shared),
                }),
            )
        };
        self.spares.push(SpareMemory {
            ptr,
            size,
            mem,
            notify,
        });
    }

    /// Wraps a frame in a buffer: zero-copy while we are within our budget, otherwise a copy
    /// in system memory whose slot goes back at once.
    fn build(
        &mut self,
        conn: &Subscriber,
        frame: Frame,
        arrival_ns: u64,
    ) -> Result<Option<Received>, gst::ErrorMessage> {
        let stream = self.stream(&frame.caps)?;
        if let Some(info) = &stream.video {
            let key = LayoutKey::of(&frame.meta);
            let known = self
                .checked
                .as_ref()
                .is_some_and(|(s, k)| Arc::ptr_eq(s, &stream) && *k == key);
            if !known {
                check_layout(&frame, info).map_err(|msg| {
                    gst::error_msg!(
                        gst::StreamError::Decode,
                        ("The producer sent an invalid frame: {}", msg)
                    )
                })?;
                self.checked = Some((stream.clone(), key));
            }
        }
        let m = frame.meta;
        let lossless = self.cfg.opts.delivery().lossless_for(m.live, &frame.caps);
        if stream.video.is_none() {
            let dropped = conn.dropped();
            if self.shared.regate.swap(false, Ordering::Relaxed) || dropped != self.dropped_seen {
                // Frames were missed: what follows may refer to them.
                self.need_keyframe = true;
            }
            let flags = gst::BufferFlags::from_bits_truncate(m.buffer_flags);
            if self.need_keyframe
                && flags.contains(gst::BufferFlags::DELTA_UNIT)
                && !flags.contains(gst::BufferFlags::HEADER)
            {
                // A decoder cannot start here: wait for the next keyframe.
                self.dropped_seen = dropped;
                self.discont = true;
                self.shared.skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            self.need_keyframe = false;
        }
        // The first buffer of a connection that joined mid-way: the caps' stream headers go
        // first (a buffer flagged HEADER means we joined at the start, where they are).
        let headers = if std::mem::take(&mut self.fresh)
            && !gst::BufferFlags::from_bits_truncate(m.buffer_flags)
                .contains(gst::BufferFlags::HEADER)
        {
            stream.headers.clone()
        } else {
            Vec::new()
        };
        let size = m.payload_size as usize;
        let mut copy = conn.should_copy();
        if copy.is_some() && lossless && !m.live {
            // A producer that is not live loses nothing by waiting. While frames wait in our
            // own queue, downstream is only slow to take them: wait until it takes one (the
            // producer waits meanwhile) and keep this frame zero-copy.
            let mut q = self.shared.queue();
            while copy.is_some() && !q.items.is_empty() && !q.stopping && !q.paused {
                // Woken as soon as downstream drops a frame (NotifyOnRelease) or takes one.
                q = self.shared.wait_release(q, Duration::from_millis(5));
                copy = conn.should_copy();
            }
        }
        if copy.is_some() && lossless && !m.live && !self.gave_up_waiting {
            // Our queue is empty: downstream holds the frames. Give it a moment to hand one
            // back. Downstream that keeps frames until it gets more (an encoder's lookahead)
            // is not waited for again until it has handed frames back.
            let deadline = std::time::Instant::now() + NON_LIVE_WAIT;
            let mut q = self.shared.queue();
            while copy.is_some() && !q.stopping {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                // Woken as soon as downstream drops a frame (NotifyOnRelease).
                q = self.shared.wait_release(q, left);
                copy = conn.should_copy();
            }
            drop(q);
            self.gave_up_waiting = copy.is_some();
        }
        if copy.is_none() {
            self.gave_up_waiting = false;
        }
        // The buffer made ahead, unless the stream changed or the frame has no publish time.
        let publish_ts = clock_time(m.publish_ns);
        let mut ahead = self
            .ahead
            .take()
            .filter(|a| Arc::ptr_eq(&a.stream, &stream) && publish_ts.is_some());
        let mut slot = None;
        // Some(None): the frame's memory is in the buffer made ahead already.
        let mem = if size == 0 {
            // An empty buffer (caps other than raw video): nothing to map or keep.
            drop(frame.lease);
            None
        } else if let Some(held) = copy {
            // The slot order learnt goes from zero-copy frame to zero-copy frame.
            self.prev_slot = None;
            let mut mem = gst::Memory::with_size(size);
            {
                let mem = mem.get_mut().ok_or_else(|| {
                    gst::error_msg!(gst::ResourceError::NoSpaceLeft, ("Cannot allocate a frame"))
                })?;
                let mut map = mem.map_writable().map_err(|_| {
                    gst::error_msg!(gst::ResourceError::NoSpaceLeft, ("Cannot map a frame"))
                })?;
                // SAFETY: the lease keeps `size` bytes at `frame.ptr` mapped (read_frame
                // checked them against the slot); raw copy, no reference to shared memory.
                unsafe { std::ptr::copy_nonoverlapping(frame.ptr, map.as_mut_ptr(), size) };
            }
            let n = conn.count_copy();
            self.shared.copied.fetch_add(1, Ordering::Relaxed);
            if !self.copy_warned {
                self.copy_warned = true;
                self.warn_copy(conn, held, n);
            }
            drop(frame.lease);
            Some(Some(mem))
        } else {
            slot = Some((frame.lease.ring().clone(), frame.ptr as usize));
            if self.cfg.opts.writable_ring
                && !frame.lease.ring().is_writable()
                && !std::mem::replace(&mut self.writable_refusal_warned, true)
            {
                if let Some(el) = self.element.upgrade() {
                    gst::element_warning!(
                        el,
                        gst::ResourceError::Settings,
                        ("The GPU cannot register read-only memory and the producer does not hand out writable rings: CUDA elements copy each frame"),
                        ["Set allow-writable-ring=true on the gpushmsink to let them read frames in place"]
                    );
                }
            }
            let ptr = frame.ptr as usize;
            if stream.video.is_some() {
                self.note_slot(ptr, size);
            }
            let expected = ahead
                .as_mut()
                .and_then(|a| a.slot.take_if(|s| s.ptr == ptr && s.size == size));
            if let Some(e) = expected {
                // SAFETY: the buffer made ahead holds the memory's only reference and we hold
                // the buffer's (it is handed out below, after this), so the NotifyOnRelease is
                // alive and nothing else reads it.
                unsafe { (*e.notify).lease = Some(frame.lease) };
                Some(None)
            } else if let Some(i) = stream.video.as_ref().and_then(|_| {
                self.spares
                    .iter()
                    .position(|s| s.ptr == ptr && s.size == size)
            }) {
                Some(Some(self.spares.swap_remove(i).fill(frame.lease)))
            } else {
                Some(Some(wrap_slot_memory(
                    frame.ptr as *mut u8,
                    size,
                    size,
                    true,
                    Box::new(NotifyOnRelease {
                        lease: Some(frame.lease),
                        shared: Arc::downgrade(&self.shared),
                    }),
                )))
            }
        };
        let metas = ahead.as_ref().map(|a| a.metas);
        // A memory put in ahead for another slot goes (the frame came elsewhere).
        let unused = ahead.as_mut().and_then(|a| a.slot.take());
        let mut buffer = ahead.map(|a| a.buffer).unwrap_or_default();
        {
            let b = buffer.get_mut().ok_or_else(|| {
                gst::error_msg!(gst::CoreError::Failed, ("A new buffer is not writable"))
            })?;
            if let Some(u) = unused {
                // Back among the spares, for the next frame in that slot.
                let mem = b.memory(0);
                b.remove_all_memory();
                if let Some(mem) = mem.filter(|_| self.spares.len() < MAX_SPARES) {
                    // `mem` is now the memory's only reference, as SpareMemory requires.
                    self.spares.push(SpareMemory {
                        ptr: u.ptr,
                        size: u.size,
                        mem,
                        notify: u.notify,
                    });
                }
            }
            if let Some(Some(mem)) = mem {
                b.append_memory(mem);
            }
            b.set_duration(clock_time(m.duration));
            b.set_offset(m.offset);
            b.set_offset_end(m.offset_end);
            // Every flag the producer set (interlacing, field order, keyframes, ...), except
            // the one that describes its memory.
            // Bits below GST_MINI_OBJECT_FLAG_LAST belong to the mini object (locking), not
            // to the buffer: never taken from a peer.
            let mut flags = gst::BufferFlags::from_bits_retain(
                m.buffer_flags & !(gst::ffi::GST_MINI_OBJECT_FLAG_LAST - 1),
            ) - gst::BufferFlags::TAG_MEMORY;
            let dropped = conn.dropped();
            if self.discont || dropped != self.dropped_seen {
                flags |= gst::BufferFlags::DISCONT;
                self.discont = false;
                self.dropped_seen = dropped;
            }
            b.set_flags(flags);
            if let Some(info) = &stream.video {
                // check_layout() bounded n_planes by the caps' (at most MAX_PLANES).
                let n = (m.n_planes as usize).min(MAX_PLANES);
                let offsets = m.plane_offset.map(|o| o as usize);
                let strides = m.plane_stride.map(|s| s as i32);
                let flags = frame_flags(m.buffer_flags);
                if let Some(vm) = metas.and_then(|m| m.video) {
                    // SAFETY: the VideoMeta of the buffer made ahead (`b`), which we hold
                    // writable.
                    unsafe { fill_video_meta(vm.as_ptr(), flags, &offsets[..n], &strides[..n]) };
                } else {
                    gst_video::VideoMeta::add_full(
                        b,
                        flags,
                        info.format(),
                        info.width(),
                        info.height(),
                        &offsets[..n],
                        &strides[..n],
                    )
                    .map_err(|_| {
                        gst::error_msg!(
                            gst::StreamError::Decode,
                            ("The producer's plane layout does not fit the frame")
                        )
                    })?;
                }
            }
            if let Some(ts) = publish_ts {
                match metas {
                    // SAFETY: a meta of the buffer made ahead (`b`), which we hold writable.
                    Some(m) => unsafe { (*m.publish.as_ptr()).timestamp = ts.into_glib() },
                    None => {
                        gst::ReferenceTimestampMeta::add(b, &publish_caps(), ts, None);
                    }
                }
            }
            if let Some(tc) = m.timecode {
                let fps =
                    (tc.fps_d > 0 && tc.fps_d <= i32::MAX as u32 && tc.fps_n <= i32::MAX as u32)
                        .then(|| gst::Fraction::new(tc.fps_n as i32, tc.fps_d as i32));
                let valid = fps.and_then(|fps| {
                    gst_video::ValidVideoTimeCode::new(
                        fps,
                        None,
                        gst_video::VideoTimeCodeFlags::from_bits_truncate(tc.flags),
                        tc.hours,
                        tc.minutes,
                        tc.seconds,
                        tc.frames,
                        tc.field_count,
                    )
                    .ok()
                });
                if let Some(v) = valid {
                    gst_video::VideoTimeCodeMeta::add(b, &v);
                }
            }
        }
        self.shared.received.fetch_add(1, Ordering::Relaxed);
        if m.latency != NONE_U64 {
            self.shared.latency.store(m.latency, Ordering::Relaxed);
        }
        self.shared.producer_live.store(m.live, Ordering::Relaxed);
        Ok(Some(Received {
            buffer,
            details: Details {
                meta: m,
                caps: frame.caps.clone(),
                arrival_ns,
                conn_serial: self.serial,
                slot,
            },
            headers,
        }))
    }

    fn warn_copy(&self, conn: &Subscriber, held: usize, n: u64) {
        let Some(el) = self.element.upgrade() else {
            return;
        };
        gst::element_warning!(
            el,
            gst::ResourceError::Busy,
            (
                "This consumer holds {} frames of the producer's ring (downstream and in its own queue), as many as it keeps zero-copy with client-budget {}: further frames are copied into system memory (one copy each, counted in frames-copied) until downstream gives frames back",
                held.saturating_sub(1),
                conn.budget()
            ),
            [
                "Copied {} frame so far. Elements such as encoders, queues with thresholds or sinks keeping their last buffer hold frames; to keep them zero-copy, raise slots (or client-budget) on the gpushmsink",
                n
            ]
        );
    }
}

/// Sets the flags and plane layout of a VideoMeta made ahead (its format and size are the
/// stream's, as check_layout() checked the frame's).
///
/// # Safety
/// `vm` is the VideoMeta of a buffer the caller holds writable, and nothing else reads or
/// writes it meanwhile.
unsafe fn fill_video_meta(
    vm: *mut gst_video::ffi::GstVideoMeta,
    flags: gst_video::VideoFrameFlags,
    offsets: &[usize],
    strides: &[i32],
) {
    let n = offsets.len().min(strides.len()).min(MAX_PLANES);
    // SAFETY: see above; n is at most MAX_PLANES (GST_VIDEO_MAX_PLANES), the arrays' length.
    let p = unsafe { &mut *vm };
    p.flags = flags.into_glib();
    p.n_planes = n as u32;
    p.offset[..n].copy_from_slice(&offsets[..n]);
    p.stride[..n].copy_from_slice(&strides[..n]);
}

fn clock_time(v: u64) -> Option<gst::ClockTime> {
    // ClockTime cannot hold u64::MAX (GST_CLOCK_TIME_NONE): that value means "none".
    (v != NONE_U64).then(|| gst::ClockTime::from_nseconds(v))
}

fn publish_caps() -> gst::Caps {
    static CAPS: once_cell::sync::Lazy<gst::Caps> =
        once_cell::sync::Lazy::new(|| gst::Caps::new_empty_simple(super::PUBLISH_TIMESTAMP_CAPS));
    CAPS.clone()
}

/// What check_layout() looked at in a frame's meta, besides the caps.
#[derive(Clone, Copy, PartialEq, Eq)]
struct LayoutKey {
    format_size: (u32, u32, u32, u32),
    offsets: [u64; MAX_PLANES],
    strides: [u32; MAX_PLANES],
    payload_size: u64,
}

impl LayoutKey {
    fn of(m: &FrameMeta) -> Self {
        Self {
            format_size: (m.video_format, m.width, m.height, m.n_planes),
            offsets: m.plane_offset,
            strides: m.plane_stride,
            payload_size: m.payload_size,
        }
    }
}

/// The VideoMeta flags that match a buffer's video flags.
fn frame_flags(buffer_flags: u32) -> gst_video::VideoFrameFlags {
    let b = gst_video::VideoBufferFlags::from_bits_truncate(buffer_flags);
    let mut f = gst_video::VideoFrameFlags::empty();
    for (bf, ff) in [
        (
            gst_video::VideoBufferFlags::INTERLACED,
            gst_video::VideoFrameFlags::INTERLACED,
        ),
        (
            gst_video::VideoBufferFlags::TFF,
            gst_video::VideoFrameFlags::TFF,
        ),
        (
            gst_video::VideoBufferFlags::RFF,
            gst_video::VideoFrameFlags::RFF,
        ),
        (
            gst_video::VideoBufferFlags::ONEFIELD,
            gst_video::VideoFrameFlags::ONEFIELD,
        ),
        (
            gst_video::VideoBufferFlags::MULTIPLE_VIEW,
            gst_video::VideoFrameFlags::MULTIPLE_VIEW,
        ),
        (
            gst_video::VideoBufferFlags::FIRST_IN_BUNDLE,
            gst_video::VideoFrameFlags::FIRST_IN_BUNDLE,
        ),
    ] {
        if b.contains(bf) {
            f |= ff;
        }
    }
    f
}

/// Checks that the frame's layout matches its caps and lies inside its slot.
pub(super) fn check_layout(frame: &Frame, info: &gst_video::VideoInfo) -> Result<(), String> {
    let m = &frame.meta;
    if m.video_format != info.format().into_glib() as u32
        || m.width != info.width()
        || m.height != info.height()
    {
        return Err(format!(
            "frame {} is {}x{} format {}, caps say {}x{} {}",
            frame.seq,
            m.width,
            m.height,
            m.video_format,
            info.width(),
            info.height(),
            info.format()
        ));
    }
    if m.n_planes != info.n_planes() {
        return Err(format!(
            "frame {} has {} planes, caps say {}",
            frame.seq,
            m.n_planes,
            info.n_planes()
        ));
    }
    for p in 0..info.n_planes() as usize {
        // Each row of the plane must hold its visible bytes (a stride narrower than that makes
        // readers run past the plane), and the last row must end inside the payload.
        let rows = crate::geometry::plane_rows(info, p) as u64;
        let stride = m.plane_stride[p] as u64;
        // Formats packed in groups of pixels (v210, UYVP, the 10-bit ...LE32/LE40 ones) have
        // no per-pixel stride, and tiled formats keep tile counts in the stride: for those,
        // nothing but GStreamer's own layout is accepted.
        let packed = info.format_info().pixel_stride()[..]
            .iter()
            .take(info.format_info().n_components() as usize)
            .any(|&ps| ps <= 0);
        if packed || info.format_info().is_tiled() {
            if stride != info.stride()[p] as u64 || m.plane_offset[p] != info.offset()[p] as u64 {
                return Err(format!(
                    "frame {} plane {p}: {} frames must have the standard layout (stride {}, offset {}), not stride {stride}, offset {}",
                    frame.seq,
                    info.format(),
                    info.stride()[p],
                    info.offset()[p],
                    m.plane_offset[p]
                ));
            }
            if (info.size() as u64) > m.payload_size {
                return Err(format!(
                    "frame {} is {} bytes, {} needs {}",
                    frame.seq,
                    m.payload_size,
                    info.format(),
                    info.size()
                ));
            }
            continue;
        }
        let row_bytes = crate::geometry::plane_row_bytes(info, p) as u64;
        if stride < row_bytes {
            return Err(format!(
                "frame {} plane {p}: stride {stride} is narrower than its {row_bytes} visible bytes a row",
                frame.seq
            ));
        }
        let end = stride
            .checked_mul(rows.saturating_sub(1))
            .and_then(|v| v.checked_add(row_bytes))
            .and_then(|v| v.checked_add(m.plane_offset[p]));
        if end.is_none_or(|e| e > m.payload_size) {
            return Err(format!(
                "frame {} plane {p} (offset {}, stride {stride}, {rows} rows of {row_bytes} bytes) overruns its {} bytes",
                frame.seq, m.plane_offset[p], m.payload_size
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VideoMeta made ahead takes each frame's flags and plane layout.
    #[test]
    fn a_video_meta_made_ahead_takes_the_frames_layout() {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, 64, 48)
            .build()
            .unwrap();
        let mut buffer = gst::Buffer::new();
        let b = buffer.get_mut().unwrap();
        let vm = gst_video::VideoMeta::add_full(
            b,
            gst_video::VideoFrameFlags::empty(),
            info.format(),
            info.width(),
            info.height(),
            info.offset(),
            info.stride(),
        )
        .unwrap()
        .as_mut_ptr();
        for (flags, offsets, strides) in [
            (
                gst_video::VideoFrameFlags::INTERLACED,
                [128, 8192],
                [128, 96],
            ),
            (gst_video::VideoFrameFlags::empty(), [0, 3072], [64, 64]),
        ] {
            // SAFETY: the meta of a buffer we hold writable.
            unsafe { fill_video_meta(vm, flags, &offsets, &strides) };
            let vm = b.meta::<gst_video::VideoMeta>().unwrap();
            assert_eq!(vm.video_frame_flags(), flags);
            assert_eq!(vm.n_planes(), 2);
            assert_eq!(vm.offset(), &offsets[..]);
            assert_eq!(vm.stride(), &strides[..]);
            assert_eq!(
                (vm.format(), vm.width(), vm.height()),
                (info.format(), 64, 48)
            );
        }
    }
}
