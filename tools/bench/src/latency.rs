// SPDX-License-Identifier: MPL-2.0
//! Latency alone (`bench latency`): the floor and every mode of gpushm against shm, rounds
//! alternating, with medians.

use crate::arg;
use crate::floor::floor;
use crate::measure::{f, median, Fields};
use crate::procs::run;

/// `bench latency --cpu-latency-us N`, asked of the kernel once here: a mode that did not get
/// its request would be measured without it, so a refused (no access) or malformed value is an
/// error that says why.
pub fn cpu_latency_arg(args: &[String]) -> Result<Option<u32>, String> {
    let Some(v) = arg(args, "--cpu-latency-us") else {
        return Ok(None);
    };
    let us = v
        .parse::<u32>()
        .map_err(|_| format!("bench latency --cpu-latency-us {v}: µs from 0 to 1000000"))?;
    gpushm::cpu_latency::CpuLatency::request(us)
        .map_err(|e| format!("bench latency --cpu-latency-us {us}: {e}"))?;
    Ok(Some(us))
}

/// One way `bench latency` measures.
pub struct Mode {
    label: String,
    transport: &'static str,
    /// gpushmsrc spin-us.
    spin: u64,
    /// `gpushmsrc ! gpushmsink` processes between producer and consumer.
    relays: u64,
    /// cpu-latency-us of both elements.
    cpu_latency: Option<u32>,
    /// gpushmsink wake-early.
    wake_early: bool,
    /// gpushmsink wake-ahead-us (None: its default).
    wake_ahead: Option<u32>,
}

