// SPDX-License-Identifier: MPL-2.0
//! The low-latency mode (`spin-us` on gpushmsrc, `ConnectOptions::spin`, Python's `spin_us`,
//! the C options' `spin_us`), with real producer processes whose cadence changes: every frame
//! arrives, complete and in order, through cadence changes, a pause of seconds and the end of
//! the stream, and a paused stream costs the consumer (almost) nothing. The producer's side
//! (gpushmsink `spin-us`, its wait for a lossless consumer's releases): every frame arrives,
//! and a stuck consumer costs it one poll. Not timed: latency and rates are measured by
//! `bench latency` and `bench tiny`.

mod common;
use common::*;
#[path = "common/fake_producer.rs"]
mod fake_producer;
use fake_producer::*;

use gst::prelude::*;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

/// 30 frames at 30 fps, 10 at 5 fps, 3 s of nothing, 60 at 60 fps, then EOS.
const SCHEDULE: &str = "30x30,5x10,p3000,60x60";
const FRAMES: u64 = 100;

/// Real-time pipelines: one at a time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn producer(sock: &std::path::Path) -> Proc {
    producer_with(sock, &["--schedule", SCHEDULE])
}

/// A 64x48 GRAY8 pattern_producer that waits for its first consumer, with `args` (its frame
/// rate, count, schedule, gpushmsink properties), started.
fn producer_with(sock: &std::path::Path, args: &[&str]) -> Proc {
    let p = Proc::spawn(producer_command(sock, args), "pattern_producer");
    wait_for_path(sock, Duration::from_secs(20));
    p
}

/// The command of [`producer_with`], to start as it is or as another user.
fn producer_command(sock: &std::path::Path, args: &[&str]) -> std::process::Command {
    let mut c = example("pattern_producer");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--format",
        "GRAY8",
        "--width",
        "64",
        "--height",
        "48",
        "--wait",
        // Lossless consumers are waited for up to a second, not one frame time: on busy cores
        // one can be that late now and then, and these tests count every frame (a test's own
        // max-wait, given in `args`, comes after and wins).
        "--sink-prop",
        "max-wait=1000000000",
    ]);
    c.args(args);
    c
}

/// frame_checker's SUMMARY: all `n` frames, every byte as drawn, no gap, PTS in order,
/// nothing dropped.
fn assert_every_frame(out: &[String], n: u64) -> std::collections::HashMap<String, String> {
    let f = fields(out, "SUMMARY ");
    assert_eq!(num(&f, "frames"), n as f64, "{out:?}");
    for k in ["bad", "gaps", "pts_errors", "dropped"] {
        assert_eq!(num(&f, k), 0.0, "{k}: {out:?}");
    }
    f
}

/// The low-latency mode's figures say it works: at least `min_caught` polls caught what they
/// waited for (none do without the mode), and at most `max_polls` polls ran (one per frame
/// or wait, at most). `what` is shown when they do not.
fn assert_polls(
    caught: f64,
    missed: f64,
    min_caught: u64,
    max_polls: u64,
    what: &impl std::fmt::Debug,
) {
    eprintln!("polls: {caught} caught, {missed} missed");
    assert!(
        caught >= min_caught as f64,
        "too few caught while polling: {what:?}"
    );
    assert!(
        caught + missed <= max_polls as f64,
        "more than one poll a frame: {what:?}"
    );
}

fn thread_cpu() -> Duration {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .expect("CLOCK_THREAD_CPUTIME_ID");
    Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32)
}

