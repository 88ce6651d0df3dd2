// SPDX-License-Identifier: MPL-2.0
//! Test tool (the suite reads its output; see examples/ for code to copy): `gpushmsrc ! appsink`, with no caps given. It reports the caps it got, the
//! delivered frame rate and the cross-process latency (from the producer's publish stamp to
//! arrival here, both CLOCK_MONOTONIC), and with --verify checks every byte of every frame
//! against the pattern of pattern_producer. PTS of a live producer must never lie further in
//! the future of the pipeline's running time than gpushm's MAX_LEAD, and never go backwards;
//! with --exact-pts their spacing must also be the producer's.
//!
//!     cargo run --release --example frame_checker -- --socket /tmp/pattern --verify
//!
//! Options: --socket PATH or --stream NAME (required), --verify, --lossless, --frames N (stop after N),
//! --expect N (fail unless exactly N frames arrived), --print (one line per frame, with the sum
//! of every byte of each plane), --exact-pts (see above),
//! --chain "ELEMENTS" (a pipeline fragment between gpushmsrc and the appsink, e.g. "queue
//! min-threshold-buffers=20"), --sync and --ts-offset NS (the appsink syncs to the clock),
//! --max-buffers N (the appsink's queue, default 2), --batch N (keep N samples before checking
//! them, as an app batching frames), --src-props "k=v ..." (more gpushmsrc properties),
//! --pause-at N --pause-ms MS (PAUSE the pipeline for MS after N frames),
//! --cudasum BACKEND (insert `cudasum backend=BACKEND` and check every sum it reports against
//! a CPU computation over the same buffer; prints a CUDASTATS line), --no-reconnect (error out
//! when the producer goes away instead of waiting for a new one). Warnings are printed as they
//! happen, as `WARNING t=<CLOCK_MONOTONIC ns> <text>`.
//! Exit code: 0 all good, 1 a check failed, 2 the pipeline failed.

use gst::prelude::*;

#[derive(Default)]
struct Args {
    socket: String,
    stream: String,
    verify: bool,
    lossless: bool,
    frames: Option<u64>,
    expect: Option<u64>,
    print: bool,
    exact_pts: bool,
    cudasum: Option<String>,
    no_reconnect: bool,
    chain: Option<String>,
    sync: bool,
    ts_offset: i64,
    max_buffers: u32,
    batch: usize,
    src_props: Vec<(String, String)>,
    pause_at: Option<u64>,
    pause_ms: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        max_buffers: 2,
        batch: 1,
        ..Default::default()
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--socket" => a.socket = v()?,
            "--stream" => a.stream = v()?,
            "--frames" => a.frames = Some(v()?.parse().map_err(|e| format!("--frames: {e}"))?),
            "--expect" => a.expect = Some(v()?.parse().map_err(|e| format!("--expect: {e}"))?),
            "--verify" => a.verify = true,
            "--lossless" => a.lossless = true,
            "--print" => a.print = true,
            "--exact-pts" => a.exact_pts = true,
            "--no-reconnect" => a.no_reconnect = true,
            "--cudasum" => a.cudasum = Some(v()?),
            "--chain" => a.chain = Some(v()?),
            "--sync" => a.sync = true,
            "--ts-offset" => a.ts_offset = v()?.parse().map_err(|e| format!("--ts-offset: {e}"))?,
            "--max-buffers" => {
                a.max_buffers = v()?.parse().map_err(|e| format!("--max-buffers: {e}"))?
            }
            "--batch" => a.batch = v()?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--src-props" => {
                for kv in v()?.split_whitespace() {
                    let (k, val) = kv
                        .split_once('=')
                        .ok_or(format!("--src-props: {kv} is not key=value"))?;
                    a.src_props.push((k.into(), val.into()));
                }
            }
            "--pause-at" => {
                a.pause_at = Some(v()?.parse().map_err(|e| format!("--pause-at: {e}"))?)
            }
            "--pause-ms" => a.pause_ms = v()?.parse().map_err(|e| format!("--pause-ms: {e}"))?,
            _ => return Err(format!("unknown option {k}")),
        }
    }
    if a.socket.is_empty() == a.stream.is_empty() {
        return Err("one of --socket PATH and --stream NAME is required".into());
    }
    Ok(a)
}

