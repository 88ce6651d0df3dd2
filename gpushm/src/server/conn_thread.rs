// SPDX-License-Identifier: MPL-2.0
//! The connection thread (`gpushmsink-ipc`): one poll over the listener, every client's
//! socket and slot-released doorbell and every pending handshake, then one round of work under
//! the engine's lock: accept, handshakes, Close messages and departures, releases, the
//! starvation check, wake-ups ahead of frames. The descriptors are collected under the lock
//! and polled without it.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Weak;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;

use super::client::Client;
use super::slots::give_back;
use super::stats::Stats;
use super::{socket, Event, Server};
use crate::ring::frame::Entry;
use crate::ring::shm;
use crate::wire::Message;
use crate::{Error, Result};

/// What a polled descriptor is.
#[derive(Clone, Copy)]
enum Kind {
    Wake,
    Listen,
    Socket(u32),
    Release(u32),
    Pending(usize),
}

/// Starts the thread; it ends when the server is gone or shut down.
pub(super) fn spawn<P: Send + 'static>(server: Weak<Server<P>>) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("gpushmsink-ipc".into())
        .spawn(move || {
            // Its polls time wake-ups ahead of frames (set_wake_ahead): to the µs, not
            // within the default 50 µs of slack.
            let _ = nix::sys::prctl::set_timerslack(1_000);
            if let Some(s) = server.upgrade() {
                s.connection_tid.store(
                    nix::unistd::gettid().as_raw(),
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            while let Some(s) = server.upgrade() {
                if !s.serve_once() {
                    break;
                }
            }
        })
        .map_err(|e| Error::os("spawning the connection thread", socket::errno(&e)))
}

impl<P: Send + 'static> Server<P> {
    /// One round of the connection thread. Returns false when it should stop.
    fn serve_once(&self) -> bool {
        // Collect what to poll under the lock, poll without it.
        let (raw, deadline, has_clients, ahead_at) = {
            let mut inner = self.lock();
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
            let closing = inner.clients.take_closing();
            if !closing.is_empty() {
                self.reap(Box::new(closing));
            }
            let mut raw: Vec<(RawFd, Kind)> = vec![(self.wake.as_raw_fd(), Kind::Wake)];
            // The listener is polled while a connection may be accepted, otherwise the poll
            // ends when one may.
            let admit_at = if inner.admission.available(Instant::now()) > 0 {
                raw.push((self.socket.listener.as_raw_fd(), Kind::Listen));
                None
            } else {
                Some(inner.admission.next_at())
            };
            let waits = inner.clients.producer_waits();
            for c in inner.clients.iter() {
                raw.push((c.conn.raw_fd(), Kind::Socket(c.id)));
                if waits || c.release_armed {
                    raw.push((c.release.as_raw_fd(), Kind::Release(c.id)));
                }
            }
            for (i, p) in inner.admission.pending().iter().enumerate() {
                raw.push((p.conn.raw_fd(), Kind::Pending(i)));
            }
            (
                raw,
                inner
                    .admission
                    .handshake_deadline()
                    .into_iter()
                    .chain(admit_at)
                    .chain(inner.starvation.deadline())
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
        // any thread wait in `closing` until this thread clears it before its next poll, and
        // only this thread removes pending connections: they stay open during the poll.
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
            let wake = Self::ahead_step(&mut self.lock(), ready.is_empty());
            for d in wake.unwrap_or_default() {
                d.ring();
            }
        }
        self.handle(ready)
    }

    /// This round's work under the lock, for the descriptors that were `ready`.
    fn handle(&self, ready: Vec<Kind>) -> bool {
        let mut guard = self.lock();
        if guard.shutdown {
            return false;
        }
        let inner = &mut *guard;
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
                    let Some(c) = inner.clients.get_mut(id) else {
                        continue;
                    };
                    let stats = &mut inner.book.stats;
                    let rate = self.upstream_rate();
                    if let Some(why) = read_socket(c, stats, &mut released, &mut inner.events, rate)
                    {
                        self.drop_client(inner, id, why);
                    }
                }
                Kind::Release(id) => {
                    // Releases of every client are taken below. A client that closed its end
                    // of the doorbell would keep it readable, and this thread polling, for
                    // good: it has left. One that rings it while nobody waits for a slot rang
                    // for nothing: it is not polled again until the next wait.
                    let waits = inner.clients.producer_waits();
                    let open = inner.clients.get_mut(id).map(|c| {
                        c.release_armed &= waits;
                        c.release.drain()
                    });
                    if open == Some(false) {
                        self.drop_client(
                            inner,
                            id,
                            "it closed its end of the slot-released doorbell".into(),
                        );
                    }
                }
            }
        }
        for e in released {
            inner.slots.unref(e, &mut back);
        }
        // Every round (at least every 100 ms with clients), whether a client woke us or not:
        // clients write their doorbell only while someone waits for a slot.
        self.reclaim_locked(inner, &mut back);
        // Closed clients that gave every frame back are done (one that keeps its socket open
        // holding nothing takes no client place).
        let done: Vec<u32> = inner
            .clients
            .iter()
            .filter(|c| c.closed && c.refs() == 0)
            .map(|c| c.id)
            .collect();
        for id in done {
            self.drop_client(inner, id, "it closed and gave every frame back".into());
        }
        // Handshakes: from the highest index down so removals keep the others valid.
        done_pending.sort_unstable();
        for i in done_pending.into_iter().rev() {
            self.advance_handshake(inner, i);
        }
        let now = Instant::now();
        for c in inner.clients.iter_mut() {
            c.note_progress(now);
        }
        if listen {
            self.accept_all(inner);
        }
        let late = inner.admission.expire(now);
        if !late.is_empty() {
            self.reap(Box::new(late));
        }
        self.check_starvation(inner, now);
        inner.slots.retire_idle();
        let events = std::mem::take(&mut inner.events);
        drop(guard);
        give_back(back);
        // A publish waiting for a lossless client re-checks after releases and disconnects.
        self.released.notify_all();
        self.emit(events);
        true
    }
}

