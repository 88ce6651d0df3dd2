// SPDX-License-Identifier: MPL-2.0
//! The `gpushm` command against a real producer and real consumers (threads of this process
//! using the gpushm crate; the command runs as its own process): what `list`, `inspect` and
//! `top` say must be what the producer published and what each consumer counted.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushm::format::{FrameLayout, VideoFormat};
use gpushm::publisher::{Config, Publisher};
use gpushm::subscriber::{ConnectOptions, Delivery, Subscriber};
use serde_json::Value;

/// The command: cargo's build of it, or (tests packed for another machine by
/// scripts/device-pack.sh) bin/gpushm beside the tests' folder.
fn exe() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_gpushm"));
    if built.exists() {
        return built;
    }
    let me = std::env::current_exe().expect("current_exe");
    let packed = me
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("bin/gpushm"));
    packed.filter(|p| p.exists()).unwrap_or_else(|| {
        panic!(
            "no gpushm command at {} or beside the tests",
            built.display()
        )
    })
}

fn gpushm(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(exe())
        .args(args)
        .env("GPUSHM_RUNTIME_DIR", dir)
        .output()
        .expect("run gpushm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(dir: &Path, args: &[&str]) -> Value {
    let (rc, out, err) = gpushm(dir, args);
    assert_eq!(rc, 0, "gpushm {args:?}: {err}");
    serde_json::from_str(out.lines().last().unwrap_or("")).unwrap_or_else(|_| {
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("gpushm {args:?} printed no JSON ({e}): {out}"))
    })
}

