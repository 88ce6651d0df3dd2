// SPDX-License-Identifier: MPL-2.0
//! The C API against the Rust subscriber and gpushmsrc (`bench capi`).

use crate::measure::f;
use crate::procs::{run_format, two_cpus, NO_ASLR, PIN};
use crate::{arg, num};

/// The C API's bench consumer (capi/bench/c_consumer.c, built against an installed
/// libgpushm): `GPUSHM_C_CONSUMER`, or `c_consumer` beside this binary.
pub fn c_consumer() -> std::path::PathBuf {
    std::env::var_os("GPUSHM_C_CONSUMER")
        .map(Into::into)
        .unwrap_or_else(|| {
            std::env::current_exe()
                .expect("current_exe")
                .with_file_name("c_consumer")
        })
}

/// The C API against the Rust subscriber and gpushmsrc: the same live producer (60 fps), tiny
/// (64x64 GRAY8) and 1080p NV12 frames, `--rounds` rounds alternating the three consumers.
pub fn capi_mode(args: &[String]) {
    let frames = num(args, "--frames", 300);
    let rounds = num(args, "--rounds", 2).max(1);
    if !c_consumer().exists() {
        println!(
            "no C consumer at {} (build capi/bench/c_consumer.c against an installed libgpushm, or set GPUSHM_C_CONSUMER)",
            c_consumer().display()
        );
        return;
    }
    // Where the scheduler puts the two processes (the same core or two, a core that was idle
    // or not) changes a frame's cost by up to twice from one run to the next on a VM: pinned,
    // every consumer is measured in the same place.
    let pinned = match args.iter().any(|a| a == "--no-pin") {
        true => None,
        false => two_cpus(),
    };
    *PIN.lock().unwrap() = pinned;
    let place = match pinned {
        Some((p, c)) => format!("producer on CPU {p}, consumer on CPU {c}"),
        None => "placed by the scheduler".into(),
    };
    // Where the libraries, heap and stack land changes after every start: --no-aslr puts each
    // consumer at the same addresses every run, to tell that apart from the code's own cost.
    let fixed = args.iter().any(|a| a == "--no-aslr");
    NO_ASLR.store(fixed, std::sync::atomic::Ordering::Relaxed);
    let place = match fixed {
        true => format!("{place}, consumers without address-space randomisation"),
        false => place,
    };
    let only = arg(args, "--only");
    if let Some(o) = only.as_deref().filter(|o| !["tiny", "1080p"].contains(o)) {
        println!("bench capi --only {o}: tiny or 1080p");
        return;
    }
    println!("\n## The C API against the Rust subscriber and gpushmsrc ({frames} frames at 60 fps, lossless, {rounds} rounds, {place})\n");
    println!("| frames | consumer | latency p50 / p99 (µs) | CPU per frame (µs) | per frame: minor faults / context switches (voluntary, involuntary) |");
    println!("|---|---|---|---|---|");
    for (name, format, w, h) in [
        ("64x64 GRAY8", "GRAY8", 64, 64),
        ("1080p NV12", "NV12", 1920, 1080),
    ]
    .into_iter()
    .filter(|(_, _, w, _)| match only.as_deref() {
        Some("tiny") => *w == 64,
        Some("1080p") => *w == 1920,
        _ => true,
    }) {
        let mut cpu = std::collections::HashMap::<&str, Vec<f64>>::new();
        let consumers = [
            ("capi", "C (libgpushm)"),
            ("sub", "Rust (gpushm crate)"),
            ("gpushm", "gpushmsrc ! fakesink"),
        ];
        for round in 0..rounds {
            // Each round starts with the next consumer: none always runs first (after the
            // previous size's or round's runs) or always right after another.
            for i in 0..consumers.len() {
                let (t, label) = consumers[(round as usize + i) % consumers.len()];
                let r = run_format(t, format, w, h, frames, 60, false, false);
                let c = &r.consumer;
                println!(
                    "| {name} | {label} | {:.1} / {:.1} | {:.1} | {:.2} / {:.2}, {:.2} |",
                    f(c, "p50_us"),
                    f(c, "p99_us"),
                    f(c, "cpu_us_per_frame"),
                    f(c, "minflt_per_frame"),
                    f(c, "nvcsw_per_frame"),
                    f(c, "nivcsw_per_frame"),
                );
                cpu.entry(t).or_default().push(f(c, "cpu_us_per_frame"));
            }
        }
        let mean = |t: &str| {
            let v = &cpu[t];
            v.iter().sum::<f64>() / v.len() as f64
        };
        // Rounds drift (the machine's state): each round's C against the same round's Rust.
        let mut paired: Vec<f64> = cpu["capi"]
            .iter()
            .zip(&cpu["sub"])
            .map(|(c, r)| c / r.max(f64::MIN_POSITIVE) * 100.0)
            .collect();
        paired.sort_by(f64::total_cmp);
        println!(
            "| {name} | C / Rust CPU per frame | | {:.0} % (means), {:.0} % (median of the rounds' ratios: {}) | |",
            mean("capi") / mean("sub") * 100.0,
            (paired[(paired.len() - 1) / 2] + paired[paired.len() / 2]) / 2.0,
            paired
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
