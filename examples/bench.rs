// SPDX-License-Identifier: MPL-2.0
//! gpushmsink/gpushmsrc against shmsink/shmsrc, side by side, in one run:
//!
//!     cargo run --release --example bench [-- --plot bench.png]   # tables on stdout, plot
//!
//! For 720p, 1080p and 4K NV12, and two producer modes (`pool`: upstream renders into the sink's
//! buffer pool; `copy`: upstream buffers come from elsewhere, forcing each sink's copy), it runs
//! a producer process and a consumer process per transport, alternating:
//! - delivered fps of a lossless consumer against the producer's own rate (the same source into
//!   fakesink), producers running flat out;
//! - cross-process latency p50/p99/max at 30 fps live: the producer stamps CLOCK_MONOTONIC into
//!   the first 8 bytes of each frame just before its sink, the consumer reads it where its
//!   source pushes the frame;
//! - CPU time per frame (getrusage) and peak RSS of each process, from the latency runs.
//!
//! With a CUDA GPU it also runs the consumer with cudasum at 4K (gpushmsrc ! cudasum against
//! shmsrc ! cudasum) and measures the bus limit in the same run. unixfdsink/unixfdsrc
//! (GStreamer >= 1.24) are run when installed, and skipped with a note otherwise.
//!
//! The same binary is the producer (`bench produce ...`) and the consumer (`bench consume ...`).
//! Parts on their own: `bench floor` (the eventfd wake-up floor), `bench tiny [--runs N]
//! [--spin-us 300]` (64x64 GRAY8 frames flat out; each round measures the producer alone,
//! gpushm, gpushm with spin-us on gpushmsink and gpushmsrc, and shm),
//! `bench gpu` (the cudasum table, with the pre-rendered producer),
//! `bench latency --runs 7 [--spin-us 300] [--chain N] [--wake-ahead-us 80,160]` (latency
//! only, rounds alternating gpushm, gpushm with gpushmsink wake-ahead-us=0 and wake-early=false
//! (and each wake-ahead-us listed), gpushm in low-latency mode (gpushmsrc spin-us) and shm,
//! with medians, CPU share of each
//! process; `--chain N` adds N relay processes, `gpushmsrc ! gpushmsink` each, between the
//! producer and the consumer, end to end; `--cpu-latency-us N` adds gpushm in low-latency mode
//! with gpushmsink and gpushmsrc asking the kernel to keep the CPUs in idle states that wake
//! within N µs (their `cpu-latency-us`); `--pin`: producer and consumer each on a CPU of its
//! own (the last two); built with `--features stages`, a diagnostic build
//! that writes into frames, it also prints each stage of a frame's way, see src/stages.rs),
//! `bench flood` (a producer's cost of a connection flood, and what its consumer sees),
//! `bench core-tiny [--runs N] [--frames N]` (the transport alone, no GStreamer: the core
//! crate's Publisher sends 64x64 GRAY8 frames flat out to a lossless Rust Subscriber in
//! another process; frames a second and CPU time a frame of each),
//! `bench capi [--rounds N] [--no-pin] [--no-aslr] [--only tiny|1080p]` (the C API's consumer
//! against the Rust subscriber and gpushmsrc, rounds rotating which goes first, producer and
//! consumer pinned to two CPUs, `--no-aslr`: consumers at the same addresses every run),
//! `bench cold [--frames N] [--evict-mib M] [--sleep-us U]` (what taking a frame costs after a
//! sleep and a cache eviction; capi/bench/c_cold.c measures the C call the same way),
//! `bench device-ring` (a 4K frame read by a CUDA kernel from a device ring, the host ring and
//! plain device memory).

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gst::prelude::*;

fn now() -> u64 {
    gpushm::monotonic_ns()
}

