// SPDX-License-Identifier: MPL-2.0
//! A consumer speaking the protocol by hand, and what hostile ones do with it: the attackers of
//! tests/hostile.rs, and of the Python tests through the `hoarders` tool
//! (tests/helpers/hoarders.rs).
#![allow(dead_code)]

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushm::ring::frame::Entry;

/// A client speaking the protocol by hand (for hostile tests): Hello sent, Welcome read.
pub struct RawClient {
    pub conn: gpushm::wire::Conn,
    pub ch: gpushm::ring::consumer_end::ConsumerChannel,
    /// Its end of the slot-released doorbell.
    pub release: gpushm::ring::shm::Doorbell,
    /// Its end of the frame-ready doorbell.
    pub ready: gpushm::ring::shm::Doorbell,
    /// The first ring announced (descriptor and flags), once asked for with `recv_ring`.
    pub ring: Option<(std::os::fd::OwnedFd, u32)>,
}

/// Connects to `sock` and says Hello with `flags`.
pub fn raw_client(sock: &Path, flags: u32) -> RawClient {
    use gpushm::wire::{Conn, Message};
    let mut conn = Conn::new(std::os::unix::net::UnixStream::connect(sock).expect("connect"));
    conn.send(
        &Message::Hello {
            flags,
            pid: std::process::id(),
            name: "hostile".into(),
        },
        &[],
    )
    .unwrap();
    let (m, mut fds) = conn
        .recv_timeout(Duration::from_secs(5), None)
        .unwrap()
        .unwrap();
    let Message::Welcome { queue_capacity, .. } = m else {
        panic!("expected Welcome, got {m:?}")
    };
    let release = gpushm::ring::shm::Doorbell::from_peer(fds.pop().unwrap(), "release").unwrap();
    let ready = gpushm::ring::shm::Doorbell::from_peer(fds.pop().unwrap(), "ready").unwrap();
    let ch = gpushm::ring::consumer_end::ConsumerChannel::open(fds.pop().unwrap(), queue_capacity)
        .unwrap();
    RawClient {
        conn,
        ch,
        release,
        ready,
        ring: None,
    }
}

impl RawClient {
    /// Waits up to 5 s for the producer's Ring message and keeps its descriptor.
    pub fn recv_ring(mut self) -> Self {
        use gpushm::wire::Message;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.ring.is_none() && Instant::now() < deadline {
            if let Some((Message::Ring { flags, .. }, mut fds)) = self
                .conn
                .recv_timeout(Duration::from_millis(200), None)
                .unwrap_or(None)
            {
                self.ring = Some((fds.pop().unwrap(), flags));
            }
        }
        self
    }
}

/// Hoarders that take turns (issue 48): each keeps at most `keep` frames (giving back at once
/// what it gets beyond), and every `every` one of them, in turn, gives back its oldest and
/// takes the next as soon as it comes, until `stop`. Together they can hold a whole ring while
/// each stays within its own cap.
pub fn relay(
    hoarders: Vec<RawClient>,
    keep: usize,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> Vec<RawClient> {
    let mut held: Vec<VecDeque<Entry>> = hoarders.iter().map(|_| Default::default()).collect();
    let (mut turn, mut last) = (0, Instant::now());
    while !stop.load(Ordering::Relaxed) {
        for (h, held) in hoarders.iter().zip(held.iter_mut()) {
            while let Ok(Some(e)) = h.ch.take() {
                if held.len() < keep {
                    held.push_back(e);
                } else {
                    h.ch.release(e);
                }
            }
        }
        if last.elapsed() >= every && !hoarders.is_empty() {
            last = Instant::now();
            let i = turn % hoarders.len();
            if let Some(e) = held[i].pop_front() {
                hoarders[i].ch.release(e);
                hoarders[i].release.ring();
            }
            turn += 1;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    hoarders
}
