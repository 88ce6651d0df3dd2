// SPDX-License-Identifier: MPL-2.0
//! Time and the start of a stream, with real producer and consumer processes: the gpushm
//! crate's one timestamp mapping (its `time` module) as consumers see it. Non-live streams
//! keep their spacing from the first frame, late joiners get strictly increasing PTS, audio
//! and video of one producer keep their offset in one consumer pipeline.

mod common;
use common::*;

use std::path::Path;
use std::time::Duration;

use gst::prelude::*;

/// Real-time pipelines: one at a time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// frame_checker as a default consumer (mode=auto), printing each frame, with `extra`.
fn checker(sock: &Path, extra: &[&str]) -> Proc {
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--print",
        "--src-props",
        "mode=auto",
    ]);
    c.args(extra);
    Proc::spawn(c, "frame_checker")
}

/// The PTS (ns) of every FRAME line, in arrival order.
fn frame_pts(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter(|l| l.starts_with("FRAME "))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("pts=")))
        .map(|p| p.parse().unwrap())
        .collect()
}

fn producer(pipeline: &str, sock: &Path) -> Proc {
    let p = Proc::spawn(
        gst_launch(&pipeline.replace("{sock}", sock.to_str().unwrap())),
        "producer",
    );
    wait_for_path(sock, Duration::from_secs(10));
    p
}

fn strictly_increasing(pts: &[u64]) -> bool {
    pts.windows(2).all(|w| w[1] > w[0])
}

/// A producer that is not live, waiting for its first consumer: a default consumer gets all
/// 60 frames with the producer's exact spacing from the first one, whether its sink syncs or
/// not (three runs each). Before, the first frames were all stamped 0.
#[test]
fn a_non_live_stream_keeps_its_spacing_from_the_first_frame() {
    init();
    let _g = serial();
    for run in 0..3 {
        for sync in [false, true] {
            let dir = tmpdir();
            let sock = dir.path().join("nonlive.sock");
            let p = producer(
                "videotestsrc num-buffers=60 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
                 ! gpushmsink socket-path={sock} wait-for-connection=true",
                &sock,
            );
            let mut extra = vec!["--exact-pts"];
            if sync {
                extra.push("--sync");
            }
            let (cs, out) = checker(&sock, &extra).finish(Duration::from_secs(30));
            let (ps, pout) = p.finish(Duration::from_secs(30));
            assert!(ps.success() && cs.success(), "{pout:?}\n{out:?}");
            let s = fields(&out, "SUMMARY ");
            assert_eq!(num(&s, "frames"), 60.0, "run {run}, sync {sync}: {out:?}");
            assert_eq!(
                num(&s, "pts_errors"),
                0.0,
                "run {run}, sync {sync}: {out:?}"
            );
            let pts = frame_pts(&out);
            assert!(strictly_increasing(&pts), "{pts:?}");
            // The first frame starts the consumer's stream (it was stamped before it started).
            assert!(pts[0] < 100_000_000, "first PTS {}", pts[0]);
            // 59 frame durations of 33.33 ms between the first and the last.
            let span = pts[59] - pts[0];
            assert!(span.abs_diff(1_966_666_667) < 60, "span {span}: {pts:?}");
        }
    }
}

/// A producer that is not live and renders flat out (sync=false) into a consumer whose sink
/// does not sync: strictly increasing PTS with the producer's spacing (three runs).
#[test]
fn a_flat_out_producer_gives_a_non_syncing_consumer_strictly_increasing_pts() {
    init();
    let _g = serial();
    for run in 0..3 {
        let dir = tmpdir();
        let sock = dir.path().join("flat.sock");
        let p = producer(
            "videotestsrc num-buffers=100 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
             ! gpushmsink socket-path={sock} wait-for-connection=true sync=false",
            &sock,
        );
        let (cs, out) = checker(&sock, &["--exact-pts"]).finish(Duration::from_secs(30));
        let (ps, pout) = p.finish(Duration::from_secs(30));
        assert!(ps.success() && cs.success(), "{pout:?}\n{out:?}");
        let s = fields(&out, "SUMMARY ");
        assert_eq!(num(&s, "frames"), 100.0, "run {run}: {out:?}");
        assert_eq!(num(&s, "pts_errors"), 0.0, "run {run}: {out:?}");
        assert!(strictly_increasing(&frame_pts(&out)), "run {run}: {out:?}");
    }
}

