// SPDX-License-Identifier: MPL-2.0
//! Test tool (the Python tests run it; see examples/ for code to copy): hoarders that take
//! turns against a producer (issue 48). It connects `--clients` raw consumers, each keeping at
//! most `--keep` frames, and every `--every-ms` one of them, in turn, gives back its oldest and
//! takes the next; together they can hold a whole ring while each stays within its own cap.
//!
//!     cargo run --example hoarders -- --socket /tmp/cam --clients 3 --keep 3 --every-ms 400 --seconds 12
//!
//! Options: --socket PATH (required), --clients 3, --keep 3, --every-ms 400, --seconds 12,
//! --lossless (ask for lossless delivery; leaky otherwise). Prints `CONNECTED n` once every
//! client is in, and `CUT n` at the end: how many the producer cut.

#[path = "../common/raw_client.rs"]
mod raw_client;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
    };
    let num = |k: &str, default: u64| {
        arg(k)
            .map(|v| v.parse::<u64>().unwrap_or_else(|e| panic!("{k} {v}: {e}")))
            .unwrap_or(default)
    };
    let Some(sock) = arg("--socket") else {
        eprintln!("hoarders: --socket PATH is required");
        std::process::exit(2);
    };
    let flags = if args.iter().any(|a| a == "--lossless") {
        gpushm::wire::FLAG_LOSSLESS
    } else {
        0
    };
    let hoarders: Vec<raw_client::RawClient> = (0..num("--clients", 3))
        .map(|_| raw_client::raw_client(sock.as_ref(), flags))
        .collect();
    println!("CONNECTED {}", hoarders.len());
    let stop = Arc::new(AtomicBool::new(false));
    let relay = {
        let stop = stop.clone();
        let (keep, every) = (
            num("--keep", 3) as usize,
            Duration::from_millis(num("--every-ms", 400)),
        );
        std::thread::spawn(move || raw_client::relay(hoarders, keep, every, stop))
    };
    std::thread::sleep(Duration::from_secs(num("--seconds", 12)));
    stop.store(true, Ordering::Relaxed);
    let hoarders = relay.join().expect("the relay");
    let cut = hoarders.iter().filter(|h| h.ch.revoked()).count();
    println!("CUT {cut}");
}