/// The Rust subscriber with a 2 ms budget: the frames' offsets are 0..100 in order (none lost
/// or repeated), the 3 s pause costs its thread under 50 ms of CPU (a poll that did not stop
/// at its budget would cost 3 s), frames are caught while polling (the mode works: without it
/// none are), and the ring is polled once per frame at most.
#[test]
fn subscriber_spin_follows_cadence_changes_and_a_pause_and_idles_for_free() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("spin.sock");
    let p = producer(&sock);
    let opts = gpushm::subscriber::ConnectOptions {
        mode: gpushm::policy::Delivery::Lossless,
        timeout: Duration::from_secs(20),
        spin: Duration::from_millis(2),
        ..Default::default()
    };
    let mut sub = gpushm::subscriber::Subscriber::connect(&sock, opts).expect("connect");
    // (offset, arrival, this thread's CPU time at arrival)
    let mut got = Vec::new();
    let start = Instant::now();
    let mut warmed = 0u64;
    loop {
        match sub.next_frame_warming(Some(Duration::from_secs(10)), &mut || warmed += 1) {
            Ok(Some(f)) => {
                assert_eq!(f.as_ptr().1, 64 * 48, "a whole frame");
                got.push((f.meta.offset, Instant::now(), thread_cpu()));
            }
            Ok(None) => break,
            Err(e) => panic!("after {} frames: {e}", got.len()),
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the stream did not end"
        );
    }
    let (status, out) = p.finish(Duration::from_secs(20));
    assert!(status.success(), "producer: {out:?}");
    let offsets: Vec<u64> = got.iter().map(|g| g.0).collect();
    assert_eq!(
        offsets,
        (0..FRAMES).collect::<Vec<_>>(),
        "every frame, in order"
    );
    // The pause: the longest gap between two frames.
    let (gap, cpu) = got
        .windows(2)
        .map(|w| (w[1].1 - w[0].1, w[1].2.saturating_sub(w[0].2)))
        .max_by_key(|g| g.0)
        .unwrap();
    let stats = sub.spin_stats();
    eprintln!("pause {gap:?} cost {cpu:?} of CPU; spin stats {stats:?}");
    assert!(gap > Duration::from_secs(2), "the pause is there: {gap:?}");
    assert!(
        cpu < Duration::from_millis(50),
        "a paused stream cost {cpu:?} of CPU over {gap:?}"
    );
    assert_polls(
        stats.caught as f64,
        stats.missed as f64,
        FRAMES / 10,
        FRAMES + 1,
        &stats,
    );
    assert_eq!(
        warmed,
        stats.caught + stats.missed,
        "the warm-up runs once as each poll starts"
    );
}

/// Without the low-latency mode, next_frame_warming never runs its warm-up (and gets every
/// frame, in order).
#[test]
fn no_warm_up_without_the_low_latency_mode() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("nowarm.sock");
    let p = producer_with(&sock, &["--fps", "30", "--frames", "15"]);
    let opts = gpushm::subscriber::ConnectOptions {
        mode: gpushm::policy::Delivery::Lossless,
        timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let mut sub = gpushm::subscriber::Subscriber::connect(&sock, opts).expect("connect");
    let (mut warmed, mut offsets) = (0u64, Vec::new());
    while let Some(f) = sub
        .next_frame_warming(Some(Duration::from_secs(10)), &mut || warmed += 1)
        .expect("a frame or the end")
    {
        offsets.push(f.meta.offset);
    }
    let (status, out) = p.finish(Duration::from_secs(20));
    assert!(status.success(), "producer: {out:?}");
    assert_eq!(
        offsets,
        (0..15).collect::<Vec<_>>(),
        "every frame, in order"
    );
    assert_eq!(warmed, 0, "a warm-up without the mode");
}

