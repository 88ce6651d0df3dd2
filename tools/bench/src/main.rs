// SPDX-License-Identifier: MPL-2.0
//! gpushmsink/gpushmsrc against shmsink/shmsrc, side by side, in one run:
//!
//!     cargo run --release -p gpushm-bench [-- --plot bench.png]   # tables on stdout, plot
//!
//! The binary is target/release/bench (`cargo build --release -p gpushm-bench`; with
//! `--features stages`, the diagnostic build of `bench latency` below).
//!
//! For 720p, 1080p and 4K NV12, and two producer modes (`pool`: upstream renders into the sink's
//! buffer pool; `copy`: upstream buffers come from elsewhere, forcing each sink's copy), it runs
//! a producer process and a consumer process per transport, alternating:
//! - delivered fps of a lossless consumer against the producer's own rate (the same source into
//!   fakesink), producers running flat out;
//! - cross-process latency p50/p99/max at 30 fps live: the producer stamps CLOCK_MONOTONIC into
//!   the first 8 bytes of each frame just before its sink, the consumer reads it where its
//!   source pushes the frame;
//! - CPU time per frame (getrusage) and peak RSS of each process, from the latency runs.
//!
//! With a CUDA GPU it also runs the consumer with cudasum at 4K (gpushmsrc ! cudasum against
//! shmsrc ! cudasum) and measures the bus limit in the same run. unixfdsink/unixfdsrc
//! (GStreamer >= 1.24) are run when installed, and skipped with a note otherwise.
//!
//! The same binary is the producer (`bench produce ...`) and the consumer (`bench consume ...`).
//! Parts on their own: `bench floor` (the eventfd wake-up floor), `bench tiny [--runs N]
//! [--spin-us 300]` (64x64 GRAY8 frames flat out; each round measures the producer alone,
//! gpushm, gpushm with spin-us on gpushmsink and gpushmsrc, and shm),
//! `bench gpu` (the cudasum table, with the pre-rendered producer),
//! `bench latency --runs 7 [--spin-us 300] [--chain N] [--wake-ahead-us 80,160]` (latency
//! only, rounds alternating gpushm, gpushm with gpushmsink wake-ahead-us=0 and wake-early=false
//! (and each wake-ahead-us listed), gpushm in low-latency mode (gpushmsrc spin-us) and shm,
//! with medians, CPU share of each
//! process; `--chain N` adds N relay processes, `gpushmsrc ! gpushmsink` each, between the
//! producer and the consumer, end to end; `--cpu-latency-us N` adds gpushm in low-latency mode
//! with gpushmsink and gpushmsrc asking the kernel to keep the CPUs in idle states that wake
//! within N µs (their `cpu-latency-us`); `--pin`: producer and consumer each on a CPU of its
//! own (the last two); built with `--features stages`, a diagnostic build
//! that writes into frames, it also prints each stage of a frame's way, see src/stages.rs),
//! `bench flood` (a producer's cost of a connection flood, and what its consumer sees),
//! `bench core-tiny [--runs N] [--frames N]` (the transport alone, no GStreamer: the core
//! crate's Publisher sends 64x64 GRAY8 frames flat out to a lossless Rust Subscriber in
//! another process; frames a second and CPU time a frame of each),
//! `bench capi [--rounds N] [--no-pin] [--no-aslr] [--only tiny|1080p]` (the C API's consumer
//! against the Rust subscriber and gpushmsrc, rounds rotating which goes first, producer and
//! consumer pinned to two CPUs, `--no-aslr`: consumers at the same addresses every run),
//! `bench cold [--frames N] [--evict-mib M] [--sleep-us U]` (what taking a frame costs after a
//! sleep and a cache eviction; capi/bench/c_cold.c measures the C call the same way),
//! `bench throughput [--rounds 3] [--scale 1] [--pin] [--pool-only] [--compare "CMD"]`
//! (throughput only, long runs, rounds alternating gpushm, shm and unixfd in pool and copy
//! mode, with the producer's CPU time, page faults and sleeps a frame, the consumer's CPU time,
//! and medians; `--compare`: gpushm of another build too, see src/throughput.rs),
//! `bench device-ring` (a 4K frame read by a CUDA kernel from a device ring, the host ring and
//! plain device memory), `bench copy [--rounds 2] [--frames 300]` (the copy of copy mode
//! alone: glibc's memcpy, streaming stores and the core's frame_copy into memfd slots, see
//! src/copy.rs),
//! `bench render [--rounds 5]` (upstream's render alone, a cached frame's planes copied whole
//! as GStreamer 1.26's videotestsrc does, by where the buffer lies: its offset in a page,
//! private or shared memory, two or three buffers in rotation; see src/render.rs).

