// SPDX-License-Identifier: MPL-2.0
//! Tiny frames (`bench tiny`): the transport's own cost per frame, GStreamer on both ends.

use crate::measure::{f, median};
use crate::procs::{run_format, timeout_s};

/// The transport's own cost: 64x64 GRAY8 frames (4 KiB), producer flat out, lossless consumer.
pub fn tiny_frames(runs: u64, spin: u64) {
    println!(
        "\n## Tiny frames: 64x64 GRAY8, producer flat out, lossless consumer, {runs} round(s)\n"
    );
    println!(
        "| round | transport | producer alone fps | delivered fps | of the producer alone | CPU µs/frame: producer / consumer |"
    );
    println!("|---|---|---|---|---|---|");
    let frames = 20_000;
    let old = std::env::var("GPUSHM_BENCH_TIMEOUT").ok();
    std::env::set_var(
        "GPUSHM_BENCH_TIMEOUT",
        old.clone().unwrap_or_else(|| "30".into()),
    );
    // (label, transport, spin-us of gpushmsink and gpushmsrc)
    let modes: Vec<(String, &str, u64)> = vec![
        ("gpushm".into(), "gpushm", 0),
        (format!("gpushm spin-us={spin}"), "gpushm", spin),
        ("shm".into(), "shm", 0),
    ];
    // Per round: the producer alone, then every transport (alternating order), each against
    // that round's producer-alone rate.
    let mut alone_fps = vec![];
    let mut share = vec![vec![]; modes.len()];
    let mut delivered = vec![vec![]; modes.len()];
    for round in 0..runs {
        let alone = run_format("none", "GRAY8", 64, 64, frames, 0, false, false);
        let a = f(&alone.producer, "fps");
        alone_fps.push(a);
        let order: Vec<usize> = if round % 2 == 0 {
            (0..modes.len()).collect()
        } else {
            (0..modes.len()).rev().collect()
        };
        for i in order {
            let (label, t, spin) = &modes[i];
            std::env::set_var("GPUSHM_BENCH_SPIN_US", spin.to_string());
            std::env::set_var("GPUSHM_BENCH_SINK_SPIN_US", spin.to_string());
            let r = run_format(t, "GRAY8", 64, 64, frames, 0, false, false);
            std::env::remove_var("GPUSHM_BENCH_SPIN_US");
            std::env::remove_var("GPUSHM_BENCH_SINK_SPIN_US");
            if r.consumer.is_none() {
                // shmsink/shmsrc at this rate on a small machine: shmsink's streaming thread
                // waits for free space that the frees it has not read yet would give, or both
                // ends block in send() on each other's full socket.
                println!(
                    "| {} | {label} | {a:.0} | stalled: not all {frames} frames within {} s | | - |",
                    round + 1,
                    timeout_s()
                );
                delivered[i].push(0.0);
                share[i].push(0.0);
                continue;
            }
            let d = f(&r.consumer, "fps");
            delivered[i].push(d);
            share[i].push(d / a * 100.0);
            println!(
                "| {} | {label} | {a:.0} | {d:.0} | {:.0} % | {:.1} / {:.1} |",
                round + 1,
                d / a * 100.0,
                f(&r.producer, "cpu_us_per_frame"),
                f(&r.consumer, "cpu_us_per_frame"),
            );
        }
    }
    let shm = median(&delivered[modes.len() - 1]);
    println!(
        "\nMedians over {runs} round(s), producer alone {:.0} fps:\n",
        median(&alone_fps)
    );
    println!("| transport | delivered fps | of the producer alone | against shm |");
    println!("|---|---|---|---|");
    for (i, (label, _, _)) in modes.iter().enumerate() {
        println!(
            "| {label} | {:.0} | {:.0} % | {} |",
            median(&delivered[i]),
            median(&share[i]),
            if shm > 0.0 {
                format!("{:.2}×", median(&delivered[i]) / shm)
            } else {
                "(shm stalled)".into()
            }
        );
    }
    match old {
        Some(v) => std::env::set_var("GPUSHM_BENCH_TIMEOUT", v),
        None => std::env::remove_var("GPUSHM_BENCH_TIMEOUT"),
    }
}