/// gpushmsrc spin-us=2000 (lossless, through frame_checker): all 100 frames, every byte as
/// the producer drew it, PTS in order and no gap, the consumer process spends under 10 % of a
/// core over 2 s of the producer's pause, and its `spin-caught` / `spin-missed` say the mode
/// caught frames while polling, once per frame at most.
#[test]
fn gpushmsrc_spin_us_delivers_every_frame_and_idles_for_free() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("spinsrc.sock");
    let mut p = producer(&sock);
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--expect",
        &FRAMES.to_string(),
        "--src-props",
        "spin-us=2000",
    ]);
    let checker = Proc::spawn(c, "frame_checker");
    p.wait_line("CONNECTED", Duration::from_secs(20));
    let first = Instant::now();
    // 40 frames take 3 s; the pause runs to 6 s.
    std::thread::sleep(Duration::from_millis(3600).saturating_sub(first.elapsed()));
    let pid = checker.child.id();
    let cpu0 = process_cpu_time(pid);
    std::thread::sleep(Duration::from_secs(2));
    let paused_cpu = process_cpu_time(pid).saturating_sub(cpu0);
    let (status, out) = checker.finish(Duration::from_secs(30));
    let (ps, pout) = p.finish(Duration::from_secs(20));
    eprintln!("consumer CPU over 2 s of pause: {paused_cpu:?}");
    assert!(ps.success(), "producer: {pout:?}");
    assert!(status.success(), "checker: {out:?}");
    let f = assert_every_frame(&out, FRAMES);
    assert!(
        paused_cpu < Duration::from_millis(200),
        "gpushmsrc spent {paused_cpu:?} of CPU over 2 s of pause"
    );
    // The mode is on: frames are caught while polling (none without it), and misses are few.
    let (caught, missed) = (num(&f, "spin_caught"), num(&f, "spin_missed"));
    assert_polls(caught, missed, FRAMES / 10, FRAMES + 1, &out);
}

/// A producer lying about its publish times cannot make a consumer in low-latency mode late
/// or make it poll past its budget. Frames come every 100 ms from a fake producer; gpushmsrc
/// spin-us=10000 reads them. First their publish times run 10 s ahead of the clock and an hour
/// apart: the consumer sleeps until that "due" time, but with its wake-up armed, so every frame
/// still arrives within 50 ms. Then each says it was published 50 ms before it was: every poll
/// misses, yet it stops at its budget (10 ms a frame), and the frame still wakes the consumer.
#[test]
fn a_producer_lying_about_publish_times_cannot_delay_frames_or_stretch_the_poll() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("liar.sock");
    let fake = FakeProducer::new(&sock);
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--print",
        "--no-reconnect",
        "--src-props",
        "spin-us=10000",
    ]);
    let consumer = Proc::spawn(c, "frame_checker");
    let mut client = fake.accept();
    let pid = consumer.child.id();
    let mut sent = Vec::new();
    let mut cpu0 = Duration::ZERO;
    for n in 0..40u64 {
        let now = gpushm::monotonic_ns();
        let publish_ns = if n < 20 {
            // Far ahead, and an hour apart.
            now + 10_000_000_000 + n * 3_600_000_000_000
        } else {
            // Half a period early: each next frame looks due 50 ms before it comes, so every
            // poll misses.
            now - 50_000_000
        };
        if n == 20 {
            cpu0 = process_cpu_time(pid);
        }
        sent.push(gpushm::monotonic_ns());
        fake.send(
            &mut client,
            n,
            gpushm::ring::producer_end::FrameMeta {
                publish_ns,
                ..Default::default()
            },
        );
        // Give the slot back as the consumer releases it: 16 slots, 40 frames.
        let _ = client.ch.take_releases();
        std::thread::sleep(Duration::from_millis(100));
    }
    let cpu1 = process_cpu_time(pid);
    drop(client);
    let (_, out) = consumer.finish(Duration::from_secs(20));
    let arrivals: Vec<(u64, u64)> = out
        .iter()
        .filter(|l| l.starts_with("FRAME "))
        .map(|l| {
            let get = |k: &str| -> u64 {
                l.split(' ')
                    .find_map(|f| f.strip_prefix(k))
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            (get("n="), get("t="))
        })
        .collect();
    assert_eq!(arrivals.len(), 40, "{}", out.join("\n"));
    for (n, t) in arrivals {
        let late = t.saturating_sub(sent[n as usize]);
        assert!(
            late < 50_000_000,
            "frame {n} arrived {} ms after it was sent",
            late / 1_000_000
        );
    }
    // 20 frames, one poll of at most 10 ms each (each misses), plus what the pipeline itself
    // costs; a poll without its bound would run until each frame came, 50 ms.
    let spent = cpu1.saturating_sub(cpu0);
    eprintln!("20 frames with polls that miss: {spent:?} of CPU");
    assert!(
        spent < Duration::from_millis(20 * 10 + 150),
        "the consumer spent {spent:?} over 20 frames with a budget of 10 ms"
    );
}

