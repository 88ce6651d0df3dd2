// SPDX-License-Identifier: MPL-2.0
//! Ordinary consumer pipelines, with real processes and the elements people use downstream:
//! encoders and muxers, queues with thresholds, sinks that sync (with an offset), apps that
//! batch samples, paused and frozen consumers, producers that are not live or run on another
//! clock. None of them may stall the stream or another consumer, and every frame they get is
//! checked byte for byte where the producer's pattern is known.

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

use gst::prelude::*;

/// These tests run real-time pipelines: one at a time, so that timing checks hold on a
/// 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// pattern_producer at `fps`, `frames` frames (0 = until killed) of 320x240 I420, waiting
/// for a consumer before the first frame.
fn pattern_producer(sock: &Path, fps: u32, frames: u32, extra: &[&str]) -> Proc {
    let mut p = example("pattern_producer");
    p.args(["--socket", sock.to_str().unwrap(), "--wait"]);
    p.args(["--fps", &fps.to_string(), "--frames", &frames.to_string()]);
    p.args(["--width", "320", "--height", "240", "--format", "I420"]);
    p.args(extra);
    let p = Proc::spawn(p, "pattern_producer");
    wait_for_path(sock, Duration::from_secs(10));
    p
}

fn checker(sock: &Path, extra: &[&str]) -> Proc {
    let mut c = example("frame_checker");
    c.args(["--socket", sock.to_str().unwrap()]);
    c.args(extra);
    Proc::spawn(c, "frame_checker")
}

/// Runs a producer of `frames` frames at 30 fps and a verifying consumer with `extra`
/// options to the end; returns the consumer's SUMMARY fields and all its output.
fn verified_run(
    frames: u32,
    producer_extra: &[&str],
    consumer_extra: &[&str],
) -> (std::collections::HashMap<String, String>, Vec<String>) {
    verified_run_at(30, frames, producer_extra, consumer_extra)
}

/// The same at `fps` (0: a producer that is not live, flat out).
fn verified_run_at(
    fps: u32,
    frames: u32,
    producer_extra: &[&str],
    consumer_extra: &[&str],
) -> (std::collections::HashMap<String, String>, Vec<String>) {
    let dir = tmpdir();
    let sock = dir.path().join("p.sock");
    let producer = pattern_producer(&sock, fps, frames, producer_extra);
    let mut args = vec!["--verify"];
    args.extend_from_slice(consumer_extra);
    let consumer = checker(&sock, &args);
    let (cs, cout) = consumer.finish(Duration::from_secs(60));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "producer failed:\n{}", pout.join("\n"));
    assert!(
        cs.success(),
        "consumer {consumer_extra:?} failed:\n{}",
        cout.join("\n")
    );
    (fields(&cout, "SUMMARY "), cout)
}

