// SPDX-License-Identifier: MPL-2.0
//! A frame pattern that depends on the frame number, for checking a transport end to end:
//! every byte of row `r` of plane `p` of frame `n` is `row_value(n, p, r)`. A consumer that
//! knows `n` (the buffer offset) can check every byte it received.

use gst_video::prelude::*;

/// The value of every byte of one row (defined once, in the transport crate).
pub use gpushm::format::pattern_value as row_value;

/// Fills a writable video frame with the pattern of frame `n`.
pub fn fill(frame: &mut gst_video::VideoFrameRef<&mut gst::BufferRef>, n: u64) {
    for p in 0..frame.n_planes() as usize {
        let stride = frame.plane_stride()[p] as usize;
        let rows = plane_rows(frame.info(), p);
        let width = plane_row_bytes(frame.info(), p);
        let Ok(data) = frame.plane_data_mut(p as u32) else {
            continue;
        };
        for r in 0..rows {
            let start = r * stride;
            if start + width > data.len() {
                break;
            }
            data[start..start + width].fill(row_value(n, p, r));
        }
    }
}

/// Checks a received frame against the pattern of frame `n`. Returns how many rows differ.
pub fn check(frame: &gst_video::VideoFrameRef<&gst::BufferRef>, n: u64) -> usize {
    let mut bad = 0;
    let mut expect = Vec::new();
    for p in 0..frame.n_planes() as usize {
        let stride = frame.plane_stride()[p] as usize;
        let rows = plane_rows(frame.info(), p);
        let width = plane_row_bytes(frame.info(), p);
        let Ok(data) = frame.plane_data(p as u32) else {
            return usize::MAX;
        };
        for r in 0..rows {
            let start = r * stride;
            expect.resize(width, 0);
            expect.fill(row_value(n, p, r));
            // Slice equality compiles to memcmp, fast even in debug builds.
            if data.get(start..start + width) != Some(&expect[..]) {
                bad += 1;
            }
        }
    }
    bad
}

/// A checksum of the visible bytes of a frame (FNV-1a over the per-row sums), to print.
pub fn checksum(frame: &gst_video::VideoFrameRef<&gst::BufferRef>) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in 0..frame.n_planes() as usize {
        let stride = frame.plane_stride()[p] as usize;
        let width = plane_row_bytes(frame.info(), p);
        let Ok(data) = frame.plane_data(p as u32) else {
            return 0;
        };
        for r in 0..plane_rows(frame.info(), p) {
            let row = &data[r * stride..r * stride + width];
            let s: u64 = row
                .chunks(8)
                .map(|c| c.iter().map(|&b| b as u64).sum::<u64>())
                .sum();
            h = (h ^ s).wrapping_mul(0x100000001b3);
        }
    }
    h
}

pub use crate::geometry::{plane_row_bytes, plane_rows};