/// A budget over `MAX_SPIN` is refused at once, saying so (no producer needed).
#[test]
fn a_spin_budget_over_the_maximum_is_refused_saying_why() {
    let dir = tmpdir();
    let opts = gpushm::subscriber::ConnectOptions {
        spin: gpushm::policy::MAX_SPIN + Duration::from_micros(1),
        timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let t = Instant::now();
    match gpushm::subscriber::Subscriber::connect(&dir.path().join("none.sock"), opts) {
        Err(gpushm::Error::Invalid(m)) => assert!(m.contains("100000 µs"), "{m}"),
        Err(e) => panic!("not refused as invalid: {e}"),
        Ok(_) => panic!("connected"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "refused before waiting"
    );
}

/// `cmd`, run on `cpu` only.
fn pinned(mut cmd: std::process::Command, cpu: usize) -> std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: sched_setaffinity is a plain system call, safe between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut set = nix::sched::CpuSet::new();
            set.set(cpu)?;
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
            Ok(())
        });
    }
    cmd
}

/// gpushmsink wake-early (on by default) wakes a gpushmsrc sleeping for a frame ahead of it,
/// through the 30 → 5 → 60 fps schedule and its pause: with wake-ahead-us (120 by default)
/// before the frame is due, from the stream's cadence; with wake-ahead-us=0 as the frame
/// reaches the sink, on both of the sink's ways (render() after GstBaseSink's clock wait with
/// sync, its own chain function with sync=false). Every frame arrives, complete and in order,
/// and frames were woken for early (ahead of their time with wake-ahead-us), at most once a
/// frame; with wake-early=false, none is. The producer and the consumer run on two CPUs (a
/// consumer asleep on the producer's CPU is never woken early: it would take that CPU from the
/// frame's way). How many wake-ups come before their frame is the machine's figure (most, on
/// an idle one; on busy cores the consumer is not always asleep when a frame comes): printed,
/// not asserted.
#[test]
fn gpushmsink_wake_early_wakes_a_sleeping_gpushmsrc_and_loses_nothing() {
    init();
    let _s = serial();
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    assert!(
        cpus.len() >= 2,
        "this test needs two CPUs, it may use {cpus:?}"
    );
    // wake-early, wake-ahead-us (None: the default), sync.
    for (on, ahead, sync) in [
        (true, None, true),
        (true, Some(0), true),
        (true, Some(0), false),
        (false, None, true),
    ] {
        let dir = tmpdir();
        let sock = dir.path().join("wakeearly.sock");
        let prop = format!("wake-early={on}");
        let sync_prop = format!("sync={sync}");
        let mut args = vec![
            "--schedule",
            SCHEDULE,
            "--sink-prop",
            &prop,
            "--sink-prop",
            &sync_prop,
            // Without sync the sink does not pace the stream: the producer does.
            "--pace",
        ];
        let ahead_prop = ahead.map(|us: u32| format!("wake-ahead-us={us}"));
        if let Some(a) = &ahead_prop {
            args.extend(["--sink-prop", a]);
        }
        let p = Proc::spawn(
            pinned(producer_command(&sock, &args), cpus[0]),
            "pattern_producer",
        );
        wait_for_path(&sock, Duration::from_secs(20));
        let mut c = example("frame_checker");
        c.args([
            "--socket",
            sock.to_str().unwrap(),
            "--verify",
            "--lossless",
            "--expect",
            &FRAMES.to_string(),
        ]);
        let checker = Proc::spawn(pinned(c, cpus[1]), "frame_checker");
        let (status, out) = checker.finish(Duration::from_secs(30));
        let (ps, pout) = p.finish(Duration::from_secs(20));
        assert!(ps.success(), "producer: {pout:?}");
        assert!(status.success(), "checker: {out:?}");
        assert_every_frame(&out, FRAMES);
        let stats = fields(&pout, "STATS ");
        let (woken, woken_ahead) = (num(&stats, "woken-early"), num(&stats, "woken-ahead"));
        eprintln!(
            "{prop} {ahead_prop:?} {sync_prop}: {woken} of {FRAMES} frames woken for early, {woken_ahead} ahead of their time"
        );
        // Once per frame as it comes; with wake-ahead-us, before it is due too (again as it
        // comes only if it came over 200 µs late: while a new cadence is learnt).
        let most = if ahead.is_none() { 2 * FRAMES } else { FRAMES };
        if on {
            assert!(
                woken >= 1.0 && woken <= most as f64,
                "{woken} early wake-ups for {FRAMES} frames: {pout:?}"
            );
        } else {
            assert_eq!(woken, 0.0, "{pout:?}");
        }
        if on && ahead.is_none() {
            // Each of the four cadences is learnt in a few frames (69 of 100 on an idle
            // machine).
            assert!(
                woken_ahead >= 1.0 && woken_ahead <= FRAMES as f64,
                "{woken_ahead} wake-ups ahead for {FRAMES} frames: {pout:?}"
            );
        } else {
            assert_eq!(woken_ahead, 0.0, "{pout:?}");
        }
    }
}

