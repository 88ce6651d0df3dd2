// SPDX-License-Identifier: MPL-2.0
//! Test tool (the Python tests run it; see examples/ for code to copy): a hostile producer
//! built from the ring's parts. It serves one consumer 64x48 GRAY8 frames (frame n: every
//! byte n), and first does to the consumer's wake-up descriptors what a producer holding them
//! can: makes them blocking, fills the one the consumer rings, and asks to be woken after
//! every release. It never reads what the consumer sends.
//!
//!     cargo run --release --example fake_producer -- --socket /tmp/fake --frames 10
//!
//! Options: --socket PATH (required), --frames N (at most 16, default 10), --interval-ms MS
//! between frames (default 20). Exits once the consumer hung up, or after 30 s.

#[path = "../common/fake_producer.rs"]
mod fake_producer;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use fake_producer::{make_blocking, FakeProducer};
use gpushm::ring::producer_end::FrameMeta;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
    };
    let Some(sock) = arg("--socket") else {
        eprintln!("fake_producer: --socket PATH is required");
        std::process::exit(2);
    };
    let frames: u64 = arg("--frames")
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
        .min(16);
    let interval = Duration::from_millis(
        arg("--interval-ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(20),
    );
    let fake = FakeProducer::new(std::path::Path::new(sock));
    let mut c = fake.accept();
    make_blocking(c.ready_theirs.as_fd(), false);
    make_blocking(c.release_theirs.as_fd(), true);
    c.ch.set_producer_waits(true);
    println!("ATTACKED");
    for n in 0..frames {
        fake.send(&mut c, n, FrameMeta::default());
        std::thread::sleep(interval);
    }
    println!("SENT {frames}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match c.conn.try_recv() {
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            _ => break,
        }
    }
    let _ = std::fs::remove_file(sock);
}
