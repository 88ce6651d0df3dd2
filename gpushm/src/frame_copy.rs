// SPDX-License-Identifier: MPL-2.0
//! Copying a whole frame into a ring slot: the copy a producer pays for every frame it does not
//! render in place (gpushmsink's copy mode, `Slot::fill_from_host`, Python's `publish` of an
//! array).
//!
//! A frame copied into a slot is read next by a consumer, never by the producer, so on x86_64
//! the copy of a large frame can write with streaming (non-temporal) stores: they skip reading
//! every destination line into the cache before overwriting it and do not push the
//! producer's own working set out of the cache. Whether that is faster depends on the machine:
//!
//! - on the H200 machine (a VM on a host whose last-level cache other tenants share) the copy
//!   of a 4K NV12 frame into ring slots in turn took 15–35 % less time than glibc's memcpy, of
//!   a 1080p one about 25 % and of a 720p one about 13 %;
//! - on the 2-core AMD EPYC VM (32 MiB of last-level cache of its own) a 4K frame took 36 %
//!   less, but 720p and 1080p frames 15–25 % more: three slots of them fit in its cache, where
//!   plain stores find their lines.
//!
//! (`bench copy`, docs/benchmarks.md.) No size threshold suits both, and the cache size a VM
//! reports does not say how much of it is ours (the H200 VM sees 300 MiB), so [`copy_frame`]
//! learns it: for each size class, after the first 64 copies, the first 32 of every 1024 go
//! half one way, half the other, timed, and a way clearly faster takes the rest (see
//! `Learnt`). Both ways copy the same bytes; only the time differs. The probes time the copy
//! alone, not what it does to the cache for the next render or for the consumer: the
//! end-to-end figures (`bench throughput --copy-only`, bench/*.md) are what showed that the
//! copy's own time decides on both machines.
//!
//! Not for a slot the producer reads back (a device ring's host staging bytes, which go to the
//! GPU next): gpushmsink copies those plainly. A consumer reads a streamed frame from memory
//! rather than from the shared cache, as it would after any copy that large on a busy machine.
//! Small copies, and other architectures (Jetson's aarch64 among them), use the plain copy.

use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{AcqRel, Relaxed},
};

/// Copies at or above this many bytes may use streaming stores (a 720p NV12 frame is 1.4 MB):
/// below it, the plain copy (a frame that small stays in the cache anyway).
pub const STREAMING_MIN: usize = 1 << 20;

/// How a large copy writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// glibc's memcpy (through `copy_from_slice`).
    Plain,
    /// Streaming stores on x86_64 (the plain copy elsewhere).
    Streaming,
}

/// Copies `src` into `dst`, the first `min(dst.len(), src.len())` bytes; returns how many.
/// A copy of [`STREAMING_MIN`] bytes or more goes the way learnt fastest for its size on this
/// machine (see the module's doc). The streaming stores are fenced: they are ordered before any
/// later store, so the release store that publishes the frame covers them as it covers a plain
/// copy.
pub fn copy_frame(dst: &mut [u8], src: &[u8]) -> usize {
    let n = dst.len().min(src.len());
    copy_frame_in(&LEARNT[size_class(n)], dst, src)
}

/// [`copy_frame`] with what `learnt` learnt (the process's own, or a test's).
fn copy_frame_in(learnt: &Learnt, dst: &mut [u8], src: &[u8]) -> usize {
    let n = dst.len().min(src.len());
    if n < STREAMING_MIN || !cfg!(target_arch = "x86_64") {
        return copy_frame_with(Way::Plain, dst, src);
    }
    let (way, timed) = learnt.next();
    if !timed {
        return copy_frame_with(way, dst, src);
    }
    let start = std::time::Instant::now();
    copy_frame_with(way, dst, src);
    learnt.record(way, start.elapsed().as_nanos() as u64, n as u64);
    n
}

/// [`copy_frame`] one given way, whatever the size (`bench copy` compares them).
pub fn copy_frame_with(way: Way, dst: &mut [u8], src: &[u8]) -> usize {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    if way == Way::Streaming {
        // SAFETY: two slices of n bytes each; they cannot overlap (one is borrowed mutably).
        unsafe { x86_64::stream_copy(dst.as_mut_ptr(), src.as_ptr(), n) };
        return n;
    }
    // Off x86_64 there are no streaming stores: both ways are the plain copy.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = way;
    dst.copy_from_slice(src);
    n
}