/// gpushmsink spin-us: a producer flat out (not live) waits for its lossless consumer's
/// releases by polling them. Every frame arrives intact and in order, waits end while polling
/// (none do without the mode), and the producer polls once a frame at most.
#[test]
fn gpushmsink_spin_us_polls_for_releases_and_loses_nothing() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("sinkspin.sock");
    const N: u64 = 3000;
    let p = producer_with(
        &sock,
        &[
            "--fps",
            "0",
            "--frames",
            &N.to_string(),
            "--sink-prop",
            "spin-us=2000",
        ],
    );
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--expect",
        &N.to_string(),
    ]);
    let checker = Proc::spawn(c, "frame_checker");
    let (status, out) = checker.finish(Duration::from_secs(60));
    let (ps, pout) = p.finish(Duration::from_secs(20));
    assert!(ps.success(), "producer: {pout:?}");
    assert!(status.success(), "checker: {out:?}");
    assert_every_frame(&out, N);
    let st = fields(&pout, "STATS ");
    let (caught, missed) = (num(&st, "spin-caught"), num(&st, "spin-missed"));
    assert_polls(caught, missed, 1, N, &pout);
}

/// gpushmsink spin-us=20000 with a lossless consumer that keeps every frame it takes (stuck
/// at its budget) and max-wait of 1.5 s: the producer polls 20 ms once, sleeps out the rest of
/// max-wait, and marks the consumer lagging; over 2.5 s it spends far less than a poll that
/// ran to max-wait would (1.5 s), and the poll is counted as missed.
#[test]
fn gpushmsink_spin_us_stops_at_its_budget_for_a_stuck_consumer() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("stuck.sock");
    let mut p = producer_with(
        &sock,
        &[
            "--fps",
            "30",
            "--frames",
            "150",
            "--sink-prop",
            "spin-us=20000",
            "--sink-prop",
            "max-wait=1500000000",
        ],
    );
    let opts = gpushm::subscriber::ConnectOptions {
        mode: gpushm::policy::Delivery::Lossless,
        timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let mut sub = gpushm::subscriber::Subscriber::connect(&sock, opts).expect("connect");
    p.wait_line("CONNECTED", Duration::from_secs(20));
    // Held: the producer's budget for this client is half its 8 slots.
    let mut held = Vec::new();
    while held.len() < 4 {
        match sub.next_frame(Some(Duration::from_secs(10))) {
            Ok(Some(f)) => held.push(f),
            r => panic!("frame {}: {:?}", held.len(), r.map(|f| f.is_some())),
        }
    }
    let pid = p.child.id();
    let cpu0 = process_cpu_time(pid);
    std::thread::sleep(Duration::from_millis(2500));
    let cpu = process_cpu_time(pid).saturating_sub(cpu0);
    // Let go and read on to the end of the stream (the producer waits for a consumer).
    drop(held);
    while let Ok(Some(_)) = sub.next_frame(Some(Duration::from_secs(10))) {}
    drop(sub);
    let (ps, pout) = p.finish(Duration::from_secs(20));
    eprintln!("producer CPU over 2.5 s with a stuck consumer: {cpu:?}");
    assert!(ps.success(), "producer: {pout:?}");
    let st = fields(&pout, "STATS ");
    assert!(num(&st, "times-lagged") >= 1.0, "{pout:?}");
    assert!(num(&st, "spin-missed") >= 1.0, "{pout:?}");
    assert!(
        cpu < Duration::from_millis(700),
        "the producer spent {cpu:?} of CPU over 2.5 s: its poll did not stop at 20 ms"
    );
}

