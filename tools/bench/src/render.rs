// SPDX-License-Identifier: MPL-2.0
//! Upstream's render alone, by where the buffer lies (`bench render [--rounds 5]`): what the
//! producer alone of `bench throughput` has that a transport's buffers do not.
//!
//! GStreamer 1.26's videotestsrc renders a solid color by copying each plane of a frame it
//! cached, whole (1.22 copies it line by line). Its cached frame and the buffers of its own
//! pool come from the same allocator, so their data lie at the same offset in a page (0x98 with
//! glibc 2.41's malloc and GStreamer 1.26's system memory): source and destination are
//! aligned alike. A transport's buffers differ in three ways, each measured here on its own,
//! in the same rounds (alternating), copying NV12 planes from a source at page offset 0x98:
//!
//! - **where in a page** the frame starts: 0x98, as the producer alone's buffers, or 0, a
//!   page-aligned slot (gpushm's, unixfd's memfd), 40 bytes apart from the source modulo 64;
//! - **what memory**: private (malloc's) or a memfd mapped shared;
//! - **how many buffers in rotation**: two (the producer alone) or three (into a consumer that
//!   keeps its last frame).
//!
//! Prints µs a frame and the medians; `DIR/run bench render` measures glibc 2.41's memcpy
//! (GStreamer 1.26's), `bench render` the host's.

use crate::measure::{median, now, FRAME_SIZES};
use crate::num;
use std::ops::{Deref, DerefMut};

/// The page offset of the source, as a GstMemory's data from glibc 2.41's malloc.
const SOURCE_OFFSET: usize = 0x98;

/// One way of laying out the destination buffers.
struct Layout {
    offset: usize,
    shared: bool,
    buffers: usize,
}

impl Layout {
    fn label(&self) -> String {
        format!(
            "{}, at +{:#x}, {} buffers",
            if self.shared { "memfd" } else { "private" },
            self.offset,
            self.buffers
        )
    }
}

const LAYOUTS: [Layout; 5] = [
    // The producer alone.
    Layout {
        offset: SOURCE_OFFSET,
        shared: false,
        buffers: 2,
    },
    Layout {
        offset: 0,
        shared: false,
        buffers: 2,
    },
    Layout {
        offset: SOURCE_OFFSET,
        shared: true,
        buffers: 2,
    },
    // A page-aligned ring slot, two or three in rotation.
    Layout {
        offset: 0,
        shared: true,
        buffers: 2,
    },
    Layout {
        offset: 0,
        shared: true,
        buffers: 3,
    },
];

/// `len` bytes starting at a page: private heap memory (malloc's, as GStreamer's system
/// memory), or a memfd mapped shared.
fn mapping(len: usize, shared: bool) -> Result<Box<dyn DerefMut<Target = [u8]>>, String> {
    if shared {
        let fd = gpushm::ring::shm::create_memfd("bench-render", len as u64)
            .map_err(|e| e.to_string())?;
        let map = gpushm::ring::shm::map_rw(&fd, len as u64).map_err(|e| e.to_string())?;
        Ok(Box::new(map))
    } else {
        Ok(Box::new(PageAligned::new(len)))
    }
}

/// Heap memory whose bytes start at a page.
struct PageAligned {
    vec: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageAligned {
    fn new(len: usize) -> Self {
        let vec = vec![0u8; len + 4096];
        let base = vec.as_ptr() as usize;
        let start = base.next_multiple_of(4096) - base;
        PageAligned { vec, start, len }
    }
}

impl Deref for PageAligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.vec[self.start..self.start + self.len]
    }
}

impl DerefMut for PageAligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

pub fn render(args: &[String]) -> Result<(), String> {
    let rounds = num(args, "--rounds", 5).max(1) as usize;
    println!(
        "# Rendering (copying a cached NV12 frame's planes whole) by where the buffer lies, {} CPUs, {rounds} round(s)\n",
        crate::measure::cpus()
    );
    println!("| round | size | destination | µs a frame |");
    println!("|---|---|---|---|");
    let sizes = FRAME_SIZES;
    let mut figs = vec![vec![Vec::new(); LAYOUTS.len()]; sizes.len()];
    for (si, &(name, w, h)) in sizes.iter().enumerate() {
        let (luma, size) = (w * h, w * h * 3 / 2);
        // Each buffer in its own pages, with room for the offset.
        let stride = (size + SOURCE_OFFSET).next_multiple_of(4096);
        let mut source = mapping(stride, false)?;
        source.fill(0x60);
        let src = &source[SOURCE_OFFSET..SOURCE_OFFSET + size];
        let mut dests = LAYOUTS
            .iter()
            .map(|l| {
                let mut m = mapping(l.buffers * stride, l.shared)?;
                m.fill(0);
                Ok(m)
            })
            .collect::<Result<Vec<_>, String>>()?;
        // About 1.5 GB copied a measurement: long enough to drown the clock, short enough
        // for many rounds.
        let frames = (1_500_000_000 / size).clamp(50, 2000);
        for round in 0..rounds {
            for k in 0..LAYOUTS.len() {
                // Each round in another order.
                let li = (k + round) % LAYOUTS.len();
                let l = &LAYOUTS[li];
                let dst = &mut dests[li];
                let mut copy = |f: usize| {
                    let at = (f % l.buffers) * stride + l.offset;
                    let d = &mut dst[at..at + size];
                    // Plane by plane, as videotestsrc: two memcpys.
                    d[..luma].copy_from_slice(&src[..luma]);
                    d[luma..].copy_from_slice(&src[luma..]);
                };
                for f in 0..2 * l.buffers {
                    copy(f);
                }
                let start = now();
                for f in 0..frames {
                    copy(f);
                }
                let us = (now() - start) as f64 / 1e3 / frames as f64;
                println!("| {} | {name} | {} | {us:.1} |", round + 1, l.label());
                figs[si][li].push(us);
            }
        }
    }
    println!("\n## Medians of {rounds} round(s), µs a frame\n");
    let head: Vec<String> = LAYOUTS.iter().map(Layout::label).collect();
    println!("| size | {} |", head.join(" | "));
    println!("|---|{}", "---|".repeat(LAYOUTS.len()));
    for (si, &(name, ..)) in sizes.iter().enumerate() {
        let cells: Vec<String> = figs[si]
            .iter()
            .map(|v| format!("{:.1}", median(v)))
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    Ok(())
}
