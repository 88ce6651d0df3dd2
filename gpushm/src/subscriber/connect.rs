// SPDX-License-Identifier: MPL-2.0
//! Reaching a producer: connect(2) bounded in time (a full listen backlog waits its turn,
//! a readable wake-up ends it), the producer's credentials checked, Hello sent and the
//! Welcome read, with one back-off for a busy producer ([`Backoff`]) used by every way in.
//! Errors that waiting cannot fix are said at once, in words a user can act on.

use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::connection::Announced;
use super::lease::Releaser;
use super::options::ConnectOptions;
use super::wait::Waiting;
use super::{Subscriber, Waker};
use crate::names::Endpoint;
use crate::policy::{check_spin, Delivery};
use crate::ring::consumer_end::ConsumerChannel;
use crate::ring::shm;
use crate::wire::{
    Conn, Message, BUSY_PREFIX, FLAG_AUTO, FLAG_DEVICE_MEMORY, FLAG_LOSSLESS, FLAG_WRITABLE_RING,
};
use crate::{Error, Result};

/// The pause before asking a busy producer again: growing from 5 ms to 250 ms, with some
/// jitter so that consumers started together do not come back together. The one back-off of
/// every way in (connecting, querying).
pub(super) struct Backoff(Duration);

impl Backoff {
    pub fn new() -> Self {
        Self(Duration::from_millis(5))
    }

    /// The next pause.
    pub fn next(&mut self) -> Duration {
        let jitter = Duration::from_nanos(crate::monotonic_ns() % 5_000_000);
        let pause = self.0 + jitter;
        self.0 = (self.0 * 2).min(Duration::from_millis(250));
        pause
    }
}

