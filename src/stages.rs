// SPDX-License-Identifier: MPL-2.0
//! Per-stage times of a frame's way from gpushmsink's sink pad to gpushmsrc's source pad, for
//! `bench latency` (cargo feature `stages`, off by default: a diagnostic build, never one to
//! ship: **it changes frames and buffers**).
//!
//! - gpushmsink writes CLOCK_MONOTONIC at its chain function, at render() and after the
//!   frame's description into bytes 8..32 of each frame it publishes from its pool (the
//!   bench's producer stamps bytes 0..8 before the sink pad).
//! - gpushmsrc puts its times into each buffer it pushes (see [`add_all`]).
//!
//! `cargo build --release -p gpushm-bench --features stages` (the bench's `stages` feature turns
//! this one on), then `target/release/bench latency` prints a `STAGES` line per run: each
//! stage's p50/p90 in µs.

use std::cell::Cell;

thread_local! {
    /// When this thread entered gpushmsink's chain function last.
    pub static CHAIN_NS: Cell<u64> = const { Cell::new(0) };
}

/// Where gpushmsink's three times go in a frame: bytes 8..32.
pub const PRODUCER_OFFSET: usize = 8;

/// Puts gpushmsrc's times into `b`: the subscriber returned the frame, the buffer was made,
/// the receiver handed it to create(), the caps were checked, the timestamps set, create() is
/// about to return. The first three go into its offset, offset_end and duration, the rest into
/// two GstReferenceTimestampMeta (`timestamp/x-stage-a` and `-b`, two times each: timestamp
/// and duration), the last time being when the metas were added (their own cost).
pub fn add_all(b: &mut gst::BufferRef, t: [u64; 6]) {
    use once_cell::sync::Lazy;
    static A: Lazy<gst::Caps> = Lazy::new(|| gst::Caps::new_empty_simple("timestamp/x-stage-a"));
    static B: Lazy<gst::Caps> = Lazy::new(|| gst::Caps::new_empty_simple("timestamp/x-stage-b"));
    let ns = gst::ClockTime::from_nseconds;
    b.set_offset(t[0]);
    b.set_offset_end(t[1]);
    b.set_duration(ns(t[2]));
    gst::ReferenceTimestampMeta::add(b, &A, ns(t[3]), Some(ns(t[4])));
    let mut m = gst::ReferenceTimestampMeta::add(b, &B, ns(t[5]), None);
    // SAFETY: the meta just added, ours to write.
    unsafe { (*m.as_mut_ptr()).duration = gpushm::monotonic_ns() };
}
