// SPDX-License-Identifier: MPL-2.0
//! The subscriber against a real publisher in this process.
use super::connect::connect_bounded;
use super::*;
use crate::format::{FrameLayout, VideoFormat};
use crate::publisher::{Config, Publisher};

fn scratch(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("gpushm-client-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The control socket a consumer connects is non-blocking: its thread never blocks on a
/// producer that stopped reading or writing (the connect itself blocks in bounded slices).
#[test]
fn a_connected_control_socket_is_non_blocking() {
    let dir = scratch("nonblocking");
    let path = dir.join("s.sock");
    let _ = std::fs::remove_file(&path);
    let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let s = connect_bounded(&path, Instant::now() + Duration::from_secs(5), None).unwrap();
    let flags = nix::fcntl::fcntl(&s, nix::fcntl::FcntlArg::F_GETFL).unwrap();
    assert!(nix::fcntl::OFlag::from_bits_truncate(flags).contains(nix::fcntl::OFlag::O_NONBLOCK));
    let _ = std::fs::remove_dir_all(&dir);
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn publish(cam: &Publisher, value: u8) {
    let mut s = cam.acquire(Duration::from_secs(5)).unwrap();
    s.bytes_mut().fill(value);
    cam.publish(s, None).unwrap();
}

fn camera(dir: &Path, slots: u32) -> Publisher {
    let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
    Publisher::new(
        &dir.join("cam"),
        layout,
        (1000, 1),
        slots,
        Config::default(),
    )
    .unwrap()
}

fn connect(dir: &Path, lossless: bool) -> Subscriber {
    let opts = ConnectOptions {
        mode: if lossless {
            Delivery::Lossless
        } else {
            Delivery::Leaky
        },
        ..Default::default()
    };
    Subscriber::connect(&dir.join("cam"), opts).unwrap()
}

fn take(sub: &mut Subscriber) -> Frame {
    sub.next_frame(Some(Duration::from_secs(5)))
        .unwrap()
        .expect("a frame")
}

fn filled_with(f: &Frame, v: u8) -> bool {
    f.to_vec().iter().all(|&b| b == v)
}

/// A frame kept after its subscriber is gone keeps its slot while the producer goes round
/// the ring many times, and a closed lossless subscriber never holds the producer up; the
/// producer forgets the subscriber once the last frame is dropped.
#[test]
fn a_lease_outliving_its_subscriber_is_not_reused() {
    for lossless in [false, true] {
        let dir = scratch(&format!("outlive-{lossless}"));
        let cam = camera(&dir, 4);
        let mut sub = connect(&dir, lossless);
        until("the client", || cam.num_clients() == 1);
        publish(&cam, 1);
        let kept = take(&mut sub);
        assert!(filled_with(&kept, 1));
        // Delivered but not taken: goes back to the producer on close.
        publish(&cam, 2);
        drop(sub);
        until("the close", || cam.num_clients() == 0);
        for n in 3..200u32 {
            publish(&cam, n as u8);
        }
        assert!(filled_with(&kept, 1), "a held frame was overwritten");
        assert!(kept.lease.is_valid());
        let (stats, clients) = cam.stats();
        assert_eq!(
            stats.times_lagged, 0,
            "the producer waited for a closed client"
        );
        assert_eq!(clients.len(), 1);
        assert!(clients[0].closed && clients[0].held == 1, "{clients:?}");
        drop(kept);
        until("the last lease to close the connection", || {
            cam.stats().1.is_empty()
        });
        drop(cam);
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Auto, the default, is leaky for live raw video: a default subscriber that takes nothing
/// never holds a live camera up (frames skip it), where a lossless one is waited for until
/// it is marked lagging.
#[test]
fn auto_is_leaky_for_live_raw_video_and_lossless_waits() {
    for mode in [Delivery::Auto, Delivery::Lossless] {
        let dir = scratch(&format!("auto-{}", mode.name()));
        let cam = camera(&dir, 8);
        let opts = ConnectOptions {
            mode,
            ..Default::default()
        };
        let sub = Subscriber::connect(&dir.join("cam"), opts).unwrap();
        until("the client", || cam.num_clients() == 1);
        for n in 0..20u8 {
            publish(&cam, n);
        }
        let (stats, clients) = cam.stats();
        assert_eq!(clients[0].mode, mode);
        match mode {
            Delivery::Auto => {
                assert!(!clients[0].lossless, "{clients:?}");
                assert_eq!(stats.times_lagged, 0, "the camera waited for it");
                assert!(sub.dropped() > 0);
            }
            _ => {
                assert!(clients[0].lossless, "{clients:?}");
                assert!(stats.times_lagged >= 1, "never waited for: {stats:?}");
            }
        }
        drop(sub);
        drop(cam);
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
}

/// Two CPUs this process may run on.
fn two_cpus() -> (usize, usize) {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    assert!(
        cpus.len() >= 2,
        "this test needs two CPUs, it may use {cpus:?}"
    );
    (cpus[0], cpus[1])
}

/// Whether thread `tid` of this process sleeps (state S: our subscriber in its poll).
fn sleeping(tid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('S'))
        })
        .unwrap_or(false)
}

/// How often thread `tid` of this process went to sleep.
fn sleeps(tid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

/// Only a stream that is not live and comes back to back is polled for before sleeping
/// ([`crate::policy::BACK_TO_BACK_POLL`]): a live one never (the Publisher's frames are live),
/// nor one that is slower; such a poll is spent once per frame taken, and a wait that follows
/// it sleeps and is rung as before.
#[test]
fn only_a_stream_that_is_not_live_and_comes_back_to_back_is_polled_for() {
    let dir = scratch("back-to-back");
    let cam = camera(&dir, 8);
    let mut sub = connect(&dir, true);
    until("the client", || cam.num_clients() == 1);
    // Live frames 50 µs apart: never polled for.
    for v in 1..=4u8 {
        publish(&cam, v);
        std::thread::sleep(Duration::from_micros(50));
    }
    for v in 1..=4u8 {
        assert!(filled_with(&take(&mut sub), v));
    }
    assert!(matches!(
        sub.next_frame(Some(Duration::from_millis(1))),
        Err(Error::Timeout(_))
    ));
    assert_eq!(
        sub.back_to_back_polls(),
        SpinStats::default(),
        "live: no poll"
    );
    // Not live (as gpushmsink marks a stream that is not), frames 100 µs apart: one poll after
    // the frame taken, which ends without a frame; the wait goes on asleep, and the frame
    // published then wakes it.
    sub.waiting.live = false;
    sub.waiting.back_to_back_poll = true;
    // Whatever CPUs this test may use (one CPU only is the end of this test).
    sub.waiting.back_to_back_cpus = true;
    let now = crate::monotonic_ns();
    sub.waiting.cadence = Default::default();
    for k in (1..=4).rev() {
        sub.waiting.cadence.record(now - k * 100_000);
    }
    let woken = cam.stats().0.woken;
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        tx.send(nix::unistd::gettid().as_raw()).unwrap();
        let f = take(&mut sub);
        (filled_with(&f, 5), sub)
    });
    let tid = rx.recv().unwrap();
    until("the subscriber to sleep", || sleeping(tid));
    publish(&cam, 5);
    let (five, mut sub) = t.join().unwrap();
    assert!(five);
    assert_eq!(
        sub.back_to_back_polls(),
        SpinStats {
            caught: 0,
            missed: 1
        }
    );
    assert_eq!(cam.stats().0.woken, woken + 1, "rung as it slept");
    // Frame 5 came long after: the median interval is still 100 µs, so the wait after it
    // polls once (and misses); the next one, with no frame taken since, does not.
    sub.waiting.live = false;
    for _ in 0..2 {
        assert!(matches!(
            sub.next_frame(Some(Duration::from_millis(2))),
            Err(Error::Timeout(_))
        ));
    }
    assert_eq!(sub.back_to_back_polls().missed, 2, "once per frame taken");
    let wait_once = |sub: &mut Subscriber, timeout: Duration| {
        sub.waiting.back_to_back_poll = true;
        assert!(matches!(
            sub.next_frame(Some(timeout)),
            Err(Error::Timeout(_))
        ));
        sub.back_to_back_polls().missed
    };
    // A look without waiting does not spend the frame's poll.
    assert_eq!(wait_once(&mut sub, Duration::ZERO), 2);
    // Four polls in a row in vain: the next 64 frames are waited for asleep.
    assert_eq!(wait_once(&mut sub, Duration::from_millis(2)), 3);
    assert_eq!(wait_once(&mut sub, Duration::from_millis(2)), 4);
    assert_eq!(
        sub.waiting.back_to_back_pause,
        crate::policy::BACK_TO_BACK_PAUSE
    );
    for _ in 0..crate::policy::BACK_TO_BACK_PAUSE {
        assert_eq!(wait_once(&mut sub, Duration::from_micros(100)), 4);
    }
    assert_eq!(
        wait_once(&mut sub, Duration::from_millis(2)),
        5,
        "polls again"
    );
    // A process that may run on one CPU only never polls.
    sub.waiting.back_to_back_cpus = false;
    assert_eq!(wait_once(&mut sub, Duration::from_millis(2)), 5);
    // A stream slower than 500 µs a frame: never polled for.
    let mut slow = connect(&dir, true);
    until("the second client", || cam.num_clients() == 2);
    for v in 6..=9u8 {
        publish(&cam, v);
        std::thread::sleep(Duration::from_millis(2));
    }
    for v in 6..=9u8 {
        let f = take(&mut slow);
        assert!(filled_with(&f, v));
        slow.waiting.live = false;
    }
    assert!(matches!(
        slow.next_frame(Some(Duration::from_millis(2))),
        Err(Error::Timeout(_))
    ));
    assert_eq!(
        slow.back_to_back_polls(),
        SpinStats::default(),
        "slow: no poll"
    );
}

/// wake_early wakes a subscriber that sleeps waiting for a frame ahead of the frame: once
/// per frame, never from the CPU it went to sleep on (where it would take the CPU from the
/// producer), never one whose event loop polls the doorbell. The subscriber woken before
/// the frame is published still gets every frame, complete and in order.
#[test]
fn wake_early_wakes_a_sleeping_subscriber_ahead_of_the_frame_and_loses_nothing() {
    let _serial = crate::timing_test();
    let (a, b) = two_cpus();
    let dir = scratch("wake-early");
    let cam = camera(&dir, 8);
    let mut sub = connect(&dir, true);
    // Polled by an event loop of its own: woken by frames, never ahead of them.
    let polled = connect(&dir, false);
    let _ = polled.poll_fds();
    until("the clients", || cam.num_clients() == 2);
    let woken = || cam.stats().0.woken_early;
    let (tx, rx) = std::sync::mpsc::channel();
    let consumer = std::thread::spawn(move || {
        pin(a);
        tx.send(nix::unistd::gettid().as_raw()).unwrap();
        let got = (1..=3u8)
            .map(|v| {
                let f = take(&mut sub);
                (f.seq, filled_with(&f, v))
            })
            .collect::<Vec<_>>();
        (got, sub.early_polls())
    });
    let tid = rx.recv().unwrap();
    pin(b);
    // Woken from another CPU, once for the frame however often asked.
    until("the subscriber to sleep", || sleeping(tid));
    let before = sleeps(tid);
    cam.wake_early();
    cam.wake_early();
    assert_eq!(woken(), 1, "one wake-up ahead of frame 1");
    // It woke, found no frame, and sleeps again (after a poll of at most 100 µs).
    until("the subscriber to wake and sleep again", || {
        sleeps(tid) > before && sleeping(tid)
    });
    publish(&cam, 1);
    // Not from the CPU it sleeps on.
    std::thread::sleep(2 * crate::policy::WAKE_EARLY_GAP);
    until("the subscriber to sleep after frame 1", || sleeping(tid));
    pin(a);
    cam.wake_early();
    pin(b);
    assert_eq!(woken(), 1, "woken from the CPU it sleeps on");
    publish(&cam, 2);
    std::thread::sleep(2 * crate::policy::WAKE_EARLY_GAP);
    until("the subscriber to sleep after frame 2", || sleeping(tid));
    cam.wake_early();
    assert_eq!(woken(), 2, "one wake-up ahead of frame 3");
    publish(&cam, 3);
    let (got, polls) = consumer.join().unwrap();
    assert_eq!(got, vec![(1, true), (2, true), (3, true)]);
    // Woken ahead of frame 1, it polled for it (in vain: frame 1 came after it slept
    // again), and at most once more, for frame 3.
    assert!(
        polls.missed >= 1 && polls.caught + polls.missed <= 2,
        "{polls:?}"
    );
    drop(polled);
    drop(cam);
    std::fs::remove_dir_all(&dir).ok();
}

/// How many times `tid` of this process ran at all (it went to sleep or was preempted).
fn switches(tid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    ["voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"]
        .iter()
        .map(|k| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .unwrap()
        })
        .sum()
}

/// set_wake_ahead: the connection thread wakes a subscriber asleep waiting for a frame
/// before the frame is due (learnt from the cadence of the last frames), not as soon as
/// the last one went out: halfway between two frames nothing is rung yet, and just before
/// the next one is due the subscriber was rung and ran. Once per frame; every frame comes,
/// complete and in order. Not from the CPU the subscriber sleeps on, and a stream that
/// stops costs one wake-up ahead, then nothing: the connection thread sleeps through the
/// pause.
#[test]
fn wake_ahead_wakes_a_sleeping_subscriber_before_each_frame_is_due() {
    let _serial = crate::timing_test();
    let (a, b) = two_cpus();
    let dir = scratch("wake-ahead");
    let cam = camera(&dir, 8);
    // Frames every 40 ms, woken the most allowed ahead (1 ms) for a loaded CI machine.
    const EVERY: Duration = Duration::from_millis(40);
    const BEFORE: Duration = Duration::from_micros(400);
    cam.set_wake_ahead(crate::policy::MAX_WAKE_AHEAD).unwrap();
    let mut sub = connect(&dir, true);
    until("the client", || cam.num_clients() == 1);
    until("the connection thread", || cam.connection_tid() != 0);
    let ahead = || cam.stats().0.woken_ahead;
    const N: u8 = 12;
    let (tx, rx) = std::sync::mpsc::channel();
    let consumer = std::thread::spawn(move || {
        pin(a);
        tx.send(nix::unistd::gettid().as_raw()).unwrap();
        (1..=2 * N + 1)
            .map(|v| {
                let f = take(&mut sub);
                (f.seq, filled_with(&f, v))
            })
            .collect::<Vec<_>>()
    });
    let tid = rx.recv().unwrap();
    pin(b);
    let (mut woken_before_due, mut rung_too_soon) = (0, 0);
    for v in 1..=N {
        until("the subscriber to sleep", || sleeping(tid));
        let (rings, ran) = (ahead(), switches(tid));
        std::thread::sleep(EVERY / 2);
        if ahead() != rings {
            rung_too_soon += 1;
        }
        // BEFORE the frame is due (a cadence of EVERY once learnt).
        std::thread::sleep(EVERY / 2 - BEFORE);
        if ahead() == rings + 1 && switches(tid) > ran {
            woken_before_due += 1;
        }
        std::thread::sleep(BEFORE);
        publish(&cam, v);
    }
    // How many wake-ups came before their frame was due is the machine's figure (on a busy
    // 2-core machine the connection thread's timed wake-up and the subscriber's can both
    // come late: 5 of 12 seen in CI, 0 with both cores busy), not the test's: what holds
    // anywhere is that frames are rung for, at most once each (two teach the cadence; a ring
    // that comes after its frame, on a busy machine, is not made up), and never halfway
    // between frames (load only delays a ring).
    eprintln!(
        "woken before {woken_before_due} of {N} frames were due, rung halfway for {rung_too_soon} (rung {})",
        ahead()
    );
    assert!(
        rung_too_soon <= 2,
        "rung halfway between frames for {rung_too_soon} of {N}"
    );
    assert!(
        (1..=N as u64 + 1).contains(&ahead()),
        "rung {} times for {N} frames",
        ahead()
    );
    // The stream stops: one wake-up for the frame that does not come, then none, and
    // the connection thread sleeps (its 100 ms rounds, not one per frame or a spin).
    std::thread::sleep(2 * EVERY);
    let rings = ahead();
    let ran = switches(cam.connection_tid());
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(ahead(), rings, "rung in a pause");
    let ran = switches(cam.connection_tid()) - ran;
    assert!(
        ran <= 12,
        "the connection thread ran {ran} times in 600 ms of pause"
    );
    // Published from the CPU the subscriber sleeps on: no wake-up ahead.
    pin(a);
    for v in N + 1..=N + N / 2 {
        std::thread::sleep(EVERY);
        publish(&cam, v);
    }
    assert_eq!(ahead(), rings, "woken ahead from the CPU it sleeps on");
    // From another CPU again: woken ahead again.
    pin(b);
    for v in N + N / 2 + 1..=2 * N {
        std::thread::sleep(EVERY);
        publish(&cam, v);
    }
    assert!(ahead() > rings, "not woken ahead after the pause");
    // A frame later than its wake-up ahead (the subscriber polled, then slept again) is
    // still rung for as it comes (wake_early).
    let rings = ahead();
    until("the wake-up ahead of the last frame", || ahead() > rings);
    std::thread::sleep(Duration::from_millis(5));
    until("the subscriber to sleep again", || sleeping(tid));
    let early = cam.stats().0.woken_early;
    cam.wake_early();
    assert_eq!(
        cam.stats().0.woken_early,
        early + 1,
        "a late frame not rung for"
    );
    publish(&cam, 2 * N + 1);
    let got = consumer.join().unwrap();
    assert_eq!(
        got,
        (1..=2 * N as u64 + 1)
            .map(|s| (s, true))
            .collect::<Vec<_>>()
    );
    drop(cam);
    std::fs::remove_dir_all(&dir).ok();
}

/// In the low-latency mode, a wake-up ahead of a frame that ends the sleep before the poll
/// (the frame comes well before its cadence says) starts the poll at once: the frame is
/// caught polling, not by a second wake-up.
#[test]
fn spin_mode_polls_at_once_when_woken_ahead_of_an_early_frame() {
    let _serial = crate::timing_test();
    let (a, b) = two_cpus();
    let dir = scratch("wake-early-spin");
    let cam = camera(&dir, 8);
    let opts = ConnectOptions {
        mode: Delivery::Lossless,
        spin: Duration::from_millis(20),
        ..Default::default()
    };
    let mut sub = Subscriber::connect(&dir.join("cam"), opts).unwrap();
    until("the client", || cam.num_clients() == 1);
    const N: u8 = 8;
    let (tx, rx) = std::sync::mpsc::channel();
    let consumer = std::thread::spawn(move || {
        pin(a);
        tx.send(nix::unistd::gettid().as_raw()).unwrap();
        (1..=N + 1)
            .map(|v| {
                let f = take(&mut sub);
                (filled_with(&f, v), sub.spin_stats())
            })
            .collect::<Vec<_>>()
    });
    let tid = rx.recv().unwrap();
    pin(b);
    // A cadence of 100 ms, learnt.
    for v in 1..=N {
        std::thread::sleep(Duration::from_millis(100));
        publish(&cam, v);
    }
    // The next frame 30 ms after the last: the subscriber sleeps until 10 ms before the
    // 100 ms are up; woken ahead of the frame, it polls from now (20 ms at most).
    std::thread::sleep(Duration::from_millis(30));
    until("the subscriber to sleep before its poll", || sleeping(tid));
    cam.wake_early();
    std::thread::sleep(Duration::from_millis(2));
    publish(&cam, N + 1);
    let got = consumer.join().unwrap();
    assert!(got.iter().all(|g| g.0), "a frame with other contents");
    let (before, after) = (got[N as usize - 1].1, got[N as usize].1);
    assert_eq!(cam.stats().0.woken_early, 1);
    assert_eq!(
        after.caught,
        before.caught + 1,
        "the early frame was not caught polling: {before:?} then {after:?}"
    );
    drop(cam);
    std::fs::remove_dir_all(&dir).ok();
}

/// A subscriber polled by an event loop (`poll_fds`) is rung after every delivery; one it
/// took without waiting leaves its doorbell readable. The wait after that returns at once
/// and must not poll the ring as after an early wake-up (it used to, 100 µs a frame).
#[test]
fn an_event_loop_subscriber_never_polls_after_a_leftover_wake_up() {
    let dir = scratch("leftover");
    let cam = camera(&dir, 8);
    let mut sub = connect(&dir, true);
    let _ = sub.poll_fds();
    until("the client", || cam.num_clients() == 1);
    publish(&cam, 1);
    publish(&cam, 2);
    assert!(filled_with(&take(&mut sub), 1));
    assert!(filled_with(&take(&mut sub), 2));
    // The doorbell still says "ready" for frames taken already.
    assert!(matches!(
        sub.next_frame(Some(Duration::from_millis(50))),
        Err(Error::Timeout(_))
    ));
    assert_eq!(sub.early_polls(), SpinStats::default());
    drop(sub);
    drop(cam);
    std::fs::remove_dir_all(&dir).ok();
}

/// Two consumers that each hold their share of the ring (all of it, together) are never
/// cut, however long the producer waits for a slot; one that holds more than its share while
/// the producer waits, every slot held, is: its frames then say they are no longer valid, and
/// why, without the subscriber reading anything.
#[test]
fn only_a_consumer_over_its_share_is_cut_and_its_frames_say_so() {
    let dir = scratch("cut");
    let cam = camera(&dir, 6);
    let mut a = connect(&dir, true);
    let mut b = connect(&dir, true);
    until("two clients", || cam.num_clients() == 2);
    // a keeps frames 1 to 3, b frames 4 to 6: every slot held, each at its share (3).
    for v in 1..=3 {
        publish(&cam, v);
    }
    let held_by_a: Vec<Frame> = (0..3).map(|_| take(&mut a)).collect();
    drop((take(&mut b), take(&mut b), take(&mut b)));
    for v in 4..=6 {
        publish(&cam, v);
    }
    let b4 = take(&mut b);
    let b5 = take(&mut b);
    let b6 = take(&mut b);
    // The producer waits for a slot, in vain.
    assert!(matches!(
        cam.acquire(crate::policy::STARVATION_TIMEOUT * 3),
        Err(Error::Timeout(_))
    ));
    assert_eq!(cam.num_clients(), 2, "a client within its share was cut");
    assert!(held_by_a[0].lease.is_valid() && b4.lease.is_valid());
    // A third consumer: the share (and every budget) is now two slots. b lets two frames go;
    // a keeps its three and takes nothing more: a alone is over its share.
    let mut c = connect(&dir, false);
    until("three clients", || cam.num_clients() == 3);
    drop((b5, b6));
    publish(&cam, 7);
    let c7 = take(&mut c);
    assert!(filled_with(&c7, 7));
    drop(c7);
    let b7 = take(&mut b);
    // Every slot is held again: a 3, b 2, c 1.
    publish(&cam, 8);
    let c8 = take(&mut c);
    // The producer waits for a slot: a is cut, and its slots come back.
    publish(&cam, 9);
    // a does not read its socket: its frames learn it from its control block.
    until("a's frames to be revoked", || {
        !held_by_a[0].lease.is_valid()
    });
    assert!(held_by_a.iter().all(|f| !f.lease.is_valid()));
    match a.next_frame(Some(Duration::from_secs(5))) {
        Err(Error::Refused(why)) => assert!(why.contains("more than its share"), "{why}"),
        r => panic!("a was not told why: {:?}", r.map(|f| f.map(|f| f.seq))),
    }
    assert!(held_by_a[1]
        .lease
        .revoked()
        .unwrap()
        .contains("more than its share"));
    assert!(b4.lease.is_valid() && b7.lease.is_valid() && c8.lease.is_valid());
    assert!(filled_with(&b4, 4) && filled_with(&b7, 7) && filled_with(&c8, 8));
    drop(cam);
    std::fs::remove_dir_all(&dir).ok();
}

/// A lossless subscriber a little slower than a publisher sending flat out: the publisher
/// waits for its releases at every budget, and each release's doorbell wakes it, not its
/// max-wait running out. (A doorbell the connection thread had stopped watching after a ring
/// for nothing left those waits to run out: frames skipped by the hundred, and a tenth of the
/// rate.) On busy cores a wait may still run out now and then (the subscriber late by a whole
/// max-wait, 40 ms): 1 % of the frames is the margin.
#[test]
fn a_flat_out_publisher_is_woken_by_every_release_it_waits_for() {
    const N: u64 = 3000;
    let dir = scratch("flat-out");
    let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
    let cam = Publisher::new(&dir.join("cam"), layout, (30, 1), 4, Config::default()).unwrap();
    let path = dir.join("cam");
    let consumer = std::thread::spawn(move || {
        let opts = ConnectOptions {
            mode: Delivery::Lossless,
            ..Default::default()
        };
        let mut sub = Subscriber::connect(&path, opts).unwrap();
        let mut offsets = Vec::new();
        loop {
            match sub.next_frame(Some(Duration::from_secs(10))) {
                Ok(Some(f)) => {
                    offsets.push(f.meta.offset);
                    std::thread::sleep(Duration::from_micros(50));
                }
                Ok(None) => break offsets,
                Err(e) => panic!("after {} frames: {e}", offsets.len()),
            }
        }
    });
    until("the subscriber", || cam.num_clients() == 1);
    for v in 0..N {
        publish(&cam, v as u8);
    }
    cam.send_eos();
    let offsets = consumer.join().unwrap();
    let (stats, _) = cam.stats();
    eprintln!("{} frames; {stats:?}", offsets.len());
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "in order");
    assert!(
        offsets.len() as u64 >= N - N / 100,
        "{} of {N} frames",
        offsets.len()
    );
    assert!(stats.times_lagged <= N / 100, "{stats:?}");
    drop(cam);
    std::fs::remove_dir_all(&dir).ok();
}