/// Demuxes a recording and returns its frame count (one H.264 access unit a frame) and its
/// duration.
fn frames_in_file(path: &Path) -> (u64, gst::ClockTime) {
    init();
    let demux = if path.extension().is_some_and(|e| e == "mp4") {
        "qtdemux"
    } else {
        "matroskademux"
    };
    let p = gst::parse::launch(&format!(
        "filesrc location={} ! {demux} ! h264parse ! video/x-h264,alignment=au ! appsink name=out sync=false",
        path.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let sink = p
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    let (mut n, mut first, mut end) = (0u64, None, gst::ClockTime::ZERO);
    while let Some(s) = sink.try_pull_sample(gst::ClockTime::from_seconds(10)) {
        let b = s.buffer().unwrap();
        n += 1;
        let pts = b.pts().expect("frames have timestamps");
        first.get_or_insert(pts);
        end = end.max(pts + b.duration().unwrap_or(gst::ClockTime::ZERO));
    }
    p.set_state(gst::State::Null).unwrap();
    (n, end - first.unwrap_or(gst::ClockTime::ZERO))
}

/// The README's recording example, verbatim (socket and file names aside), records every
/// frame of a live camera: lossless and leaky, into MP4 and Matroska. x264enc keeps dozens of
/// frames for its lookahead; the consumer copies what it keeps beyond its budget.
#[test]
fn readme_recording_example_records_every_frame() {
    let _serial = serial();
    init();
    let frames = 90;
    for (lossless, mux, ext) in [
        (true, "mp4mux", "mp4"),
        (false, "mp4mux", "mp4"),
        (true, "matroskamux", "mkv"),
        (false, "matroskamux", "mkv"),
    ] {
        let dir = tmpdir();
        let sock = dir.path().join("cam");
        let file = dir.path().join(format!("rec.{ext}"));
        let lossless_prop = if lossless { " lossless=true" } else { "" };
        // Started first: it waits for the producer (timeout, 5 s by default).
        let consumer = Proc::spawn(
            gst_launch(&format!(
                "gpushmsrc socket-path={}{lossless_prop} ! videoconvert ! x264enc ! {mux} ! filesink location={} -e",
                sock.display(),
                file.display()
            )),
            "recorder",
        );
        let producer = Proc::spawn(
            gst_launch(&format!(
                "videotestsrc is-live=true num-buffers={frames} ! video/x-raw,format=I420,width=640,height=480,framerate=30/1 ! gpushmsink socket-path={} wait-for-connection=true",
                sock.display()
            )),
            "camera",
        );
        let (ps, pout) = producer.finish(Duration::from_secs(30));
        assert!(ps.success(), "camera failed:\n{}", pout.join("\n"));
        // EOS crosses to the recorder, which finalizes its file and exits.
        let (cs, cout) = consumer.finish(Duration::from_secs(60));
        assert!(cs.success(), "recorder failed:\n{}", cout.join("\n"));
        let (n, duration) = frames_in_file(&file);
        let what = format!("{mux} lossless={lossless}");
        let log = format!("{}\n{}", cout.join("\n"), pout.join("\n"));
        if lossless {
            assert_eq!(n, frames, "{what}: frames recorded\n{log}");
        } else {
            assert!(
                n * 100 >= frames * 95,
                "{what}: {n} of {frames} frames\n{log}"
            );
        }
        let expect = gst::ClockTime::from_mseconds(frames * 1000 / 30);
        assert!(
            duration + gst::ClockTime::from_mseconds(100) >= expect
                && duration <= expect + gst::ClockTime::from_mseconds(100),
            "{what}: duration {duration}, expected {expect}"
        );
    }
}

/// Downstream elements that keep frames, a sink 1 s behind its clock, an app that batches 8
/// samples, and a 2-slot ring with a syncing sink: each gets at least 95 % of the frames of
/// a 30 fps producer, every byte right.
#[test]
fn downstream_that_holds_frames_never_stalls_the_stream() {
    let _serial = serial();
    let frames = 90u32;
    let cases: [(&str, &[&str], &[&str]); 5] = [
        (
            "queue min-threshold-buffers=20",
            &[],
            &["--chain", "queue min-threshold-buffers=20"],
        ),
        (
            "a sink with ts-offset=1s",
            &[],
            &["--sync", "--ts-offset", "1000000000"],
        ),
        (
            "an app batching 8 samples",
            &[],
            &["--batch", "8", "--max-buffers", "0"],
        ),
        ("slots=2 and a syncing sink", &["--slots", "2"], &["--sync"]),
        (
            "slots=2, lossless, a syncing sink",
            &["--slots", "2"],
            &["--sync", "--lossless"],
        ),
    ];
    for (what, p, c) in cases {
        let (s, out) = verified_run(frames, p, c);
        let n = num(&s, "frames");
        assert!(
            n * 100.0 >= frames as f64 * 95.0,
            "{what}: {n} of {frames} frames\n{}",
            out.join("\n")
        );
        assert_eq!(num(&s, "bad"), 0.0, "{what}: a frame with a wrong byte");
        assert_eq!(
            num(&s, "pts_errors"),
            0.0,
            "{what}: timestamps\n{}",
            out.join("\n")
        );
    }
}

fn frame_times(lines: &[String]) -> Vec<(u64, u64)> {
    lines
        .iter()
        .filter(|l| l.starts_with("FRAME "))
        .map(|l| {
            assert!(l.ends_with("ok=true"), "a bad frame: {l}");
            let f = fields(std::slice::from_ref(l), "FRAME ");
            (num(&f, "n") as u64, num(&f, "t") as u64)
        })
        .collect()
}

/// A lossless consumer frozen with SIGSTOP for 10 s and another whose app PAUSES it for
/// 10 s cost a lossless verifier at most one max-wait each, once: its longest gap between
/// frames stays under 100 ms, and it misses no frame. Both get stuck 5 s into the stream:
/// the producer waits for connection, and its first consumers get the start of the stream
/// whole (waited for up to 1 s a frame) until they have kept up for 1.5 s.
#[test]
fn stuck_lossless_consumers_cost_the_others_one_max_wait_once() {
    let _serial = serial();
    let dir = tmpdir();
    let sock = dir.path().join("stuck.sock");
    // 30 fps for about 20 s.
    let producer = pattern_producer(&sock, 30, 600, &[]);
    let mut verifier = checker(&sock, &["--verify", "--print", "--lossless"]);
    let mut frozen = checker(&sock, &["--lossless", "--print"]);
    let mut paused = checker(
        &sock,
        &[
            "--lossless",
            "--print",
            "--pause-at",
            "150",
            "--pause-ms",
            "10000",
        ],
    );
    verifier.wait_line("FRAME ", Duration::from_secs(20));
    frozen.wait_line("FRAME ", Duration::from_secs(20));
    paused.wait_line("PAUSED ", Duration::from_secs(20));
    let pid = nix::unistd::Pid::from_raw(frozen.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::SIGSTOP).unwrap();
    let stopped_at = now();
    std::thread::sleep(Duration::from_secs(10));
    nix::sys::signal::kill(pid, nix::sys::signal::SIGCONT).unwrap();
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "producer failed:\n{}", pout.join("\n"));
    let (vs, vout) = verifier.finish(Duration::from_secs(30));
    let (fs, fout) = frozen.finish(Duration::from_secs(30));
    let (pst, pauseout) = paused.finish(Duration::from_secs(30));
    for (what, st, out) in [
        ("verifier", vs, &vout),
        ("frozen", fs, &fout),
        ("paused", pst, &pauseout),
    ] {
        assert!(st.success(), "{what} failed:\n{}", out.join("\n"));
    }
    let frames = frame_times(&vout);
    assert!(frames.len() >= 580, "verifier got {} frames", frames.len());
    for w in frames.windows(2) {
        assert_eq!(
            w[1].0,
            w[0].0 + 1,
            "the verifier missed frames after {}",
            w[0].0
        );
    }
    let (at, gap) = frames
        .windows(2)
        .map(|w| (w[0].0, w[1].1 - w[0].1))
        .max_by_key(|x| x.1)
        .unwrap();
    assert!(
        gap < 100_000_000,
        "the verifier's longest gap was {} ms (after frame {at})",
        gap / 1_000_000
    );
    // The stuck ones really were skipped (lagging) and came back afterwards.
    let stats = fields(&pout, "STATS ");
    assert!(num(&stats, "frames-dropped") > 0.0, "{stats:?}");
    // Once: the frozen one lagged one time; the paused one gives frames back while paused and
    // never holds the producer up.
    assert_eq!(num(&stats, "times-lagged"), 1.0, "{stats:?}");
    let fz = frame_times(&fout);
    assert!(
        fz.iter().any(|&(_, t)| t > stopped_at + 10_000_000_000),
        "the frozen consumer received again after SIGCONT"
    );
    let pz = frame_times(&pauseout);
    let resumed = pauseout
        .iter()
        .find(|l| l.starts_with("RESUMED "))
        .map(|l| num(&fields(std::slice::from_ref(l), "RESUMED "), "t") as u64)
        .expect("the paused consumer resumed");
    assert!(
        pz.iter().filter(|&&(_, t)| t > resumed).count() > 10,
        "the paused consumer received again after PLAYING"
    );
}

fn now() -> u64 {
    gpushm::monotonic_ns()
}

/// `do-timestamp=true` with a syncing sink keeps the producer's rate: the latency answered
/// for buffers stamped on arrival is 0, not one frame.
#[test]
fn do_timestamp_with_a_syncing_sink_keeps_the_producers_rate() {
    let _serial = serial();
    let frames = 90u32;
    let (s, out) = verified_run(frames, &[], &["--sync", "--src-props", "do-timestamp=true"]);
    let n = num(&s, "frames");
    assert!(
        n * 100.0 >= frames as f64 * 95.0,
        "{n} of {frames}\n{}",
        out.join("\n")
    );
    let fps = num(&s, "fps");
    assert!(
        (28.5..=31.5).contains(&fps),
        "{fps} fps\n{}",
        out.join("\n")
    );
    assert_eq!(num(&s, "src_latency_ns"), 0.0);
}

/// A live producer on the monotonic clock keeps its spacing exactly; its frames are stamped
/// about when it published them (its timestamps plus its pipeline latency, see gpushm's
/// `time` module), so the latency answered is the way to us (5 ms), plus, in 10 ms steps, how
/// late its first frames came: they waited for this consumer to connect (wait-for-connection)
/// and keep their spacing.
#[test]
fn live_producer_keeps_its_spacing_and_answers_a_small_latency() {
    let _serial = serial();
    let dir = tmpdir();
    let sock = dir.path().join("live.sock");
    let consumer = checker(&sock, &["--sync", "--exact-pts"]);
    let producer = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true num-buffers=60 ! video/x-raw,format=I420,width=320,height=240,framerate=30/1 ! gpushmsink socket-path={} wait-for-connection=true",
            sock.display()
        )),
        "camera",
    );
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "{}", pout.join("\n"));
    let (cs, cout) = consumer.finish(Duration::from_secs(30));
    assert!(cs.success(), "{}", cout.join("\n"));
    let s = fields(&cout, "SUMMARY ");
    assert_eq!(num(&s, "frames"), 60.0, "{}", cout.join("\n"));
    assert_eq!(num(&s, "pts_errors"), 0.0);
    let latency = num(&s, "src_latency_ns");
    assert!(
        latency == 5e6 || (latency % 10e6 == 0.0 && (10e6..=1e9).contains(&latency)),
        "{latency} ns answered\n{}",
        cout.join("\n")
    );
    assert!(
        !cout.iter().any(|l| l.contains("timestamps are")),
        "no clock warning for a producer on our clock"
    );
}