/// A consumer thread: counts the frames it takes (and checks each holds its sequence byte),
/// holding each `hold` before releasing it.
struct Counter {
    taken: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Counter {
    fn start(path: &Path, name: &str, mode: Delivery, hold: Duration) -> Self {
        let opts = ConnectOptions {
            mode,
            name: name.into(),
            ..Default::default()
        };
        let mut sub = Subscriber::connect(path, opts).expect("connect");
        let taken = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, d, s) = (taken.clone(), dropped.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match sub.next_frame(Some(Duration::from_millis(50))) {
                    Ok(Some(f)) => {
                        assert_eq!(f.to_vec()[0], (f.seq % 251) as u8, "frame contents");
                        std::thread::sleep(hold);
                        drop(f);
                        t.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(None) | Err(gpushm::Error::Timeout(_)) => {}
                    Err(e) => panic!("consumer: {e}"),
                }
                d.store(sub.dropped(), Ordering::SeqCst);
            }
        });
        Self {
            taken,
            dropped,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn client<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["client_list"]
        .as_array()
        .expect("client_list")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no client {name} in {v}"))
}

#[test]
fn list_inspect_and_top_report_what_the_producer_published_and_the_clients_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cam");
    let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
    let camera = Arc::new(Publisher::new(&path, layout, (100, 1), 8, Config::default()).unwrap());
    // Both consumers connect before the first frame: every frame counts for them.
    let fast = Counter::start(&path, "fast", Delivery::Lossless, Duration::ZERO);
    // Holds each frame 60 ms at 100 fps: it keeps up with about a sixth and drops the rest.
    let slow = Counter::start(&path, "slow", Delivery::Leaky, Duration::from_millis(60));
    // A name meant to rewrite the terminal of whoever lists it.
    let evil = Counter::start(
        &path,
        "evil\x1b[2J\u{202e}",
        Delivery::Leaky,
        Duration::ZERO,
    );
    let publishing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (camera, publishing) = (camera.clone(), publishing.clone());
        std::thread::spawn(move || {
            let mut n = 1u64;
            while publishing.load(Ordering::Relaxed) {
                if let Ok(mut slot) = camera.acquire(Duration::from_millis(100)) {
                    // Frames are numbered from 1 in publishing order (their seq).
                    slot.bytes_mut().fill((n % 251) as u8);
                    camera.publish(slot, None).unwrap();
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    // A socket nobody listens on: a producer that was killed.
    drop(std::os::unix::net::UnixListener::bind(dir.path().join("dead")).unwrap());
    std::thread::sleep(Duration::from_millis(1500));

    let list = json(dir.path(), &["list", "--json"]);
    let streams = list.as_array().expect("array");
    assert_eq!(streams.len(), 2, "{list}");
    let cam = streams
        .iter()
        .find(|s| s["name"] == "cam")
        .expect("cam listed");
    assert_eq!(cam["state"], "live");
    assert_eq!(cam["path"], path.to_str().unwrap());
    assert_eq!(cam["clients"], 3);
    assert_eq!(cam["slots"], 8);
    assert!(cam["caps"].as_str().unwrap().contains("GRAY8"), "{cam}");
    assert!(
        cam["caps"].as_str().unwrap().contains("width=(int)64"),
        "{cam}"
    );
    let fps = cam["fps"].as_f64().unwrap();
    // Paced by a 10 ms sleep per frame: below 100, well above nothing.
    assert!((30.0..=110.0).contains(&fps), "fps {fps}");
    assert!(cam["ring_size"].as_u64().unwrap() >= 8 * 64 * 48);
    assert_eq!(cam["producer_pid"], std::process::id());
    let dead = streams
        .iter()
        .find(|s| s["name"] == "dead")
        .expect("dead listed");
    assert_eq!(dead["state"], "stale", "{dead}");
    // The table says the same.
    let (rc, table, err) = gpushm(dir.path(), &["list"]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("cam") && l.contains("GRAY8 64x48")),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("dead") && l.contains("stale")),
        "{table}"
    );

    // Live: what top says lies between what the clients counted before and after it asked
    // (after the last report, which a producer sends again for 100 ms, has gone stale).
    std::thread::sleep(Duration::from_millis(150));
    let before = (
        fast.taken.load(Ordering::SeqCst),
        slow.taken.load(Ordering::SeqCst),
    );
    let top = json(dir.path(), &["top", "--json", "-n", "1", "cam"]);
    let after = (
        fast.taken.load(Ordering::SeqCst),
        slow.taken.load(Ordering::SeqCst),
    );
    let s = &top["streams"][0];
    for (name, lo, hi) in [("fast", before.0, after.0), ("slow", before.1, after.1)] {
        let c = client(s, name);
        let d = c["delivered"].as_u64().unwrap();
        // A frame taken and not yet counted (the consumer counts it when it lets it go).
        assert!(
            lo <= d && d <= hi + 1,
            "{name}: top says {d}, the client counted {lo}..{hi}"
        );
    }
    assert_eq!(client(s, "fast")["mode"], "lossless");
    assert_eq!(client(s, "slow")["mode"], "leaky");
    // Publish to take: a consumer that keeps up takes a frame within a few ms (a woken thread,
    // well above the histogram's first bucket); one that takes a frame every 60 ms takes
    // frames that waited for it.
    let fast_p50 = client(s, "fast")["latency_p50_us"].as_f64().unwrap();
    let slow_p50 = client(s, "slow")["latency_p50_us"].as_f64().unwrap();
    assert!(
        (2.0..20_000.0).contains(&fast_p50),
        "fast p50 {fast_p50} us"
    );
    assert!(
        slow_p50 > fast_p50,
        "slow p50 {slow_p50} us, fast {fast_p50} us"
    );
    eprintln!("p50: fast {fast_p50} us, slow {slow_p50} us");

    // Two refreshes while frames flow: the second has rates over the interval, by the
    // producer's clock, and the consumer that keeps up takes frames at the producer's rate.
    let (rc, out, err) = gpushm(
        dir.path(),
        &["top", "--json", "-n", "2", "-d", "0.5", "cam"],
    );
    assert_eq!(rc, 0, "{err}");
    let second: Value = serde_json::from_str(out.lines().nth(1).expect("two lines")).unwrap();
    let s = &second["streams"][0];
    let fps = s["fps"].as_f64().unwrap();
    assert!((30.0..=110.0).contains(&fps), "fps {fps}");
    let rate = client(s, "fast")["delivered_per_s"].as_f64().unwrap();
    assert!(
        (rate - fps).abs() <= fps * 0.25,
        "fast takes {rate}/s of {fps}/s"
    );
    assert!(s["cpu_per_frame_us"].as_f64().unwrap() > 0.0, "{s}");

    // Stopped: every figure settles and must equal the clients' own.
    publishing.store(false, Ordering::Relaxed);
    producer.join().unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let inspect = json(dir.path(), &["inspect", "--json", "cam"]);
    let sent = inspect["frames_sent"].as_u64().unwrap();
    assert!(sent > 50, "{inspect}");
    let fast_c = client(&inspect, "fast");
    assert_eq!(
        fast_c["delivered"].as_u64().unwrap(),
        fast.taken.load(Ordering::SeqCst)
    );
    assert_eq!(
        fast_c["delivered"].as_u64().unwrap(),
        sent,
        "a lossless consumer gets every frame"
    );
    assert_eq!(fast_c["dropped"], 0);
    let slow_c = client(&inspect, "slow");
    assert_eq!(
        slow_c["delivered"].as_u64().unwrap(),
        slow.taken.load(Ordering::SeqCst)
    );
    assert_eq!(
        slow_c["dropped"].as_u64().unwrap(),
        slow.dropped.load(Ordering::SeqCst)
    );
    assert!(slow_c["dropped"].as_u64().unwrap() > 10, "{slow_c}");
    assert_eq!(
        slow_c["delivered"].as_u64().unwrap() + slow_c["dropped"].as_u64().unwrap(),
        sent,
        "every frame the slow consumer did not take is counted as dropped: {slow_c}"
    );
    assert_eq!(fast_c["held"], 0);
    // Text inspect names both clients.
    let (rc, text, err) = gpushm(dir.path(), &["inspect", "cam"]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        text.contains("\"fast\"") && text.contains("\"slow\"") && text.contains("8 slots"),
        "{text}"
    );
    // A client's own words reach the terminal escaped.
    assert!(
        !text.contains('\x1b') && !text.contains('\u{202e}'),
        "{text:?}"
    );
    assert!(text.contains("evil\\u{1b}[2J\\u{202e}"), "{text}");

    // Two refreshes: the second has a rate and the producer's CPU per frame (none published
    // in between now: no rate to divide by).
    let (rc, out, err) = gpushm(dir.path(), &["top", "--json", "-n", "2", "-d", "0.3"]);
    assert_eq!(rc, 0, "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    drop((fast, slow, evil));
}

#[test]
fn bad_names_and_missing_streams_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (rc, _, err) = gpushm(dir.path(), &["inspect", ".hidden"]);
    assert_eq!(rc, 1);
    assert!(
        err.contains("stream name \".hidden\" is not valid"),
        "{err}"
    );
    let (rc, _, err) = gpushm(dir.path(), &["inspect", "nobody-here"]);
    assert_eq!(rc, 1);
    assert!(err.contains("nobody-here"), "{err}");
    let (rc, out, _) = gpushm(dir.path(), &["list"]);
    assert_eq!(rc, 0);
    assert!(out.contains("no streams in"), "{out}");
    let list = json(dir.path(), &["list", "--json"]);
    assert_eq!(list, Value::Array(vec![]));
    let started = Instant::now();
    let (rc, _, err) = gpushm(dir.path(), &["top", "-d", "0", "-n", "1"]);
    assert_eq!(rc, 1, "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}