fn now_ns() -> u64 {
    gpushm::monotonic_ns()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("frame_checker: {e}");
            std::process::exit(2);
        }
    };
    gst::init().expect("gst::init");
    gstgpushm::plugin_register_static().expect("register gpushm");
    let src = gst::ElementFactory::make("gpushmsrc")
        .property("lossless", a.lossless)
        .property("reconnect", !a.no_reconnect)
        .build()
        .expect("gpushmsrc");
    if a.stream.is_empty() {
        src.set_property("socket-path", &a.socket);
    } else {
        src.set_property("stream", &a.stream);
    }
    for (k, v) in &a.src_props {
        src.set_property_from_str(k, v);
    }
    let sink = gst_app::AppSink::builder()
        .sync(a.sync)
        .max_buffers(a.max_buffers)
        .build();
    sink.set_property("ts-offset", a.ts_offset);
    let chain = a.chain.as_ref().map(|d| {
        gst::parse::bin_from_description(d, true)
            .expect("--chain: a valid pipeline fragment")
            .upcast::<gst::Element>()
    });
    let pipeline = gst::Pipeline::new();
    let cudasum = a.cudasum.as_ref().map(|b| {
        gst::ElementFactory::make("cudasum")
            .property_from_str("backend", b)
            .build()
            .expect("cudasum")
    });
    let elements: Vec<gst::Element> = std::iter::once(src.clone())
        .chain(cudasum.clone())
        .chain(chain)
        .chain(std::iter::once(sink.clone().upcast()))
        .collect();
    pipeline.add_many(&elements).expect("add");
    gst::Element::link_many(&elements).expect("link");
    let bus = pipeline.bus().expect("bus");
    bus.set_sync_handler(|_, m| {
        if let gst::MessageView::Warning(w) = m.view() {
            println!("WARNING t={} {}", now_ns(), w.error());
        }
        gst::BusSyncReply::Pass
    });
    let mut sums = SumCheck::default();
    // Latency is taken where gpushmsrc hands the buffer downstream: the transport's share,
    // without cudasum or the app.
    let publish_caps = gst::Caps::new_empty_simple(gstgpushm::PUBLISH_TIMESTAMP_CAPS);
    let lat = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let lat = lat.clone();
        let publish_caps = publish_caps.clone();
        src.static_pad("src").expect("src pad").add_probe(
            gst::PadProbeType::BUFFER,
            move |_, info| {
                let arrival = now_ns();
                if let Some(b) = info.buffer() {
                    if let Some(m) = b
                        .iter_meta::<gst::ReferenceTimestampMeta>()
                        .find(|m| m.reference() == publish_caps.as_ref())
                    {
                        lat.lock()
                            .unwrap()
                            .push(arrival.saturating_sub(m.timestamp().nseconds()));
                    }
                }
                gst::PadProbeReturn::Ok
            },
        );
    }
    if pipeline.set_state(gst::State::Playing).is_err() {
        report_bus_error(&pipeline);
        std::process::exit(2);
    }
    let (mut n_frames, mut bad, mut pts_errors) = (0u64, 0u64, 0u64);
    let mut first: Option<(u64, gst::ClockTime)> = None;
    let mut last_pts: Option<gst::ClockTime> = None;
    let mut last_n = None;
    let mut gaps = 0u64;
    let mut caps_seen = Vec::<String>::new();
    let mut t0 = None;
    // Samples kept before they are checked (--batch): an app that batches its frames.
    let mut held: Vec<(gst::Sample, u64, Option<gst::ClockTime>)> = Vec::new();
    let mut pulled = 0u64;
    let mut done = false;
    while !done {
        match sink.pull_sample() {
            Ok(sample) if a.frames.is_none_or(|f| pulled < f) => {
                pulled += 1;
                held.push((sample, now_ns(), pipeline.current_running_time()));
                if a.pause_at == Some(pulled) {
                    println!("PAUSED t={}", now_ns());
                    let _ = pipeline.set_state(gst::State::Paused);
                    std::thread::sleep(std::time::Duration::from_millis(a.pause_ms));
                    let _ = pipeline.set_state(gst::State::Playing);
                    println!("RESUMED t={}", now_ns());
                }
                if held.len() < a.batch && a.frames.is_none_or(|f| pulled < f) {
                    continue;
                }
            }
            _ => done = true,
        }
        if a.frames.is_some_and(|f| pulled >= f) {
            done = true;
        }
        for (sample, arrival, running) in held.drain(..) {
            t0.get_or_insert(arrival);
            let caps = sample.caps().expect("sample caps");
            let caps_str = caps.to_string();
            if caps_seen.last() != Some(&caps_str) {
                if a.print {
                    println!("CAPS {caps_str}");
                }
                caps_seen.push(caps_str);
            }
            let buffer = sample.buffer().expect("sample buffer");
            // gpushmsrc numbers video frames in the offset; other streams keep the producer's,
            // which may be none: count them here then.
            let n = match buffer.offset() {
                u64::MAX => n_frames,
                o => o,
            };
            if last_n.is_some_and(|l: u64| n != l + 1) {
                gaps += 1;
            }
            last_n = Some(n);
            let pts = buffer.pts();
            // A live producer's frames are never further in the future than the backlog of a
            // wait-for-connection start, at most gpushm::time::MAX_LEAD: a syncing sink plays
            // every frame without waiting longer. (One that is not live keeps its own
            // timestamps, ahead of real time included: a syncing sink plays them at their pace.)
            let live = src.property::<bool>("producer-live");
            let lead = gst::ClockTime::from_nseconds(gpushm::time::MAX_LEAD as u64);
            if let (Some(p), Some(r), true) = (pts, running, live) {
                if p > r + lead {
                    pts_errors += 1;
                    println!("PTS_IN_FUTURE n={n} pts={p} running_time={r}");
                }
            }
            // PTS are checked within continuous runs: a drop or a new producer starts a new one.
            if buffer.flags().contains(gst::BufferFlags::DISCONT) {
                first = None;
            }
            if let (Some(p), Some(l)) = (pts, last_pts) {
                if p < l {
                    pts_errors += 1;
                }
            }
            last_pts = pts;
            match (first, pts, buffer.duration()) {
                (None, Some(p), _) => first = Some((n, p)),
                (Some(_), Some(_), _) if !a.exact_pts => {}
                (Some((n0, p0)), Some(p), Some(d)) => {
                    // Sources round n * 1s / fps while the duration is truncated: allow the
                    // truncation, under 1 ns per frame.
                    let frames = n as i128 - n0 as i128;
                    let err = p.nseconds() as i128
                        - p0.nseconds() as i128
                        - frames * d.nseconds() as i128;
                    if err.abs() > frames.abs() {
                        pts_errors += 1;
                    }
                }
                _ => pts_errors += 1,
            }
            let mut ok = true;
            let mut sum = 0;
            if a.verify {
                let info = gst_video::VideoInfo::from_caps(caps).expect("video caps");
                match gst_video::VideoFrameRef::from_buffer_ref_readable(buffer, &info) {
                    Ok(frame) => {
                        ok = gstgpushm::pattern::check(&frame, n) == 0;
                        if a.print {
                            sum = gstgpushm::pattern::checksum(&frame);
                        }
                    }
                    Err(_) => ok = false,
                }
                if !ok {
                    bad += 1;
                }
            }
            if a.print {
                println!(
                    "FRAME n={n} t={arrival} pts={} checksum={sum:016x} plane_sums={} ok={ok}",
                    pts.map_or(-1, |p| p.nseconds() as i64),
                    plane_sums(caps, buffer)
                );
                // The producer's custom metas and reference timestamps, one line each.
                for m in buffer.iter_meta::<gst::Meta>() {
                    if let Some(c) = m.try_as_custom_meta() {
                        println!("META n={n} {} {}", m.type_().name(), c.structure());
                    } else if let Some(r) = m
                        .downcast_ref::<gst::ReferenceTimestampMeta>()
                        .filter(|r| r.reference().to_string() != gstgpushm::PUBLISH_TIMESTAMP_CAPS)
                    {
                        println!(
                            "REFTS n={n} {} {} {}",
                            r.timestamp().nseconds(),
                            r.duration()
                                .map_or("-".into(), |d| d.nseconds().to_string()),
                            r.reference()
                        );
                    }
                }
            }
            if cudasum.is_some() {
                sums.check(&bus, caps, buffer, a.print);
            }
            n_frames += 1;
        }
    }
    let elapsed = t0.map_or(0, |t| now_ns() - t);
    if let Some(c) = &cudasum {
        let st = c.property::<gst::Structure>("stats");
        let gbps = sums.gbps_p50();
        println!(
            "CUDASTATS device={} kernels={} zero_copy={} staged={} cpu={} host_registrations={} checked={} mismatches={} gbps_p50={:.1}",
            st.get::<&str>("device").unwrap_or("none").replace(' ', "_"),
            st.get::<&str>("kernels").unwrap_or("none"),
            st.get::<u64>("frames-zero-copy").unwrap_or(0),
            st.get::<u64>("frames-staged").unwrap_or(0),
            st.get::<u64>("frames-cpu").unwrap_or(0),
            st.get::<u64>("host-registrations").unwrap_or(0),
            sums.checked,
            sums.mismatches,
            gbps,
        );
    }
    let bus_error = pipeline
        .bus()
        .and_then(|b| b.pop_filtered(&[gst::MessageType::Error]));
    let dropped = src.property::<u64>("frames-dropped");
    let copied = src.property::<u64>("frames-copied");
    let (spin_caught, spin_missed) = (
        src.property::<u64>("spin-caught"),
        src.property::<u64>("spin-missed"),
    );
    let mut q = gst::query::Latency::new();
    let src_latency = if src.query(&mut q) {
        q.result().1.nseconds() as i64
    } else {
        -1
    };
    let _ = pipeline.set_state(gst::State::Null);
    let mut lat = std::mem::take(&mut *lat.lock().unwrap());
    lat.sort_unstable();
    if !a.print {
        for c in &caps_seen {
            println!("CAPS {c}");
        }
    }
    let fps = if elapsed > 0 && n_frames > 1 {
        (n_frames - 1) as f64 * 1e9 / elapsed as f64
    } else {
        0.0
    };
    println!(
        "SUMMARY frames={n_frames} bad={bad} pts_errors={pts_errors} gaps={gaps} dropped={dropped} copied={copied} spin_caught={spin_caught} spin_missed={spin_missed} src_latency_ns={src_latency} first={} last={} fps={fps:.1} latency_p50_us={:.1} latency_p99_us={:.1} latency_max_us={:.1}",
        first.map_or(-1, |f| f.0 as i64),
        last_n.map_or(-1, |l| l as i64),
        percentile(&lat, 0.5) as f64 / 1e3,
        percentile(&lat, 0.99) as f64 / 1e3,
        lat.last().copied().unwrap_or(0) as f64 / 1e3,
    );
    if let Some(m) = bus_error {
        if let gst::MessageView::Error(e) = m.view() {
            println!("ERROR {}", e.error());
        }
        std::process::exit(2);
    }
    let failed = n_frames == 0
        || bad > 0
        || pts_errors > 0
        || a.expect.is_some_and(|e| e != n_frames)
        || (cudasum.is_some() && (sums.mismatches > 0 || sums.checked != n_frames));
    std::process::exit(if failed { 1 } else { 0 });
}

