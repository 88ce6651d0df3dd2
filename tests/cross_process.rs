// SPDX-License-Identifier: MPL-2.0
//! Two real processes: a producer and a consumer, started with exec (never fork), checked by
//! frame contents, timestamps and the caps the consumer negotiated without being given any.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// The producer renders a pattern that depends on the frame number into gpushmsink's pool;
/// the consumer (`gpushmsrc ! appsink`, no caps) checks every byte of every frame and the PTS
/// spacing.
fn pattern_run(width: u32, height: u32, frames: u64) {
    let dir = tmpdir();
    let sock = dir.path().join("pattern.sock");
    let shm_before = dev_shm();
    let mut producer = example("pattern_producer");
    producer.args(["--socket", sock.to_str().unwrap(), "--fps", "0", "--wait"]);
    producer.args([
        "--width",
        &width.to_string(),
        "--height",
        &height.to_string(),
        "--frames",
        &frames.to_string(),
    ]);
    let producer = Proc::spawn(producer, "pattern_producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut consumer = example("frame_checker");
    consumer.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--expect",
        &frames.to_string(),
    ]);
    let consumer = Proc::spawn(consumer, "frame_checker");
    let (cs, cout) = consumer.finish(Duration::from_secs(240));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(cs.success(), "consumer failed:\n{}", cout.join("\n"));
    assert!(ps.success(), "producer failed:\n{}", pout.join("\n"));
    let s = fields(&cout, "SUMMARY ");
    assert_eq!(num(&s, "frames"), frames as f64);
    assert_eq!(num(&s, "bad"), 0.0, "frames with a wrong byte");
    assert_eq!(
        num(&s, "pts_errors"),
        0.0,
        "PTS not spaced by the frame duration"
    );
    assert_eq!(num(&s, "gaps"), 0.0);
    assert_eq!(
        (num(&s, "first"), num(&s, "last")),
        (0.0, (frames - 1) as f64)
    );
    let caps: Vec<_> = cout.iter().filter(|l| l.starts_with("CAPS ")).collect();
    assert_eq!(caps.len(), 1, "{caps:?}");
    assert!(
        caps[0].contains("format=(string)NV12")
            && caps[0].contains(&format!("width=(int){width}"))
            && caps[0].contains(&format!("height=(int){height}")),
        "consumer negotiated {}",
        caps[0]
    );
    let st = fields(&pout, "STATS ");
    assert_eq!(num(&st, "frames-sent"), frames as f64);
    assert_eq!(
        num(&st, "frames-copied"),
        0.0,
        "the producer rendered into the pool: nothing to copy"
    );
    assert_eq!(dev_shm(), shm_before, "nothing of ours in /dev/shm");
}

/// `wait-for-clients`: a producer at 30 fps told to wait for two consumers holds its first
/// frame until the second connects, a second after the first, and both get every frame,
/// checked byte for byte from frame 0. Waiting for one (the default), the late one misses
/// the frames made before it came.
#[test]
fn wait_for_clients_gives_every_consumer_started_with_the_producer_the_first_frame() {
    for (clients, late_gets_all) in [(2, true), (1, false)] {
        let dir = tmpdir();
        let sock = dir.path().join("wait.sock");
        let mut producer = example("pattern_producer");
        producer.args([
            "--socket",
            sock.to_str().unwrap(),
            "--fps",
            "30",
            "--pace",
            "--wait",
        ]);
        producer.args(["--width", "320", "--height", "240", "--frames", "60"]);
        producer.args(["--sink-prop", &format!("wait-for-clients={clients}")]);
        let producer = Proc::spawn(producer, "pattern_producer");
        wait_for_path(&sock, Duration::from_secs(10));
        let consumer = || {
            let mut c = example("frame_checker");
            c.args(["--socket", sock.to_str().unwrap(), "--verify", "--lossless"]);
            Proc::spawn(c, "frame_checker")
        };
        let first = consumer();
        std::thread::sleep(Duration::from_secs(1));
        let late = consumer();
        let (fs, fout) = first.finish(Duration::from_secs(60));
        let (ls, lout) = late.finish(Duration::from_secs(60));
        let (ps, pout) = producer.finish(Duration::from_secs(30));
        assert!(ps.success(), "producer failed:\n{}", pout.join("\n"));
        assert!(fs.success(), "first consumer failed:\n{}", fout.join("\n"));
        assert!(ls.success(), "late consumer failed:\n{}", lout.join("\n"));
        let f = fields(&fout, "SUMMARY ");
        let l = fields(&lout, "SUMMARY ");
        assert_eq!(
            (num(&f, "frames"), num(&f, "first"), num(&f, "bad")),
            (60.0, 0.0, 0.0)
        );
        assert_eq!(num(&l, "bad"), 0.0);
        if late_gets_all {
            assert_eq!(
                (num(&l, "frames"), num(&l, "first")),
                (60.0, 0.0),
                "wait-for-clients={clients}"
            );
        } else {
            // A second at 30 fps: about 30 frames went out before it connected.
            assert!(
                num(&l, "first") >= 10.0,
                "wait-for-clients=1: the late one started at {l:?}"
            );
        }
    }
}

