// SPDX-License-Identifier: MPL-2.0
//! The full run (`bench`, no subcommand): throughput and latency tables for 720p, 1080p and
//! 4K against shm (and unixfd), tiny frames, the plot and, with a GPU, the GPU mode.

use crate::floor::floor;
use crate::gpu::gpu_mode;
use crate::measure::f;
use crate::plot::{plot, Row};
use crate::procs::{have, run};
use crate::tiny::tiny_frames;
use crate::unixfdsink_copies;

pub fn orchestrate(plot_path: &str) {
    let mut rows = Vec::new();
    let sizes = [
        ("720p", 1280, 720, 300),
        ("1080p", 1920, 1080, 200),
        ("4K", 3840, 2160, 100),
    ];
    let mut transports = vec!["gpushm", "shm"];
    if have("unixfdsink") {
        transports.push("unixfd");
    }
    let machine = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    println!("# gpushm benchmark\n");
    println!(
        "Machine: {} CPUs ({machine}), GStreamer {}.",
        crate::measure::cpus(),
        gst::version_string()
    );
    if !have("unixfdsink") {
        println!("unixfdsink/unixfdsrc: not installed (GStreamer >= 1.24), skipped.");
    }
    println!("\n## Throughput (producer flat out, lossless consumer) and latency (30 fps live)\n");
    println!("The floor: one process writes an eventfd at 30 Hz, another blocked in poll() wakes (measured before each size's runs); overhead = latency p50 - floor p50.\n");
    println!("| size | mode | transport | producer alone fps | delivered fps | % | latency p50 / p99 / max µs (30 fps live) | floor p50 / p99 µs | overhead p50 µs | CPU µs/frame: producer alone / producer / consumer | peak RSS producer / consumer MiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (size, (name, w, h, frames)) in sizes.into_iter().enumerate() {
        let fl = floor(30, 90);
        let alone = run("none", w, h, frames, 0, false, false);
        let own = f(&alone.producer, "fps");
        for copy in [false, true] {
            let mode = if copy { "copy" } else { "pool" };
            for t in &transports {
                if copy && *t == "unixfd" && !unixfdsink_copies() {
                    println!(
                        "| {name} | {mode} | unixfd | {own:.0} | n/a | n/a: unixfdsink before GStreamer 1.28 takes only memory backed by a file descriptor and stops the stream (\"Internal data stream error\") on any other; 1.28 copies it into shared memory (its `min-memory-size`) | | | | | |"
                    );
                    continue;
                }
                let tput = run(t, w, h, frames, 0, copy, false);
                let lat = run(t, w, h, 90, 30, copy, false);
                let delivered = f(&tput.consumer, "fps");
                rows.push(Row {
                    size,
                    copy,
                    transport: t,
                    percent: 100.0 * delivered / own,
                    p50: f(&lat.consumer, "p50_us"),
                    p99: f(&lat.consumer, "p99_us"),
                });
                println!(
                    "| {name} | {mode} | {t} | {own:.0} | {delivered:.0} | {:.0} % | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {:.0} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} |",
                    100.0 * delivered / own,
                    f(&lat.consumer, "p50_us"),
                    f(&lat.consumer, "p99_us"),
                    f(&lat.consumer, "max_us"),
                    f(&fl, "p50_us"),
                    f(&fl, "p99_us"),
                    f(&lat.consumer, "p50_us") - f(&fl, "p50_us"),
                    f(&alone.producer, "cpu_us_per_frame"),
                    f(&tput.producer, "cpu_us_per_frame"),
                    f(&tput.consumer, "cpu_us_per_frame"),
                    f(&tput.producer, "rss_kib") / 1024.0,
                    f(&tput.consumer, "rss_kib") / 1024.0,
                );
            }
        }
    }
    tiny_frames(1, 300);
    let title = format!(
        "gpushm vs shmsink/shmsrc, NV12: {} CPUs ({machine})",
        crate::measure::cpus()
    );
    match plot(&rows, plot_path, &title) {
        Ok(()) => println!("\nPlot: {plot_path}"),
        Err(e) => eprintln!("bench: no plot: {e}"),
    }
    match gstgpushm::cuda::driver() {
        Err(e) => println!("\nGPU mode skipped: {e}"),
        Ok(_) => gpu_mode(),
    }
}