/// The GStreamer-free publisher's low-latency mode (`Publisher::set_spin`, which the C
/// and Python publishers set): a camera flat out with two slots waits for its lossless
/// consumer's releases by polling them. Every frame arrives intact and in order, some waits
/// end while polling, and the camera polls once a frame at most. A budget over the maximum is
/// refused, saying why.
#[test]
fn frame_publisher_spin_polls_for_releases_and_loses_nothing() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("camspin.sock");
    const N: u64 = 2000;
    let frames = N.to_string();
    let mut camera = example("synthetic_camera");
    camera.args([
        "--socket",
        sock.to_str().unwrap(),
        "--wait",
        "--fps",
        "1000000",
    ]);
    camera.args(["--slots", "2", "--frames", &frames, "--spin-us", "2000"]);
    camera.args(["--width", "64", "--height", "48", "--format", "GRAY8"]);
    let camera = Proc::spawn(camera, "synthetic_camera");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut sums = example("plane_sums");
    sums.args(["--socket", sock.to_str().unwrap(), "--verify", "--lossless"]);
    let (ss, sout) = Proc::spawn(sums, "plane_sums").finish(Duration::from_secs(90));
    let (cs, cout) = camera.finish(Duration::from_secs(30));
    assert!(ss.success() && cs.success(), "{sout:?}\n{cout:?}");
    let got: Vec<&String> = sout.iter().filter(|l| l.starts_with("FRAME ")).collect();
    assert_eq!(got.len() as u64, N, "{sout:?}");
    assert!(got.iter().all(|l| l.ends_with("ok=true")), "{sout:?}");
    // In order: FRAME lines carry the frame number first.
    let numbers: Vec<u64> = got
        .iter()
        .filter_map(|l| l.split_whitespace().nth(1)?.split('=').nth(1)?.parse().ok())
        .collect();
    assert_eq!(numbers, (0..N).collect::<Vec<_>>(), "{sout:?}");
    let st = fields(&cout, "STATS ");
    let (caught, missed) = (num(&st, "spin-caught"), num(&st, "spin-missed"));
    assert_polls(caught, missed, 1, N, &cout);

    let refused = gpushm::publisher::Publisher::new(
        &dir.path().join("over.sock"),
        gpushm::format::FrameLayout::new(gpushm::format::VideoFormat::Gray8, 64, 48).unwrap(),
        (30, 1),
        4,
        Default::default(),
    )
    .unwrap()
    .set_spin(gpushm::policy::MAX_SPIN + Duration::from_micros(1));
    match refused {
        Err(gpushm::Error::Invalid(m)) => assert!(m.contains("100000 µs"), "{m}"),
        r => panic!("not refused as invalid: {:?}", r.is_ok()),
    }
}