/// Latency alone (30 fps live, pool mode), with the floor measured in the same round:
/// `bench latency [--width 1280 --height 720] [--frames 300] [--runs 7]`. Without a size it
/// runs 720p, 1080p and 4K. Each round measures the floor, then both transports, the one that
/// goes first alternating from round to round; with more than one round it prints the
/// medians and in how many rounds gpushm's p50 was the lower, because single runs on these
/// machines differ by 5-15 µs.
pub fn latency_only(
    sizes: &[(u64, u64)],
    frames: u64,
    runs: u64,
    spin: u64,
    chain: u64,
    cpu_latency: Option<u32>,
    wake_ahead: &[u32],
) {
    let gpushm = |label: String| Mode {
        label,
        transport: "gpushm",
        spin: 0,
        relays: 0,
        cpu_latency: None,
        wake_early: true,
        wake_ahead: None,
    };
    let mut modes = vec![
        gpushm("gpushm".into()),
        Mode {
            wake_ahead: Some(0),
            ..gpushm("gpushm wake-ahead-us=0".into())
        },
        Mode {
            wake_early: false,
            ..gpushm("gpushm wake-early=false".into())
        },
        Mode {
            spin,
            ..gpushm(format!("gpushm spin-us={spin}"))
        },
        Mode {
            transport: "shm",
            ..gpushm("shm".into())
        },
    ];
    for &us in wake_ahead {
        modes.push(Mode {
            wake_ahead: Some(us),
            ..gpushm(format!("gpushm wake-ahead-us={us}"))
        });
    }
    if let Some(us) = cpu_latency {
        modes.push(Mode {
            spin,
            cpu_latency: Some(us),
            ..gpushm(format!("gpushm spin-us={spin} cpu-latency-us={us}"))
        });
    }
    if chain > 0 {
        modes.push(Mode {
            relays: chain,
            ..gpushm(format!("gpushm, {chain} relays"))
        });
        modes.push(Mode {
            spin,
            relays: chain,
            ..gpushm(format!("gpushm spin-us={spin}, {chain} relays"))
        });
    }
    let mut summary = Vec::new();
    for &(w, h) in sizes {
        println!("\n## Latency {w}x{h} NV12, 30 fps live, pool mode, {runs} round(s) of {frames} frames\n");
        // Per mode and round: p50, p99, producer part, CPU % of a core (producer, relays,
        // consumer).
        let n = modes.len();
        let (mut p50, mut p99, mut part) = (vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
        let (mut pcpu, mut rcpu, mut ccpu) = (vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
        let mut floors = Vec::new();
        for round in 0..runs {
            let fl = floor(30, frames);
            floors.push(f(&fl, "p50_us"));
            println!(
                "round {}: floor p50 {:.1} µs, p99 {:.1} µs",
                round + 1,
                f(&fl, "p50_us"),
                f(&fl, "p99_us")
            );
            // Alternating: odd rounds run the modes backwards.
            let order: Vec<usize> = if round % 2 == 0 {
                (0..n).collect()
            } else {
                (0..n).rev().collect()
            };
            for i in order {
                let Mode {
                    label,
                    transport: t,
                    spin,
                    relays,
                    cpu_latency,
                    wake_early,
                    wake_ahead,
                } = &modes[i];
                std::env::set_var("GPUSHM_BENCH_SPIN_US", spin.to_string());
                std::env::set_var("GPUSHM_BENCH_WAKE_EARLY", wake_early.to_string());
                std::env::set_var("GPUSHM_BENCH_CHAIN", relays.to_string());
                if let Some(us) = cpu_latency {
                    std::env::set_var("GPUSHM_BENCH_CPU_LATENCY_US", us.to_string());
                }
                if let Some(us) = wake_ahead {
                    std::env::set_var("GPUSHM_BENCH_WAKE_AHEAD_US", us.to_string());
                }
                let lat = run(t, w, h, frames, 30, false, false);
                std::env::remove_var("GPUSHM_BENCH_SPIN_US");
                std::env::remove_var("GPUSHM_BENCH_CHAIN");
                std::env::remove_var("GPUSHM_BENCH_CPU_LATENCY_US");
                std::env::remove_var("GPUSHM_BENCH_WAKE_EARLY");
                std::env::remove_var("GPUSHM_BENCH_WAKE_AHEAD_US");
                let c = &lat.consumer;
                // CPU time per frame times the frame rate: the share of a core.
                let share = |m: &Option<Fields>| f(m, "cpu_us_per_frame") * 30.0 / 1e4;
                let relay_cpu: f64 = lat.relays.iter().map(share).sum();
                p50[i].push(f(c, "p50_us"));
                p99[i].push(f(c, "p99_us"));
                part[i].push(f(c, "producer_p50_us"));
                pcpu[i].push(share(&lat.producer));
                rcpu[i].push(relay_cpu);
                ccpu[i].push(share(c));
                let stamp = if *t == "gpushm" {
                    format!("; stamp to publish {:.1}", f(c, "producer_p50_us"))
                } else {
                    String::new()
                };
                // How the low-latency mode fared: a frame that came outside the poll's window
                // waited for a wake-up (the p99 of a round is its 2nd-worst frame of 150).
                let polls = if *spin > 0 {
                    format!(
                        "; polls caught {:.0}, missed {:.0}",
                        f(c, "spin_caught"),
                        f(c, "spin_missed")
                    )
                } else {
                    String::new()
                };
                let relays_cpu = if *relays > 0 {
                    format!(", relays {relay_cpu:.2} %")
                } else {
                    String::new()
                };
                println!(
                    "  {label}: p50 {:.1} µs (floor +{:.1}{stamp}), p99 {:.1} µs{polls}; CPU of a core: producer {:.2} %{relays_cpu}, consumer {:.2} %",
                    f(c, "p50_us"),
                    f(c, "p50_us") - f(&fl, "p50_us"),
                    f(c, "p99_us"),
                    share(&lat.producer),
                    share(c),
                );
            }
        }
        let fl = median(&floors);
        for (
            i,
            Mode {
                label,
                transport: t,
                relays,
                ..
            },
        ) in modes.iter().enumerate()
        {
            let m = median(&p50[i]);
            summary.push(format!(
                "| {w}x{h} | {label} | {fl:.1} | {m:.1} | {:.1} | {:+.1} | {} | {:.2} / {} / {:.2} |",
                median(&p99[i]),
                m - fl,
                if *t == "gpushm" {
                    format!("{:.1}", median(&part[i]))
                } else {
                    "".into()
                },
                median(&pcpu[i]),
                if *relays > 0 {
                    format!("{:.2}", median(&rcpu[i]))
                } else {
                    "".into()
                },
                median(&ccpu[i]),
            ));
        }
    }
    println!("\n## Latency, medians over {runs} round(s)\n");
    println!("| size | mode | floor p50 µs | p50 µs | p99 µs | p50 above the floor | stamp to publish p50 µs | CPU % of a core: producer / relays / consumer |");
    println!("|---|---|---|---|---|---|---|---|");
    for line in summary {
        println!("{line}");
    }
}