/// Copies of a size class between two learnings; the first [`PROBE`] of them are the probes.
const RECHECK: u64 = 1024;
/// The probes at the start of each [`RECHECK`] copies: half plainly, then half streaming, each
/// half in a row. The first [`SETTLE`] of each half are not timed: they pay for the way of the
/// copies before them (a plain copy into a slot last written with streaming stores finds none
/// of its lines in the cache). Six covers a ring with up to six slots in turn; gpushmsink's
/// pool lends the slot that came back last, so a stream has two or three.
const PROBE: u64 = 32;
const SETTLE: u64 = 6;
/// The timed probes of a window, half each way.
const TIMED: u64 = PROBE - 2 * SETTLE;
/// A window's probes change the way only if the other one took less than this share of the
/// current one's time a byte.
const SWITCH_BELOW: f64 = 0.9;
/// Copies of a size class before its first probe, the way learnt by default (streaming): the
/// first copy into each slot of a ring faults its pages in, which would count against
/// whichever way probed first.
const WARMUP: u64 = 64;
/// Size classes: 1–2 MiB, 2–4, ... and 64 MiB or more.
const CLASSES: usize = 7;

fn size_class(n: usize) -> usize {
    ((n / STREAMING_MIN).max(1).ilog2() as usize).min(CLASSES - 1)
}

/// What one size class learnt. Atomics, shared by every copier in the process (sinks,
/// publishers, Python): two threads learning at once only mix their timings, and either way
/// copies the same bytes.
struct Learnt {
    /// Copies of this class so far.
    copies: AtomicU64,
    /// This window's timed probes, plain then streaming: the sum of their times a KiB (ns),
    /// the largest (left out of the mean: one probe preempted or faulting pages in would
    /// otherwise decide a window), and how many.
    sum: [AtomicU64; 2],
    max: [AtomicU64; 2],
    count: [AtomicU64; 2],
    /// Timed probes recorded this window, both ways.
    counted: AtomicU64,
    /// The way learnt (streaming until a window says otherwise).
    streaming: AtomicBool,
}

impl Learnt {
    const fn new() -> Self {
        Learnt {
            copies: AtomicU64::new(0),
            sum: [AtomicU64::new(0), AtomicU64::new(0)],
            max: [AtomicU64::new(0), AtomicU64::new(0)],
            count: [AtomicU64::new(0), AtomicU64::new(0)],
            counted: AtomicU64::new(0),
            streaming: AtomicBool::new(true),
        }
    }

    /// The way of the next copy, and whether it is a probe to time.
    fn next(&self) -> (Way, bool) {
        let copies = self.copies.fetch_add(1, Relaxed);
        let i = copies.wrapping_sub(WARMUP) % RECHECK;
        if copies >= WARMUP && i < PROBE {
            let way = if i < PROBE / 2 {
                Way::Plain
            } else {
                Way::Streaming
            };
            return (way, i % (PROBE / 2) >= SETTLE);
        }
        let way = match self.streaming.load(Relaxed) {
            true => Way::Streaming,
            false => Way::Plain,
        };
        (way, false)
    }

    /// A probe took `ns` for `bytes`; the window's last one decides the way.
    fn record(&self, way: Way, ns: u64, bytes: u64) {
        let k = (way == Way::Streaming) as usize;
        let per_kib = ns.saturating_mul(1024) / bytes.max(1);
        self.sum[k].fetch_add(per_kib, Relaxed);
        self.max[k].fetch_max(per_kib, Relaxed);
        self.count[k].fetch_add(1, Relaxed);
        // AcqRel: the deciding thread sees every other thread's figures added before theirs.
        if self.counted.fetch_add(1, AcqRel) + 1 < TIMED {
            return;
        }
        self.counted.store(0, Relaxed);
        // The mean a way's probes took, leaving out the largest (0: no figure).
        let mean = |k: usize| {
            let (sum, max) = (self.sum[k].swap(0, Relaxed), self.max[k].swap(0, Relaxed));
            match self.count[k].swap(0, Relaxed) {
                0 => 0.0,
                1 => sum as f64,
                n => (sum - max.min(sum)) as f64 / (n - 1) as f64,
            }
        };
        let (plain, streaming) = (mean(0), mean(1));
        // A window with no time for one way (the clock too coarse, or another thread's
        // probes took them) keeps the way learnt, and so does one where the other way is not
        // clearly faster: ten probes a way are few, and a wrong switch costs a whole window
        // (at 4K on the H200 machine, plain copies take half as long again).
        if plain > 0.0 && streaming > 0.0 {
            let now_streaming = self.streaming.load(Relaxed);
            let (current, other) = match now_streaming {
                true => (streaming, plain),
                false => (plain, streaming),
            };
            if other < current * SWITCH_BELOW {
                // The way that won, not a toggle: two deciders in one window agree.
                self.streaming.store(plain > streaming, Relaxed);
            }
        }
    }
}