/// Compares each `cudasum` message with a CPU computation over the same buffer.
#[derive(Default)]
struct SumCheck {
    pending: std::collections::HashMap<u64, gst::Structure>,
    checked: u64,
    mismatches: u64,
    gbps: Vec<f64>,
}

impl SumCheck {
    fn check(&mut self, bus: &gst::Bus, caps: &gst::CapsRef, buffer: &gst::BufferRef, print: bool) {
        use gstgpushm::sum_planes as sp;
        // cudasum posts its message before it pushes the buffer, so it is on the bus by now.
        // Messages of frames still queued in appsink wait here for their buffer.
        while let Some(m) = bus.pop_filtered(&[gst::MessageType::Element]) {
            if let Some(s) = m.structure().filter(|s| s.name() == "cudasum") {
                self.pending
                    .insert(s.get::<u64>("offset").unwrap_or(u64::MAX), s.to_owned());
            }
        }
        let Some(s) = self.pending.remove(&buffer.offset()) else {
            println!("CUDASUM n={} missing", buffer.offset());
            self.mismatches += 1;
            return;
        };
        let gpu: Vec<u64> = s
            .get::<gst::Array>("plane-sums")
            .map(|a| a.iter().filter_map(|v| v.get::<u64>().ok()).collect())
            .unwrap_or_default();
        let info = gst_video::VideoInfo::from_caps(caps).expect("video caps");
        let map = buffer.map_readable().expect("map");
        let planes = sp::buffer_planes(&info, buffer).expect("planes");
        let cpu = sp::plane_totals(&sp::cpu_sums(&map, &planes));
        let ok = gpu == cpu;
        self.checked += 1;
        if !ok {
            self.mismatches += 1;
        }
        let ns = s.get::<u64>("kernel-time-ns").unwrap_or(0);
        let bytes = s.get::<u64>("bytes").unwrap_or(0);
        if ns > 0 {
            self.gbps.push(bytes as f64 / ns as f64);
        }
        if print || !ok {
            println!(
                "CUDASUM n={} path={} plane_sums={} cpu={} match={ok} kernel_us={:.1}",
                buffer.offset(),
                s.get::<&str>("path").unwrap_or("?"),
                gpu.iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                cpu.iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                ns as f64 / 1e3
            );
        }
    }

