// SPDX-License-Identifier: MPL-2.0
//! The consumer's side of a run (`bench consume`): gpushmsrc, shmsrc or unixfdsrc into
//! fakesink (or cudasum), and the relays of `--chain` (`bench relay`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gst::prelude::*;

use crate::measure::{faults_and_switches, now, percentile, rusage};
use crate::procs::{cpu_latency_prop, spin_us, timeout_s};
use crate::produce::run_pipeline;
use crate::transport::subscribe;
use crate::{arg, num};

pub fn consume(args: &[String]) -> Result<(), String> {
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
    // GPUSHM_BENCH_CONSUMER_SINK_PROPS: more fakesink properties (`enable-last-sample=false`:
    // it keeps no frame, so its transport has one buffer fewer in rotation).
    let launch = format!(
        "{src} ! {cudasum}fakesink name=sink sync=false {}",
        std::env::var("GPUSHM_BENCH_CONSUMER_SINK_PROPS").unwrap_or_default()
    );
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

/// A relay of `--chain`: `gpushmsrc ! gpushmsink`, from `--in` to `--out`, with the
/// consumers' budget; prints its CPU time per frame.
pub fn relay(args: &[String]) -> Result<(), String> {
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