/// A producer that is not live and renders with sync=false (a file read flat out) keeps its
/// own timestamps, ahead of real time: a syncing consumer plays them at their pace, with the
/// producer's exact spacing from the first frame (and, lossless, holds the producer to that
/// pace), as shmsrc does.
#[test]
fn non_live_producer_plays_at_its_timestamps_pace_in_a_syncing_consumer() {
    let _serial = serial();
    let dir = tmpdir();
    let sock = dir.path().join("nonlive.sock");
    let consumer = checker(&sock, &["--sync", "--exact-pts", "--lossless"]);
    let producer = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc num-buffers=60 ! video/x-raw,format=I420,width=320,height=240,framerate=30/1 ! gpushmsink socket-path={} sync=false wait-for-connection=true",
            sock.display()
        )),
        "file-like producer",
    );
    let t = Instant::now();
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "{}", pout.join("\n"));
    let (cs, cout) = consumer.finish(Duration::from_secs(30));
    assert!(cs.success(), "{}", cout.join("\n"));
    let s = fields(&cout, "SUMMARY ");
    assert_eq!(num(&s, "frames"), 60.0, "{}", cout.join("\n"));
    assert_eq!(num(&s, "pts_errors"), 0.0, "{}", cout.join("\n"));
    // 60 frames stamped 2 s apart in total play in about 2 s (process start-up aside).
    let took = t.elapsed();
    assert!(
        took > Duration::from_millis(1800) && took < Duration::from_secs(6),
        "played at another pace than its timestamps': {took:?}"
    );
}

