// SPDX-License-Identifier: MPL-2.0
//! Test tool (the suite reads its output; see examples/ for code to copy): a producer that takes buffers from gpushmsink's own pool (so frames
//! are rendered straight into shared memory), fills each with a pattern that depends on the
//! frame number, and pushes them through appsrc.
//!
//!     cargo run --release --example pattern_producer -- --socket /tmp/pattern --frames 300
//!     cargo run --release --example frame_checker -- --socket /tmp/pattern --verify
//!
//! Options: --socket PATH or --stream NAME (required), --width 1920, --height 1080, --format NV12, --frames 300
//! (0 = until killed),
//! --fps 30 (0 = as fast as the consumers take them), --copy (buffers from elsewhere, forcing
//! the sink's copy path), --wait (wait for a consumer before the first frame), --slots 8,
//! --seed (every plane holds the bytes 1, 2, ..., 16, 1, 2, ... in raster order, as in the
//! seed prototype: a 4x4 GRAY8 frame sums to 136), --realtime-clock (the pipeline runs on
//! CLOCK_REALTIME instead of GStreamer's default CLOCK_MONOTONIC), --schedule "30x30,5x10,p3000,60x60"
//! (a live producer whose cadence changes: N frames at FPS for each FPSxN, a pause of MS ms
//! for each pMS; replaces --frames and --fps), --sink-prop NAME=VALUE (a gpushmsink property;
//! repeatable), --pace (push each frame when the pipeline's running time reaches its PTS, as a
//! camera does: keeps the cadence with sync=false, where the sink does not wait),
//! --admission-every MS (prints `ADMISSION t=.. accepted=.. reports=..` that often: the
//! sink's `connections-accepted` and `reports-built`).
//! Prints `CONNECTED t=.. id=..` / `DISCONNECTED t=.. id=..` (CLOCK_MONOTONIC ns) as consumers
//! come and go, and `STATS frames-sent=.. frames-copied=.. frames-dropped=.. times-lagged=..
//! spin-caught=.. spin-missed=.. woken-early=.. woken-ahead=..` at the end, and `WARNING ...` for each warning on the bus.

use gst::prelude::*;

struct Args {
    socket: String,
    stream: String,
    width: u32,
    height: u32,
    format: String,
    frames: u64,
    fps: u32,
    copy: bool,
    /// --pace: wait for each frame's PTS before pushing it.
    pace: bool,
    wait: bool,
    slots: u32,
    seed: bool,
    realtime_clock: bool,
    /// Each frame's PTS (from the first frame's) and duration, ns: --schedule.
    schedule: Option<Vec<(u64, u64)>>,
    /// gpushmsink properties, NAME=VALUE: --sink-prop (repeatable).
    sink_props: Vec<(String, String)>,
    /// --admission-every MS: print the sink's admission counts this often (0: never).
    admission_every_ms: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        socket: String::new(),
        stream: String::new(),
        width: 1920,
        height: 1080,
        format: "NV12".into(),
        frames: 300,
        fps: 30,
        copy: false,
        pace: false,
        wait: false,
        slots: 8,
        seed: false,
        realtime_clock: false,
        schedule: None,
        sink_props: Vec::new(),
        admission_every_ms: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--socket" => a.socket = v()?,
            "--stream" => a.stream = v()?,
            "--width" => a.width = v()?.parse().map_err(|e| format!("--width: {e}"))?,
            "--height" => a.height = v()?.parse().map_err(|e| format!("--height: {e}"))?,
            "--format" => a.format = v()?,
            "--frames" => a.frames = v()?.parse().map_err(|e| format!("--frames: {e}"))?,
            "--fps" => a.fps = v()?.parse().map_err(|e| format!("--fps: {e}"))?,
            "--slots" => a.slots = v()?.parse().map_err(|e| format!("--slots: {e}"))?,
            "--copy" => a.copy = true,
            "--pace" => a.pace = true,
            "--sink-prop" => {
                let p = v()?;
                let (k, val) = p
                    .split_once('=')
                    .ok_or(format!("--sink-prop {p}: not NAME=VALUE"))?;
                a.sink_props.push((k.into(), val.into()));
            }
            "--admission-every" => {
                a.admission_every_ms = v()?
                    .parse()
                    .map_err(|e| format!("--admission-every: {e}"))?
            }
            "--wait" => a.wait = true,
            "--seed" => a.seed = true,
            "--realtime-clock" => a.realtime_clock = true,
            "--schedule" => {
                let spec = v()?;
                let mut frames = Vec::new();
                let mut t = 0u64;
                let mut top = 0;
                for part in spec.split(',') {
                    if let Some(ms) = part.strip_prefix('p') {
                        t += ms
                            .parse::<u64>()
                            .map_err(|e| format!("--schedule {part}: {e}"))?
                            * 1_000_000;
                        continue;
                    }
                    let (fps, n) = part
                        .split_once('x')
                        .ok_or(format!("--schedule: {part} is not FPSxN or pMS"))?;
                    let fps: u64 = fps.parse().map_err(|e| format!("--schedule {part}: {e}"))?;
                    let n: u64 = n.parse().map_err(|e| format!("--schedule {part}: {e}"))?;
                    if fps == 0 {
                        return Err(format!("--schedule {part}: fps 0"));
                    }
                    top = top.max(fps);
                    let d = 1_000_000_000 / fps;
                    for _ in 0..n {
                        frames.push((t, d));
                        t += d;
                    }
                }
                a.frames = frames.len() as u64;
                a.fps = top as u32;
                a.schedule = Some(frames);
            }
            _ => return Err(format!("unknown option {k}")),
        }
    }
    if a.socket.is_empty() == a.stream.is_empty() {
        return Err("one of --socket PATH and --stream NAME is required".into());
    }
    Ok(a)
}

