// SPDX-License-Identifier: MPL-2.0
//! Copying a whole frame into a ring slot: the copy a producer pays for every frame it does not
//! render in place (gpushmsink's copy mode, `Slot::fill_from_host`, Python's `publish` of an
//! array).
//!
//! A frame copied into a slot is read next by a consumer, never by the producer, so on x86_64
//! the copy of a large frame writes with streaming (non-temporal) stores: they skip reading
//! every destination line into the cache before overwriting it and do not push the
//! producer's own working set out of the cache. On the H200 machine the copy of a 4K NV12
//! frame into ring slots in turn took 15–35 % less time than with glibc's memcpy, of a 1080p
//! one about 25 % and of a 720p one about 13 % (`bench copy`, docs/benchmarks.md). Not for a
//! slot the producer reads back (a device ring's host staging bytes, which go to the GPU next):
//! gpushmsink copies those plainly. glibc's memcpy streams too, but only above a threshold
//! it derives from the size of the last-level cache, which a VM that sees 300 MiB of cache
//! puts above a 4K frame. The consumer then reads the frame from memory rather than from the
//! shared cache, as it would after any copy that large on a busy machine.
//!
//! Small copies, and other architectures (Jetson's aarch64 among them), use the plain copy.

/// Copies at or above this many bytes use streaming stores (a 720p NV12 frame is 1.4 MB).
pub const STREAMING_MIN: usize = 1 << 20;

/// Copies `src` into `dst`, the first `min(dst.len(), src.len())` bytes; returns how many.
/// The streaming stores are fenced: they are ordered before any later store, so the release
/// store that publishes the frame covers them as it covers a plain copy.
pub fn copy_frame(dst: &mut [u8], src: &[u8]) -> usize {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    if n >= STREAMING_MIN {
        // SAFETY: two slices of n bytes each; they cannot overlap (one is borrowed mutably).
        unsafe { x86_64::stream_copy(dst.as_mut_ptr(), src.as_ptr(), n) };
        return n;
    }
    dst.copy_from_slice(src);
    n
}

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
                let mut dst = vec![0xAAu8; n + dof + 8];
                let copied = copy_frame(&mut dst[dof..dof + n], &src[so..]);
                assert_eq!(copied, n, "n={n} src+{so} dst+{dof}");
                assert!(dst[..dof].iter().all(|&b| b == 0xAA), "before, n={n}");
                assert!(
                    dst[dof..dof + n] == src[so..so + n],
                    "n={n} src+{so} dst+{dof}"
                );
                assert!(dst[dof + n..].iter().all(|&b| b == 0xAA), "after, n={n}");
            }
        }
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