/// `wait-for-connection` on a live producer: a consumer that connected before the first frame
/// (the producer was still starting) and then takes no frame for a while (stopped here for
/// 1.3 s around the first frame; a consumer mapping a device ring spends hundreds of ms
/// creating its CUDA context) still gets every frame, although the live stream's max-wait is
/// 40 ms. (It lost the first ones before: a consumer connected before the first frame was not
/// waited for as one the producer waited for is, and once the producer had fallen 200 ms
/// behind, neither was.)
#[test]
fn wait_for_connection_waits_for_a_consumer_still_setting_up_at_the_first_frame() {
    let dir = tmpdir();
    let sock = dir.path().join("early.sock");
    let mut producer = example("pattern_producer");
    producer.args([
        "--socket",
        sock.to_str().unwrap(),
        "--fps",
        "30",
        "--pace",
        "--wait",
    ]);
    // The first frame is due 1.5 s after the producer starts: the consumer is there before.
    producer.args([
        "--width",
        "320",
        "--height",
        "240",
        "--schedule",
        "p1500,30x45",
    ]);
    let producer = Proc::spawn(producer, "pattern_producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut c = example("frame_checker");
    c.args(["--socket", sock.to_str().unwrap(), "--verify", "--lossless"]);
    let consumer = Proc::spawn(c, "frame_checker");
    std::thread::sleep(Duration::from_millis(700));
    let pid = nix::unistd::Pid::from_raw(consumer.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    nix::sys::signal::kill(pid, nix::sys::signal::SIGCONT).unwrap();
    let (cs, cout) = consumer.finish(Duration::from_secs(60));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "producer failed:\n{}", pout.join("\n"));
    assert!(cs.success(), "consumer failed:\n{}", cout.join("\n"));
    let f = fields(&cout, "SUMMARY ");
    assert_eq!(
        (num(&f, "frames"), num(&f, "first"), num(&f, "bad")),
        (45.0, 0.0, 0.0),
        "{}",
        cout.join("\n")
    );
}

/// A lossless gpushmsrc of a producer that is not live, whose downstream keeps its last frame
/// (fakesink, as most sinks) and whose budget keeps one frame zero-copy (4 slots): the frame
/// it gets next can be zero-copy only once downstream has the one after. gpushmsrc used to
/// wait 20 ms for downstream to hand one back before every other frame (2000 small frames
/// took 20 s). It now stops waiting once waiting does not help, for 1 s, then twice as long
/// each time: however slow the machine, a handful of waits in vain in the whole run (its
/// debug log says each), where every other frame had one.
#[test]
fn a_consumer_whose_sink_keeps_its_last_frame_is_not_held_up_every_other_frame() {
    const FRAMES: u32 = 2000;
    let dir = tmpdir();
    let sock = dir.path().join("last.sock");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc num-buffers={FRAMES} ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
             ! gpushmsink socket-path={} slots=4 wait-for-connection=true sync=false",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let mut consumer = gst_launch(&format!(
        "gpushmsrc socket-path={} mode=lossless num-buffers={FRAMES} ! fakesink sync=false",
        sock.display()
    ));
    consumer
        .env("GST_DEBUG", "gpushmsrc:5")
        .env("GST_DEBUG_NO_COLOR", "1");
    let (cs, cout) = Proc::spawn(consumer, "consumer").finish(Duration::from_secs(120));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(
        cs.success() && ps.success(),
        "{}\n{}",
        cout.join("\n"),
        pout.join("\n")
    );
    let futile = cout
        .iter()
        .filter(|l| l.contains("handed no frame back"))
        .count();
    // At least the first wait is tried; at most 7 fit in the 120 s the run may take
    // (1 + 2 + 4 + 8 + 16 + 32 s between them, then every 32 s).
    assert!(
        (1..=7).contains(&futile),
        "{futile} waits in vain for downstream in {FRAMES} frames"
    );
}

