// SPDX-License-Identifier: MPL-2.0
//! The transport alone, without GStreamer (`bench core-tiny`): the core crate's Publisher
//! (`bench core-produce`) against the Rust Subscriber (`bench consume --transport sub`).

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::measure::{f, faults_and_switches, median, now, parse, percentile, rusage};
use crate::procs::{finish, timeout_s};
use crate::{arg, num};

/// `bench core-produce`: the core crate's Publisher (no GStreamer), 64x64 GRAY8 frames
/// flat out, each stamped with CLOCK_MONOTONIC as `produce` stamps them, once a consumer is
/// there; the same PRODUCER line.
pub fn core_produce(args: &[String]) -> Result<(), String> {
    use gpushm::format::{FrameLayout, VideoFormat};
    let socket = arg(args, "--socket").unwrap_or_default();
    let frames = num(args, "--frames", 100).max(1);
    let layout = FrameLayout::new(VideoFormat::Gray8, 64, 64).ok_or("no 64x64 GRAY8 layout")?;
    let cam = gpushm::publisher::Publisher::new(
        std::path::Path::new(&socket),
        layout,
        (30, 1),
        8,
        gpushm::publisher::Config::default(),
    )
    .map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout_s());
    while cam.num_clients() == 0 {
        if std::time::Instant::now() > deadline {
            return Err("no consumer came".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let (cpu0, first) = (rusage().0, now());
    for _ in 0..frames {
        let mut slot = cam
            .acquire(Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let t = now();
        slot.bytes_mut()[..8].copy_from_slice(&t.to_le_bytes());
        cam.publish(slot, Some(t)).map_err(|e| e.to_string())?;
    }
    let (cpu, last) = (rusage().0 - cpu0, now());
    // Served until the consumer has read everything and gone (10 s at most).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cam.num_clients() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "PRODUCER frames={frames} fps={:.1} cpu_us_per_frame={:.2}",
        frames as f64 * 1e9 / (last - first).max(1) as f64,
        cpu as f64 / frames as f64
    );
    Ok(())
}

/// `bench core-tiny`: the transport alone (see `core_produce`), against a lossless Rust
/// Subscriber (`consume --transport sub`) in another process: per round, the frames a second
/// the consumer got and each side's CPU time a frame.
pub fn core_tiny(runs: u64, frames: u64) {
    println!("\n## The transport alone: Publisher to Subscriber, 64x64 GRAY8 flat out, {frames} frames, {runs} round(s)\n");
    println!("| round | delivered fps | CPU µs/frame: producer / consumer |");
    println!("|---|---|---|");
    let exe = std::env::current_exe().expect("current_exe");
    let mut fps = vec![];
    for round in 1..=runs {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("core.sock");
        let sock = sock.to_str().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(timeout_s());
        let producer = Command::new(&exe)
            .args([
                "core-produce",
                "--socket",
                sock,
                "--frames",
                &frames.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the producer");
        let consumer = Command::new(&exe)
            .args(["consume", "--transport", "sub", "--socket", sock])
            .args(["--frames", &frames.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the consumer");
        let c_out = finish(consumer, deadline);
        let p_out = finish(producer, deadline + Duration::from_secs(10));
        let c = parse(&String::from_utf8_lossy(&c_out.stdout), "CONSUMER");
        let p = parse(&String::from_utf8_lossy(&p_out.stdout), "PRODUCER");
        // Every frame, or the round means nothing (a consumer cut as lagging loses some).
        if c.is_none() || p.is_none() || f(&c, "frames") != frames as f64 {
            let err = String::from_utf8_lossy(&c_out.stderr).to_string()
                + &String::from_utf8_lossy(&p_out.stderr);
            println!(
                "| {round} | failed: {} of {frames} frames within {} s ({}) | |",
                f(&c, "frames"),
                timeout_s(),
                err.trim().lines().last().unwrap_or("no error printed")
            );
            continue;
        }
        fps.push(f(&c, "fps"));
        println!(
            "| {round} | {:.0} | {:.2} / {:.2} |",
            f(&c, "fps"),
            f(&p, "cpu_us_per_frame"),
            f(&c, "cpu_us_per_frame")
        );
    }
    if !fps.is_empty() {
        println!(
            "\nMedian delivered: {:.0} frames/s over {} round(s)",
            median(&fps),
            fps.len()
        );
    }
}

/// The Rust counterpart of capi/bench/c_consumer.c: the `gpushm` crate's Subscriber, lossless,
/// the stamp read from the frame's first 8 bytes; the same CONSUMER line.
pub fn subscribe(args: &[String]) -> Result<(), String> {
    let socket = arg(args, "--socket").unwrap_or_default();
    let frames = num(args, "--frames", 100) as usize;
    let opts = gpushm::subscriber::ConnectOptions {
        mode: gpushm::policy::Delivery::Lossless,
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let mut sub = gpushm::subscriber::Subscriber::connect(std::path::Path::new(&socket), opts)
        .map_err(|e| e.to_string())?;
    let mut lat = Vec::with_capacity(frames);
    let (mut cpu0, mut first, mut last) = (0, 0, 0);
    let mut fs0 = (0, 0, 0);
    while lat.len() < frames {
        let f = match sub.next_frame(Some(Duration::from_secs(10))) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return Err(e.to_string()),
        };
        let t = now();
        let (ptr, len) = f.as_ptr();
        let mut stamp = [0u8; 8];
        if len >= 8 {
            // SAFETY: the frame's lease keeps `len` bytes at `ptr` mapped.
            unsafe { std::ptr::copy_nonoverlapping(ptr, stamp.as_mut_ptr(), 8) };
        }
        drop(f);
        if lat.is_empty() {
            cpu0 = rusage().0;
            fs0 = faults_and_switches();
            first = t;
        }
        last = t;
        lat.push(t.saturating_sub(u64::from_le_bytes(stamp)));
    }
    let cpu = rusage().0.saturating_sub(cpu0);
    let fs = faults_and_switches();
    let n = lat.len();
    let skip = if n > 20 { 10 } else { 0 };
    let mut l = lat[skip..].to_vec();
    l.sort_unstable();
    println!(
        "CONSUMER frames={n} fps={:.1} p50_us={:.1} p99_us={:.1} max_us={:.1} cpu_us_per_frame={:.1} minflt_per_frame={:.2} nvcsw_per_frame={:.2} nivcsw_per_frame={:.2}",
        if n > 1 { (n - 1) as f64 * 1e9 / (last - first).max(1) as f64 } else { 0.0 },
        percentile(&l, 0.5) as f64 / 1e3,
        percentile(&l, 0.99) as f64 / 1e3,
        l.last().copied().unwrap_or(0) as f64 / 1e3,
        cpu as f64 / n.saturating_sub(1).max(1) as f64,
        (fs.0 - fs0.0) as f64 / n.saturating_sub(1).max(1) as f64,
        (fs.1 - fs0.1) as f64 / n.saturating_sub(1).max(1) as f64,
        (fs.2 - fs0.2) as f64 / n.saturating_sub(1).max(1) as f64,
    );
    Ok(())
}