/// A default consumer started 1 s after a live wait-for-connection producer, and one joining
/// a running live stream, get strictly increasing PTS, never ahead of their syncing sink
/// (three runs).
#[test]
fn late_joiners_get_strictly_increasing_pts() {
    init();
    let _g = serial();
    for run in 0..3 {
        for wait in [true, false] {
            let dir = tmpdir();
            let sock = dir.path().join("late.sock");
            let p = producer(
                &format!(
                    "videotestsrc is-live=true num-buffers=90 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
                     ! gpushmsink socket-path={{sock}} wait-for-connection={wait}"
                ),
                &sock,
            );
            std::thread::sleep(Duration::from_secs(1));
            let (cs, out) = checker(&sock, &["--sync"]).finish(Duration::from_secs(30));
            let (ps, pout) = p.finish(Duration::from_secs(30));
            assert!(ps.success() && cs.success(), "{pout:?}\n{out:?}");
            let s = fields(&out, "SUMMARY ");
            assert!(num(&s, "frames") >= 30.0, "run {run}, wait {wait}: {out:?}");
            // PTS_IN_FUTURE and PTS going back count as errors.
            assert_eq!(
                num(&s, "pts_errors"),
                0.0,
                "run {run}, wait {wait}: {out:?}"
            );
            assert!(
                strictly_increasing(&frame_pts(&out)),
                "run {run}, wait {wait}: {out:?}"
            );
        }
    }
}

/// (offset, PTS) of every buffer reaching each sink named in `names`, from `gst-launch-1.0 -v`
/// output (fakesink silent=false).
fn sink_buffers(lines: &[String], name: &str) -> Vec<(u64, u64)> {
    let tag = format!("({name}:sink)");
    let ns = |t: &str| -> Option<u64> {
        let p: Vec<&str> = t.split(':').collect();
        let (h, m): (u64, u64) = (p.first()?.parse().ok()?, p.get(1)?.parse().ok()?);
        let (s, f) = p.get(2)?.split_once('.')?;
        Some(((h * 60 + m) * 60 + s.parse::<u64>().ok()?) * 1_000_000_000 + f.parse::<u64>().ok()?)
    };
    lines
        .iter()
        .filter(|l| l.contains(&tag) && l.contains("chain"))
        .filter_map(|l| {
            let field = |k: &str| {
                l.split(", ")
                    .find_map(|f| f.trim().strip_prefix(k))
                    .map(|v| v.trim().to_string())
            };
            let pts = ns(&field("pts: ")?)?;
            let offset = field("offset: ")?.parse().ok()?;
            Some((offset, pts))
        })
        .collect()
}