#[test]
fn nv12_1080p_500_frames_between_processes() {
    pattern_run(1920, 1080, 500);
}

#[test]
fn nv12_4k_500_frames_between_processes() {
    pattern_run(3840, 2160, 500);
}

/// Releases wake nobody unless the producer waits for a slot. With two slots and a lossless
/// consumer, a producer flat out waits for a slot again and again, and must be woken by the
/// release it waits for, not by its connection thread's 100 ms round: 2000 small frames take
/// a second or two here, and minutes without those wake-ups. Through gpushmsink's pool
/// (upstream waits in the pool, render waits for the lossless consumer) and through the
/// GStreamer-free Publisher.
#[test]
fn a_flat_out_producer_with_two_slots_is_woken_by_each_release() {
    const FRAMES: u64 = 2000;
    let size = ["--width", "64", "--height", "48", "--format", "GRAY8"];
    let frames = FRAMES.to_string();
    let limit = Duration::from_secs(20);

    let dir = tmpdir();
    let sock = dir.path().join("sink.sock");
    let mut producer = example("pattern_producer");
    producer.args(["--socket", sock.to_str().unwrap(), "--fps", "0", "--wait"]);
    producer.args(["--slots", "2", "--frames", &frames]);
    producer.args(size);
    let producer = Proc::spawn(producer, "pattern_producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut consumer = example("frame_checker");
    consumer.args(["--socket", sock.to_str().unwrap(), "--verify", "--lossless"]);
    consumer.args(["--expect", &frames]);
    let t = Instant::now();
    let (cs, cout) = Proc::spawn(consumer, "frame_checker").finish(Duration::from_secs(90));
    let took = t.elapsed();
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(
        cs.success() && ps.success(),
        "{}\n{}",
        cout.join("\n"),
        pout.join("\n")
    );
    let s = fields(&cout, "SUMMARY ");
    assert_eq!(num(&s, "frames"), FRAMES as f64);
    assert_eq!(num(&s, "bad"), 0.0);
    assert_eq!(num(&s, "dropped"), 0.0);
    assert!(took < limit, "gpushmsink: {FRAMES} frames took {took:?}");

    let sock = dir.path().join("camera.sock");
    let mut camera = example("synthetic_camera");
    camera.args([
        "--socket",
        sock.to_str().unwrap(),
        "--wait",
        "--fps",
        "1000000",
    ]);
    camera.args(["--slots", "2", "--frames", &frames]);
    camera.args(size);
    let camera = Proc::spawn(camera, "synthetic_camera");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut sums = example("plane_sums");
    sums.args(["--socket", sock.to_str().unwrap(), "--verify", "--lossless"]);
    let t = Instant::now();
    let (ss, sout) = Proc::spawn(sums, "plane_sums").finish(Duration::from_secs(90));
    let took = t.elapsed();
    let (cs, cout) = camera.finish(Duration::from_secs(30));
    assert!(
        ss.success() && cs.success(),
        "{}\n{}",
        sout.join("\n"),
        cout.join("\n")
    );
    let got: Vec<&String> = sout.iter().filter(|l| l.starts_with("FRAME ")).collect();
    assert_eq!(got.len() as u64, FRAMES);
    assert!(got.iter().all(|l| l.ends_with("ok=true")));
    assert!(took < limit, "Publisher: {FRAMES} frames took {took:?}");
}

/// The copy path also delivers correct frames, and counts its copies.
#[test]
fn foreign_buffers_are_copied_once_and_counted() {
    let dir = tmpdir();
    let sock = dir.path().join("copy.sock");
    let mut producer = example("pattern_producer");
    producer.args([
        "--socket",
        sock.to_str().unwrap(),
        "--fps",
        "0",
        "--wait",
        "--copy",
    ]);
    producer.args(["--width", "640", "--height", "480", "--frames", "60"]);
    let producer = Proc::spawn(producer, "pattern_producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut consumer = example("frame_checker");
    consumer.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--expect",
        "60",
    ]);
    let (cs, cout) = Proc::spawn(consumer, "frame_checker").finish(Duration::from_secs(60));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(
        cs.success() && ps.success(),
        "{}\n{}",
        cout.join("\n"),
        pout.join("\n")
    );
    assert_eq!(num(&fields(&cout, "SUMMARY "), "bad"), 0.0);
    let st = fields(&pout, "STATS ");
    assert_eq!(num(&st, "frames-copied"), 60.0);
}