fn arg(args: &[String], key: &str) -> Option<String> {
    args.iter()
        .position(|a| a == key)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn num(args: &[String], key: &str, default: u64) -> u64 {
    arg(args, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rusage() -> (u64, u64) {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(r) => {
            let t =
                |tv: nix::sys::time::TimeVal| tv.tv_sec() as u64 * 1_000_000 + tv.tv_usec() as u64;
            (t(r.user_time()) + t(r.system_time()), r.max_rss() as u64)
        }
        Err(_) => (0, 0),
    }
}

/// Minor page faults and context switches (voluntary, involuntary) of this process so far.
fn faults_and_switches() -> (u64, u64, u64) {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(r) => (
            r.minor_page_faults() as u64,
            r.voluntary_context_switches() as u64,
            r.involuntary_context_switches() as u64,
        ),
        Err(_) => (0, 0, 0),
    }
}

/// The median of the finite values of `v` (NaN when there are none).
fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs `pipeline` until EOS, an error, or `frames` buffers went through `counted` (a pad).
fn run_pipeline(pipeline: &gst::Element, timeout: Duration) -> Result<(), String> {
    pipeline
        .set_state(gst::State::Playing)
        .map_err(|e| format!("{e}"))?;
    let bus = pipeline.bus().ok_or("no bus")?;
    let r = match bus.timed_pop_filtered(
        gst::ClockTime::from_nseconds(timeout.as_nanos() as u64),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    ) {
        Some(m) => match m.view() {
            gst::MessageView::Error(e) => Err(format!("{}", e.error())),
            _ => Ok(()),
        },
        None => Err("timed out".into()),
    };
    let _ = pipeline.set_state(gst::State::Null);
    r
}

/// A producer that is not the bottleneck: eight frames rendered once, then published again
/// and again without being redrawn. gpushm: the core's Publisher republishes its slots;
/// shm: appsrc pushes the same eight buffers into shmsink (which copies each, as it must).
fn produce_prerendered(args: &[String]) -> Result<(), String> {
    let transport = arg(args, "--transport").unwrap_or_default();
    let socket = arg(args, "--socket").unwrap_or_default();
    let (w, h) = (num(args, "--width", 3840), num(args, "--height", 2160));
    let frames = num(args, "--frames", 300);
    let size = (w * h * 3 / 2) as usize;
    let (mut first, mut count, mut cpu0) = (0u64, 0u64, 0u64);
    let mut tick = |count: &mut u64| {
        if *count == 0 {
            first = now();
            cpu0 = rusage().0;
        }
        *count += 1;
    };
    if transport == "gpushm" {
        use gpushm::format::{FrameLayout, VideoFormat};
        use gpushm::publisher::{Config, Publisher};
        let layout = FrameLayout::new(VideoFormat::Nv12, w as u32, h as u32).ok_or("size")?;
        let publisher = Publisher::new(
            std::path::Path::new(&socket),
            layout,
            (30, 1),
            8,
            Config::default(),
        )
        .map_err(|e| e.to_string())?;
        while publisher.num_clients() == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        for n in 0..frames {
            let mut lease = publisher
                .acquire(Duration::from_secs(10))
                .map_err(|e| e.to_string())?;
            if n < 8 {
                lease.bytes_mut().fill(n as u8 * 16 + 1);
            }
            tick(&mut count);
            publisher.publish(lease, None).map_err(|e| e.to_string())?;
        }
        publisher.send_eos();
        // Give the consumer time to take the last frames before the socket goes.
        std::thread::sleep(Duration::from_millis(500));
    } else {
        let caps = format!("video/x-raw,format=NV12,width={w},height={h},framerate=30/1");
        let launch = format!(
            "appsrc name=src format=time do-timestamp=true block=true max-bytes={} caps={caps} ! shmsink socket-path={socket} wait-for-connection=true sync=false shm-size={}",
            size * 2,
            size * 12
        );
        let pipeline = gst::parse::launch(&launch).map_err(|e| format!("{launch}: {e}"))?;
        let bin = pipeline
            .clone()
            .downcast::<gst::Bin>()
            .map_err(|_| "not a bin")?;
        let src = bin
            .by_name("src")
            .ok_or("no appsrc")?
            .downcast::<gst_app::AppSrc>()
            .map_err(|_| "not an appsrc")?;
        let bufs: Vec<gst::Buffer> = (0..8u8)
            .map(|n| gst::Buffer::from_mut_slice(vec![n * 16 + 1; size]))
            .collect();
        pipeline
            .set_state(gst::State::Playing)
            .map_err(|e| e.to_string())?;
        for n in 0..frames {
            // The same buffer again (a reference, not a copy); appsrc stamps it.
            tick(&mut count);
            src.push_buffer(bufs[(n % 8) as usize].clone())
                .map_err(|e| format!("push: {e:?}"))?;
        }
        let _ = src.end_of_stream();
        let bus = pipeline.bus().ok_or("no bus")?;
        let _ = bus.timed_pop_filtered(
            gst::ClockTime::from_seconds(30),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        );
        let _ = pipeline.set_state(gst::State::Null);
    }
    let last = now();
    let (cpu_us, rss) = rusage();
    println!(
        "PRODUCER frames={count} fps={:.1} cpu_us_per_frame={:.1} rss_kib={rss} copied=0",
        count.saturating_sub(1) as f64 * 1e9 / (last - first).max(1) as f64,
        cpu_us.saturating_sub(cpu0) as f64 / count.max(1) as f64
    );
    Ok(())
}

fn produce(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--prerendered") {
        return produce_prerendered(args);
    }
    let transport = arg(args, "--transport").unwrap_or_default();
    let socket = arg(args, "--socket").unwrap_or_default();
    let (w, h) = (num(args, "--width", 1920), num(args, "--height", 1080));
    let frames = num(args, "--frames", 100);
    let fps = num(args, "--fps", 0);
    let copy = args.iter().any(|a| a == "--copy");
    let format = arg(args, "--format").unwrap_or_else(|| "NV12".into());
    let size = if format == "GRAY8" {
        w * h
    } else {
        w * h * 3 / 2
    };
    let live = fps > 0;
    // A live source paces itself; no sink waits on the clock, so latency is the transport's.
    // GPUSHM_BENCH_SINK_PROPS: more gpushmsink properties (`slots=32`), to try a setting.
    let sink = match transport.as_str() {
        "gpushm" => format!(
            "gpushmsink name=sink socket-path={socket} wait-for-connection=true sync=false spin-us={} wake-early={}{}{} {}",
            std::env::var("GPUSHM_BENCH_SINK_SPIN_US").unwrap_or_else(|_| "0".into()),
            std::env::var("GPUSHM_BENCH_WAKE_EARLY").unwrap_or_else(|_| "true".into()),
            std::env::var("GPUSHM_BENCH_WAKE_AHEAD_US")
                .map(|us| format!(" wake-ahead-us={us}"))
                .unwrap_or_default(),
            cpu_latency_prop(),
            std::env::var("GPUSHM_BENCH_SINK_PROPS").unwrap_or_default()
        ),
        // shmsink's allocator pads each buffer: tiny frames need more than 12 frames' bytes.
        "shm" => format!("shmsink name=sink socket-path={socket} wait-for-connection=true sync=false shm-size={}", (size * 12).max(4 << 20)),
        "unixfd" => format!("unixfdsink name=sink socket-path={socket} sync=false"),
        _ => "fakesink name=sink sync=false".to_string(),
    };
    let launch = format!(
        "videotestsrc pattern=solid-color foreground-color=0xff3060a0 is-live={live} num-buffers={frames} \
         ! video/x-raw,format={format},width={w},height={h},framerate={}/1 {} ! {sink}",
        if live { fps } else { 30 },
        if copy { "! identity drop-allocation=true" } else { "" },
    );
    let pipeline = gst::parse::launch(&launch).map_err(|e| format!("{launch}: {e}"))?;
    let bin = pipeline
        .clone()
        .downcast::<gst::Bin>()
        .map_err(|_| "not a bin")?;
    let sink_el = bin.by_name("sink").ok_or("no sink")?;
    // first, last, count, CPU time at the first frame
    let times = Arc::new(Mutex::new((0u64, 0u64, 0u64, 0u64)));
    {
        let times = times.clone();
        sink_el.static_pad("sink").ok_or("no pad")?.add_probe(
            gst::PadProbeType::BUFFER,
            move |_, info| {
                if let Some(gst::PadProbeData::Buffer(b)) = info.data.as_mut() {
                    // Stamped once the frame is mapped: the stamp's own mapping is the
                    // bench's cost, not the transport's.
                    let mut t = now();
                    if let Ok(mut m) = b.make_mut().map_writable() {
                        if m.len() >= 8 {
                            t = now();
                            m[..8].copy_from_slice(&t.to_le_bytes());
                        }
                    }
                    let mut g = times.lock().unwrap();
                    if g.2 == 0 {
                        g.0 = t;
                        g.3 = rusage().0;
                    }
                    g.1 = t;
                    g.2 += 1;
                }
                gst::PadProbeReturn::Ok
            },
        );
    }
    run_pipeline(&pipeline, Duration::from_secs(timeout_s()))?;
    let (first, last, count, cpu0) = *times.lock().unwrap();
    let (cpu_us, rss) = rusage();
    let cpu_us = cpu_us.saturating_sub(cpu0);
    let copied = if transport == "gpushm" {
        sink_el
            .property::<gst::Structure>("stats")
            .get::<u64>("frames-copied")
            .unwrap_or(0)
    } else {
        0
    };
    let fps = if count > 1 {
        (count - 1) as f64 * 1e9 / (last - first).max(1) as f64
    } else {
        0.0
    };
    println!(
        "PRODUCER frames={count} fps={fps:.1} cpu_us_per_frame={:.1} rss_kib={rss} copied={copied}",
        cpu_us as f64 / count.saturating_sub(1).max(1) as f64
    );
    Ok(())
}