/// Audio and video of one producer pipeline, each through its own gpushmsink, rendered by
/// one consumer pipeline (a syncing sink each): the offset between an audio and a video
/// buffer is the producer's, within 5 ms, with the producer on the default clock and on a
/// realtime system clock. Before, each gpushmsrc started its own stream at 0 (audio 27–50 ms
/// late).
#[test]
fn audio_and_video_of_one_producer_keep_their_offset() {
    init();
    let _g = serial();
    for realtime in [false, true] {
        let dir = tmpdir();
        let (a, v) = (dir.path().join("a.sock"), dir.path().join("v.sock"));
        let producer = gst::parse::launch(&format!(
            "audiotestsrc is-live=true samplesperbuffer=480 num-buffers=400 ! audio/x-raw,rate=48000,channels=1 \
             ! gpushmsink name=as socket-path={} \
             videotestsrc is-live=true num-buffers=120 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
             ! gpushmsink name=vs socket-path={}",
            a.display(),
            v.display()
        ))
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
        if realtime {
            let clock = gst::glib::Object::builder::<gst::SystemClock>()
                .property("clock-type", gst::ClockType::Realtime)
                .build();
            producer.use_clock(Some(&clock));
        }
        // The producer's running time of each buffer, by offset, as its sinks get them.
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(bool, u64, u64)>::new()));
        for (name, is_audio) in [("as", true), ("vs", false)] {
            let pad = producer.by_name(name).unwrap().static_pad("sink").unwrap();
            let seen = seen.clone();
            pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
                if let Some(b) = info.buffer() {
                    if let Some(p) = b.pts() {
                        seen.lock()
                            .unwrap()
                            .push((is_audio, b.offset(), p.nseconds()));
                    }
                }
                gst::PadProbeReturn::Ok
            });
        }
        producer.set_state(gst::State::Playing).unwrap();
        wait_for_path(&a, Duration::from_secs(10));
        wait_for_path(&v, Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(500));
        // -v (before the pipeline) prints each fakesink's last-message.
        let mut c = gst_launch_program();
        c.arg("-v").args(
            format!(
                "gpushmsrc socket-path={} ! fakesink name=asink silent=false sync=true \
                 gpushmsrc socket-path={} ! fakesink name=vsink silent=false sync=true",
                a.display(),
                v.display()
            )
            .split_whitespace(),
        );
        with_plugin_path(&mut c);
        let c = Proc::spawn(c, "consumer");
        // The producer ends after 4 s (400 x 10 ms of audio): consumers get EOS.
        let bus = producer.bus().unwrap();
        let _ = bus.timed_pop_filtered(gst::ClockTime::from_seconds(20), &[gst::MessageType::Eos]);
        let (_, out) = c.finish(Duration::from_secs(20));
        producer.set_state(gst::State::Null).unwrap();
        let (audio, video) = (sink_buffers(&out, "asink"), sink_buffers(&out, "vsink"));
        assert!(
            audio.len() > 50 && video.len() > 20,
            "{} {}\n{out:?}",
            audio.len(),
            video.len()
        );
        let seen = seen.lock().unwrap();
        let producer_pts = |audio: bool, offset: u64| {
            seen.iter()
                .find(|s| s.0 == audio && s.1 == offset)
                .map(|s| s.2 as i64)
                .unwrap_or_else(|| panic!("offset {offset} never reached the producer's sink"))
        };
        // Several pairs: each consumer offset between an audio and a video buffer is the
        // producer's.
        for (i, (vo, vp)) in video.iter().enumerate().step_by(5) {
            let (ao, ap) = audio[(i * 3).min(audio.len() - 1)];
            let consumer = *vp as i64 - ap as i64;
            let prod = producer_pts(false, *vo) - producer_pts(true, ao);
            assert!(
                (consumer - prod).abs() <= 5_000_000,
                "realtime {realtime}: video {vo} vs audio {ao}: {consumer} ns in the consumer, {prod} ns in the producer"
            );
        }
    }
}

/// Live audio through gpushm for 20 s, in two consumer pipelines of this process: one started
/// before the producer, one joining it 2 s in. `audiorate tolerance=0` adds and drops no
/// sample in either (the consumer's segment starts at its first buffer), and every PTS follows
/// the one before by exactly its buffer's duration, the producer's spacing (at any publish
/// jitter). Before, the late joiner's stream began a few ms into its segment (audiorate filled
/// them: hundreds of samples) and publish jitter under load moved PTS by milliseconds.
#[test]
fn live_audio_stays_sample_exact_joined_from_the_start_and_late() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("audio.sock");
    // 940 buffers of 1024 samples at 48 kHz: 20 s.
    const BUFFERS: usize = 940;
    let consumer = || {
        let p = gst::parse::launch(&format!(
            "gpushmsrc name=src socket-path={} timeout=30000000000 num-buffers={BUFFERS} \
             ! audiorate name=rate tolerance=0 ! fakesink sync=false",
            sock.display()
        ))
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, u64)>::new()));
        let pad = p.by_name("src").unwrap().static_pad("src").unwrap();
        let s = seen.clone();
        pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if let Some(b) = info.buffer() {
                s.lock().unwrap().push((
                    b.pts().map_or(u64::MAX, |t| t.nseconds()),
                    b.duration().map_or(u64::MAX, |t| t.nseconds()),
                ));
            }
            gst::PadProbeReturn::Ok
        });
        p.set_state(gst::State::Playing).unwrap();
        (p, seen)
    };
    let from_start = consumer();
    std::thread::sleep(Duration::from_millis(500));
    let _producer = producer(
        "audiotestsrc is-live=true num-buffers=1100 ! audio/x-raw,format=S16LE,rate=48000,channels=1 \
         ! gpushmsink socket-path={sock}",
        &sock,
    );
    std::thread::sleep(Duration::from_secs(2));
    let late = consumer();
    for (name, (p, seen)) in [("from the start", from_start), ("joined late", late)] {
        let msg = p.bus().unwrap().timed_pop_filtered(
            gst::ClockTime::from_seconds(60),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        );
        assert!(
            matches!(
                msg.as_ref().map(|m| m.view()),
                Some(gst::MessageView::Eos(_))
            ),
            "{name}: {msg:?}"
        );
        let rate = p.by_name("rate").unwrap();
        let (added, dropped) = (rate.property::<u64>("add"), rate.property::<u64>("drop"));
        p.set_state(gst::State::Null).unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), BUFFERS, "{name}");
        assert_eq!(
            (added, dropped),
            (0, 0),
            "{name}: samples audiorate added and dropped"
        );
        for (i, w) in seen.windows(2).enumerate() {
            assert_eq!(
                w[1].0 - w[0].0,
                w[0].1,
                "{name}: buffer {i} at {} lasts {} but the next is at {}",
                w[0].0,
                w[0].1,
                w[1].0
            );
        }
    }
}