mod capi;
mod cold;
mod consume;
mod copy;
mod flood;
mod floor;
mod full;
mod gpu;
mod latency;
mod measure;
mod plot;
mod procs;
mod produce;
mod render;
mod throughput;
mod tiny;
mod transport;

use gst::prelude::*;

use crate::capi::capi_mode;
use crate::cold::cold;
use crate::consume::{consume, relay};
use crate::flood::flood;
use crate::floor::{floor, floor_wait};
use crate::full::orchestrate;
use crate::gpu::{device_ring_mode, gpu_mode};
use crate::latency::{cpu_latency_arg, latency_only};
use crate::measure::f;
use crate::procs::{two_cpus, PIN};
use crate::produce::produce;
use crate::throughput::throughput;
use crate::tiny::tiny_frames;
use crate::transport::{core_produce, core_tiny};

/// The value after `key` in `args`.
pub fn arg(args: &[String], key: &str) -> Option<String> {
    args.iter()
        .position(|a| a == key)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// The number after `key` in `args`, or `default`.
pub fn num(args: &[String], key: &str, default: u64) -> u64 {
    arg(args, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Whether unixfdsink copies buffers whose memory is not backed by a file descriptor (copy
/// mode's buffers, from `identity drop-allocation=true`) into shared memory: GStreamer 1.28+
/// (the `min-memory-size` property came with it); before, it errors out on them.
pub fn unixfdsink_copies() -> bool {
    gst::ElementFactory::make("unixfdsink")
        .build()
        .is_ok_and(|e| e.find_property("min-memory-size").is_some())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    gst::init().expect("gst::init");
    gstgpushm::plugin_register_static().expect("register gpushm");
    let r = match args.get(1).map(String::as_str) {
        Some("produce") => produce(&args),
        Some("consume") => consume(&args),
        Some("floor-wait") => floor_wait(&args),
        Some("relay") => relay(&args),
        Some("flood") => flood(&args),
        Some("core-produce") => core_produce(&args),
        Some("core-tiny") => {
            core_tiny(
                num(&args, "--runs", 3).max(1),
                num(&args, "--frames", 200_000),
            );
            Ok(())
        }
        Some("capi") => {
            capi_mode(&args);
            Ok(())
        }
        Some("cold") => cold(&args),
        Some("copy") => crate::copy::copy(&args),
        Some("render") => crate::render::render(&args),
        Some("tiny") => {
            tiny_frames(num(&args, "--runs", 1).max(1), num(&args, "--spin-us", 300));
            Ok(())
        }
        Some("throughput") => {
            throughput(&args);
            Ok(())
        }
        Some("gpu") => {
            gpu_mode();
            Ok(())
        }
        Some("device-ring") => {
            device_ring_mode();
            Ok(())
        }
        Some("latency") => {
            if args.iter().any(|a| a == "--pin") {
                *PIN.lock().unwrap() = two_cpus();
            }
            let cpu_latency = cpu_latency_arg(&args).unwrap_or_else(|e| {
                println!("{e}");
                std::process::exit(2);
            });
            // --wake-ahead-us 80,160: more gpushm modes, with those wake-ahead-us.
            let wake_ahead: Vec<u32> = match arg(&args, "--wake-ahead-us") {
                Some(v) => v
                    .split(',')
                    .map(|us| us.trim().parse())
                    .collect::<Result<_, _>>()
                    .unwrap_or_else(|e| {
                        println!("--wake-ahead-us {v}: {e} (microseconds, comma-separated)");
                        std::process::exit(2);
                    }),
                None => Vec::new(),
            };
            let sizes = match (arg(&args, "--width"), arg(&args, "--height")) {
                (None, None) => vec![(1280, 720), (1920, 1080), (3840, 2160)],
                _ => vec![(num(&args, "--width", 1280), num(&args, "--height", 720))],
            };
            latency_only(
                &sizes,
                num(&args, "--frames", 300),
                num(&args, "--runs", 1).max(1),
                num(&args, "--spin-us", 300),
                num(&args, "--chain", 0),
                cpu_latency,
                &wake_ahead,
            );
            Ok(())
        }
        Some("floor") => {
            let fl = floor(num(&args, "--fps", 30), num(&args, "--frames", 90));
            println!(
                "floor at {} fps: p50 {:.1} µs, p99 {:.1} µs",
                num(&args, "--fps", 30),
                f(&fl, "p50_us"),
                f(&fl, "p99_us")
            );
            Ok(())
        }
        _ => {
            orchestrate(&arg(&args, "--plot").unwrap_or_else(|| "bench.png".into()));
            Ok(())
        }
    };
    if let Err(e) = r {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}