/// `bench core-produce`: the core crate's Publisher (no GStreamer), 64x64 GRAY8 frames
/// flat out, each stamped with CLOCK_MONOTONIC as `produce` stamps them, once a consumer is
/// there; the same PRODUCER line.
fn core_produce(args: &[String]) -> Result<(), String> {
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
fn core_tiny(runs: u64, frames: u64) {
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

/// The C API's bench consumer (capi/bench/c_consumer.c, built against an installed
/// libgpushm): `GPUSHM_C_CONSUMER`, or `c_consumer` beside this binary.
fn c_consumer() -> std::path::PathBuf {
    std::env::var_os("GPUSHM_C_CONSUMER")
        .map(Into::into)
        .unwrap_or_else(|| {
            std::env::current_exe()
                .expect("current_exe")
                .with_file_name("c_consumer")
        })
}

/// The Rust counterpart of capi/bench/c_consumer.c: the `gpushm` crate's Subscriber, lossless,
/// the stamp read from the frame's first 8 bytes; the same CONSUMER line.
fn subscribe(args: &[String]) -> Result<(), String> {
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

/// The Rust side of capi/bench/c_cold.c (`bench cold [--frames N] [--evict-mib M]
/// [--sleep-us U]`): what taking a frame costs with cold caches, as after a consumer's sleep. A
/// publisher and a subscriber in this process; per frame, publish, sleep and write M MiB (the
/// caches and the TLB lose what the frame's way reads), then time `next_frame` and the frame's
/// drop (the frame is there already: no wait). The same COLD lines as c_cold.
fn cold(args: &[String]) -> Result<(), String> {
    use gpushm::format::{FrameLayout, VideoFormat};
    use gpushm::publisher::{Config, Publisher};
    let n = num(args, "--frames", 500).max(1) as usize;
    let evict_mib = num(args, "--evict-mib", 16) as usize;
    let nap = Duration::from_micros(num(args, "--sleep-us", 1000));
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("cold.sock");
    let layout =
        FrameLayout::new(VideoFormat::from_name("GRAY8").ok_or("GRAY8")?, 64, 64).ok_or("64x64")?;
    let p =
        Publisher::new(&path, layout, (60, 1), 8, Config::default()).map_err(|e| e.to_string())?;
    let opts = gpushm::subscriber::ConnectOptions {
        mode: gpushm::policy::Delivery::Lossless,
        ..Default::default()
    };
    let mut sub =
        gpushm::subscriber::Subscriber::connect(&path, opts).map_err(|e| e.to_string())?;
    let mut evict = vec![0u8; evict_mib << 20];
    let second = Some(Duration::from_secs(1));
    for (pass, what) in ["rust cold", "rust warm"].into_iter().enumerate() {
        let mut v = Vec::with_capacity(n);
        // The first frames set the subscriber up (caps, ring): not counted.
        for i in 0..n + 10 {
            let lease = p
                .acquire(Duration::from_secs(1))
                .map_err(|e| e.to_string())?;
            p.publish(lease, None).map_err(|e| e.to_string())?;
            if pass == 0 {
                std::thread::sleep(nap);
                for o in (0..evict.len()).step_by(64) {
                    evict[o] = (o + i) as u8;
                }
                std::hint::black_box(&evict);
            }
            let t0 = now();
            let f = sub
                .next_frame(second)
                .map_err(|e| e.to_string())?
                .ok_or("end of stream")?;
            std::hint::black_box(f.as_ptr());
            drop(f);
            let t1 = now();
            if i >= 10 {
                v.push(t1 - t0);
            }
        }
        let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
        v.sort_unstable();
        println!(
            "COLD {what} frames={n} median_ns={} mean_ns={mean:.0} p90_ns={}",
            v[v.len() / 2],
            v[v.len() * 9 / 10]
        );
    }
    Ok(())
}

/// The C API against the Rust subscriber and gpushmsrc: the same live producer (60 fps), tiny
/// (64x64 GRAY8) and 1080p NV12 frames, `--rounds` rounds alternating the three consumers.
fn capi_mode(args: &[String]) {
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

fn consume(args: &[String]) -> Result<(), String> {
    let transport = arg(args, "--transport").unwrap_or_default();
    if transport == "sub" {
        return subscribe(args);
    }
    let socket = arg(args, "--socket").unwrap_or_default();
    let (w, h) = (num(args, "--width", 1920), num(args, "--height", 1080));
    let frames = num(args, "--frames", 100);
    let format = arg(args, "--format").unwrap_or_else(|| "NV12".into());
    let cudasum = if args.iter().any(|a| a == "--cudasum") {
        "cudasum backend=cuda ! "
    } else {
        ""
    };
    let src = match transport.as_str() {
        "gpushm" => format!("gpushmsrc name=src socket-path={socket} lossless=true reconnect=false spin-us={}{}", spin_us(), cpu_latency_prop()),
        "shm" => format!("shmsrc name=src socket-path={socket} is-live=true ! video/x-raw,format={format},width={w},height={h},framerate=30/1"),
        _ => format!("unixfdsrc name=src socket-path={socket}"),
    };
    let launch = format!("{src} ! {cudasum}fakesink name=sink sync=false");
    let pipeline = gst::parse::launch(&launch).map_err(|e| format!("{launch}: {e}"))?;
    let bin = pipeline
        .clone()
        .downcast::<gst::Bin>()
        .map_err(|_| "not a bin")?;
    let lat = Arc::new(Mutex::new(Vec::<(u64, u64)>::new()));
    // first, last, count, CPU time at the first frame
    let done = Arc::new(Mutex::new((0u64, 0u64, 0u64, 0u64)));
    #[cfg(feature = "stages")]
    let stages = Arc::new(Mutex::new(Vec::<[u64; 13]>::new()));
    {
        let lat = lat.clone();
        #[cfg(feature = "stages")]
        let stages = stages.clone();
        bin.by_name("src")
            .ok_or("no src")?
            .static_pad("src")
            .ok_or("no pad")?
            .add_probe(gst::PadProbeType::BUFFER, move |_, info| {
                let t = now();
                if let Some(gst::PadProbeData::Buffer(b)) = info.data.as_ref() {
                    if let Ok(m) = b.map_readable() {
                        if m.len() >= 8 {
                            let stamp = u64::from_le_bytes(m[..8].try_into().unwrap());
                            // gpushm says when the frame was published: split the latency
                            // into the producer's part and the consumer's.
                            let published = b
                                .iter_meta::<gst::ReferenceTimestampMeta>()
                                .find(|r| {
                                    r.reference()
                                        .structure(0)
                                        .is_some_and(|s| s.name() == "timestamp/x-gpushm-publish")
                                })
                                .map(|r| r.timestamp().nseconds());
                            lat.lock().unwrap().push((
                                t.saturating_sub(stamp),
                                published.map_or(0, |p| p.saturating_sub(stamp)),
                            ));
                            #[cfg(feature = "stages")]
                            if m.len() >= 32 {
                                let meta = |stage: &str| {
                                    let name = format!("timestamp/x-stage-{stage}");
                                    b.iter_meta::<gst::ReferenceTimestampMeta>()
                                        .find(|r| {
                                            r.reference()
                                                .structure(0)
                                                .is_some_and(|s| s.name() == name.as_str())
                                        })
                                        .map_or((0, 0), |r| {
                                            (
                                                r.timestamp().nseconds(),
                                                r.duration().map_or(0, |d| d.nseconds()),
                                            )
                                        })
                                };
                                let word = |i: usize| {
                                    u64::from_le_bytes(m[i * 8..i * 8 + 8].try_into().unwrap())
                                };
                                let (a, bb) = (meta("a"), meta("b"));
                                stages.lock().unwrap().push([
                                    stamp,
                                    word(1),
                                    word(2),
                                    word(3),
                                    published.unwrap_or(0),
                                    b.offset(),
                                    b.offset_end(),
                                    b.duration().map_or(0, |d| d.nseconds()),
                                    a.0,
                                    a.1,
                                    bb.0,
                                    bb.1,
                                    t,
                                ]);
                            }
                        }
                    }
                }
                gst::PadProbeReturn::Ok
            });
    }
    // gpushmsrc's low-latency figures, read at the last frame (they go with the source's
    // state when it stops).
    let spin = Arc::new(Mutex::new((0u64, 0u64)));
    let fs0 = Arc::new(Mutex::new((0u64, 0u64, 0u64)));
    {
        let done = done.clone();
        let fs0 = fs0.clone();
        let weak = pipeline.downgrade();
        let spin = spin.clone();
        let src = bin
            .by_name("src")
            .filter(|s| s.find_property("spin-caught").is_some())
            .map(|s| s.downgrade());
        bin.by_name("sink")
            .ok_or("no sink")?
            .static_pad("sink")
            .ok_or("no pad")?
            .add_probe(gst::PadProbeType::BUFFER, move |_, _| {
                let t = now();
                let mut g = done.lock().unwrap();
                if g.2 == 0 {
                    g.0 = t;
                    g.3 = rusage().0;
                    *fs0.lock().unwrap() = faults_and_switches();
                }
                g.1 = t;
                g.2 += 1;
                if g.2 == frames {
                    if let Some(s) = src.as_ref().and_then(|s| s.upgrade()) {
                        *spin.lock().unwrap() = (
                            s.property::<u64>("spin-caught"),
                            s.property::<u64>("spin-missed"),
                        );
                    }
                    if let Some(p) = weak.upgrade() {
                        let _ = p.post_message(gst::message::Eos::new());
                    }
                }
                gst::PadProbeReturn::Ok
            });
    }
    let gbps = Arc::new(Mutex::new(Vec::<f64>::new()));
    {
        let gbps = gbps.clone();
        pipeline
            .bus()
            .ok_or("no bus")?
            .set_sync_handler(move |_, m| {
                if let Some(s) = m.structure().filter(|s| s.name() == "cudasum") {
                    let (b, ns) = (
                        s.get::<u64>("bytes").unwrap_or(0),
                        s.get::<u64>("kernel-time-ns").unwrap_or(0),
                    );
                    if ns > 0 {
                        gbps.lock().unwrap().push(b as f64 / ns as f64);
                    }
                }
                gst::BusSyncReply::Pass
            });
    }
    let r = run_pipeline(&pipeline, Duration::from_secs(timeout_s()));
    let (first, last, count, cpu0) = *done.lock().unwrap();
    if count == 0 {
        return Err(r.err().unwrap_or_else(|| "no frames".into()));
    }
    let (cpu_us, rss) = rusage();
    let cpu_us = cpu_us.saturating_sub(cpu0);
    // The first frames waited for the connection: warm-up, not latency.
    let mut l: Vec<u64> = lat.lock().unwrap().iter().skip(10).map(|v| v.0).collect();
    l.sort_unstable();
    let mut producer_part: Vec<u64> = lat.lock().unwrap().iter().skip(10).map(|v| v.1).collect();
    producer_part.sort_unstable();
    let mut g = gbps.lock().unwrap().clone();
    g.sort_by(|a, b| a.total_cmp(b));
    let fps = if count > 1 {
        (count - 1) as f64 * 1e9 / (last - first).max(1) as f64
    } else {
        0.0
    };
    let (caught, missed) = *spin.lock().unwrap();
    #[cfg(feature = "stages")]
    {
        const NAMES: [&str; 12] = [
            "stamp>chain",
            "chain>render",
            "render>described",
            "described>publish",
            "publish>take",
            "take>built",
            "built>next",
            "next>caps",
            "caps>ts",
            "ts>created",
            "(metas)",
            "metas>pad",
        ];
        let all = stages.lock().unwrap();
        let rows: Vec<&[u64; 13]> = all.iter().skip(10).filter(|r| !r.contains(&0)).collect();
        // Frames published from a copy (not from the sink's pool) carry no producer times.
        let mut line = format!(
            "STAGES frames={} of {}",
            rows.len(),
            all.len().saturating_sub(10)
        );
        for (i, name) in NAMES.iter().enumerate() {
            let mut d: Vec<u64> = rows.iter().map(|r| r[i + 1].saturating_sub(r[i])).collect();
            d.sort_unstable();
            line += &format!(
                " {name}={:.1}/{:.1}",
                percentile(&d, 0.5) as f64 / 1e3,
                percentile(&d, 0.9) as f64 / 1e3
            );
        }
        println!("{line}");
    }
    let (fs, fs0) = (faults_and_switches(), *fs0.lock().unwrap());
    let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / count.saturating_sub(1).max(1) as f64;
    println!(
        "CONSUMER frames={count} fps={fps:.1} p50_us={:.1} producer_p50_us={:.1} p99_us={:.1} max_us={:.1} cpu_us_per_frame={:.1} rss_kib={rss} gbps={:.1} spin_caught={caught} spin_missed={missed} minflt_per_frame={:.2} nvcsw_per_frame={:.2} nivcsw_per_frame={:.2}",
        percentile(&l, 0.5) as f64 / 1e3,
        percentile(&producer_part, 0.5) as f64 / 1e3,
        percentile(&l, 0.99) as f64 / 1e3,
        l.last().copied().unwrap_or(0) as f64 / 1e3,
        cpu_us as f64 / count.saturating_sub(1).max(1) as f64,
        g.get(g.len() / 2).copied().unwrap_or(0.0),
        per(fs.0, fs0.0),
        per(fs.1, fs0.1),
        per(fs.2, fs0.2),
    );
    Ok(())
}

/// The wake-up floor, waiting side: blocks in poll() on an inherited eventfd whose counter the
/// writer sets to its CLOCK_MONOTONIC time, and reports how late each wake-up came.
fn floor_wait(args: &[String]) -> Result<(), String> {
    use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
    let fd = num(args, "--fd", u64::MAX);
    let frames = num(args, "--frames", 90);
    let fd = i32::try_from(fd).map_err(|_| "--fd N is required")?;
    // SAFETY: the parent handed us this eventfd and nothing else uses it here.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let efd: BorrowedFd<'_> = owned.as_fd();
    println!("READY");
    let mut lat = Vec::new();
    while (lat.len() as u64) < frames {
        let mut pfd = [nix::poll::PollFd::new(efd, nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(5000u16))
            .map_err(|e| format!("poll: {e}"))?;
        let mut buf = [0u8; 8];
        if nix::unistd::read(efd, &mut buf).map_err(|e| format!("read: {e}"))? != 8 {
            return Err("short read".into());
        }
        let t = now();
        lat.push(t.saturating_sub(u64::from_ne_bytes(buf)));
    }
    lat.sort_unstable();
    println!(
        "FLOOR p50_us={:.1} p99_us={:.1}",
        percentile(&lat, 0.5) as f64 / 1e3,
        percentile(&lat, 0.99) as f64 / 1e3
    );
    Ok(())
}

/// The latency no transport can avoid on this machine: one process writes an eventfd at `fps`,
/// another blocked in poll() wakes. Measured in the same run as the transports.
fn floor(fps: u64, frames: u64) -> Option<Fields> {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    // Inherited by the child: no CLOEXEC.
    let efd =
        nix::sys::eventfd::EventFd::from_value_and_flags(0, nix::sys::eventfd::EfdFlags::empty())
            .ok()?;
    let mut child = Command::new(std::env::current_exe().ok()?)
        .args([
            "floor-wait",
            "--fd",
            &efd.as_raw_fd().to_string(),
            "--frames",
            &frames.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    let mut out = std::io::BufReader::new(child.stdout.take()?);
    let mut line = String::new();
    out.read_line(&mut line).ok()?;
    let period = Duration::from_nanos(1_000_000_000 / fps.max(1));
    let mut next = std::time::Instant::now() + period;
    for _ in 0..frames {
        std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
        next += period;
        let _ = efd.write(now());
    }
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    let _ = child.wait();
    parse(&rest, "FLOOR ")
}

type Fields = std::collections::HashMap<String, String>;

fn parse(out: &str, prefix: &str) -> Option<Fields> {
    let line = out.lines().find(|l| l.starts_with(prefix))?;
    Some(
        line[prefix.len()..]
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.into(), v.into()))
            .collect(),
    )
}

fn f(m: &Option<Fields>, k: &str) -> f64 {
    m.as_ref()
        .and_then(|m| m.get(k))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

struct Run {
    producer: Option<Fields>,
    consumer: Option<Fields>,
    /// The relays of `--chain`, in order.
    relays: Vec<Option<Fields>>,
}

/// One producer process and (unless `transport` is "none") one consumer process, NV12.
fn run(transport: &str, w: u64, h: u64, frames: u64, fps: u64, copy: bool, cudasum: bool) -> Run {
    run_format(transport, "NV12", w, h, frames, fps, copy, cudasum)
}

#[allow(clippy::too_many_arguments)]
fn run_format(
    transport: &str,
    format: &str,
    w: u64,
    h: u64,
    frames: u64,
    fps: u64,
    copy: bool,
    cudasum: bool,
) -> Run {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("bench.sock");
    let sock_s = sock.to_str().unwrap().to_string();
    // The Rust subscriber ("sub") and the C API's consumer ("capi") read a gpushmsink.
    let producer_transport = match transport {
        "sub" | "capi" => "gpushm",
        t => t,
    };
    let common = |role: &str, socket: &str| {
        let mut c = Command::new(&exe);
        let t = if role == "produce" {
            producer_transport
        } else {
            transport
        };
        c.args([role, "--transport", t, "--socket", socket]);
        c.args([
            "--width",
            &w.to_string(),
            "--height",
            &h.to_string(),
            "--frames",
            &frames.to_string(),
            "--format",
            format,
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let mut p = common("produce", &sock_s);
    p.args(["--fps", &fps.to_string()]);
    if std::env::var_os("GPUSHM_BENCH_PRERENDERED").is_some() {
        p.arg("--prerendered");
    }
    if copy {
        p.arg("--copy");
    }
    // --chain: relays in a line between the producer and the consumer, which reads the last
    // relay. Started from the consumer's end, each waiting for its input to appear, so that
    // the whole line is connected before the producer's first frame (a relay that queued
    // frames while waiting for its consumer would add that backlog to every frame).
    let relays_n = if transport == "gpushm" {
        chain_len()
    } else {
        0
    };
    let socks: Vec<String> = std::iter::once(sock_s.clone())
        .chain((0..relays_n).map(|i| {
            dir.path()
                .join(format!("relay{i}.sock"))
                .to_str()
                .unwrap()
                .to_string()
        }))
        .collect();
    let last = socks.last().unwrap().clone();
    let pinned = *PIN.lock().unwrap();
    if let Some((cpu, _)) = pinned {
        pin(&mut p, cpu);
    }
    let spawn_consumer = || {
        let mut c = if transport == "capi" {
            let mut c = Command::new(c_consumer());
            c.args([&last, &frames.to_string()]);
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            c
        } else {
            // The last relay's socket (the producer's without relays).
            common("consume", &last)
        };
        if cudasum {
            c.arg("--cudasum");
        }
        if let Some((_, cpu)) = pinned {
            pin(&mut c, cpu);
        }
        if NO_ASLR.load(std::sync::atomic::Ordering::Relaxed) {
            no_aslr(&mut c);
        }
        c.spawn().unwrap_or_else(|e| {
            panic!(
                "spawn consumer: {e} (for capi: GPUSHM_C_CONSUMER or c_consumer beside bench; \
                 --no-aslr needs personality(2), which some containers forbid)"
            )
        })
    };
    let mut relays = Vec::new();
    let (producer, consumer) = if relays_n > 0 {
        let consumer = spawn_consumer();
        for i in (0..relays_n as usize).rev() {
            relays.push(
                Command::new(&exe)
                    .args(["relay", "--in", &socks[i], "--out", &socks[i + 1]])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn relay"),
            );
        }
        relays.reverse();
        (p.spawn().expect("spawn producer"), Some(consumer))
    } else {
        let producer = p.spawn().expect("spawn producer");
        let consumer = (transport != "none").then(|| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !sock.exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            spawn_consumer()
        });
        (producer, consumer)
    };
    // shmsink/shmsrc can deadlock (see tiny_frames): give up on both after the pipelines'
    // own timeout, and kill them if they do not end by themselves.
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout_s() + 15);
    let cout = consumer.map(|c| finish(c, deadline));
    let pout = finish(producer, deadline);
    let rout: Vec<_> = relays.into_iter().map(|r| finish(r, deadline)).collect();
    let show = |o: &std::process::Output| {
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
    };
    #[cfg(feature = "stages")]
    if let Some(line) = cout.as_ref().and_then(|o| {
        show(o)
            .lines()
            .find(|l| l.starts_with("STAGES "))
            .map(String::from)
    }) {
        eprintln!(
            "bench: {transport} {w}x{h} spin={} (µs p50/p90): {line}",
            spin_us()
        );
    }
    let run = Run {
        producer: parse(&show(&pout), "PRODUCER "),
        consumer: cout.as_ref().and_then(|o| parse(&show(o), "CONSUMER ")),
        relays: rout.iter().map(|o| parse(&show(o), "RELAY ")).collect(),
    };
    for (i, o) in rout.iter().enumerate() {
        if run.relays[i].is_none() {
            eprintln!("bench: relay {i} failed:\n{}", show(o));
        }
    }
    if run.producer.is_none() || (transport != "none" && run.consumer.is_none()) {
        eprintln!(
            "bench: {transport} {w}x{h} failed:\n{}\n{}",
            show(&pout),
            cout.as_ref().map(show).unwrap_or_default()
        );
    }
    run
}

/// The consumers' and relays' low-latency budget (`GPUSHM_BENCH_SPIN_US`, µs; 0: off).
fn spin_us() -> u64 {
    std::env::var("GPUSHM_BENCH_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// `bench latency --cpu-latency-us N`, asked of the kernel once here: a mode that did not get
/// its request would be measured without it, so a refused (no access) or malformed value is an
/// error that says why.
fn cpu_latency_arg(args: &[String]) -> Result<Option<u32>, String> {
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

/// gpushmsink's and gpushmsrc's `cpu-latency-us` (`GPUSHM_BENCH_CPU_LATENCY_US`; unset: not
/// set), as a property to append to their launch lines.
fn cpu_latency_prop() -> String {
    std::env::var("GPUSHM_BENCH_CPU_LATENCY_US")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(String::new(), |us| format!(" cpu-latency-us={us}"))
}

/// Relays (`gpushmsrc ! gpushmsink` processes) between a gpushm producer and its consumer
/// (`GPUSHM_BENCH_CHAIN`; 0: none).
fn chain_len() -> u64 {
    std::env::var("GPUSHM_BENCH_CHAIN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A relay of `--chain`: `gpushmsrc ! gpushmsink`, from `--in` to `--out`, with the
/// consumers' budget; prints its CPU time per frame.
fn relay(args: &[String]) -> Result<(), String> {
    let from = arg(args, "--in").unwrap_or_default();
    let to = arg(args, "--out").unwrap_or_default();
    let launch = format!(
        "gpushmsrc name=src socket-path={from} lossless=true reconnect=false spin-us={}{cl} \
         ! gpushmsink name=sink socket-path={to} wait-for-connection=true sync=false{cl}",
        spin_us(),
        cl = cpu_latency_prop()
    );
    let pipeline = gst::parse::launch(&launch).map_err(|e| format!("{launch}: {e}"))?;
    let bin = pipeline
        .clone()
        .downcast::<gst::Bin>()
        .map_err(|_| "not a bin")?;
    // Done when the consumer leaves (the sink would wait for another one).
    let weak = pipeline.downgrade();
    bin.by_name("sink")
        .ok_or("no sink")?
        .connect("client-disconnected", false, move |_| {
            if let Some(p) = weak.upgrade() {
                let _ = p.post_message(gst::message::Eos::new());
            }
            None
        });
    // first, count, CPU time at the first frame
    let seen = Arc::new(Mutex::new((0u64, 0u64, 0u64)));
    {
        let seen = seen.clone();
        bin.by_name("sink")
            .ok_or("no sink")?
            .static_pad("sink")
            .ok_or("no pad")?
            .add_probe(gst::PadProbeType::BUFFER, move |_, _| {
                let mut g = seen.lock().unwrap();
                if g.1 == 0 {
                    g.0 = now();
                    g.2 = rusage().0;
                }
                g.1 += 1;
                gst::PadProbeReturn::Ok
            });
    }
    run_pipeline(&pipeline, Duration::from_secs(timeout_s()))?;
    let (first, count, cpu0) = *seen.lock().unwrap();
    let cpu = rusage().0.saturating_sub(cpu0);
    let secs = now().saturating_sub(first) as f64 / 1e9;
    println!(
        "RELAY frames={count} cpu_us_per_frame={:.1} cpu_percent={:.2}",
        cpu as f64 / count.saturating_sub(1).max(1) as f64,
        if secs > 0.0 {
            cpu as f64 / 1e4 / secs
        } else {
            f64::NAN
        }
    );
    Ok(())
}

/// CPUs that `bench capi` and `bench latency --pin` pin the producer and consumer to (none: the
/// scheduler places them).
static PIN: Mutex<Option<(usize, usize)>> = Mutex::new(None);

/// `bench capi --no-aslr`: consumers start with address-space randomisation off, each at the
/// same addresses every run.
static NO_ASLR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts the process `c` starts with address-space randomisation off.
fn no_aslr(c: &mut Command) {
    use nix::sys::personality::{self, Persona};
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only system calls run (no allocation, no lock).
    unsafe {
        c.pre_exec(|| {
            let p = personality::get().map_err(std::io::Error::from)?;
            personality::set(p | Persona::ADDR_NO_RANDOMIZE)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
}

/// The last two CPUs this process may run on (CPU 0 takes more of the machine's interrupts).
fn two_cpus() -> Option<(usize, usize)> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    match cpus[..] {
        [.., a, b] => Some((a, b)),
        _ => None,
    }
}

/// Runs the process `c` starts on `cpu` only (its threads inherit it).
fn pin(c: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_err() {
        return;
    }
    // SAFETY: between fork and exec only a system call runs (no allocation, no lock).
    unsafe {
        c.pre_exec(move || {
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                .map_err(std::io::Error::from)
        });
    }
}

/// How long each pipeline of a run may take (`GPUSHM_BENCH_TIMEOUT`, seconds; 120).
fn timeout_s() -> u64 {
    std::env::var("GPUSHM_BENCH_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120)
}

/// Waits for `child` until `deadline`, then kills it; its output either way.
fn finish(mut child: std::process::Child, deadline: std::time::Instant) -> std::process::Output {
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().expect("child output")
}

/// `run` with the pre-rendered producer (4K NV12 republished without redrawing).
fn run_prerendered(transport: &str, frames: u64, cudasum: bool) -> Run {
    std::env::set_var("GPUSHM_BENCH_PRERENDERED", "1");
    let r = run(transport, 3840, 2160, frames, 0, false, cudasum);
    std::env::remove_var("GPUSHM_BENCH_PRERENDERED");
    r
}

fn have(element: &str) -> bool {
    gst::ElementFactory::find(element).is_some()
}

/// One line of the table, kept for the plot.
struct Row {
    size: usize,
    copy: bool,
    transport: &'static str,
    percent: f64,
    p50: f64,
    p99: f64,
}

/// Latency (p50 solid, p99 dashed) and delivered fps per transport, per size.
fn plot(rows: &[Row], path: &str, title: &str) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let sizes = ["720p", "1080p", "4K"];
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let (left, right) = root.split_horizontally(700);
    let colour = |t: &str| match t {
        "gpushm" => RGBColor(0, 114, 178),
        "shm" => RGBColor(213, 94, 0),
        _ => RGBColor(0, 158, 115),
    };
    let ymax = rows
        .iter()
        .filter(|r| !r.copy)
        .map(|r| r.p99)
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max)
        * 1.15;
    let mut c = ChartBuilder::on(&left)
        .caption("latency at 30 fps live, pool mode (µs)", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(-0.3f64..2.3f64, 0f64..ymax)?;
    c.configure_mesh()
        .x_labels(3)
        .x_label_formatter(&|x| {
            sizes
                .get(x.round() as usize)
                .map_or(String::new(), |s| s.to_string())
        })
        .y_desc("µs")
        .draw()?;
    let mut transports: Vec<&str> = rows.iter().map(|r| r.transport).collect();
    transports.dedup();
    transports.sort();
    transports.dedup();
    for t in &transports {
        let pts = |f: &dyn Fn(&Row) -> f64| -> Vec<(f64, f64)> {
            rows.iter()
                .filter(|r| r.transport == *t && !r.copy)
                .map(|r| (r.size as f64, f(r)))
                .collect()
        };
        let col = colour(t);
        c.draw_series(LineSeries::new(pts(&|r| r.p50), col.stroke_width(3)))?
            .label(format!("{t} p50"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(3)));
        c.draw_series(LineSeries::new(pts(&|r| r.p99), col.stroke_width(1)))?
            .label(format!("{t} p99"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(1)));
        c.draw_series(
            pts(&|r| r.p50)
                .into_iter()
                .map(|p| Circle::new(p, 4, col.filled())),
        )?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    let mut c = ChartBuilder::on(&right)
        .caption(
            "delivered fps, % of the producer alone (flat out)",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(-0.3f64..2.3f64, 0f64..125f64)?;
    c.configure_mesh()
        .x_labels(3)
        .x_label_formatter(&|x| {
            sizes
                .get(x.round() as usize)
                .map_or(String::new(), |s| s.to_string())
        })
        .y_desc("%")
        .draw()?;
    for t in &transports {
        for copy in [false, true] {
            let col = colour(t);
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.transport == *t && r.copy == copy)
                .map(|r| (r.size as f64, r.percent))
                .collect();
            let w = if copy { 1 } else { 3 };
            c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(w)))?
                .label(format!("{t} {}", if copy { "copy" } else { "pool" }))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(w))
                });
            c.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, col.filled())))?;
        }
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn orchestrate(plot_path: &str) {
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
        std::thread::available_parallelism().map_or(0, |n| n.get()),
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
        std::thread::available_parallelism().map_or(0, |n| n.get())
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

/// One way `bench latency` measures.
struct Mode {
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
fn latency_only(
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

/// The transport's own cost: 64x64 GRAY8 frames (4 KiB), producer flat out, lossless consumer.
fn tiny_frames(runs: u64, spin: u64) {
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

fn gpu_mode() {
    println!("\n## GPU: the consumer runs cudasum (4K NV12, producer flat out, pool mode)\n");
    println!("| consumer | delivered fps | cudasum GB/s (median per frame) |");
    println!("|---|---|---|");
    let mut fps = Vec::new();
    for t in ["gpushm", "shm"] {
        let r = run(t, 3840, 2160, 150, 0, false, true);
        fps.push(f(&r.consumer, "fps"));
        let src = if t == "gpushm" { "gpushmsrc" } else { "shmsrc" };
        println!(
            "| {src} ! cudasum | {:.0} | {:.1} |",
            f(&r.consumer, "fps"),
            f(&r.consumer, "gbps")
        );
    }
    // The bus limit in the same run: a plain read kernel over registered host memory.
    if let Ok(dev) = gstgpushm::cuda::device(-1) {
        if let (Ok(mut gpu), Ok(ring)) = (
            gstgpushm::cuda::kernels::GpuSummer::new(&dev),
            gpushm::ring::producer_end::ProducerRing::create(1, 2, 3840 * 2160 * 3 / 2, false),
        ) {
            let (base, len) = ring.mapping();
            // SAFETY: the ring outlives the registration.
            if let Ok(reg) =
                unsafe { gstgpushm::cuda::register::HostRegistration::new(&dev, base, len, false) }
            {
                let d = reg.device_ptr_of(ring.slot_ptr(0)).unwrap_or(0);
                if let Ok(ns) = gpu.time_read(d, 3840 * 2160 * 3 / 2, 20) {
                    println!("\nBus limit (plain read kernel over registered host memory, one 4K frame): {:.1} GB/s on {}", (3840.0 * 2160.0 * 1.5) / ns as f64, dev.name);
                }
            }
        }
    }
    println!(
        "gpushmsrc ! cudasum reaches {:.1}x the fps of shmsrc ! cudasum (videotestsrc producer)",
        fps[0] / fps[1]
    );
    let g = run_prerendered("gpushm", 600, true);
    let s = run_prerendered("shm", 600, true);
    println!(
        "With the pre-rendered producer: {:.0} vs {:.0} fps, {:.1}x (producers: {:.0} / {:.0} fps)",
        f(&g.consumer, "fps"),
        f(&s.consumer, "fps"),
        f(&g.consumer, "fps") / f(&s.consumer, "fps"),
        f(&g.producer, "fps"),
        f(&s.producer, "fps")
    );
}

/// CPU time (user + system) of process `pid` so far, in µs.
fn proc_cpu_us(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Fields after the command name (which may hold spaces): utime and stime are the 12th
    // and 13th of them.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as u64;
    f.iter().sum::<u64>() * 1_000_000 / hz.max(1)
}

/// A connection flood against a live producer (pattern_producer, 320x240 I420 at 30 fps):
/// `--threads N` clients connect and hang up (`--mode hangup`), or connect, say Hello and hang
/// up (`--mode hello`), as fast as they can for `--seconds S`. Prints connections per second,
/// the producer's CPU (in % of one core) before and during the flood, and the frames one
/// honest consumer got and its longest gap.
fn flood(args: &[String]) -> Result<(), String> {
    let secs = num(args, "--seconds", 5);
    let threads = num(args, "--threads", 1).max(1);
    let mode = arg(args, "--mode").unwrap_or_else(|| "hangup".into());
    if mode != "hangup" && mode != "hello" {
        return Err(format!("--mode {mode}: hangup or hello"));
    }
    let dir = std::env::temp_dir().join(format!("gpushm-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let sock = dir.join("s");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let pp = exe.with_file_name("pattern_producer");
    let mut child = Command::new(&pp)
        .args([
            "--socket",
            sock.to_str().unwrap_or_default(),
            "--frames",
            "0",
        ])
        .args([
            "--fps", "30", "--width", "320", "--height", "240", "--format", "I420",
        ])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", pp.display()))?;
    let pid = child.id();
    let result = (|| {
        let opts = gpushm::subscriber::ConnectOptions {
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let mut sub =
            gpushm::subscriber::Subscriber::connect(&sock, opts).map_err(|e| e.to_string())?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The consumer: frames and the longest gap between two, per phase.
        let phase = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = Arc::new(Mutex::new([(0u64, 0u64); 2]));
        let consumer = {
            let (stop, phase, seen) = (stop.clone(), phase.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut last = now();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(Some(f)) = sub.next_frame(Some(Duration::from_millis(200))) {
                        drop(f);
                        let t = now();
                        let p = phase.load(std::sync::atomic::Ordering::Relaxed) as usize;
                        let mut s = seen.lock().unwrap();
                        s[p].0 += 1;
                        s[p].1 = s[p].1.max(t - last);
                        last = t;
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_secs(1));
        let (c0, t0) = (proc_cpu_us(pid), now());
        std::thread::sleep(Duration::from_secs(secs));
        let (c1, t1) = (proc_cpu_us(pid), now());
        phase.store(1, std::sync::atomic::Ordering::Relaxed);
        let conns = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let flooders: Vec<_> = (0..threads)
            .map(|_| {
                let (stop, conns, sock, mode) =
                    (stop.clone(), conns.clone(), sock.clone(), mode.clone());
                std::thread::spawn(move || {
                    let hello = gpushm::wire::Message::Hello {
                        flags: 0,
                        pid: std::process::id(),
                        name: "flood".into(),
                    };
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let Ok(s) = std::os::unix::net::UnixStream::connect(&sock) else {
                            continue;
                        };
                        if mode == "hello" {
                            let c = gpushm::wire::Conn::new(s);
                            let _ = c.send(&hello, &[]);
                        }
                        conns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let (c2, t2) = (proc_cpu_us(pid), now());
        std::thread::sleep(Duration::from_secs(secs) / 2);
        // A consumer that starts during the flood: how long until its first frame.
        let late = (|| {
            let start = now();
            let opts = gpushm::subscriber::ConnectOptions {
                timeout: Duration::from_secs(30),
                ..Default::default()
            };
            let mut s =
                gpushm::subscriber::Subscriber::connect(&sock, opts).map_err(|e| e.to_string())?;
            match s.next_frame(Some(Duration::from_secs(30))) {
                Ok(Some(_)) => Ok((now() - start) as f64 / 1e6),
                Ok(None) => Err("end of stream".to_string()),
                Err(e) => Err(e.to_string()),
            }
        })();
        std::thread::sleep(Duration::from_nanos(
            (t2 + secs * 1_000_000_000).saturating_sub(now()),
        ));
        let (c3, t3, n) = (
            proc_cpu_us(pid),
            now(),
            conns.load(std::sync::atomic::Ordering::Relaxed),
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for f in flooders {
            let _ = f.join();
        }
        let _ = consumer.join();
        let s = *seen.lock().unwrap();
        let pct = |c: u64, t: u64| c as f64 / (t as f64 / 1000.0) * 100.0;
        println!("\n## Connection flood ({mode}, {threads} thread(s), {secs} s) against a 320x240 I420 producer at 30 fps\n");
        println!("| phase | connections/s | producer CPU (% of a core) | consumer frames | longest gap ms |");
        println!("|---|---|---|---|---|");
        println!(
            "| quiet | 0 | {:.1} | {} | {:.1} |",
            pct(c1 - c0, t1 - t0),
            s[0].0,
            s[0].1 as f64 / 1e6
        );
        println!(
            "| flood | {:.0} | {:.1} | {} | {:.1} |",
            n as f64 / ((t3 - t2) as f64 / 1e9),
            pct(c3 - c2, t3 - t2),
            s[1].0,
            s[1].1 as f64 / 1e6
        );
        match late {
            Ok(ms) => println!(
                "\nA consumer started during the flood had its first frame after {ms:.0} ms."
            ),
            Err(e) => println!("\nA consumer started during the flood failed: {e}"),
        }
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Where a 4K NV12 frame is read fastest by a CUDA kernel: a device ring (GPU memory shared
/// with the CUDA virtual memory API), the host ring registered with CUDA, and plain device
/// memory (the limit), in one process and one run. The cudasum kernel's per-frame time
/// (median of 50) over the frame's bytes, and a plain read kernel's best time.
fn device_ring_mode() {
    use gpushm::ring::producer_end::ProducerRing;
    use gstgpushm::cuda::{self, kernels::PlaneJob};
    println!("\n## Reading a 4K NV12 frame on the GPU: device ring, host ring, device memory\n");
    let dev = match cuda::device(-1) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU: {e}");
            return;
        }
    };
    let (w, h) = (3840u32, 2160u32);
    let len = (w * h * 3 / 2) as usize;
    let mut gpu = match cuda::kernels::GpuSummer::new(&dev) {
        Ok(g) => g,
        Err(e) => {
            println!("cudasum kernels: {e}");
            return;
        }
    };
    let jobs = |base: u64| {
        [
            PlaneJob {
                dev_ptr: base,
                stride: w as u64,
                row_bytes: w,
                rows: h,
                channels: 1,
            },
            PlaneJob {
                dev_ptr: base + (w * h) as u64,
                stride: w as u64,
                row_bytes: w,
                rows: h / 2,
                channels: 2,
            },
        ]
    };
    println!("| frame in | cudasum kernel GB/s (median) | plain read kernel GB/s (best) |");
    println!("|---|---|---|");
    let device_ring = ProducerRing::create(1, 2, len as u64, false).and_then(|r| {
        cuda::vmm::place_ring(&r, &dev).map_err(|e| gpushm::Error::Invalid(e.0))?;
        Ok(r)
    });
    let host_ring = ProducerRing::create(1, 2, len as u64, false);
    let plain = gpu.alloc_device(len);
    let mut measure = |what: &str, base: u64| {
        let mut t: Vec<u64> = (0..50)
            .filter_map(|_| gpu.sum(&jobs(base)).ok().map(|r| r.1))
            .collect();
        t.sort_unstable();
        let sum_ns = t.get(t.len() / 2).copied().unwrap_or(0).max(1);
        let read_ns = gpu.time_read(base, len as u64, 20).unwrap_or(0).max(1);
        let (a, b) = (len as f64 / sum_ns as f64, len as f64 / read_ns as f64);
        println!("| {what} | {a:.1} | {b:.1} |");
        (a, b)
    };
    let (mut d, mut hr, mut p) = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0));
    match &device_ring {
        Ok(r) => match cuda::vmm::device_ptr_of_slot(r, 0) {
            Some(ptr) => d = measure("device ring (GPU memory, VMM)", ptr),
            None => println!("| device ring | no device address | |"),
        },
        Err(e) => println!("| device ring | {e} | |"),
    }
    if let Ok(r) = &host_ring {
        let (base, l) = r.mapping();
        // SAFETY: the ring outlives the registration.
        match unsafe { cuda::register::HostRegistration::new(&dev, base, l, false) } {
            Ok(reg) => match reg.device_ptr_of(r.slot_ptr(0)) {
                Some(ptr) => hr = measure("host ring (registered, over the bus)", ptr),
                None => println!("| host ring | no device address | |"),
            },
            Err(e) => println!("| host ring | {e} | |"),
        }
    }
    if let Ok((_buf, ptr)) = &plain {
        p = measure("plain device memory (the limit)", *ptr);
    }
    println!(
        "\nDevice ring: {:.0} % of plain device memory (cudasum kernel), {:.1}x the host ring; on {}",
        d.0 / p.0.max(1e-9) * 100.0,
        d.0 / hr.0.max(1e-9),
        dev.name
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    gst::init().expect("gst::init");
    gstgpushm::plugin_register_static().expect("register gpushm");
    let r = match args.get(1).map(String::as_str) {
        Some("produce") => produce(&args),
        Some("consume") => consume(&args),
        Some("floor-wait") => floor_wait(&args),
        Some("relay") => relay(&args),
        Some("flood") => flood(&args),
        Some("core-produce") => core_produce(&args),
        Some("core-tiny") => {
            core_tiny(
                num(&args, "--runs", 3).max(1),
                num(&args, "--frames", 200_000),
            );
            Ok(())
        }
        Some("capi") => {
            capi_mode(&args);
            Ok(())
        }
        Some("cold") => cold(&args),
        Some("tiny") => {
            tiny_frames(num(&args, "--runs", 1).max(1), num(&args, "--spin-us", 300));
            Ok(())
        }
        Some("gpu") => {
            gpu_mode();
            Ok(())
        }
        Some("device-ring") => {
            device_ring_mode();
            Ok(())
        }
        Some("latency") => {
            if args.iter().any(|a| a == "--pin") {
                *PIN.lock().unwrap() = two_cpus();
            }
            let cpu_latency = cpu_latency_arg(&args).unwrap_or_else(|e| {
                println!("{e}");
                std::process::exit(2);
            });
            // --wake-ahead-us 80,160: more gpushm modes, with those wake-ahead-us.
            let wake_ahead: Vec<u32> = match arg(&args, "--wake-ahead-us") {
                Some(v) => v
                    .split(',')
                    .map(|us| us.trim().parse())
                    .collect::<Result<_, _>>()
                    .unwrap_or_else(|e| {
                        println!("--wake-ahead-us {v}: {e} (microseconds, comma-separated)");
                        std::process::exit(2);
                    }),
                None => Vec::new(),
            };
            let sizes = match (arg(&args, "--width"), arg(&args, "--height")) {
                (None, None) => vec![(1280, 720), (1920, 1080), (3840, 2160)],
                _ => vec![(num(&args, "--width", 1280), num(&args, "--height", 720))],
            };
            latency_only(
                &sizes,
                num(&args, "--frames", 300),
                num(&args, "--runs", 1).max(1),
                num(&args, "--spin-us", 300),
                num(&args, "--chain", 0),
                cpu_latency,
                &wake_ahead,
            );
            Ok(())
        }
        Some("floor") => {
            let fl = floor(num(&args, "--fps", 30), num(&args, "--frames", 90));
            println!(
                "floor at {} fps: p50 {:.1} µs, p99 {:.1} µs",
                num(&args, "--fps", 30),
                f(&fl, "p50_us"),
                f(&fl, "p99_us")
            );
            Ok(())
        }
        _ => {
            orchestrate(&arg(&args, "--plot").unwrap_or_else(|| "bench.png".into()));
            Ok(())
        }
    };
    if let Err(e) = r {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}