/// gpushmsrc spin-us with a sink that syncs to the clock and a pipeline paused for 400 ms
/// mid-stream (its receiver thread then reads the ring while the streaming thread waits in
/// the sink, and its warm-up must not get in the way): the stream goes on after the pause,
/// every frame delivered is intact and in PTS order, the consumer ends with the stream (no
/// hang), and frames are still caught while polling.
#[test]
fn gpushmsrc_spin_us_survives_a_syncing_sink_and_a_pause() {
    init();
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("spinpause.sock");
    let p = producer_with(&sock, &["--fps", "30", "--frames", "120"]);
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--sync",
        "--pause-at",
        "40",
        "--pause-ms",
        "400",
        "--src-props",
        "spin-us=2000",
    ]);
    let (status, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(40));
    let (ps, pout) = p.finish(Duration::from_secs(20));
    assert!(ps.success(), "producer: {pout:?}");
    assert!(status.success(), "checker: {out:?}");
    assert!(out.iter().any(|l| l.starts_with("RESUMED")), "{out:?}");
    let f = fields(&out, "SUMMARY ");
    eprintln!("{:?}", out.iter().find(|l| l.starts_with("SUMMARY ")));
    assert_eq!(num(&f, "bad"), 0.0, "{out:?}");
    assert_eq!(num(&f, "pts_errors"), 0.0, "{out:?}");
    // The frames that came while paused are the only ones a live pipeline may drop.
    assert!(num(&f, "frames") >= 90.0, "{out:?}");
    assert!(num(&f, "spin_caught") >= 10.0, "{out:?}");
}

/// What the kernel keeps the CPUs' wake-up latency to now, µs (needs root).
fn cpu_latency_now() -> u32 {
    gpushm::cpu_latency::CpuLatency::current().expect("reading /dev/cpu_dma_latency")
}

/// What the CPU latency tests need to read the kernel's value back (root, the device) and
/// to see their own requests in it (nothing else holding `lowest` µs or less); the value
/// before them.
fn cpu_latency_before(lowest: u32) -> u32 {
    assert!(
        nix::unistd::geteuid().is_root(),
        "reading /dev/cpu_dma_latency needs root; skip this test with --skip second_user"
    );
    assert!(
        std::path::Path::new(gpushm::cpu_latency::DEVICE).exists(),
        "this kernel or container has no /dev/cpu_dma_latency; skip this test with --skip second_user_cpu_latency"
    );
    let before = cpu_latency_now();
    assert!(
        before > lowest,
        "another process holds the CPU latency at {before} µs"
    );
    before
}

/// Waits until the kernel's CPU latency reads `want`, or says what it read.
fn wait_cpu_latency(want: u32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = cpu_latency_now();
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the CPU latency reads {now} µs, not {want}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// cpu-latency-us on gpushmsink (41) and gpushmsrc (23), each in its own process: the kernel
/// keeps the CPUs to the smallest asked while the elements run, to the producer's alone once
/// the consumer is gone, and to the system's own once the producer is killed (kill -9: the
/// kernel drops a dead process's request); every frame arrives intact meanwhile. Reading
/// /dev/cpu_dma_latency needs root.
#[test]
fn second_user_cpu_latency_us_is_held_while_the_elements_run() {
    init();
    let _s = serial();
    // Values nobody else on this machine is likely to hold, below the default (2000 s).
    let before = cpu_latency_before(41);
    let dir = tmpdir();
    let sock = dir.path().join("cpulat.sock");
    let mut p = producer_with(
        &sock,
        &[
            "--fps",
            "30",
            "--frames",
            "100000",
            "--sink-prop",
            "cpu-latency-us=41",
        ],
    );
    wait_cpu_latency(41, "gpushmsink cpu-latency-us=41");
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--frames",
        "60",
        "--src-props",
        "cpu-latency-us=23 spin-us=500",
    ]);
    let checker = Proc::spawn(c, "frame_checker");
    wait_cpu_latency(23, "gpushmsrc cpu-latency-us=23 beside gpushmsink's 41");
    let (status, out) = checker.finish(Duration::from_secs(30));
    assert!(status.success(), "checker: {out:?}");
    assert_every_frame(&out, 60);
    wait_cpu_latency(41, "the consumer gone, the producer still running");
    p.kill9();
    let _ = p.finish(Duration::from_secs(20));
    wait_cpu_latency(before, "both gone, the producer killed");
}