impl Subscriber {
    /// Connects to `ep` (a socket path, or a stream name looked up at each attempt, see
    /// [`crate::names`]), waiting up to `opts.timeout` for a producer to appear. `waker`
    /// interrupts the wait (`Err(Error::Interrupted)`) and, once connected,
    /// [`Self::next_frame`].
    pub fn connect_to(ep: &Endpoint, opts: &ConnectOptions, waker: &Waker) -> Result<Self> {
        if let Endpoint::Stream(n) = ep {
            crate::names::check_name(n)?;
        }
        check_spin(opts.spin)?;
        let wake = Some(waker.0.as_fd());
        let deadline = Instant::now()
            .checked_add(opts.timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 40));
        let mut backoff = Backoff::new();
        loop {
            match Self::connect_once(ep, opts, waker, deadline) {
                // A producer that dies (or is being replaced) can accept a connection and
                // close it before answering, an impostor may give way to the real one, and a
                // busy producer asks us to try again: try again while time is left.
                Err(e @ (Error::Disconnected | Error::WrongPeer(_) | Error::Busy(_)))
                    if Instant::now() < deadline =>
                {
                    let pause = match e {
                        Error::Busy(_) => backoff
                            .next()
                            .min(deadline.saturating_duration_since(Instant::now())),
                        _ => opts.retry,
                    };
                    if let Some(w) = wake {
                        let ms = pause.as_millis().clamp(1, u16::MAX as u128) as u16;
                        let mut pfd = [PollFd::new(w, PollFlags::POLLIN)];
                        if poll(&mut pfd, PollTimeout::from(ms)).unwrap_or(0) > 0 {
                            return Err(Error::Interrupted);
                        }
                    } else {
                        std::thread::sleep(pause);
                    }
                }
                r => return r,
            }
        }
    }

    fn connect_once(
        ep: &Endpoint,
        opts: &ConnectOptions,
        waker: &Waker,
        deadline: Instant,
    ) -> Result<Self> {
        let wake = Some(waker.0.as_fd());
        let (stream, path) = 'found: loop {
            // A stream name may be in several directories, the first of them left by a
            // producer that was killed: try each; an error waiting cannot fix is final.
            let mut waiting = None;
            for path in ep.candidates()? {
                match connect_bounded(&path, deadline, wake) {
                    Ok(s) => break 'found (s, path),
                    Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => {
                        return Err(Error::Interrupted)
                    }
                    Err(e) if e.raw_os_error() == Some(nix::libc::EAGAIN) => {
                        return Err(backlog_full(&path))
                    }
                    Err(e) if !connect_error_may_pass(&path, &e) => {
                        return Err(connect_error(&path, &e));
                    }
                    Err(e) => {
                        waiting.get_or_insert((path, e));
                    }
                }
            }
            let (path, e) = waiting.expect("candidates() is never empty");
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(match ep {
                    Endpoint::Path(_) => format!(
                        "no gpushmsink is serving {} ({e}); is the producer running?",
                        path.display()
                    ),
                    Endpoint::Stream(n) => format!(
                        "no gpushmsink is serving stream {n:?} (looked in {}); is the producer running, as this user or with {} set alike?",
                        crate::names::search_dirs()
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", "),
                        crate::names::ENV_DIR
                    ),
                }));
            }
            // A producer may appear any moment: retry shortly, unless woken.
            let ms = left.min(opts.retry).as_millis().clamp(1, u16::MAX as u128) as u16;
            if let Some(w) = wake {
                let mut pfd = [PollFd::new(w, PollFlags::POLLIN)];
                if poll(&mut pfd, PollTimeout::from(ms)).unwrap_or(0) > 0 {
                    return Err(Error::Interrupted);
                }
            } else {
                std::thread::sleep(Duration::from_millis(ms as u64));
            }
        };
        let me = nix::unistd::geteuid().as_raw();
        let peer = getsockopt(&stream, PeerCredentials)
            .map_err(|e| Error::os("reading the producer's credentials (SO_PEERCRED)", e))?;
        let accepted = match opts.producer_uid {
            Some(uid) => peer.uid() == uid,
            None => peer.uid() == me || peer.uid() == 0,
        };
        if !accepted {
            return Err(Error::WrongPeer(format!(
                "{} is served by pid {} of uid {}, not by {}: refusing its frames (set producer-uid to accept a producer of another user)",
                path.display(),
                peer.pid(),
                peer.uid(),
                match opts.producer_uid {
                    Some(u) => format!("uid {u} (producer-uid)"),
                    None => format!("this user (uid {me}) or root"),
                }
            )));
        }
        // Non-blocking already (connect_bounded).
        let mut conn = Conn::new(stream);
        conn.send(
            &Message::Hello {
                flags: match opts.delivery() {
                    Delivery::Leaky => 0,
                    Delivery::Lossless => FLAG_LOSSLESS,
                    Delivery::Auto => FLAG_AUTO,
                } | if opts.writable_ring {
                    FLAG_WRITABLE_RING
                } else {
                    0
                } | if opts.device_memory {
                    FLAG_DEVICE_MEMORY
                } else {
                    0
                },
                pid: std::process::id(),
                name: opts.name.clone(),
            },
            &[],
        )?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        let (msg, mut fds) = conn.recv_timeout(left, wake)?.ok_or(Error::Interrupted)?;
        let (client_id, capacity) = match msg {
            Message::Welcome {
                client_id,
                queue_capacity,
            } => (client_id, queue_capacity),
            Message::Error { message } => {
                return Err(match message.strip_prefix(BUSY_PREFIX) {
                    Some(m) => Error::Busy(format!("the producer is busy: {m}")),
                    None => {
                        Error::Refused(format!("the producer refused the connection: {message}"))
                    }
                })
            }
            m => return Err(Error::protocol(format!("expected Welcome, got {m:?}"))),
        };
        let mut fd = || {
            fds.pop()
                .ok_or_else(|| Error::protocol("Welcome arrived without its descriptors"))
        };
        let release = fd()?;
        let ready = fd()?;
        let block = fd()?;
        let ch = ConsumerChannel::open(block, capacity)?;
        let ready = shm::Doorbell::from_peer(ready, "the frame-ready doorbell")?;
        let release = shm::Doorbell::from_peer(release, "the slot-released doorbell")?;
        let mut c = Self {
            conn: ManuallyDrop::new(conn),
            client_id,
            releaser: Arc::new(Releaser::new(ch, release)),
            announced: Announced::new(opts),
            waiting: Waiting::new(ready, opts),
            wake: waker.0.clone(),
        };
        c.pump()?;
        Ok(c)
    }
}

/// Whether a failed connect() may succeed later: nobody listens yet (no socket file, or a
/// stale one). Anything else (no permission, not a socket, a path too long) will not fix
/// itself.
fn connect_error_may_pass(path: &Path, e: &std::io::Error) -> bool {
    use std::os::unix::fs::FileTypeExt;
    match e.raw_os_error().map(nix::errno::Errno::from_raw) {
        Some(nix::errno::Errno::ENOENT) => true,
        // Linux answers ECONNREFUSED for a regular file or a directory too.
        Some(nix::errno::Errno::ECONNREFUSED) => {
            std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
        }
        _ => false,
    }
}