static LEARNT: [Learnt; CLASSES] = [const { Learnt::new() }; CLASSES];

#[cfg(target_arch = "x86_64")]
mod x86_64 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// One cache line a step: four 16-byte loads, four streaming stores (SSE2, which every
    /// x86_64 CPU has).
    const LINE: usize = 64;

    /// # Safety
    /// `dst` and `src` are valid for `n` bytes each and do not overlap.
    pub unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
        // The unaligned head up to dst's next cache line, plainly: streaming stores need
        // 16-byte aligned destinations, and whole lines let the CPU write each line at once.
        let head = (dst.align_offset(LINE)).min(n);
        // SAFETY (all blocks): within the n bytes of both, as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut at = head;
        while at + LINE <= n {
            unsafe {
                let s = src.add(at) as *const __m128i;
                let d = dst.add(at) as *mut __m128i;
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            at += LINE;
        }
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n - at) };
        // Streaming stores are weakly ordered: without the fence, the store that publishes the
        // frame (a plain release store on x86) could become visible before the frame.
        unsafe { _mm_sfence() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
            .collect()
    }

    /// Every size around the streaming threshold and the line size, at every alignment of the
    /// source and the destination within a line: the bytes copied are the source's, the bytes
    /// around them untouched, and the count returned is the shorter length.
    #[test]
    fn copies_exactly_at_every_size_and_alignment() {
        let sizes = [
            0,
            1,
            63,
            64,
            65,
            4096,
            STREAMING_MIN - 1,
            STREAMING_MIN,
            STREAMING_MIN + 1,
            STREAMING_MIN + 63,
            3 * STREAMING_MIN + 17,
        ];
        for &n in &sizes {
            for (so, dof) in [(0, 0), (1, 0), (0, 1), (13, 50), (63, 63), (32, 16)] {
                let src = pattern(n + so, 7);
                // Each way on its own, and the way copy_frame learns.
                for way in [Some(Way::Plain), Some(Way::Streaming), None] {
                    let mut dst = vec![0xAAu8; n + dof + 8];
                    let copied = match way {
                        Some(w) => copy_frame_with(w, &mut dst[dof..dof + n], &src[so..]),
                        None => copy_frame(&mut dst[dof..dof + n], &src[so..]),
                    };
                    let at = format!("n={n} src+{so} dst+{dof} {way:?}");
                    assert_eq!(copied, n, "{at}");
                    assert!(dst[..dof].iter().all(|&b| b == 0xAA), "before, {at}");
                    assert!(dst[dof..dof + n] == src[so..so + n], "{at}");
                    assert!(dst[dof + n..].iter().all(|&b| b == 0xAA), "after, {at}");
                }
            }
        }
    }

    /// Runs one window of [`RECHECK`] copies through `l`, each timed probe taking `per(way)` ns
    /// a byte; returns the ways of the copies after the probes.
    fn window(l: &Learnt, mut per: impl FnMut(Way) -> u64) -> Vec<Way> {
        let mut after = Vec::new();
        for i in 0..RECHECK {
            let (way, timed) = l.next();
            if i < PROBE {
                let expect = if i < PROBE / 2 {
                    Way::Plain
                } else {
                    Way::Streaming
                };
                assert_eq!(way, expect, "probe {i}");
                // The first copies after a change of way are not counted.
                assert_eq!(timed, i % (PROBE / 2) >= SETTLE, "probe {i}");
            } else {
                assert!(!timed, "copy {i}");
                after.push(way);
            }
            if timed {
                l.record(way, per(way) * 1000, 1000);
            }
        }
        after
    }

    /// Every probe of a way taking the same time: `plain` or `streaming` ns a byte.
    fn ways(plain: u64, streaming: u64) -> impl FnMut(Way) -> u64 {
        move |w| match w {
            Way::Plain => plain,
            Way::Streaming => streaming,
        }
    }

    /// Each window's probes decide the way of the rest of it: the one clearly faster, learnt
    /// afresh every window (a machine whose load changes), kept when the clock said nothing or
    /// the other was not clearly faster.
    #[test]
    fn the_faster_way_takes_the_copies_after_each_window_s_probes() {
        let l = Learnt::new();
        for _ in 0..WARMUP {
            assert_eq!(l.next(), (Way::Streaming, false), "warming up");
        }
        // Each window in turn: ns a byte plain and streaming, the way of the copies after it.
        let windows = [
            (1, 2, Way::Plain, "plain was faster"),
            (3, 2, Way::Streaming, "streaming was faster"),
            (0, 0, Way::Streaming, "no timing: kept"),
            (0, 2, Way::Streaming, "no plain timing: kept"),
            (2, 5, Way::Plain, "plain again"),
            // Not clearly faster: no switch, either way.
            (100, 95, Way::Plain, "streaming 5 % faster: kept"),
            (100, 80, Way::Streaming, "streaming 20 % faster"),
            (95, 100, Way::Streaming, "plain 5 % faster: kept"),
        ];
        for (plain, streaming, expect, why) in windows {
            let after = window(&l, ways(plain, streaming));
            assert!(after.iter().all(|&w| w == expect), "{why}");
        }
    }

    /// One probe far slower than the others (preempted, or faulting a slot's pages in) does not
    /// decide a window: the largest of a way's probes is left out of its mean.
    #[test]
    fn one_slow_probe_does_not_decide_a_window() {
        let l = Learnt::new();
        for _ in 0..WARMUP {
            l.next();
        }
        let mut slow_one = true;
        let after = window(&l, |way| match way {
            Way::Plain if std::mem::take(&mut slow_one) => 1000,
            Way::Plain => 1,
            Way::Streaming => 2,
        });
        assert!(
            after.iter().all(|&w| w == Way::Plain),
            "plain was faster but for one probe"
        );
    }

    /// copy_frame's own path, through warm-up, both ways of the probes (timed and not) and the
    /// way learnt: every copy byte-exact, with nothing written past it.
    #[test]
    fn every_copy_of_a_learning_window_is_exact() {
        let l = Learnt::new();
        let n = STREAMING_MIN + 17;
        let src = [pattern(n + 3, 1), pattern(n + 3, 2)];
        let mut dst = vec![0u8; n + 64];
        for i in 0..(WARMUP + PROBE + 8) as usize {
            dst.fill(0xAA);
            let s = &src[i % 2][3..];
            assert_eq!(copy_frame_in(&l, &mut dst[5..5 + n], s), n, "copy {i}");
            assert!(dst[5..5 + n] == s[..n], "copy {i}");
            assert!(
                dst[..5].iter().chain(&dst[5 + n..]).all(|&b| b == 0xAA),
                "copy {i}"
            );
        }
    }

    /// Sizes fall into their classes, the largest ones into the last.
    #[test]
    fn size_classes() {
        assert_eq!(size_class(STREAMING_MIN), 0);
        assert_eq!(size_class(2 * STREAMING_MIN - 1), 0);
        assert_eq!(size_class(1382400), 0); // 720p NV12
        assert_eq!(size_class(3110400), 1); // 1080p
        assert_eq!(size_class(12441600), 3); // 4K
        assert_eq!(size_class(usize::MAX), CLASSES - 1);
    }

    /// Slices of different lengths: the shorter decides, the rest of the destination stays.
    #[test]
    fn copies_the_shorter_length() {
        let src = pattern(STREAMING_MIN + 100, 3);
        let mut dst = vec![0u8; STREAMING_MIN + 10];
        assert_eq!(copy_frame(&mut dst, &src), STREAMING_MIN + 10);
        assert!(dst[..] == src[..STREAMING_MIN + 10]);
        let mut big = vec![9u8; STREAMING_MIN + 200];
        assert_eq!(copy_frame(&mut big, &src), STREAMING_MIN + 100);
        assert!(big[..STREAMING_MIN + 100] == src[..]);
        assert!(big[STREAMING_MIN + 100..].iter().all(|&b| b == 9));
    }
}
