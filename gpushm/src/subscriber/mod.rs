// SPDX-License-Identifier: MPL-2.0
//! The consumer's side: [`Subscriber`] connects to a producer, maps its rings and takes
//! frames from the delivery queue. Each frame comes with a [`SlotLease`] that gives the slot back when
//! dropped, on whatever thread that happens.
//!
//! # Held frames
//!
//! The one rule every binding (Rust, gpushmsrc, Python, C) follows, because they all hold
//! frames through a [`SlotLease`]:
//!
//! - **A frame's slot is never reused while any lease on it lives**, whatever happens to the
//!   [`Subscriber`] (or gpushmsrc element, or Python object) it came from. A Python view, a
//!   DLPack tensor or a GstBuffer made from a frame holds its lease; the slot goes back to the
//!   producer when the last of them is gone.
//! - **Closing a subscriber** (dropping it, `close()`, gpushmsrc going to NULL) tells the
//!   producer (a `Close` message) that it takes no more frames. The producer delivers nothing
//!   more, never waits for it (even a lossless one), takes back the frames it delivered that
//!   were not taken yet, and leaves the held ones alone. The connection's socket stays open,
//!   owned by the leases, until the last one is dropped: then the producer sees it close and
//!   knows that nothing is held any more.
//! - **The one exception: a consumer the producer cuts.** A producer that has to go on cuts a
//!   consumer when it has waited [`crate::policy::STARVATION_TIMEOUT`] for a slot with every
//!   slot of its ring held: a closed consumer still holding frames first, else one holding
//!   more than its fair share (the ring's slots over the open consumers, which no budget
//!   exceeds: gpushmsrc and Python copy what they keep past theirs); a consumer that keeps
//!   within its share is never cut, except in a crowded ring (as many open consumers as slots
//!   less one, or more): there, while the producer waits for a slot with every slot held, the
//!   consumers holding the oldest frame are cut at once. The rules, and why, are
//!   `server/fairness.rs`'s. The producer marks
//!   the consumer's control block before it takes the slots back, then says why (an `Error`
//!   message): from then on [`SlotLease::is_valid`] is false and [`SlotLease::revoked`] says
//!   why, whether the subscriber is open, closed or no longer reading. Python frames then
//!   refuse new views (`Frame.valid`, `FrameRevoked`); gpushmsrc posts the producer's reason
//!   as its error. Memory already handed out (a NumPy array, a tensor, a GstBuffer downstream)
//!   cannot be taken back: **it may then show newer frames**.
//! - A producer that stops or dies does not revalidate anything: its ring stays mapped in the
//!   consumer, and nobody writes it any more, so frames held stay valid.
//!
//! - `options`: what a consumer asks for ([`ConnectOptions`]).
//! - `connect`: reaching a producer, with one back-off for a busy one.
//! - `connection`: one connection's messages, rings and frames.
//! - `wait`: sleeping or polling for the next frame (low-latency mode, early wake-ups).
//! - `lease`: giving a held frame's slot back ([`SlotLease`]).
//! - `frame`: a frame taken from the ring ([`Frame`]).
//! - `query`: asking a producer for its figures without becoming its client.
//! - `reconnect`: following a producer that goes away and comes back ([`Link`]).

mod connect;
mod connection;
mod frame;
mod lease;
mod options;
mod query;
mod reconnect;
mod wait;

use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::eventfd::EventFd;

use self::connection::Announced;
use self::lease::Releaser;
use self::wait::Waiting;
use crate::names::Endpoint;
use crate::ring::shm;
use crate::wire::Conn;
use crate::{Error, Result};

pub use self::frame::Frame;
pub use self::lease::SlotLease;
pub use self::options::ConnectOptions;
pub use self::query::{query, Queried};
pub use self::reconnect::Link;
pub use self::wait::SpinStats;
use self::wait::Wait;
pub use crate::policy::Delivery;