fn run(a: Args) -> Result<(), Box<dyn std::error::Error>> {
    gst::init()?;
    gstgpushm::plugin_register_static()?;
    let fps = if a.fps == 0 { 30 } else { a.fps };
    let caps = gst_video::VideoInfo::builder(a.format.parse()?, a.width, a.height)
        .fps(gst::Fraction::new(fps as i32, 1))
        .build()?
        .to_caps()?;
    let info = gst_video::VideoInfo::from_caps(&caps)?;
    let appsrc = gst_app::AppSrc::builder()
        .caps(&caps)
        .format(gst::Format::Time)
        .block(true)
        .max_buffers(2)
        // At a frame rate it is a camera: live, stamping frames with the running time.
        .is_live(a.fps > 0)
        .build();
    let sink = gst::ElementFactory::make("gpushmsink")
        .property("wait-for-connection", a.wait)
        .property("slots", a.slots)
        .property("sync", a.fps > 0)
        .build()?;
    for (k, v) in &a.sink_props {
        sink.set_property_from_str(k, v);
    }
    if a.stream.is_empty() {
        sink.set_property("socket-path", &a.socket);
    } else {
        sink.set_property("stream", &a.stream);
    }
    let pipeline = gst::Pipeline::new();
    pipeline.add_many([appsrc.upcast_ref(), &sink])?;
    appsrc.link(&sink)?;
    // Consumers coming and going, stamped with CLOCK_MONOTONIC for the tests.
    sink.connect("client-connected", false, |v| {
        println!(
            "CONNECTED t={} id={}",
            gpushm::monotonic_ns(),
            v[1].get::<i32>().unwrap_or(-1)
        );
        None
    });
    sink.connect("client-disconnected", false, |v| {
        println!(
            "DISCONNECTED t={} id={}",
            gpushm::monotonic_ns(),
            v[1].get::<i32>().unwrap_or(-1)
        );
        None
    });
    if a.realtime_clock {
        // Wall-clock time: timestamps about 56 years ahead of CLOCK_MONOTONIC.
        let clock = gst::glib::Object::builder::<gst::SystemClock>()
            .property("clock-type", gst::ClockType::Realtime)
            .build();
        pipeline.use_clock(Some(&clock));
    }
    pipeline.set_state(gst::State::Playing)?;
    if a.admission_every_ms > 0 {
        // What the sink let in so far, for tests that bound it by count (not by CPU share,
        // which a busy machine changes).
        let (sink, every) = (sink.clone(), a.admission_every_ms);
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(every));
            let s = sink.property::<gst::Structure>("stats");
            println!(
                "ADMISSION t={} accepted={} reports={}",
                gpushm::monotonic_ns(),
                s.get::<u64>("connections-accepted").unwrap_or(0),
                s.get::<u64>("reports-built").unwrap_or(0)
            );
        });
    }

    // Ask the sink for its pool, as any upstream element would.
    let pool = if a.copy {
        None
    } else {
        let mut q = gst::query::Allocation::new(Some(&caps), true);
        if !sink.static_pad("sink").ok_or("no sink pad")?.query(&mut q) {
            return Err("the allocation query failed".into());
        }
        let (pool, size, _, _) = q
            .allocation_pools()
            .next()
            .ok_or("gpushmsink offered no pool")?;
        let pool = pool.ok_or("gpushmsink offered no pool")?;
        let mut config = pool.config();
        config.set_params(Some(&caps), size, 0, 0);
        config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
        pool.set_config(config)?;
        pool.set_active(true)?;
        Some(pool)
    };

    let dur = gst::ClockTime::SECOND
        .mul_div_floor(1, fps as u64)
        .ok_or("bad fps")?;
    if a.wait {
        // Frames are stamped from the moment a consumer is there, as a camera would: none
        // is late, and none is published in a burst.
        while sink.property::<u32>("num-clients") == 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    let t0 = if a.fps > 0 {
        pipeline
            .current_running_time()
            .unwrap_or(gst::ClockTime::ZERO)
    } else {
        gst::ClockTime::ZERO
    };
    for n in (0..).take_while(|&n| a.frames == 0 || n < a.frames) {
        let mut buf = match &pool {
            Some(p) => p.acquire_buffer(None)?,
            None => gst::Buffer::with_size(info.size())?,
        };
        {
            let b = buf.get_mut().ok_or("buffer not writable")?;
            match &a.schedule {
                Some(s) => {
                    let (at, d) = s[n as usize];
                    b.set_pts(t0 + gst::ClockTime::from_nseconds(at));
                    b.set_duration(gst::ClockTime::from_nseconds(d));
                }
                None => {
                    b.set_pts(t0 + dur * n);
                    b.set_duration(dur);
                }
            }
            b.set_offset(n);
            b.set_offset_end(n + 1);
            let mut frame = gst_video::VideoFrameRef::from_buffer_ref_writable(b, &info)?;
            if a.seed {
                fill_seed(&mut frame);
            } else {
                gstgpushm::pattern::fill(&mut frame, n);
            }
        }
        if a.pace {
            if let (Some(pts), Some(now)) = (buf.pts(), pipeline.current_running_time()) {
                if pts > now {
                    std::thread::sleep(std::time::Duration::from_nanos((pts - now).nseconds()));
                }
            }
        }
        if appsrc.push_buffer(buf).is_err() {
            break;
        }
    }
    appsrc.end_of_stream()?;
    let bus = pipeline.bus().ok_or("no bus")?;
    let mut result = Ok(());
    for msg in bus.iter_timed(gst::ClockTime::NONE) {
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => {
                result = Err(format!("{}: {}", e.error(), e.debug().unwrap_or_default()).into());
                break;
            }
            gst::MessageView::Warning(w) => println!("WARNING {}", w.error()),
            _ => {}
        }
    }
    let stats = sink.property::<gst::Structure>("stats");
    println!(
        "STATS frames-sent={} frames-copied={} frames-dropped={} times-lagged={} spin-caught={} spin-missed={} woken-early={} woken-ahead={}",
        stats.get::<u64>("frames-sent")?,
        stats.get::<u64>("frames-copied")?,
        stats.get::<u64>("frames-dropped")?,
        stats.get::<u64>("times-lagged")?,
        stats.get::<u64>("spin-caught")?,
        stats.get::<u64>("spin-missed")?,
        stats.get::<u64>("woken-early")?,
        stats.get::<u64>("woken-ahead")?
    );
    if let Some(p) = pool {
        let _ = p.set_active(false);
    }
    pipeline.set_state(gst::State::Null)?;
    result
}

/// Bytes 1..=16, repeated, over the visible bytes of every plane.
fn fill_seed(frame: &mut gst_video::VideoFrameRef<&mut gst::BufferRef>) {
    use gst_video::prelude::*;
    let info = frame.info().clone();
    for p in 0..frame.n_planes() as usize {
        let stride = frame.plane_stride()[p] as usize;
        let rows = gstgpushm::pattern::plane_rows(&info, p);
        let width = gstgpushm::pattern::plane_row_bytes(&info, p);
        let Ok(data) = frame.plane_data_mut(p as u32) else {
            continue;
        };
        let mut i = 0usize;
        for r in 0..rows {
            for b in &mut data[r * stride..r * stride + width] {
                *b = (i % 16) as u8 + 1;
                i += 1;
            }
        }
    }
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pattern_producer: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args) {
        eprintln!("pattern_producer: {e}");
        std::process::exit(1);
    }
}