/// Client `c`'s socket is readable. Clients send nothing after Hello but Close, once, and
/// upstream events (`rate` a second at most, the rest dropped; 0: all refused): readable
/// means those, gone, or misbehaving. Returns why it must go, if it must; frames a closing
/// client had not taken go to `released`.
fn read_socket(
    c: &mut Client,
    stats: &mut Stats,
    released: &mut Vec<Entry>,
    events: &mut Vec<Event>,
    rate: u32,
) -> Option<String> {
    for _ in 0..crate::policy::CLIENT_MESSAGES_PER_LOOK {
        match c.conn.try_recv() {
            Ok(None) => return None,
            Ok(Some((Message::Upstream { payload }, _))) => {
                if c.take_upstream_token(rate, Instant::now()) {
                    events.push(Event::Upstream { id: c.id, payload });
                } else if !std::mem::replace(&mut c.upstream_dropped, true) {
                    events.push(Event::Info(match rate {
                        0 => format!("client {} sent an upstream event: refused (upstream events are off)", c.id),
                        r => format!("client {} sends upstream events faster than {r} a second: the rest are dropped", c.id),
                    }));
                }
            }
            Ok(Some((Message::Close, _))) if !c.closed => {
                if let Err(e) = close_client(c, stats, released) {
                    return Some(e.to_string());
                }
                events.push(Event::Closed {
                    id: c.id,
                    held: c.refs(),
                });
            }
            Ok(Some((m, _))) => return Some(format!("unexpected {m:?} from the client")),
            Err(Error::Disconnected) => return Some("the client went away".to_string()),
            Err(e) => return Some(e.to_string()),
        }
    }
    // More waits: the socket stays readable, read again at the next look.
    None
}

/// A client sent Close: it is served no more frames and never waited for; what was delivered
/// to it and not taken goes back (into `released`), what it holds stays its own.
fn close_client(c: &mut Client, stats: &mut Stats, released: &mut Vec<Entry>) -> Result<()> {
    c.closed = true;
    // Each round revokes one, or finds the client took it meanwhile.
    while c.ch.pending_len() > 0 {
        if let Some(e) = c.ch.revoke_oldest()? {
            released.push(e);
            stats.frames_dropped += 1;
        }
    }
    Ok(())
}
