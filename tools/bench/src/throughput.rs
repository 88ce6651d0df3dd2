// SPDX-License-Identifier: MPL-2.0
//! Throughput only (`bench throughput [--rounds 3] [--scale 1] [--pin] [--pool-only | --copy-only]
//! [--sizes 720p,1080p,4K] [--compare "CMD"] [--aligned-alone]`): a producer flat out
//! into a lossless consumer, against the same producer alone, at 720p, 1080p and 4K NV12, in
//! pool mode (upstream renders into the sink's buffers) and copy mode (the sink copies), for
//! gpushm, shm and unixfd (when installed). Rounds alternate the transports' order; the table
//! at the end has the medians.
//!
//! Runs are long enough to measure the steady state (720p 3000 frames, 1080p 1500, 4K 500,
//! times `--scale`): with a hundred frames, the first touch of every slot of a ring (8 × 12 MiB
//! at 4K) is a tenth of the run. Besides frames a second and CPU time a frame, the producer
//! reports its minor page faults and voluntary context switches (sleeps) a frame, counted from
//! its first frame on: the whole process's, and in brackets its streaming thread's own (the
//! thread that renders and pushes every frame; the others, a server's connection thread among
//! them, do not hold frames up). The streaming thread's own CPU time a frame, and the buffers
//! in rotation (the distinct buffers upstream rendered into over the second half of a run)
//! say where a size's extra time goes: alone, videotestsrc takes turns between two buffers;
//! into a consumer that keeps its last frame (fakesink does), every transport needs a third,
//! one more frame's worth of memory for the CPU's caches to hold.
//!
//! The producer alone runs before and after each size's transports, and each is measured
//! against the mean of the two: a shared machine's pace drifts by 10 % and more within a
//! minute. `--compare "CMD"` adds gpushm run by another build (`CMD produce ...` and `CMD
//! consume ...`, e.g. `target/old/bench` or `DIR/run old/bench` on GStreamer 1.26), labelled
//! `gpushm (compared)`, in the same rounds; leading `NAME=value` words set its environment,
//! and with nothing after them it is this build (`--compare
//! "GPUSHM_BENCH_CONSUMER_SINK_PROPS=enable-last-sample=false"`).
//!
//! `--aligned-alone` adds the producer alone with its buffers starting at a page, as every
//! transport's do (`alone, page-aligned`, pool mode, measured against the producer alone like
//! a transport). GStreamer 1.26's videotestsrc renders a solid color by copying the planes of
//! a frame it cached; its own buffers lie at the same offset in a page as that frame, so its
//! copies are aligned alike, which a page-aligned slot's are not (`bench render` measures the
//! copy alone). The table's last line says where each run's buffers started.

use crate::measure::{f, median};
use crate::procs::{have, run, two_cpus, OTHER_BUILD, PIN};
use crate::{num, unixfdsink_copies};

/// The label of gpushm run by the build `--compare` names.
const COMPARED: &str = "gpushm (compared)";

/// The label of the producer alone with page-aligned buffers (`--aligned-alone`).
const ALIGNED: &str = "alone, page-aligned";

/// One transport's figures over the rounds of one size and mode.
#[derive(Default, Clone)]
struct Figures {
    percent: Vec<f64>,
    cpu: Vec<f64>,
    faults: Vec<f64>,
    sleeps: Vec<f64>,
    /// The producer's streaming thread's own sleeps a frame.
    stream_sleeps: Vec<f64>,
    /// The consumer's CPU time a frame (NaN for the producer alone).
    consumer_cpu: Vec<f64>,
    /// The producer's streaming thread's own CPU time a frame.
    stream_cpu: Vec<f64>,
    /// Buffers upstream rendered into over the second half of the run.
    rotation: Vec<f64>,
}

impl Figures {
    fn push(
        &mut self,
        producer: &Option<crate::measure::Fields>,
        consumer: &Option<crate::measure::Fields>,
        percent: f64,
    ) {
        self.percent.push(percent);
        self.consumer_cpu.push(f(consumer, "cpu_us_per_frame"));
        self.cpu.push(f(producer, "cpu_us_per_frame"));
        self.faults.push(f(producer, "faults_per_frame"));
        self.sleeps.push(f(producer, "sleeps_per_frame"));
        self.stream_sleeps
            .push(f(producer, "stream_sleeps_per_frame"));
        self.stream_cpu.push(f(producer, "stream_cpu_us_per_frame"));
        self.rotation.push(f(producer, "rotation"));
    }
}