    fn gbps_p50(&mut self) -> f64 {
        self.gbps.sort_by(|a, b| a.total_cmp(b));
        self.gbps.get(self.gbps.len() / 2).copied().unwrap_or(0.0)
    }
}

/// The sum of every visible byte of each plane, e.g. `136` or `1234,567`.
fn plane_sums(caps: &gst::CapsRef, buffer: &gst::BufferRef) -> String {
    use gstgpushm::sum_planes as sp;
    let (Ok(info), Ok(map)) = (gst_video::VideoInfo::from_caps(caps), buffer.map_readable()) else {
        return "?".into();
    };
    match sp::buffer_planes(&info, buffer) {
        Ok(planes) => sp::plane_totals(&sp::cpu_sums(&map, &planes))
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(","),
        Err(_) => "?".into(),
    }
}

fn report_bus_error(pipeline: &gst::Pipeline) {
    if let Some(m) = pipeline.bus().and_then(|b| {
        b.timed_pop_filtered(gst::ClockTime::from_seconds(1), &[gst::MessageType::Error])
    }) {
        if let gst::MessageView::Error(e) = m.view() {
            println!("ERROR {}", e.error());
            eprintln!(
                "frame_checker: {} ({})",
                e.error(),
                e.debug().unwrap_or_default()
            );
        }
    }
}