/// The first consumer of a live wait-for-connection producer, started 1 s after it, a
/// default consumer (mode=auto, leaky for live raw video): it gets all 90 frames, none
/// dropped, with the producer's exact spacing, ten runs in a row; and twice more with
/// mode=leaky. The source's backlog comes in a burst when it connects; before, the leaky
/// consumer lost 12 to 32 of them.
#[test]
fn the_first_consumer_of_a_live_wait_for_connection_producer_gets_every_frame() {
    init();
    let _g = serial();
    for run in 0..12 {
        let mode = if run < 10 { "mode=auto" } else { "mode=leaky" };
        let dir = tmpdir();
        let sock = dir.path().join("first.sock");
        let p = producer(
            "videotestsrc is-live=true num-buffers=90 ! video/x-raw,format=I420,width=320,height=240,framerate=30/1 \
             ! gpushmsink socket-path={sock} wait-for-connection=true",
            &sock,
        );
        std::thread::sleep(Duration::from_secs(1));
        let (cs, out) =
            checker(&sock, &["--exact-pts", "--src-props", mode]).finish(Duration::from_secs(30));
        let (ps, pout) = p.finish(Duration::from_secs(30));
        assert!(ps.success() && cs.success(), "{pout:?}\n{out:?}");
        let s = fields(&out, "SUMMARY ");
        assert_eq!(num(&s, "frames"), 90.0, "run {run}, {mode}: {out:?}");
        assert_eq!(num(&s, "dropped"), 0.0, "run {run}, {mode}: {out:?}");
        assert_eq!(num(&s, "pts_errors"), 0.0, "run {run}, {mode}: {out:?}");
    }
}

/// The same with a syncing default consumer, four runs started before the producer (it
/// connects while the producer's first frame waits for it, tens of ms late) and four started
/// 300 ms after it: all 60 frames, none dropped. Its sink holds more frames while it plays
/// the late start out (and for the latency it answered for it); served as leaky from the
/// first frame on time, it lost a frame in about half the runs (59 of 60, frame 2 or 5
/// taken back by the producer while the consumer's queue was full).
#[test]
fn a_syncing_first_consumer_of_a_live_wait_for_connection_producer_gets_every_frame() {
    init();
    let _g = serial();
    for run in 0..8 {
        let dir = tmpdir();
        let sock = dir.path().join("first-sync.sock");
        let pipeline = "videotestsrc is-live=true num-buffers=60 \
             ! video/x-raw,format=I420,width=320,height=240,framerate=30/1 \
             ! gpushmsink socket-path={sock} wait-for-connection=true";
        let (c, p) = if run < 4 {
            let c = checker(&sock, &["--sync", "--exact-pts"]);
            let p = Proc::spawn(
                gst_launch(&pipeline.replace("{sock}", sock.to_str().unwrap())),
                "producer",
            );
            (c, p)
        } else {
            let p = producer(pipeline, &sock);
            std::thread::sleep(Duration::from_millis(300));
            (checker(&sock, &["--sync", "--exact-pts"]), p)
        };
        let (cs, out) = c.finish(Duration::from_secs(30));
        let (ps, pout) = p.finish(Duration::from_secs(30));
        assert!(ps.success() && cs.success(), "{pout:?}\n{out:?}");
        let s = fields(&out, "SUMMARY ");
        let summary = out.iter().find(|l| l.starts_with("SUMMARY"));
        assert_eq!(num(&s, "frames"), 60.0, "run {run}: {summary:?}");
        assert_eq!(num(&s, "dropped"), 0.0, "run {run}: {summary:?}");
        assert_eq!(num(&s, "pts_errors"), 0.0, "run {run}: {summary:?}");
    }
}