/// A readable error for a connect() that will not succeed by waiting.
fn connect_error(path: &Path, e: &std::io::Error) -> Error {
    use std::os::unix::fs::FileTypeExt;
    let p = path.display();
    if let Ok(m) = std::fs::metadata(path) {
        if m.is_dir() {
            return Error::Invalid(format!(
                "{p} is a directory, not a gpushmsink socket; set socket-path to the producer's socket-path"
            ));
        }
        if !m.file_type().is_socket() {
            return Error::Invalid(format!(
                "{p} is not a socket (a regular file or other node); set socket-path to the producer's socket-path"
            ));
        }
    }
    match e.raw_os_error().map(nix::errno::Errno::from_raw) {
        Some(nix::errno::Errno::EACCES) | Some(nix::errno::Errno::EPERM) => Error::Invalid(format!(
            "no permission to connect to {p}: the producer's socket (perms on gpushmsink) or a directory on the path does not allow this user"
        )),
        None if e.kind() == std::io::ErrorKind::InvalidInput => Error::Invalid(format!(
            "socket path {p} is too long: unix socket paths hold at most {} bytes",
            crate::MAX_SOCKET_PATH
        )),
        Some(errno) => Error::os(format!("cannot connect to {p}"), errno),
        None => Error::Invalid(format!("cannot connect to {p}: {e}")),
    }
}

/// connect(2) that never blocks past `deadline`: with the listener's backlog full (a producer
/// that is stopped or swamped) it waits its turn in slices, then returns EAGAIN; a readable
/// `wake` (looked at between slices) returns EINTR. A path too long for a unix socket is
/// InvalidInput (no errno). The stream it returns is non-blocking.
pub(super) fn connect_bounded(
    path: &std::path::Path,
    deadline: Instant,
    wake: Option<BorrowedFd<'_>>,
) -> std::io::Result<UnixStream> {
    use nix::errno::Errno;
    use nix::sys::socket::{
        connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr,
    };
    // Blocking, but never past a slice of the time left: with the listener's backlog full, a
    // blocking connect(2) waits in the listener's queue of connectors, woken in turn as room
    // comes, where a non-blocking one retried later loses every race to clients already
    // waiting there (a flood's). SO_SNDTIMEO bounds each wait (a stopped producer's full
    // backlog would otherwise block it for good); `wake` is looked at between slices. The
    // socket is ours alone until it is connected, and non-blocking from then on.
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new(path).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket path too long")
    })?;
    let slice = Duration::from_millis(if wake.is_some() { 10 } else { 100 });
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Zero would mean no bound at all: at least a microsecond.
        let wait = left.min(slice).max(Duration::from_micros(1));
        let tv = nix::sys::time::TimeVal::new(
            wait.as_secs() as nix::sys::time::time_t,
            wait.subsec_micros() as nix::sys::time::suseconds_t,
        );
        setsockopt(&fd, sockopt::SendTimeout, &tv)?;
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                let stream = UnixStream::from(fd);
                stream.set_nonblocking(true)?;
                return Ok(stream);
            }
            Err(Errno::EAGAIN) if Instant::now() < deadline => {
                if let Some(w) = wake {
                    let mut pfd = [PollFd::new(w, PollFlags::POLLIN)];
                    if poll(&mut pfd, PollTimeout::ZERO).unwrap_or(0) > 0 {
                        return Err(Errno::EINTR.into());
                    }
                }
            }
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// What a full backlog past the deadline says.
fn backlog_full(path: &std::path::Path) -> Error {
    Error::Timeout(format!(
        "{}: the producer takes no connections (its queue is full: is it stopped?)",
        path.display()
    ))
}

/// A connection to `path` made without blocking past `deadline` (a stopped producer's full
/// backlog would block connect(2) for good). A socket nobody listens on is `Error::Os` with
/// ECONNREFUSED.
pub(super) fn connect_within(path: &std::path::Path, deadline: Instant) -> Result<UnixStream> {
    connect_bounded(path, deadline, None).map_err(|e| match e.raw_os_error() {
        Some(nix::libc::EAGAIN) => backlog_full(path),
        Some(nix::libc::ECONNREFUSED) => Error::os(
            format!("{}: no producer listens (stale socket)", path.display()),
            nix::errno::Errno::ECONNREFUSED,
        ),
        _ => connect_error(path, &e),
    })
}
