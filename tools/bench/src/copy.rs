// SPDX-License-Identifier: MPL-2.0
//! The copy of copy mode alone (`bench copy [--rounds 2] [--frames 300]`): a producer renders
//! a 720p, 1080p or 4K NV12 frame (two buffers of its own in turn, as videotestsrc's pool),
//! then copies it into one of three slots of a memfd ring in turn: with a plain copy (glibc's
//! memcpy), with streaming stores (`frame_copy::copy_frame_with(Way::Streaming, ..)`), and with
//! the core's `frame_copy`, which learns which of the two is faster for a size on this machine;
//! rounds rotate the three. Prints µs a copy and a frame (render and copy), and the medians.
//! What `frame_copy` learns lasts for the process: with the defaults each size's first run
//! has its 64 copies of warm-up (streaming) and one window of probes, and later rounds copy
//! the way learnt, probing again every 1024 copies; with `--frames 64` or fewer and one round
//! it never probes.

use crate::measure::{median, now, FRAME_SIZES};
use crate::num;
use gpushm::frame_copy::{copy_frame, copy_frame_with, Way};

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
        "# The copy into a ring slot: memcpy, streaming stores and frame_copy (learning), {} CPUs, {rounds} round(s) of {frames} frames\n",
        crate::measure::cpus()
    );
    println!("| round | size | copy | µs a copy | µs a frame (render + copy) |");
    println!("|---|---|---|---|---|");
    let sizes = FRAME_SIZES;
    const WAYS: [&str; 3] = ["memcpy", "streaming", "frame_copy"];
    // [size][way] -> (copy µs, frame µs) per round
    let mut figs = vec![[(); 3].map(|_| (Vec::new(), Vec::new())); sizes.len()];
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
            for k in 0..WAYS.len() {
                // Each round in another order.
                let wi = (k + round) % WAYS.len();
                let (mut copying, start) = (0u64, now());
                for f in 0..frames {
                    let s = &mut src[f % 2];
                    render(s, w, f as u8);
                    let t = now();
                    let dst = &mut ring[(f % 3) * slot..(f % 3) * slot + size];
                    match wi {
                        0 => dst.copy_from_slice(s),
                        1 => {
                            copy_frame_with(Way::Streaming, dst, s);
                        }
                        _ => {
                            copy_frame(dst, s);
                        }
                    }
                    copying += now() - t;
                }
                let per_copy = copying as f64 / 1e3 / frames as f64;
                let per_frame = (now() - start) as f64 / 1e3 / frames as f64;
                println!(
                    "| {} | {name} | {} | {per_copy:.1} | {per_frame:.1} |",
                    round + 1,
                    WAYS[wi]
                );
                figs[si][wi].0.push(per_copy);
                figs[si][wi].1.push(per_frame);
            }
        }
    }
    println!("\n## Medians of {rounds} round(s)\n");
    let cols = WAYS.join(" / ");
    println!("| size | µs a copy: {cols} | µs a frame: {cols} |");
    println!("|---|---|---|");
    for (si, &(name, ..)) in sizes.iter().enumerate() {
        let m = |v: &Vec<f64>| format!("{:.1}", median(v));
        let copies: Vec<String> = figs[si].iter().map(|f| m(&f.0)).collect();
        let frames: Vec<String> = figs[si].iter().map(|f| m(&f.1)).collect();
        println!(
            "| {name} | {} | {} |",
            copies.join(" / "),
            frames.join(" / ")
        );
    }
    Ok(())
}