/// A live producer that stalls for 400 ms (its source blocked once, then catching up in a
/// burst), read by a lossless consumer started before it (the producer waits for it: a
/// consumer polling for the socket may connect after the first frames, which on GStreamer
/// 1.26 come sooner than on 1.22): every frame arrives with the
/// producer's exact spacing, those after the stall late, and the latency the consumer answers
/// grows to cover them (the 5 ms it answers for a stream on time, before as after the stall
/// without this). What gives is latency, not spacing.
#[test]
fn a_stalled_live_producer_keeps_its_spacing_and_its_consumer_answers_the_latency() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("stall.sock");
    let consumer = checker(&sock, &["--exact-pts", "--src-props", "mode=lossless"]);
    std::thread::sleep(Duration::from_secs(1));
    let producer = gst::parse::launch(&format!(
        "videotestsrc name=src is-live=true num-buffers=90 \
         ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
         ! gpushmsink socket-path={} wait-for-connection=true",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let pad = producer.by_name("src").unwrap().static_pad("src").unwrap();
    let n = std::sync::atomic::AtomicU32::new(0);
    pad.add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        if n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 29 {
            std::thread::sleep(Duration::from_millis(400));
        }
        gst::PadProbeReturn::Ok
    });
    producer.set_state(gst::State::Playing).unwrap();
    let msg = producer.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    let (cs, out) = consumer.finish(Duration::from_secs(30));
    producer.set_state(gst::State::Null).unwrap();
    assert!(
        matches!(
            msg.as_ref().map(|m| m.view()),
            Some(gst::MessageView::Eos(_))
        ),
        "{msg:?}"
    );
    assert!(cs.success(), "{out:?}");
    let s = fields(&out, "SUMMARY ");
    assert_eq!(num(&s, "frames"), 90.0, "{out:?}");
    assert_eq!(num(&s, "pts_errors"), 0.0, "{out:?}");
    let latency = num(&s, "src_latency_ns");
    assert!(
        (300e6..=1.01e9).contains(&latency),
        "the consumer answers {latency} ns of latency after a 400 ms stall: {out:?}"
    );
}

/// A producer that is not live whose first buffer lies 30 s ahead (videotestsrc
/// timestamp-offset), flat out into a wait-for-connection gpushmsink: its consumer gets PTS
/// 0, 33.3 and 66.7 ms. Before, the first frame was brought back below 0 and clamped there
/// while the mapping kept the lower value: 0, 29.2, 62.6 ms (issue 50).
#[test]
fn a_producer_far_ahead_is_brought_back_to_0_with_its_spacing() {
    init();
    let _g = serial();
    for run in 0..3 {
        let dir = tmpdir();
        let sock = dir.path().join("ahead.sock");
        let p = producer(
            "videotestsrc num-buffers=3 timestamp-offset=30000000000 \
             ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
             ! gpushmsink socket-path={sock} sync=false wait-for-connection=true",
            &sock,
        );
        let (cs, out) = checker(&sock, &[]).finish(Duration::from_secs(30));
        let (ps, pout) = p.finish(Duration::from_secs(30));
        assert!(ps.success() && cs.success(), "{pout:?}\n{out:?}");
        assert_eq!(
            frame_pts(&out),
            vec![0, 33_333_333, 66_666_666],
            "run {run}: {out:?}"
        );
    }
}