/// A consumer for apps without GStreamer: connects to a gpushmsink or a
/// [`crate::publisher::Publisher`] and yields frames that point into the shared ring. A
/// frame's slot goes back to the producer when the [`Frame`] is dropped, on any thread.
///
/// ```no_run
/// use gpushm::subscriber::{ConnectOptions, Subscriber};
/// let mut sub = Subscriber::connect("/tmp/cam".as_ref(), ConnectOptions::default()).unwrap();
/// while let Some(frame) = sub.next_frame(None).unwrap() {
///     let layout = frame.layout().unwrap();
///     println!("frame {} {} {}x{}", frame.meta.offset, layout.format, layout.width, layout.height);
/// }
/// ```
pub struct Subscriber {
    /// The control socket; moved into the releaser when the subscriber is dropped while
    /// frames are held (see `connection.rs`).
    conn: ManuallyDrop<Conn>,
    client_id: u32,
    /// Gives held frames back; shared with every lease.
    releaser: Arc<Releaser>,
    /// What the producer announced (`connection.rs`).
    announced: Announced,
    /// How we wait for the next frame (`wait.rs`).
    waiting: Waiting,
    /// Interrupts a wait ([`Waker`]).
    wake: Arc<EventFd>,
}

/// Interrupts a [`Subscriber`] waiting in [`Subscriber::next_frame`], from any thread.
#[derive(Clone)]
pub struct Waker(Arc<EventFd>);

impl Waker {
    /// A waker of its own, to interrupt [`Subscriber::connect_with_waker`] while it waits for a
    /// producer, and then the subscriber's waits.
    pub fn new() -> Result<Self> {
        Ok(Self(Arc::new(shm::new_eventfd()?)))
    }

    pub fn wake(&self) {
        shm::notify(&self.0);
    }

    /// Forgets a wake nobody consumed (the next wait blocks again).
    pub fn clear(&self) {
        shm::drain(&self.0);
    }
}

impl Subscriber {
    /// Connects to the producer at `path`, waiting up to `opts.timeout` for one to appear.
    pub fn connect(path: &Path, opts: ConnectOptions) -> Result<Self> {
        Self::connect_with_waker(path, &opts, &Waker::new()?)
    }

    /// Connects like [`Self::connect`]; `waker` interrupts the wait for a producer
    /// (`Err(Error::Interrupted)`) and, once connected, [`Self::next_frame`].
    pub fn connect_with_waker(path: &Path, opts: &ConnectOptions, waker: &Waker) -> Result<Self> {
        Self::connect_to(&Endpoint::Path(path.to_owned()), opts, waker)
    }

    /// Connects to the producer of stream `name` (see [`crate::names`]), waiting up to
    /// `opts.timeout` for one to appear.
    pub fn connect_stream(name: &str, opts: ConnectOptions) -> Result<Self> {
        crate::names::check_name(name)?;
        Self::connect_to(&Endpoint::Stream(name.into()), &opts, &Waker::new()?)
    }

    /// The producer sent EOS: no frame follows the ones already delivered.
    pub fn is_eos(&self) -> bool {
        self.announced.eos
    }

    /// Our id in the producer's logs and statistics.
    pub fn client_id(&self) -> u32 {
        self.client_id
    }

    /// Frames the producer lets us reference at once (0: it did not say).
    pub fn budget(&self) -> u32 {
        self.releaser.ch.budget()
    }

    /// Frames of this subscriber alive now, wherever they are.
    pub fn held(&self) -> usize {
        self.releaser.leases.load(Ordering::Acquire)
    }

    /// Sends `payload` (an event for the producer's pipeline, see [`crate::wire`]) to the
    /// producer. Never waits: a producer that does not read its socket fails it.
    pub fn send_upstream(&self, payload: &str) -> Result<()> {
        self.conn.send(
            &crate::wire::Message::Upstream {
                payload: payload.to_string(),
            },
            &[],
        )
    }

    /// Whether another frame seems to be waiting for us already (a hint, read without a
    /// system call): a consumer that finds one as it takes a frame is behind.
    pub fn has_frame(&self) -> bool {
        self.releaser.ch.has_delivery()
    }

    /// Frames to keep zero-copy at most (our budget less room for frames on their way).
    pub fn zero_copy_limit(&self) -> usize {
        crate::policy::zero_copy_limit(self.budget() as usize)
    }

    /// Whether the frame just taken should be copied out of the ring and dropped at once
    /// (we hold more than [`Self::zero_copy_limit`] frames), and if so how many we hold. A
    /// consumer that keeps frames for long (an encoder, a queue) copies past that limit, so
    /// the producer never waits for it and frames keep arriving.
    pub fn should_copy(&self) -> Option<usize> {
        let held = self.held();
        (self.budget() > 0 && held > self.zero_copy_limit()).then_some(held)
    }

    /// Counts a frame copied out of the ring (reported in the producer's statistics too);
    /// returns the count.
    pub fn count_copy(&self) -> u64 {
        let n = self.releaser.copied.fetch_add(1, Ordering::Relaxed) + 1;
        self.releaser.ch.set_copied(n);
        n
    }