fn live_producer(sock: &std::path::Path) -> Proc {
    let p = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true ! video/x-raw,format=NV12,width=320,height=240,framerate=100/1 ! gpushmsink socket-path={}",
            sock.display()
        )),
        "gst-launch producer",
    );
    wait_for_path(sock, Duration::from_secs(10));
    p
}

fn printing_consumer(sock: &std::path::Path) -> Proc {
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--print",
        "--no-reconnect",
    ]);
    Proc::spawn(c, "frame_checker")
}

#[test]
fn producer_killed_consumer_errors_within_a_second() {
    let dir = tmpdir();
    let sock = dir.path().join("kill-producer.sock");
    let shm_before = dev_shm();
    let mut producer = live_producer(&sock);
    let mut consumer = printing_consumer(&sock);
    consumer.wait_line("FRAME ", Duration::from_secs(10));
    producer.kill9();
    let killed = Instant::now();
    let (status, out) = consumer.finish(Duration::from_secs(5));
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the consumer took {took:?} to notice"
    );
    assert_eq!(
        status.code(),
        Some(2),
        "the consumer reports an error:\n{}",
        out.join("\n")
    );
    assert!(
        out.iter().any(|l| l.contains("went away")),
        "readable error:\n{}",
        out.join("\n")
    );
    assert_eq!(dev_shm(), shm_before, "nothing of ours in /dev/shm");
}

#[test]
fn consumer_killed_producer_keeps_serving_others() {
    let dir = tmpdir();
    let sock = dir.path().join("kill-consumer.sock");
    let shm_before = dev_shm();
    let mut producer = live_producer(&sock);
    let mut survivor = printing_consumer(&sock);
    let mut victim = printing_consumer(&sock);
    victim.wait_line("FRAME ", Duration::from_secs(10));
    survivor.wait_line("FRAME ", Duration::from_secs(10));
    victim.kill9();
    let (_, _) = victim.finish(Duration::from_secs(5));
    // The survivor keeps receiving, and a newcomer connects and gets frames.
    for _ in 0..20 {
        survivor.wait_line("FRAME ", Duration::from_secs(2));
    }
    let mut newcomer = example("frame_checker");
    newcomer.args(["--socket", sock.to_str().unwrap(), "--frames", "30"]);
    let (status, out) = Proc::spawn(newcomer, "newcomer").finish(Duration::from_secs(20));
    assert!(status.success(), "{}", out.join("\n"));
    assert_eq!(num(&fields(&out, "SUMMARY "), "frames"), 30.0);
    assert!(
        producer.is_running(),
        "the producer survived a consumer's kill -9"
    );
    producer.kill9();
    assert_eq!(dev_shm(), shm_before, "nothing of ours in /dev/shm");
}

#[test]
fn producer_restarts_on_a_stale_socket() {
    let dir = tmpdir();
    let sock = dir.path().join("restart.sock");
    let mut first = live_producer(&sock);
    first.kill9();
    let _ = first.finish(Duration::from_secs(5));
    assert!(sock.exists(), "kill -9 leaves the socket file behind");
    let _second = live_producer(&sock);
    let mut c = example("frame_checker");
    c.args(["--socket", sock.to_str().unwrap(), "--frames", "10"]);
    let (status, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(20));
    assert!(status.success(), "{}", out.join("\n"));
}

#[test]
fn second_live_producer_on_the_same_path_is_an_error() {
    let dir = tmpdir();
    let sock = dir.path().join("busy.sock");
    let _first = live_producer(&sock);
    let second = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc num-buffers=10 ! gpushmsink socket-path={}",
            sock.display()
        )),
        "second producer",
    );
    let (status, out) = second.finish(Duration::from_secs(10));
    assert!(!status.success());
    assert!(
        out.iter().any(|l| l.contains("already serving")),
        "{}",
        out.join("\n")
    );
}

/// The command-line use from the README: both sides are gst-launch-1.0, the consumer gives no
/// caps, and EOS travels from the producer to the consumer.
#[test]
fn gst_launch_on_both_sides() {
    let dir = tmpdir();
    let sock = dir.path().join("cli.sock");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc num-buffers=120 ! video/x-raw,format=I420,width=320,height=240,framerate=30/1 ! gpushmsink wait-for-connection=true socket-path={}",
            sock.display()
        )),
        "gst-launch producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let consumer = Proc::spawn(
        gst_launch(&format!(
            "gpushmsrc lossless=true socket-path={} ! videoconvert ! fakesink",
            sock.display()
        )),
        "gst-launch consumer",
    );
    let (cs, cout) = consumer.finish(Duration::from_secs(30));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(cs.success(), "consumer:\n{}", cout.join("\n"));
    assert!(ps.success(), "producer:\n{}", pout.join("\n"));
}

