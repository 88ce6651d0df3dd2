// SPDX-License-Identifier: MPL-2.0
//! The producer's side of a run (`bench produce`): videotestsrc into gpushmsink, shmsink,
//! unixfdsink or fakesink, or the pre-rendered producer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gst::prelude::*;

use crate::measure::{faults_and_switches, now, rusage};
use crate::procs::{cpu_latency_prop, timeout_s};
use crate::{arg, num};

/// Runs `pipeline` until EOS, an error, or `frames` buffers went through `counted` (a pad).
pub fn run_pipeline(pipeline: &gst::Element, timeout: Duration) -> Result<(), String> {
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
pub fn produce_prerendered(args: &[String]) -> Result<(), String> {
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

pub fn produce(args: &[String]) -> Result<(), String> {
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
    // GPUSHM_BENCH_ALONE_ALIGN (bytes, a power of two): the producer alone's buffers start at
    // that alignment, as a transport's slots do (a page: 4096). videotestsrc's own pool takes
    // the allocation parameters downstream answers with; fakesink answers none, so its
    // buffers lie where the system allocator puts them, at the same page offset as the frame
    // videotestsrc caches and copies from (see src/render.rs).
    if transport == "none" {
        if let Some(align) = std::env::var("GPUSHM_BENCH_ALONE_ALIGN")
            .ok()
            .and_then(|a| a.parse::<usize>().ok())
            .filter(|a| a.is_power_of_two())
        {
            sink_el.static_pad("sink").ok_or("no pad")?.add_probe(
                gst::PadProbeType::QUERY_DOWNSTREAM,
                move |_, info| {
                    if let Some(q) = info.query_mut() {
                        if let gst::QueryViewMut::Allocation(q) = q.view_mut() {
                            let params = gst::AllocationParams::new(
                                gst::MemoryFlags::empty(),
                                align - 1,
                                0,
                                0,
                            );
                            q.add_allocation_param(None::<&gst::Allocator>, params);
                        }
                    }
                    gst::PadProbeReturn::Ok
                },
            );
        }
    }
    // first, last, count, CPU time at the first frame, minor faults and voluntary context
    // switches at the first frame
    let times = Arc::new(Mutex::new((0u64, 0u64, 0u64, 0u64, 0u64, 0u64)));
    // The streaming thread's own sleeps at the first frame and at the last so far: the
    // process's count also has the transport's other threads (a server's connection thread
    // wakes for consumers' messages), which do not hold the frames up.
    let stream_sleeps = Arc::new(Mutex::new((0u64, 0u64)));
    // The streaming thread's own CPU time at the first frame and at the last so far, and the
    // buffers (their first bytes' addresses) in rotation over the second half of the run: the
    // memory upstream renders into, which stays in the CPU's caches only if few buffers take
    // turns. Measuring costs the probe a clock read, a lock and a set insert a frame (under a
    // µs), in the producer alone's runs too.
    let stream_cpu = Arc::new(Mutex::new((0u64, 0u64)));
    let rotation = Arc::new(Mutex::new(std::collections::HashSet::<usize>::new()));
    {
        let times = times.clone();
        let stream_sleeps = stream_sleeps.clone();
        let stream_cpu = stream_cpu.clone();
        let rotation = rotation.clone();
        sink_el.static_pad("sink").ok_or("no pad")?.add_probe(
            gst::PadProbeType::BUFFER,
            move |_, info| {
                if let Some(gst::PadProbeData::Buffer(b)) = info.data.as_mut() {
                    // Stamped once the frame is mapped: the stamp's own mapping is the
                    // bench's cost, not the transport's.
                    let mut t = now();
                    let mut addr = 0usize;
                    if let Ok(mut m) = b.make_mut().map_writable() {
                        addr = m.as_ptr() as usize;
                        if m.len() >= 8 {
                            t = now();
                            m[..8].copy_from_slice(&t.to_le_bytes());
                        }
                    }
                    let mut g = times.lock().unwrap();
                    let slept = crate::measure::thread_sleeps();
                    let mut ss = stream_sleeps.lock().unwrap();
                    let mut sc = stream_cpu.lock().unwrap();
                    let cpu = crate::measure::thread_cpu_ns();
                    // (0: the frame could not be mapped, no buffer to count.)
                    if g.2 >= frames / 2 && addr != 0 {
                        let mut r = rotation.lock().unwrap();
                        if r.len() < 1024 {
                            r.insert(addr);
                        }
                    }
                    if g.2 == 0 {
                        sc.0 = cpu;
                        g.0 = t;
                        g.3 = rusage().0;
                        let (faults, voluntary, _) = faults_and_switches();
                        (g.4, g.5) = (faults, voluntary);
                        ss.0 = slept;
                    }
                    ss.1 = slept;
                    sc.1 = cpu;
                    g.1 = t;
                    g.2 += 1;
                }
                gst::PadProbeReturn::Ok
            },
        );
    }
    run_pipeline(&pipeline, Duration::from_secs(timeout_s()))?;
    let (first, last, count, cpu0, faults0, voluntary0) = *times.lock().unwrap();
    let (cpu_us, rss) = rusage();
    let (faults, voluntary, _) = faults_and_switches();
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
    // Faults and switches after the first frame, per frame: what the frames themselves cost
    // (first touches of buffers, waits that slept), not the pipeline's setup.
    let per_frame = |n: u64| n as f64 / count.saturating_sub(1).max(1) as f64;
    let (ss0, ss1) = *stream_sleeps.lock().unwrap();
    let (sc0, sc1) = *stream_cpu.lock().unwrap();
    let (rotation, page_offset) = {
        let r = rotation.lock().unwrap();
        (r.len(), r.iter().min().map_or(-1, |a| (a % 4096) as i64))
    };
    println!(
        "PRODUCER frames={count} fps={fps:.1} cpu_us_per_frame={:.1} rss_kib={rss} copied={copied} faults_per_frame={:.2} sleeps_per_frame={:.2} stream_sleeps_per_frame={:.2} stream_cpu_us_per_frame={:.1} rotation={rotation} page_offset={page_offset}",
        per_frame(cpu_us),
        per_frame(faults.saturating_sub(faults0)),
        per_frame(voluntary.saturating_sub(voluntary0)),
        per_frame(ss1.saturating_sub(ss0)),
        per_frame(sc1.saturating_sub(sc0)) / 1000.0,
    );
    Ok(())
}
