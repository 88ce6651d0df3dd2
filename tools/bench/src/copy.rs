// SPDX-License-Identifier: MPL-2.0
//! The copy of copy mode alone (`bench copy [--rounds 2] [--frames 300]`): a producer renders
//! a 720p, 1080p or 4K NV12 frame (two buffers of its own in turn, as videotestsrc's pool),
//! then copies it into one of three slots of a memfd ring in turn, with a plain copy (glibc's
//! memcpy) or with the core's `frame_copy` (streaming stores from 1 MiB up on x86_64); rounds
//! alternate the two. Prints µs a copy and a frame (render and copy), and the medians.

use crate::measure::{median, now};
use crate::num;

/// Renders like videotestsrc's solid color: row by row.
fn render(buf: &mut [u8], row: usize, value: u8) {
    for line in buf.chunks_mut(row) {
        line.fill(value);
    }
}

pub fn copy(args: &[String]) -> Result<(), String> {
    let rounds = num(args, "--rounds", 2).max(1) as usize;
    let frames = num(args, "--frames", 300).max(1) as usize;
    println!(
        "# The copy into a ring slot: memcpy against frame_copy, {} CPUs, {rounds} round(s) of {frames} frames\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| round | size | copy | µs a copy | µs a frame (render + copy) |");
    println!("|---|---|---|---|---|");
    let sizes: [(&str, usize, usize); 3] = [
        ("720p", 1280, 720),
        ("1080p", 1920, 1080),
        ("4K", 3840, 2160),
    ];
    // [size][streaming] -> (copy µs, frame µs) per round
    let mut figs = vec![[Vec::new(), Vec::new(), Vec::new(), Vec::new()]; sizes.len()];
    for round in 0..rounds {
        for (si, &(name, w, h)) in sizes.iter().enumerate() {
            let size = w * h * 3 / 2;
            let slot = size.next_multiple_of(4096);
            let fd = gpushm::ring::shm::create_memfd("bench-copy", 3 * slot as u64)
                .map_err(|e| e.to_string())?;
            let mut ring =
                gpushm::ring::shm::map_rw(&fd, 3 * slot as u64).map_err(|e| e.to_string())?;
            ring.fill(0);
            let mut src = [vec![1u8; size], vec![2u8; size]];
            for k in 0..2 {
                // Each round in another order.
                let streaming = (k + round) % 2 == 1;
                let (mut copying, start) = (0u64, now());
                for f in 0..frames {
                    let s = &mut src[f % 2];
                    render(s, w, f as u8);
                    let t = now();
                    let dst = &mut ring[(f % 3) * slot..(f % 3) * slot + size];
                    match streaming {
                        true => {
                            gpushm::frame_copy::copy_frame(dst, s);
                        }
                        false => dst.copy_from_slice(s),
                    }
                    copying += now() - t;
                }
                let per_copy = copying as f64 / 1e3 / frames as f64;
                let per_frame = (now() - start) as f64 / 1e3 / frames as f64;
                let label = if streaming { "frame_copy" } else { "memcpy" };
                println!(
                    "| {} | {name} | {label} | {per_copy:.1} | {per_frame:.1} |",
                    round + 1
                );
                figs[si][2 * streaming as usize].push(per_copy);
                figs[si][2 * streaming as usize + 1].push(per_frame);
            }
        }
    }
    println!("\n## Medians of {rounds} round(s)\n");
    println!("| size | µs a copy: memcpy / frame_copy | µs a frame: memcpy / frame_copy |");
    println!("|---|---|---|");
    for (si, &(name, ..)) in sizes.iter().enumerate() {
        let m = |i: usize| median(&figs[si][i]);
        println!(
            "| {name} | {:.1} / {:.1} | {:.1} / {:.1} |",
            m(0),
            m(2),
            m(1),
            m(3)
        );
    }
    Ok(())
}