/// A producer pipeline on CLOCK_REALTIME stamps frames about 56 years ahead of ours: it
/// publishes how its clock relates to CLOCK_MONOTONIC, and its frames play at its rate with
/// its exact spacing.
#[test]
fn realtime_clock_producer_plays_at_its_rate_with_its_spacing() {
    let _serial = serial();
    let frames = 60u32;
    let (s, out) = verified_run(
        frames,
        &["--realtime-clock"],
        &["--sync", "--exact-pts", "--lossless"],
    );
    assert_eq!(num(&s, "frames"), frames as f64, "{}", out.join("\n"));
    assert_eq!(num(&s, "pts_errors"), 0.0, "{}", out.join("\n"));
    let fps = num(&s, "fps");
    assert!(
        (28.5..=31.5).contains(&fps),
        "{fps} fps\n{}",
        out.join("\n")
    );
}

/// A lossless consumer slower than a producer that is not live (a file, flat out) holds the
/// producer to its pace and keeps every frame zero-copy: frames waiting in its own queue are
/// not copied, since the producer loses nothing by waiting.
#[test]
fn slow_lossless_consumer_of_a_non_live_producer_waits_instead_of_copying() {
    let _serial = serial();
    let (s, out) = verified_run_at(
        0,
        150,
        &[],
        &["--lossless", "--chain", "identity sleep-time=3000"],
    );
    assert_eq!(num(&s, "frames"), 150.0);
    assert_eq!(num(&s, "copied"), 0.0, "{}", out.join("\n"));
}

/// The same producer, with a downstream that keeps frames until it gets more (a queue with a
/// threshold, like an encoder's lookahead): the consumer waits once, then copies, and never
/// deadlocks.
#[test]
fn lossless_consumer_of_a_non_live_producer_copies_what_downstream_keeps() {
    let _serial = serial();
    let (s, out) = verified_run_at(
        0,
        150,
        &[],
        &["--lossless", "--chain", "queue min-threshold-buffers=20"],
    );
    assert_eq!(num(&s, "frames"), 150.0);
    assert_eq!(num(&s, "bad"), 0.0);
    assert!(num(&s, "copied") > 0.0, "{}", out.join("\n"));
}