    /// Frames copied out of the ring so far.
    pub fn copied(&self) -> u64 {
        self.releaser.copied.load(Ordering::Relaxed)
    }

    /// The next frame: `Ok(None)` at the end of the stream (the producer sent EOS),
    /// `Err(Error::Timeout)` when none came within `timeout` (`None`: wait as long as it
    /// takes), `Err(Error::Interrupted)` when woken ([`Self::waker`]), `Err(Disconnected)`
    /// or another error when the producer went away.
    #[link_section = ".text.hot.gpushm"]
    pub fn next_frame(&mut self, timeout: Option<Duration>) -> Result<Option<Frame>> {
        self.next_frame_warming(timeout, &mut || {})
    }

    /// [`Self::next_frame`], for the low-latency mode ([`ConnectOptions::spin`]): `warm_up`
    /// runs as each poll for the frame starts, a little before the frame is due, to read what
    /// the caller's way with the frame will read (its own structures, the buffers it fills).
    /// After a sleep those are out of the caches and the TLB, and each miss costs on the
    /// frame's way: read once while waiting, they cost it nothing (gpushmsrc's way from the
    /// ring to its source pad took 5 µs less on the H200 machine). It runs at most once a
    /// frame, never without the mode, and must not block.
    #[link_section = ".text.hot.gpushm"]
    pub fn next_frame_warming(
        &mut self,
        timeout: Option<Duration>,
        warm_up: &mut dyn FnMut(),
    ) -> Result<Option<Frame>> {
        // A timeout too large to add is no timeout.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut polled = false;
        loop {
            if let Some(f) = self.try_next_frame()? {
                return Ok(Some(f));
            }
            if self.announced.eos {
                return Ok(None);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // Poll at least once, even with no time left: that takes note of what the
            // descriptors say (a frame, EOS, the producer's end), so an event loop that calls
            // with a zero timeout when they are readable does not spin.
            if polled && left.is_some_and(|l| l.is_zero()) {
                return Err(Error::Timeout("no frame from the producer".into()));
            }
            polled = true;
            let wake = self.wake.clone();
            match self.wait(wake.as_fd(), left, warm_up)? {
                Wait::Woken => {
                    shm::drain(&wake);
                    return Err(Error::Interrupted);
                }
                Wait::TimedOut => return Err(Error::Timeout("no frame from the producer".into())),
                Wait::Ready => {}
            }
        }
    }

    /// How the low-latency mode fares ([`ConnectOptions::spin`]; zeros when it is off).
    pub fn spin_stats(&self) -> SpinStats {
        self.waiting.spin_stats
    }

    /// The polls run after the producer woke us ahead of a frame
    /// ([`crate::server::Server::wake_early`]) while it was not published yet, without
    /// the low-latency mode (with it, they count in [`Self::spin_stats`]): frames they caught,
    /// and polls that ended without one (each cost up to [`crate::policy::EARLY_WAKE_POLL`]).
    pub fn early_polls(&self) -> SpinStats {
        self.waiting.early_stats
    }

    /// The polls run after a frame of a stream that is not live and comes back to back, before
    /// sleeping ([`crate::policy::BACK_TO_BACK_POLL`]): frames they caught (each a wake-up the
    /// producer did not ring), and polls that ended without one.
    pub fn back_to_back_polls(&self) -> SpinStats {
        self.waiting.back_to_back_stats
    }

    /// Interrupts [`Self::next_frame`] from another thread.
    pub fn waker(&self) -> Waker {
        Waker(self.wake.clone())
    }

    /// The producer's newest caps (a GStreamer caps string).
    pub fn caps(&self) -> Option<Arc<str>> {
        self.announced.caps.back().map(|c| c.1.clone())
    }

    /// Frames the producer did not hand us (we fell behind).
    pub fn dropped(&self) -> u64 {
        self.releaser.ch.dropped()
    }

    /// Descriptors to poll (readable) in an event loop before calling [`Self::next_frame`]:
    /// the frame-ready eventfd and the control socket (news, or the producer's end).
    pub fn poll_fds(&self) -> [RawFd; 2] {
        // From now on the producer rings the doorbell after every delivery.
        self.waiting.always_wake.store(true, Ordering::Relaxed);
        self.releaser
            .ch
            .set_waiting(crate::ring::layout::WAITS_POLLED);
        [self.waiting.ready.as_raw_fd(), self.conn.raw_fd()]
    }
}

#[cfg(test)]
mod tests;