pub fn throughput(args: &[String]) {
    let rounds = num(args, "--rounds", 3).max(1) as usize;
    let scale = num(args, "--scale", 1).max(1);
    if args.iter().any(|a| a == "--pin") {
        *PIN.lock().unwrap() = two_cpus();
    }
    let wanted = crate::arg(args, "--sizes");
    let sizes: Vec<(&str, u64, u64, u64)> = [
        ("720p", 1280, 720, 3000 * scale),
        ("1080p", 1920, 1080, 1500 * scale),
        ("4K", 3840, 2160, 500 * scale),
    ]
    .into_iter()
    .filter(|(name, ..)| {
        wanted
            .as_deref()
            .is_none_or(|w| w.split(',').any(|x| x.trim() == *name))
    })
    .collect();
    let compare: Option<Vec<String>> = crate::arg(args, "--compare")
        .map(|c| c.split_whitespace().map(String::from).collect())
        .filter(|c: &Vec<String>| !c.is_empty());
    let mut transports = vec!["gpushm"];
    if compare.is_some() {
        transports.push(COMPARED);
    }
    transports.push("shm");
    if have("unixfdsink") {
        transports.push("unixfd");
    }
    if args.iter().any(|a| a == "--aligned-alone") {
        transports.push(ALIGNED);
    }
    // The producer alone's copy mode is its pool mode: only pool mode has the aligned run.
    let copies = |t: &str| t != ALIGNED && (t != "unixfd" || unixfdsink_copies());
    let modes: &[bool] = if args.iter().any(|a| a == "--pool-only") {
        &[false]
    } else if args.iter().any(|a| a == "--copy-only") {
        &[true]
    } else {
        &[false, true]
    };
    println!(
        "# Throughput: producer flat out, lossless consumer; GStreamer {}, {} CPUs, {rounds} round(s){}\n",
        gst::version_string(),
        crate::measure::cpus(),
        match *PIN.lock().unwrap() {
            Some((p, c)) => format!(", producer on CPU {p}, consumer on CPU {c}"),
            None => String::new(),
        }
    );
    if let Some(c) = &compare {
        println!("`{COMPARED}`: gpushm run by `{}`.\n", c.join(" "));
    }
    println!("| round | size | mode | transport | frames | producer alone fps | delivered fps | % | producer CPU µs/frame | consumer CPU µs/frame | producer faults/frame | producer sleeps/frame (streaming thread) | streaming thread CPU µs/frame | buffers in rotation |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    // [size][mode][transport], and the producer alone [size].
    let mut figs = vec![vec![vec![Figures::default(); transports.len()]; 2]; sizes.len()];
    let mut alone = vec![Figures::default(); sizes.len()];
    let mut alone_fps = vec![Vec::new(); sizes.len()];
    // Where in a page upstream's buffers start, by transport (the last run's).
    let mut offsets = std::collections::BTreeMap::<&str, f64>::new();
    for round in 0..rounds {
        for (si, &(name, w, h, frames)) in sizes.iter().enumerate() {
            let alone_run = |when: &str| {
                let a = run("none", w, h, frames, 0, false, false);
                println!(
                    "| {} | {name} | - | alone ({when}) | {frames} | {:.0} | | | {:.0} | | {:.2} | {:.2} ({:.2}) | {:.0} | {:.0} |",
                    round + 1,
                    f(&a.producer, "fps"),
                    f(&a.producer, "cpu_us_per_frame"),
                    f(&a.producer, "faults_per_frame"),
                    f(&a.producer, "sleeps_per_frame"),
                    f(&a.producer, "stream_sleeps_per_frame"),
                    f(&a.producer, "stream_cpu_us_per_frame"),
                    f(&a.producer, "rotation"),
                );
                a
            };
            let a = alone_run("before");
            // Runs of the transports, measured once the second alone run is in.
            let mut runs = Vec::new();
            for (mi, &copy) in modes.iter().enumerate() {
                let mode = if copy { "copy" } else { "pool" };
                // Each round in another order: a transport is not always the one run right
                // after the producer alone.
                let n = transports.len();
                for k in 0..n {
                    let ti = (k + round) % n;
                    let t = transports[ti];
                    if copy && !copies(t) {
                        continue;
                    }
                    // The command its processes run: another build, this one with an
                    // environment (`NAME=value` words alone: see procs::run), or this one.
                    *OTHER_BUILD.lock().unwrap() = match t {
                        COMPARED => compare.clone(),
                        // The producer alone with page-aligned buffers (src/produce.rs).
                        ALIGNED => Some(vec!["GPUSHM_BENCH_ALONE_ALIGN=4096".to_string()]),
                        _ => None,
                    };
                    let r = run(
                        match t {
                            COMPARED => "gpushm",
                            ALIGNED => "none",
                            t => t,
                        },
                        w,
                        h,
                        frames,
                        0,
                        copy,
                        false,
                    );
                    *OTHER_BUILD.lock().unwrap() = None;
                    runs.push((mi, mode, ti, t, r));
                }
            }
            let b = alone_run("after");
            offsets.insert("alone", f(&b.producer, "page_offset"));
            let own = (f(&a.producer, "fps") + f(&b.producer, "fps")) / 2.0;
            alone_fps[si].push(own);
            alone[si].push(&a.producer, &None, 100.0);
            alone[si].push(&b.producer, &None, 100.0);
            for (mi, mode, ti, t, r) in runs {
                // The producer alone, aligned, has no consumer: its own pace.
                let delivered = match t {
                    ALIGNED => f(&r.producer, "fps"),
                    _ => f(&r.consumer, "fps"),
                };
                offsets.insert(t, f(&r.producer, "page_offset"));
                let percent = 100.0 * delivered / own;
                figs[si][mi][ti].push(&r.producer, &r.consumer, percent);
                println!(
                    "| {} | {name} | {mode} | {t} | {frames} | {own:.0} | {delivered:.0} | {percent:.1} | {:.0} | {:.0} | {:.2} | {:.2} ({:.2}) | {:.0} | {:.0} |",
                    round + 1,
                    f(&r.producer, "cpu_us_per_frame"),
                    f(&r.consumer, "cpu_us_per_frame"),
                    f(&r.producer, "faults_per_frame"),
                    f(&r.producer, "sleeps_per_frame"),
                    f(&r.producer, "stream_sleeps_per_frame"),
                    f(&r.producer, "stream_cpu_us_per_frame"),
                    f(&r.producer, "rotation"),
                );
            }
        }
    }
    println!("\n## Medians of {rounds} round(s)\n");
    let cols = transports.join(" / ");
    println!("| size | mode | producer alone fps (mean of the runs before and after) | % of alone: {cols} | lowest–highest round: {cols} | producer CPU µs/frame: alone / {cols} | consumer CPU µs/frame: {cols} | producer faults/frame: alone / {cols} | producer sleeps/frame: alone / {cols} | streaming thread's sleeps/frame: alone / {cols} | streaming thread CPU µs/frame: alone / {cols} | buffers in rotation: alone / {cols} |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (si, &(name, ..)) in sizes.iter().enumerate() {
        for (mi, &copy) in modes.iter().enumerate() {
            let mode = if copy { "copy" } else { "pool" };
            let row = |pick: fn(&Figures) -> &Vec<f64>, digits: usize, with_alone: bool| {
                let mut v: Vec<String> = Vec::new();
                if with_alone {
                    v.push(format!("{:.*}", digits, median(pick(&alone[si]))));
                }
                for (ti, t) in transports.iter().enumerate() {
                    v.push(match copy && !copies(t) {
                        true => "n/a".into(),
                        false => format!("{:.*}", digits, median(pick(&figs[si][mi][ti]))),
                    });
                }
                v.join(" / ")
            };
            // How far the rounds spread: on a shared machine a transport's rounds spread
            // wider than the medians of two transports differ.
            let spread = (0..transports.len())
                .map(
                    |ti| match (copy && !copies(transports[ti]), &figs[si][mi][ti].percent) {
                        // Rounds whose consumer failed (NaN) left out, as median() does.
                        (false, v) if v.iter().any(|x| x.is_finite()) => {
                            let finite = || v.iter().copied().filter(|x| x.is_finite());
                            let lo = finite().fold(f64::INFINITY, f64::min);
                            let hi = finite().fold(f64::NEG_INFINITY, f64::max);
                            format!("{lo:.0}–{hi:.0}")
                        }
                        _ => "n/a".into(),
                    },
                )
                .collect::<Vec<_>>()
                .join(" / ");
            println!(
                "| {name} | {mode} | {:.0} | {} | {spread} | {} | {} | {} | {} | {} | {} | {} |",
                median(&alone_fps[si]),
                row(|x| &x.percent, 1, false),
                row(|x| &x.cpu, 0, true),
                row(|x| &x.consumer_cpu, 0, false),
                row(|x| &x.faults, 2, true),
                row(|x| &x.sleeps, 2, true),
                row(|x| &x.stream_sleeps, 2, true),
                row(|x| &x.stream_cpu, 0, true),
                row(|x| &x.rotation, 0, true),
            );
        }
    }
    let at: Vec<String> = offsets
        .iter()
        .filter(|(_, o)| o.is_finite() && **o >= 0.0)
        .map(|(t, o)| format!("{t} {:#x}", *o as u64))
        .collect();
    if !at.is_empty() {
        println!(
            "\nWhere in a page the frames upstream rendered into start (the last run of each): {}.",
            at.join(", ")
        );
    }
    if transports.contains(&"unixfd") && !unixfdsink_copies() {
        println!("\nunixfd copy mode: n/a, unixfdsink before GStreamer 1.28 takes only memory backed by a file descriptor (see `bench`).");
    }
}
