// SPDX-License-Identifier: MPL-2.0
//! A producer assembled from the ring's own parts, writing whatever a test wants: the hostile
//! producer of tests/hostile.rs, and of the Python tests through the `fake_producer` tool
//! (tests/helpers/fake_producer.rs).
#![allow(dead_code)]

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

use gpushm::ring::producer_end::{ClientChannel, Entry, FrameMeta, ProducerRing};
use gpushm::ring::shm;
use gpushm::wire::{Conn, Message};
use gst::glib::translate::IntoGlib;

pub struct FakeProducer {
    pub listener: UnixListener,
    pub ring: ProducerRing,
}

pub struct FakeClient {
    pub conn: Conn,
    pub ch: ClientChannel,
    /// Our ends of the wake-up socketpairs.
    pub ready: shm::Doorbell,
    pub release: shm::Doorbell,
    /// The ends we sent the consumer, kept: the same open file descriptions it has, which a
    /// hostile producer can change (see [`make_blocking`]).
    pub ready_theirs: shm::Doorbell,
    pub release_theirs: shm::Doorbell,
}

pub const GRAY_CAPS: &str =
    "video/x-raw, format=(string)GRAY8, width=(int)64, height=(int)48, framerate=(fraction)30/1";

impl FakeProducer {
    pub fn new(sock: &Path) -> Self {
        Self {
            listener: UnixListener::bind(sock).unwrap(),
            ring: ProducerRing::create(1, 16, 64 * 48, false).unwrap(),
        }
    }

    pub fn accept(&self) -> FakeClient {
        let (s, _) = self.listener.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let mut conn = Conn::new(s);
        let _hello = conn.recv_timeout(Duration::from_secs(10), None).unwrap();
        let ch = ClientChannel::create(128).unwrap();
        let (ready, ready_theirs) = shm::Doorbell::pair().unwrap();
        let (release, release_theirs) = shm::Doorbell::pair().unwrap();
        conn.send(
            &Message::Welcome {
                client_id: 1,
                queue_capacity: 128,
            },
            &[ch.fd(), ready_theirs.as_fd(), release_theirs.as_fd()],
        )
        .unwrap();
        let g = self.ring.geometry();
        conn.send(
            &Message::Ring {
                ring_gen: 1,
                flags: 0,
                slot_count: g.slot_count,
                slot_size: g.slot_size,
                total_size: g.total_size,
            },
            &[self.ring.read_only_fd().unwrap().as_fd()],
        )
        .unwrap();
        conn.send(
            &Message::Caps {
                caps_gen: 1,
                caps: GRAY_CAPS.into(),
            },
            &[],
        )
        .unwrap();
        FakeClient {
            conn,
            ch,
            ready,
            release,
            ready_theirs,
            release_theirs,
        }
    }

    /// Frame `n` in slot `n % 16`, every byte `n`, with `meta` as given (geometry filled in).
    pub fn send(&self, c: &mut FakeClient, n: u64, mut meta: FrameMeta) {
        let slot = (n % 16) as u32;
        // SAFETY: the slot is 64*48 bytes long, and the caller sends at most 16 frames the
        // consumer has not given back.
        unsafe { std::ptr::write_bytes(self.ring.slot_ptr(slot), n as u8, 64 * 48) };
        meta.payload_size = 64 * 48;
        meta.caps_gen = 1;
        meta.video_format = gst_video::VideoFormat::Gray8.into_glib() as u32;
        meta.width = 64;
        meta.height = 48;
        meta.offset = n;
        meta.offset_end = n + 1;
        if meta.n_planes == 0 {
            meta.n_planes = 1;
            meta.plane_stride[0] = 64;
        }
        self.ring.publish(slot, n + 1, &meta);
        c.ch.deliver(Entry {
            seq: n + 1,
            ring_gen: 1,
            slot,
        })
        .unwrap();
        c.ready.ring();
    }
}

/// What a peer holding the same open file description as ours can do to a descriptor: clear
/// its O_NONBLOCK (the flag lives in the description) and, with `fill`, first fill what is
/// sent from it, so that the next send through it blocks unless it says MSG_DONTWAIT (without,
/// the next receive from an empty one blocks unless it does).
pub fn make_blocking(fd: BorrowedFd<'_>, fill: bool) {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    if fill {
        if link.to_string_lossy().contains("eventfd") {
            nix::unistd::write(fd, &0xffff_ffff_ffff_fffeu64.to_ne_bytes()).unwrap();
        } else {
            let chunk = [0u8; 4096];
            let mut sent = 0usize;
            loop {
                match nix::sys::socket::send(
                    fd.as_raw_fd(),
                    &chunk,
                    nix::sys::socket::MsgFlags::MSG_DONTWAIT,
                ) {
                    Ok(n) => sent += n,
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(e) => panic!("filling {}: {e}", link.display()),
                }
            }
            assert!(sent > 0, "nothing could be sent on {}", link.display());
        }
    }
    fcntl(fd, FcntlArg::F_SETFL(OFlag::empty())).unwrap();
}
