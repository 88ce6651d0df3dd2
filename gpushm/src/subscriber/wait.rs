// SPDX-License-Identifier: MPL-2.0
//! Waiting for the next frame: asleep on the frame-ready doorbell and the control socket, or
//! in low-latency mode polling the ring around the time the next frame is due
//! ([`crate::subscriber::ConnectOptions::spin`]), and the short poll after a wake-up ahead of a
//! frame ([`crate::server::Server::wake_early`]).

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;

use super::options::ConnectOptions;
use super::Subscriber;
use crate::policy::{BACK_TO_BACK_MISSES, BACK_TO_BACK_PAUSE, BACK_TO_BACK_POLL, EARLY_WAKE_POLL};
use crate::ring::shm;
use crate::{Error, Result};

/// The descriptors of a connection to poll on. They stay open while the connection lives; the
/// caller must not let it be dropped during a wait.
#[derive(Clone, Copy)]
struct WaitFds {
    ready: RawFd,
    socket: RawFd,
}

impl WaitFds {
    fn of(c: &Subscriber) -> Self {
        Self {
            ready: c.waiting.ready.as_raw_fd(),
            socket: c.conn.raw_fd(),
        }
    }

    /// Blocks until a frame may be ready, the socket has news, `wake` fires or `timeout` ends.
    /// Returns also whether the socket was readable (or hung up).
    #[link_section = ".text.hot.gpushm"]
    fn wait(&self, wake: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<(Wait, bool)> {
        // ppoll: a timeout to the µs (low-latency mode sleeps until just before a frame).
        let t = timeout.map(|d| TimeSpec::from_duration(d.min(Duration::from_secs(1 << 31))));
        // SAFETY: the caller keeps the connection, which owns both descriptors, alive.
        let (ready, sock) = unsafe {
            (
                BorrowedFd::borrow_raw(self.ready),
                BorrowedFd::borrow_raw(self.socket),
            )
        };
        let mut pfds = [
            PollFd::new(wake, PollFlags::POLLIN),
            PollFd::new(ready, PollFlags::POLLIN),
            PollFd::new(sock, PollFlags::POLLIN),
        ];
        let n = match nix::poll::ppoll(&mut pfds, t, None) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => return Ok((Wait::Ready, true)),
            Err(e) => return Err(Error::os("poll", e)),
        };
        if pfds[0].any().unwrap_or(false) {
            return Ok((Wait::Woken, false));
        }
        if n == 0 {
            return Ok((Wait::TimedOut, false));
        }
        Ok((Wait::Ready, pfds[2].any().unwrap_or(true)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// Something may be ready: call `try_next` again.
    Ready,
    /// The wake descriptor fired (unlock).
    Woken,
    TimedOut,
}

/// How a subscriber's low-latency mode ([`ConnectOptions::spin`](crate::subscriber::ConnectOptions::spin)) fares: tune the budget by
/// it. A frame that comes while the ring is polled saves the wake-up; a poll that ends without
/// one cost its whole budget (the stream paused, changed its cadence, or jitters more than the
/// budget covers).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SpinStats {
    /// Frames that came while the ring was polled.
    pub caught: u64,
    /// Polls that ended without a frame.
    pub missed: u64,
}

/// How a subscriber waits: its frame-ready doorbell, what poll() said of the socket, and the
/// low-latency mode's and early wake-ups' state.
pub(super) struct Waiting {
    /// Readable when the producer delivered a frame while we wait.
    pub ready: shm::Doorbell,
    /// poll() saw the socket readable (or hung up) since it was last read.
    pub socket_ready: bool,
    /// The caller polls the frame-ready doorbell itself ([`Subscriber::poll_fds`]): the
    /// producer rings it after every delivery, not only while we wait.
    pub always_wake: AtomicBool,
    /// Low-latency mode's budget per frame ([`ConnectOptions::spin`]; zero: off).
    pub spin: Duration,
    /// When the next frame is due (low-latency mode).
    pub cadence: crate::cadence::Cadence,
    /// This thread's timer slack, ns (low-latency mode wakes up that much earlier).
    pub slack_ns: u64,
    /// Low-latency mode: frames that came while polling, and polls that ended without one.
    pub spin_stats: SpinStats,
    /// A wake-up that finds no frame may poll for it ([`EARLY_WAKE_POLL`]): once per frame
    /// taken, so that a producer that rings for nothing costs us one poll a frame at most.
    pub early_poll: bool,
    /// Those polls: frames they caught, and polls that ended without one.
    pub early_stats: SpinStats,
    /// The last frame taken was of a live stream (true before the first: nothing to poll
    /// for yet).
    pub live: bool,
    /// The wait after a frame of a stream that comes back to back may poll for the next one
    /// ([`BACK_TO_BACK_POLL`]): once per frame taken.
    pub back_to_back_poll: bool,
    /// Those polls: frames they caught, and polls that ended without one.
    pub back_to_back_stats: SpinStats,
    /// This process may use more than one CPU (its affinity and its cgroup's quota, as
    /// `available_parallelism` reads them): polling cannot keep the producer from its own (see
    /// [`BACK_TO_BACK_POLL`]).
    pub back_to_back_cpus: bool,
    /// Polls in a row that ended without a frame, and the frames still to wait for asleep
    /// after [`BACK_TO_BACK_MISSES`] of them.
    pub back_to_back_misses: u32,
    pub back_to_back_pause: u32,
}

impl Waiting {
    pub fn new(ready: shm::Doorbell, opts: &ConnectOptions) -> Self {
        Self {
            ready,
            socket_ready: true,
            always_wake: AtomicBool::new(false),
            spin: opts.spin,
            cadence: Default::default(),
            slack_ns: if opts.spin.is_zero() {
                0
            } else {
                crate::cadence::timer_slack_ns()
            },
            spin_stats: SpinStats::default(),
            early_poll: true,
            early_stats: SpinStats::default(),
            live: true,
            back_to_back_poll: false,
            back_to_back_stats: SpinStats::default(),
            back_to_back_cpus: std::thread::available_parallelism().map_or(true, |n| n.get() > 1),
            back_to_back_misses: 0,
            back_to_back_pause: 0,
        }
    }
}

impl Subscriber {
    /// Blocks until a frame may be ready, the socket has news, `wake` fires or `timeout` ends.
    /// In low-latency mode, polls the ring around the time the next frame is due first,
    /// calling `warm_up` as the poll starts.
    #[link_section = ".text.hot.gpushm"]
    pub(super) fn wait(
        &mut self,
        wake: BorrowedFd<'_>,
        timeout: Option<Duration>,
        warm_up: &mut dyn FnMut(),
    ) -> Result<Wait> {
        if self.waiting.spin.is_zero() {
            let start = Instant::now();
            if self.poll_back_to_back(timeout) {
                return Ok(Wait::Ready);
            }
            let r = self.wait_blocking(wake, timeout.map(|t| t.saturating_sub(start.elapsed())))?;
            if r == Wait::Ready {
                self.poll_after_early_wake(timeout.map(|t| t.saturating_sub(start.elapsed())));
            }
            return Ok(r);
        }
        let start = Instant::now();
        let deadline = timeout.and_then(|t| start.checked_add(t));
        if let Some(r) = self.wait_spinning(wake, deadline, warm_up)? {
            return Ok(r);
        }
        self.wait_blocking(
            wake,
            deadline.map(|d| d.saturating_duration_since(Instant::now())),
        )
    }

    /// Low-latency mode ([`ConnectOptions::spin`](crate::subscriber::ConnectOptions::spin)): if the next frame's time is known and a
    /// poll was not spent on it yet, sleeps (woken by a frame as usual) until a little before
    /// it is due, then polls the ring for at most the budget. `None`: no frame came in that
    /// time (or no poll is due): wait as usual.
    #[link_section = ".text.hot.gpushm"]
    fn wait_spinning(
        &mut self,
        wake: BorrowedFd<'_>,
        deadline: Option<Instant>,
        warm_up: &mut dyn FnMut(),
    ) -> Result<Option<Wait>> {
        let Some(due) = self.waiting.cadence.take_due() else {
            return Ok(None);
        };
        let half = self.waiting.spin.as_nanos() as u64 / 2;
        let now = crate::monotonic_ns();
        if now >= due.saturating_add(half) {
            // Late past the window already (the stream paused, or we came late): sleep.
            return Ok(None);
        }
        if self.waiting.always_wake.load(Ordering::Relaxed) && !self.waiting.ready.drain() {
            // (The doorbell rings for every frame, the caller polls it too: what it said of
            // frames taken already must not end the sleep below at once.)
            return Ok(Some(self.doorbell_closed()));
        }
        // Awake half the budget before the frame is due, the timer's slack allowed for.
        let wake_at = due.saturating_sub(half + self.waiting.slack_ns);
        if wake_at > now {
            let mut sleep = Duration::from_nanos(wake_at - now);
            if let Some(d) = deadline {
                sleep = sleep.min(d.saturating_duration_since(Instant::now()));
            }
            match self.wait_blocking(wake, Some(sleep))? {
                Wait::TimedOut if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Ok(Some(Wait::TimedOut))
                }
                Wait::TimedOut => {}
                // Rung ahead of a frame (the producer's wake-early), from another CPU: the
                // frame is on its way, poll for it from now.
                Wait::Ready if self.woken_early_elsewhere() => {}
                // A frame came early, news on the socket, or woken.
                r => return Ok(Some(r)),
            }
        }
        // Awake before the frame: what its way will read, read now (after a sleep it is out
        // of the caches and the TLB, and each miss costs on the frame's way): ours, then the
        // caller's.
        std::hint::black_box((
            self.announced.rings.back().map(|r| r.warm_up()),
            self.announced.caps.back().map(|c| c.0),
            self.releaser.leases.load(Ordering::Relaxed),
        ));
        warm_up();
        // Poll, the producer not asked to ring (it saves the system call too).
        let ch = &self.releaser.ch;
        let mut end = Instant::now() + self.waiting.spin;
        if let Some(d) = deadline {
            end = end.min(d);
        }
        loop {
            if ch.has_delivery() {
                self.waiting.spin_stats.caught += 1;
                return Ok(Some(Wait::Ready));
            }
            if Instant::now() >= end {
                break;
            }
            for _ in 0..16 {
                std::hint::spin_loop();
            }
        }
        self.waiting.spin_stats.missed += 1;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Some(Wait::TimedOut));
        }
        Ok(None)
    }

    /// Before sleeping after a frame of a stream that is not live and whose frames come less
    /// than [`BACK_TO_BACK_POLL`] apart: polls the ring for the next frame for up to twice
    /// their interval (at most that, never past `timeout`), once per frame taken. A producer
    /// flat out then delivers without ringing us: its wake-up would cost it a system call and
    /// an interrupt to our core on every frame. Not on a single CPU, and not for the next
    /// [`BACK_TO_BACK_PAUSE`] frames after [`BACK_TO_BACK_MISSES`] polls in a row in vain.
    /// The wake descriptor and the socket are not looked at meanwhile: an unlock, an event or
    /// the end waits for the poll's end (500 µs at most). True: a frame came.
    #[link_section = ".text.hot.gpushm"]
    fn poll_back_to_back(&mut self, timeout: Option<Duration>) -> bool {
        // A look without waiting (a zero timeout) does not spend the frame's poll.
        if timeout.is_some_and(|t| t.is_zero())
            || !std::mem::take(&mut self.waiting.back_to_back_poll)
            || self.waiting.live
            || !self.waiting.back_to_back_cpus
            || self.waiting.always_wake.load(Ordering::Relaxed)
        {
            return false;
        }
        if self.waiting.back_to_back_pause > 0 {
            self.waiting.back_to_back_pause -= 1;
            return false;
        }
        let Some(interval) = self.waiting.cadence.interval() else {
            return false;
        };
        let limit = BACK_TO_BACK_POLL.as_nanos() as u64;
        if interval >= limit {
            return false;
        }
        let mut window = Duration::from_nanos((2 * interval).min(limit));
        if let Some(t) = timeout {
            window = window.min(t);
        }
        let ch = &self.releaser.ch;
        let end = Instant::now() + window;
        loop {
            if ch.has_delivery() {
                self.waiting.back_to_back_stats.caught += 1;
                self.waiting.back_to_back_misses = 0;
                return true;
            }
            if Instant::now() >= end {
                self.waiting.back_to_back_stats.missed += 1;
                self.waiting.back_to_back_misses += 1;
                if self.waiting.back_to_back_misses >= BACK_TO_BACK_MISSES {
                    self.waiting.back_to_back_misses = 0;
                    self.waiting.back_to_back_pause = BACK_TO_BACK_PAUSE;
                }
                return false;
            }
            // Give the CPU to whatever else may run on it: with more consumers than spare
            // cores, a spinning one would keep the producer from the frame it waits for.
            std::thread::yield_now();
        }
    }

    /// After a wake-up that found no frame and no news on the socket: the producer rang
    /// ahead of a frame ([`crate::server::Server::wake_early`]) and we woke before it
    /// was published. Polls the ring for it for up to [`EARLY_WAKE_POLL`] (never past
    /// `timeout`), once per frame taken: sleeping again would cost a second wake-up, tens of
    /// µs on machines where the first took longer than the producer's way to the publish.
    #[link_section = ".text.hot.gpushm"]
    fn poll_after_early_wake(&mut self, timeout: Option<Duration>) {
        if !self.waiting.early_poll || !self.woken_early_elsewhere() {
            return;
        }
        let ch = &self.releaser.ch;
        self.waiting.early_poll = false;
        let end = Instant::now() + timeout.map_or(EARLY_WAKE_POLL, |t| t.min(EARLY_WAKE_POLL));
        while !ch.has_delivery() && Instant::now() < end {
            for _ in 0..16 {
                std::hint::spin_loop();
            }
        }
        if ch.has_delivery() {
            self.waiting.early_stats.caught += 1;
        } else {
            self.waiting.early_stats.missed += 1;
        }
    }

    /// Whether the last sleep (in a subscriber's wait, not an event loop's) was ended by the
    /// producer ringing ahead of a frame, from another CPU than ours, and nothing is there
    /// yet: polling then costs the producer nothing. Woken on the producer's CPU (the
    /// scheduler's choice for a socket's wake-up) we would keep it from publishing.
    fn woken_early_elsewhere(&self) -> bool {
        let ch = &self.releaser.ch;
        let from = ch.early_wake_cpu();
        from != 0
            && !self.waiting.always_wake.load(Ordering::Relaxed)
            && !self.waiting.socket_ready
            && !ch.has_delivery()
            && crate::ring::layout::this_cpu() != from
    }

    /// Sleeps on the descriptors until a frame may be ready, the socket has news, `wake`
    /// fires or `timeout` ends.
    #[link_section = ".text.hot.gpushm"]
    fn wait_blocking(&mut self, wake: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<Wait> {
        let always = self.waiting.always_wake.load(Ordering::Relaxed);
        if !always && !self.waiting.ready.drain() {
            // Cleared before asking, not after waking: the system call is then off the way
            // of the next frame. A wake-up written from here on stays readable for poll.
            return Ok(self.doorbell_closed());
        }
        let ch = &self.releaser.ch;
        // Ask for a wake-up, then look once more: a frame delivered before the producer saw
        // the request came without one.
        ch.set_waiting(if always {
            crate::ring::layout::WAITS_POLLED
        } else {
            crate::ring::layout::WAITS_SLEEPING
        });
        if ch.has_delivery() {
            if !always {
                ch.set_waiting(0);
            }
            return Ok(Wait::Ready);
        }
        let w = WaitFds::of(self);
        let r = w.wait(wake, timeout);
        if !always {
            self.releaser.ch.set_waiting(0);
        }
        let (r, socket_readable) = r?;
        if socket_readable {
            self.waiting.socket_ready = true;
        }
        // The caller's own poll sees the descriptor: readable only while news may wait.
        if always && matches!(r, Wait::Ready) && !self.waiting.ready.drain() {
            return Ok(self.doorbell_closed());
        }
        Ok(r)
    }

    /// The producer closed its end of the frame-ready doorbell, which stays readable for
    /// good (polling on would spin). A producer that exits closes it with its socket: what
    /// the socket says (EOS, the end) is read, after waiting a moment for it to close too.
    /// One that keeps its socket open and closed only the doorbell is broken, and gone for us.
    #[cold]
    #[inline(never)]
    fn doorbell_closed(&mut self) -> Wait {
        // SAFETY: the socket is ours while `self` lives.
        let sock = unsafe { BorrowedFd::borrow_raw(self.conn.raw_fd()) };
        let mut pfd = [PollFd::new(sock, PollFlags::POLLIN)];
        let _ = nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(100u16));
        if let Err(e) = self.pump() {
            self.announced.gone.get_or_insert(e);
        }
        if !self.announced.eos {
            self.announced.gone.get_or_insert(Error::protocol(
                "the producer closed its end of the frame-ready doorbell",
            ));
        }
        Wait::Ready
    }
}