/// Events reach a subscriber in order with the frames: those sent before a frame come with
/// it, those after the last frame at the end; a subscriber that connects later gets the
/// latest sticky event of each key before its first frame, and not the others.
#[test]
fn events_come_with_the_frame_they_precede_and_sticky_ones_to_late_joiners() {
    let dir = scratch("events");
    let cam = camera(&dir, 4);
    let mut sub = connect(&dir, true);
    until("the subscriber", || cam.num_clients() == 1);
    let names = |f: &Frame| f.events.iter().map(|e| e.to_string()).collect::<Vec<_>>();
    cam.send_event("a", None);
    publish(&cam, 1);
    assert_eq!(names(&take(&mut sub)), ["a"]);
    cam.send_event("b", Some("tags"));
    cam.send_event("c", None);
    publish(&cam, 2);
    assert_eq!(names(&take(&mut sub)), ["b", "c"]);
    publish(&cam, 3);
    assert!(take(&mut sub).events.is_empty());
    cam.send_event("b2", Some("tags"));
    let mut late = connect(&dir, true);
    until("the late subscriber", || cam.num_clients() == 2);
    publish(&cam, 4);
    assert_eq!(names(&take(&mut late)), ["b2"]);
    assert_eq!(names(&take(&mut sub)), ["b2"]);
    cam.send_event("d", None);
    cam.send_eos();
    assert!(sub
        .next_frame(Some(Duration::from_secs(5)))
        .unwrap()
        .is_none());
    assert_eq!(
        sub.take_events()
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>(),
        ["d"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A producer that floods events at a subscriber that does not read its socket meanwhile
/// cannot cut it nor make it keep more than [`crate::policy::EVENTS_KEPT_MAX`]: it misses
/// events it had no room for, gets the frame after them, and the stream goes on.
#[test]
fn a_flood_of_events_costs_a_subscriber_events_not_its_stream() {
    let dir = scratch("event-flood");
    let cam = camera(&dir, 4);
    let mut sub = connect(&dir, true);
    until("the subscriber", || cam.num_clients() == 1);
    let payload = "x".repeat(200);
    for n in 0..5000 {
        cam.send_event(&format!("{n} {payload}"), None);
    }
    assert_eq!(cam.num_clients(), 1, "cut for events it did not read");
    publish(&cam, 1);
    let f = take(&mut sub);
    assert!(filled_with(&f, 1));
    assert!(!f.events.is_empty() && f.events.len() <= crate::policy::EVENTS_KEPT_MAX);
    assert!(f.events.len() < 5000, "the socket held them all: no flood");
    drop(f);
    cam.send_event("after", None);
    publish(&cam, 2);
    let f = take(&mut sub);
    assert!(filled_with(&f, 2));
    assert_eq!(
        f.events.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
        ["after"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