/// The Python example (PyGObject) reads frames from a Rust producer process: the seed frame
/// sums to 136 in Python too.
/// The first interpreter with PyGObject: Debian's (python3-gi) may sit behind another python3
/// on PATH (pyenv, venv). scripts/install-deps.sh installs it.
fn python_with_gi() -> &'static str {
    ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|py| {
            std::process::Command::new(py)
                .args(["-c", "import gi; gi.require_version('GstApp', '1.0')"])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .expect("a python3 with PyGObject (python3-gi, gir1.2-gst-plugins-base-1.0): run scripts/install-deps.sh")
}

/// Without a producer the Python example says why and leaves no GStreamer-CRITICAL behind
/// (it sets its pipeline to NULL on every path).
#[test]
fn python_consumer_without_producer_fails_cleanly() {
    let dir = tmpdir();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/consumer.py");
    let mut py = std::process::Command::new(python_with_gi());
    with_plugin_path(&mut py);
    py.arg(script).args([
        dir.path().join("nobody").to_str().unwrap(),
        "5",
        "--timeout",
        "0.2",
    ]);
    let (status, out) = Proc::spawn(py, "consumer.py").finish(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{}", out.join("\n"));
    assert!(
        out.iter()
            .any(|l| l.starts_with("error: Could not connect") && l.contains("nobody")),
        "{}",
        out.join("\n")
    );
    assert!(
        !out.iter().any(|l| l.contains("CRITICAL")),
        "{}",
        out.join("\n")
    );
}

#[test]
fn python_consumer_reads_the_seed_frames() {
    let python = python_with_gi();
    let dir = tmpdir();
    let sock = dir.path().join("py.sock");
    let producer = seed_producer(&sock, 5);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/consumer.py");
    let mut py = std::process::Command::new(python);
    with_plugin_path(&mut py);
    py.arg(script)
        .args([sock.to_str().unwrap(), "5", "--lossless"]);
    let (status, out) = Proc::spawn(py, "consumer.py").finish(Duration::from_secs(30));
    let _ = producer.finish(Duration::from_secs(10));
    assert!(status.success(), "{}", out.join("\n"));
    let lines: Vec<&String> = out.iter().filter(|l| l.starts_with("frame ")).collect();
    assert_eq!(lines.len(), 5, "{}", out.join("\n"));
    for l in lines {
        assert!(l.contains("4x4") && l.ends_with("bytes=16 sum=136"), "{l}");
    }
}

/// The Rust consumer example prints each frame's plane sums: the seed frame sums to 136.
#[test]
fn rust_consumer_prints_per_frame_sums() {
    let dir = tmpdir();
    let sock = dir.path().join("sums.sock");
    let producer = seed_producer(&sock, 3);
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--lossless",
        "--print",
        "--expect",
        "3",
    ]);
    let (status, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(30));
    let _ = producer.finish(Duration::from_secs(10));
    assert!(status.success(), "{}", out.join("\n"));
    let frames: Vec<&String> = out.iter().filter(|l| l.starts_with("FRAME ")).collect();
    assert_eq!(frames.len(), 3);
    for l in frames {
        assert!(l.contains(" plane_sums=136 "), "{l}");
    }
}

/// The smallest app example (examples/app_consumer.rs) receives frames from a live producer
/// and prints them: format, size and content as sent (white GRAY8 is 235, video range).
#[test]
fn app_consumer_example_prints_the_frames() {
    let dir = tmpdir();
    let sock = dir.path().join("app.sock");
    let p = gst_launch(&format!(
        "videotestsrc is-live=true pattern=white num-buffers=300 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 ! gpushmsink socket-path={}",
        sock.display()
    ));
    let producer = Proc::spawn(p, "producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut c = example("app_consumer");
    c.args([sock.to_str().unwrap(), "5"]);
    let (status, out) = Proc::spawn(c, "app_consumer").finish(Duration::from_secs(30));
    drop(producer);
    assert!(status.success(), "{}", out.join("\n"));
    let frames: Vec<&String> = out.iter().filter(|l| l.starts_with("frame ")).collect();
    assert_eq!(frames.len(), 5, "{}", out.join("\n"));
    for l in frames {
        assert!(
            l.contains(": Gray8 64x48 ") && l.ends_with("bytes 3072 mean byte 235"),
            "{l}"
        );
    }
}