/// In one process: gpushmsink with the default (-1) asks for nothing; with 41 the kernel
/// holds 41 while it runs, gpushmsrc's 23 beside it while that runs, and each request goes
/// when its element stops (to NULL), not only when the process ends (root).
#[test]
fn second_user_cpu_latency_us_goes_when_the_element_stops() {
    init();
    let _s = serial();
    let before = cpu_latency_before(41);
    let dir = tmpdir();
    let sock = dir.path().join("cpulat-stop.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
         ! gpushmsink name=sink socket-path={} sync=false",
        sock.display()
    ))
    .unwrap();
    let sink = producer
        .downcast_ref::<gst::Bin>()
        .unwrap()
        .by_name("sink")
        .unwrap();
    assert_eq!(sink.property::<i32>("cpu-latency-us"), -1);
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    assert_eq!(cpu_latency_now(), before, "the default asked for something");
    producer.set_state(gst::State::Null).unwrap();
    sink.set_property("cpu-latency-us", 41i32);
    producer.set_state(gst::State::Playing).unwrap();
    wait_cpu_latency(41, "gpushmsink cpu-latency-us=41 playing");
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} cpu-latency-us=23 ! fakesink",
        sock.display()
    ))
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    wait_cpu_latency(23, "gpushmsrc cpu-latency-us=23 playing");
    consumer.set_state(gst::State::Null).unwrap();
    wait_cpu_latency(41, "gpushmsrc stopped");
    producer.set_state(gst::State::Null).unwrap();
    wait_cpu_latency(before, "gpushmsink stopped");
}

/// A user without access to /dev/cpu_dma_latency (nobody) asking for cpu-latency-us: a
/// warning that says what it needs, and the stream goes on (gpushmsink and gpushmsrc, each
/// in a process of its own).
#[test]
fn second_user_cpu_latency_us_refused_warns_and_streams() {
    init();
    let _s = serial();
    let home = tmpdir();
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = home.path().join("cpulat-nobody.sock");
    let mut p = producer_command(
        &sock,
        &[
            "--fps",
            "30",
            "--frames",
            "30",
            "--sink-prop",
            "cpu-latency-us=0",
        ],
    );
    as_nobody(&mut p, home.path());
    let p = Proc::spawn(p, "nobody's producer");
    wait_for_path(&sock, Duration::from_secs(20));
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--expect",
        "30",
        "--src-props",
        "cpu-latency-us=0",
    ]);
    as_nobody(&mut c, home.path());
    let (status, out) = Proc::spawn(c, "nobody's consumer").finish(Duration::from_secs(30));
    let (ps, pout) = p.finish(Duration::from_secs(20));
    assert!(status.success(), "checker: {out:?}");
    assert!(ps.success(), "producer: {pout:?}");
    assert_every_frame(&out, 30);
    // Why: no access for nobody, or (a container) no such device.
    let why = if std::path::Path::new(gpushm::cpu_latency::DEVICE).exists() {
        "udev rule"
    } else {
        "no CPU latency QoS device"
    };
    for (who, lines) in [("gpushmsink", &pout), ("gpushmsrc", &out)] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains("cpu-latency-us=0 is not applied")
                    && l.contains(gpushm::cpu_latency::DEVICE)
                    && l.contains(why)),
            "{who}: no warning that says why cpu-latency-us is not applied ({why}): {lines:?}"
        );
    }
}
