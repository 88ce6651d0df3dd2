// SPDX-License-Identifier: MPL-2.0
//! A connection's way in: accepted as [`super::admission`] allows, then its first message. A
//! Hello makes it a client (its control block and doorbells sent with the Welcome, then the
//! ring and caps); a Query gets the stream's Report and is closed; anything else, or a
//! producer at its limits, turns it away with a reason. At max-clients a stalled client may
//! make room ([`super::fairness::stalled_longest`]); with every handshake place taken the
//! oldest silent connection does.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Instant;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::admission::Pending;
use super::client::{Client, HoldCredit};
use super::stats::StreamState;
use super::{fairness, ring_refusal, send_ring_and_caps, socket, Event, Inner, Server};
use crate::policy::{Delivery, ACCEPT_BATCH, MAX_PENDING};
use crate::ring::layout::CLIENT_QUEUE_CAPACITY;
use crate::ring::producer_end::ClientChannel;
use crate::ring::shm;
use crate::wire::{
    Conn, Message, BUSY_PREFIX, FLAG_AUTO, FLAG_DEVICE_MEMORY, FLAG_LOSSLESS, FLAG_WRITABLE_RING,
    REPORT_MAX_NAME,
};
use crate::Result;

impl<P: Send + 'static> Server<P> {
    /// Accepts what the admission rate allows now, [`ACCEPT_BATCH`] at most.
    pub(super) fn accept_all(&self, inner: &mut Inner<P>) {
        let allowed = inner.admission.available(Instant::now()).min(ACCEPT_BATCH);
        for _ in 0..allowed {
            let stream = match self.socket.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e)
                    if matches!(
                        socket::errno(&e),
                        nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE
                    ) =>
                {
                    self.refuse_out_of_descriptors(inner);
                    return;
                }
                Err(_) => return,
            };
            inner.admission.take();
            inner.book.stats.connections_accepted += 1;
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
            if inner.clients.len() >= self.config.max_clients && stalled_longest(inner).is_none() {
                let why = self.max_clients_busy();
                let log = format!("refused pid {pid} (uid {uid}): {why}");
                self.turn_away(inner, conn, &why, log);
                continue;
            }
            if inner.admission.pending().len() >= MAX_PENDING {
                self.make_pending_room(inner);
            }
            inner.admission.add_pending(Pending {
                conn,
                since: Instant::now(),
                pid,
                uid,
            });
        }
    }

    /// Out of descriptors: makes room for one, tells that client why, closes it again, so
    /// that the listener does not stay readable forever.
    fn refuse_out_of_descriptors(&self, inner: &mut Inner<P>) {
        let mut reserve = self.reserve.lock().unwrap_or_else(|e| e.into_inner());
        *reserve = None;
        if let Ok((s, _)) = self.socket.listener.accept() {
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
                .admission
                .pending()
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
        if inner.admission.pending().len() < MAX_PENDING {
            return;
        }
        let Some(oldest) = inner.admission.oldest_pending() else {
            return;
        };
        let p = inner.admission.take_pending(oldest);
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

    /// At max-clients: cuts the client stalled longest to make room. False if none is.
    fn evict_stalled(&self, inner: &mut Inner<P>) -> bool {
        let Some((id, since)) = stalled_longest(inner) else {
            return false;
        };
        self.drop_client(
            inner,
            id,
            format!(
                "the producer serves its maximum of {} consumers (max-clients) and a new one connected: this one took no frame for {:?} while frames waited, so it made room",
                self.config.max_clients,
                Instant::now().saturating_duration_since(since)
            ),
        );
        true
    }

    /// Reads pending connection `i`'s first message and acts on it.
    pub(super) fn advance_handshake(&self, inner: &mut Inner<P>, i: usize) {
        let conn = &mut inner.admission.pending_mut(i).conn;
        let clean = |c: &Conn| c.stray_fds() == 0 && c.buffered() == 0;
        let hello = match conn.try_recv() {
            Ok(None) => return,
            Ok(Some((Message::Hello { flags, name, .. }, _))) if clean(conn) => Ok((flags, name)),
            Ok(Some((Message::Hello { .. }, _))) if conn.stray_fds() > 0 => {
                Err("the client sent file descriptors; clients never send any".to_string())
            }
            Ok(Some((Message::Hello { .. }, _))) => {
                Err("the client sent more than Hello before its Welcome".to_string())
            }
            Ok(Some((Message::Query { .. }, _))) if clean(conn) => {
                let p = inner.admission.take_pending(i);
                self.answer_query(inner, p.conn);
                return;
            }
            Ok(Some((Message::Query { .. }, _))) => {
                Err("the tool sent more than Query, or descriptors".to_string())
            }
            Ok(Some((m, _))) => Err(format!("expected Hello, got {m:?}")),
            Err(e) => Err(e.to_string()),
        };
        let p = inner.admission.take_pending(i);
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
        if let Some(why) = ring_refusal(&inner.slots, device_memory) {
            let log = format!("refused pid {} (uid {}): {why}", p.pid, p.uid);
            self.turn_away(inner, p.conn, &why, log);
            return;
        }
        let id = inner.clients.next_id();
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
        let (pid, uid) = (p.pid, p.uid);
        match welcome(inner, p, id, flags, &name, writable) {
            Ok(c) => {
                inner.clients.add(c);
                inner.events.push(Event::Connected { id, pid, uid, name });
                self.changed.notify_all();
            }
            Err(e) => inner.events.push(Event::Disconnected {
                id,
                reason: format!("handshake failed: {e}"),
            }),
        }
    }

    /// Answers a tool's Query with the stream's Report (at most one built per
    /// [`crate::wire::REPORT_INTERVAL`], however many queries come) and closes it.
    fn answer_query(&self, inner: &mut Inner<P>, conn: Conn) {
        let ring = inner
            .slots
            .current()
            .map(|r| {
                let g = r.geometry();
                (
                    g.slot_count,
                    g.slot_size,
                    g.total_size,
                    r.device().is_some(),
                )
            })
            .unwrap_or_default();
        let stream = StreamState {
            caps: inner.stream.caps.as_ref().map_or("", |c| c.1.as_str()),
            eos: inner.stream.eos,
            ring,
            max_clients: self.config.max_clients,
        };
        let report = inner.book.report(inner.clients.iter_mut(), stream);
        // Never waits: a tool that does not read its socket loses its report, nobody else
        // waits for it.
        let _ = conn.send(&Message::Report(Box::new((*report).clone())), &[]);
        self.reap(Box::new(conn));
    }
}

/// The client stalled longest, if for long enough to make room at max-clients.
fn stalled_longest<P>(inner: &Inner<P>) -> Option<(u32, Instant)> {
    fairness::stalled_longest(
        inner.clients.iter().map(|c| (c.id, c.stalled_since)),
        Instant::now(),
    )
}

/// Makes pending connection `p` client `id`: its control block and doorbells (each side gets
/// its own end of each: neither blocks on the other's descriptor flags, see
/// [`shm::Doorbell`]) sent with the Welcome, then the ring, the caps and EOS if it came.
fn welcome<P>(
    inner: &Inner<P>,
    p: Pending,
    id: u32,
    flags: u32,
    name: &str,
    writable: bool,
) -> Result<Client> {
    let ch = ClientChannel::create(CLIENT_QUEUE_CAPACITY)?;
    let (ready, ready_theirs) = shm::Doorbell::pair()?;
    let (release, release_theirs) = shm::Doorbell::pair()?;
    p.conn.send(
        &Message::Welcome {
            client_id: id,
            queue_capacity: ch.capacity(),
        },
        &[ch.fd(), ready_theirs.as_fd(), release_theirs.as_fd()],
    )?;
    let c = Client {
        id,
        pid: p.pid,
        uid: p.uid,
        name: crate::wire::cut_str(name, REPORT_MAX_NAME),
        since: Instant::now(),
        conn: p.conn,
        ch,
        ready: Arc::new(ready),
        release,
        release_armed: true,
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
        device_memory: flags & FLAG_DEVICE_MEMORY != 0,
        closed: false,
        hold: HoldCredit::new(),
        first_of_wait: false,
        on_time_since: None,
        upstream_tokens: 0.0,
        upstream_at: None,
        upstream_dropped: false,
        stalled_since: None,
        taken_seen: 0,
    };
    send_ring_and_caps(inner, &c)?;
    for (_, seq, payload) in &inner.stream.sticky {
        c.conn.send(
            &Message::Event {
                seq: *seq,
                payload: payload.clone(),
            },
            &[],
        )?;
    }
    if inner.stream.eos {
        c.conn.send(&Message::Eos, &[])?;
    }
    Ok(c)
}
