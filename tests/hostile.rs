// SPDX-License-Identifier: MPL-2.0
//! A peer can only hurt itself. Each test attacks the way a hostile peer would, through the
//! real socket and real shared memory: raw protocol clients, a fake producer built from the
//! ring's own parts but writing what it likes, connection floods under a low descriptor limit,
//! a hostile umask, and (as root) a second user. The victims are real processes whose frames
//! are checked byte for byte.

mod common;
use common::*;
#[path = "common/fake_producer.rs"]
mod fake_producer;
use fake_producer::*;

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use gpushm::ring::layout::MAX_PLANES;
use gpushm::ring::producer_end::{Entry, FrameMeta, TimeCode};
use gpushm::wire::{Conn, Message, FLAG_LOSSLESS, FLAG_WRITABLE_RING, RING_WRITABLE};
use gst::prelude::*;

/// Real-time victims: one attack at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn now() -> u64 {
    gpushm::monotonic_ns()
}

/// A live 30 fps pattern producer (until killed).
fn producer(sock: &Path, extra: &[&str]) -> Proc {
    let mut p = example("pattern_producer");
    p.args([
        "--socket",
        sock.to_str().unwrap(),
        "--frames",
        "0",
        "--fps",
        "30",
    ]);
    p.args(["--width", "320", "--height", "240", "--format", "I420"]);
    p.args(extra);
    let p = Proc::spawn(p, "pattern_producer");
    wait_for_path(sock, Duration::from_secs(10));
    p
}

/// A lossless consumer that checks every byte and prints each frame with its arrival time.
fn victim(sock: &Path) -> Proc {
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--print",
        "--lossless",
        "--no-reconnect",
    ]);
    Proc::spawn(c, "victim")
}

/// (frame number, arrival time) of every FRAME line, asserting each one verified.
fn frames(lines: &[String]) -> Vec<(u64, u64)> {
    lines
        .iter()
        .filter(|l| l.starts_with("FRAME "))
        .map(|l| {
            assert!(l.ends_with("ok=true"), "the victim got a bad frame: {l}");
            let f = fields(std::slice::from_ref(l), "FRAME ");
            (num(&f, "n") as u64, num(&f, "t") as u64)
        })
        .collect()
}

/// The victim received every frame at full rate (30 fps) between `from` and `to`.
fn assert_full_rate(lines: &[String], from: u64, to: u64) {
    let f: Vec<(u64, u64)> = frames(lines)
        .into_iter()
        .filter(|&(_, t)| t >= from && t <= to)
        .collect();
    for w in f.windows(2) {
        assert_eq!(
            w[1].0,
            w[0].0 + 1,
            "the victim missed frames after {}",
            w[0].0
        );
    }
    let expected = (to - from) as f64 * 30.0 / 1e9;
    assert!(
        f.len() as f64 >= expected * 0.9,
        "the victim got {} frames in {:.1} s",
        f.len(),
        (to - from) as f64 / 1e9
    );
}

/// What the producer let in between `from` and `to` (CLOCK_MONOTONIC ns), from its
/// `ADMISSION` lines (pattern_producer --admission-every): connections accepted, reports
/// built, and the seconds between the two samples they are read from.
fn admitted(lines: &[String], from: u64, to: u64) -> (u64, u64, f64) {
    let samples: Vec<(u64, u64, u64)> = lines
        .iter()
        .filter(|l| l.starts_with("ADMISSION "))
        .map(|l| {
            let f = fields(std::slice::from_ref(l), "ADMISSION ");
            (
                num(&f, "t") as u64,
                num(&f, "accepted") as u64,
                num(&f, "reports") as u64,
            )
        })
        .collect();
    let first = samples
        .iter()
        .rev()
        .find(|s| s.0 <= from)
        .or(samples.first())
        .expect("ADMISSION lines from the producer");
    let last = samples
        .iter()
        .rev()
        .find(|s| s.0 <= to)
        .expect("ADMISSION lines from the producer");
    (
        last.1 - first.1,
        last.2 - first.2,
        last.0.saturating_sub(first.0) as f64 / 1e9,
    )
}

/// The most connections the producer may accept in `secs`: its admission rate, after a
/// burst, with a quarter of a second's slack for when the counts were read. What bounds a
/// flood's cost whatever else the machine is doing.
fn most_accepted(secs: f64) -> u64 {
    use gpushm::policy::{ACCEPT_BURST, ACCEPT_RATE};
    ((secs + 0.25) * ACCEPT_RATE as f64) as u64 + ACCEPT_BURST as u64
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

type Raw = RawClient;

fn raw_connect(sock: &Path, flags: u32) -> Raw {
    raw_client(sock, flags).recv_ring()
}

/// Takes the next frame delivered to a raw client.
fn take(r: &Raw) -> Entry {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(e) = r.ch.take().unwrap() {
            return e;
        }
        assert!(Instant::now() < deadline, "no frame delivered");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Item 1: a release batch holding a frame the client has, then one it never got. The
/// producer must get its slot back when it drops that client: eight such clients (one per
/// slot) used to stop the producer for good.
#[test]
fn a_bogus_release_batch_costs_the_producer_no_slot() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("batch.sock");
    let mut p = producer(&sock, &["--slots", "8"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let from = now();
    for round in 0..3 {
        let attackers: Vec<Raw> = (0..8).map(|_| raw_connect(&sock, 0)).collect();
        for a in &attackers {
            let e = take(a);
            assert!(a.ch.release(e));
            assert!(a.ch.release(Entry {
                seq: e.seq + 1000,
                ring_gen: e.ring_gen,
                slot: (e.slot + 1) % 8,
            }));
            a.release.ring();
        }
        std::thread::sleep(Duration::from_millis(300));
        drop(attackers);
        println!("round {round} done");
    }
    std::thread::sleep(Duration::from_secs(2));
    let to = now();
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
}

/// Items 2 and 3: the read-only ring cannot be written by a consumer, not by reopening its
/// descriptor read-write, not by asking for a writable ring (unless the producer allows it),
/// and fchmod on the descriptor stops no one.
#[test]
fn a_consumer_cannot_write_the_ring_or_lock_others_out() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("ro.sock");
    let mut p = producer(&sock, &[]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let from = now();
    // Asks for a writable ring: gets the read-only one, and is told so.
    let a = raw_connect(&sock, FLAG_WRITABLE_RING);
    let (ring, flags) = a.ring.as_ref().expect("a ring");
    assert_eq!(
        flags & RING_WRITABLE,
        0,
        "writable rings are off by default"
    );
    // Reopens it read-write through /proc: open works, writing does not.
    let rw = nix::fcntl::open(
        format!("/proc/self/fd/{}", ring.as_raw_fd()).as_str(),
        nix::fcntl::OFlag::O_RDWR,
        nix::sys::stat::Mode::empty(),
    );
    if let Ok(rw) = rw {
        let file = std::fs::File::from(rw);
        let size = file.metadata().unwrap().len() as usize;
        assert!(
            unsafe { memmap2::MmapOptions::new().len(size).map_mut(&file) }.is_err(),
            "a consumer mapped the ring writable"
        );
        assert!(
            (&file).write(&[0xff; 4096]).is_err(),
            "a consumer wrote to the ring"
        );
    }
    // fchmod through its descriptor: new consumers still connect.
    let _ = nix::sys::stat::fchmod(ring.as_fd(), nix::sys::stat::Mode::empty());
    let mut late = victim(&sock);
    late.wait_line("FRAME ", Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(2));
    let to = now();
    drop(a);
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
    let (_, late_out) = late.finish(Duration::from_secs(10));
    assert!(frames(&late_out).len() > 20);
}

/// With allow-writable-ring=true, a client that asks gets a writable ring, and says so.
#[test]
fn writable_rings_only_where_the_producer_allows_them() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("rw.sock");
    let p = gst::parse::launch(&format!(
        "videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=64,height=48 ! gpushmsink allow-writable-ring=true socket-path={}",
        sock.display()
    ))
    .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    let a = raw_connect(&sock, FLAG_WRITABLE_RING);
    let (ring, flags) = a.ring.as_ref().expect("a ring");
    assert_eq!(flags & RING_WRITABLE, RING_WRITABLE);
    let file = std::fs::File::from(ring.try_clone().unwrap());
    let size = file.metadata().unwrap().len() as usize;
    assert!(unsafe { memmap2::MmapOptions::new().len(size).map_mut(&file) }.is_ok());
    // One that does not ask still gets the read-only one.
    let b = raw_connect(&sock, 0);
    assert_eq!(b.ring.as_ref().unwrap().1 & RING_WRITABLE, 0);
    p.set_state(gst::State::Null).unwrap();
}

fn checker(sock: &Path, extra: &[&str]) -> Proc {
    let mut c = example("frame_checker");
    c.args(["--socket", sock.to_str().unwrap(), "--print"]);
    c.args(extra);
    Proc::spawn(c, "consumer")
}

/// Item 4: a producer writing extreme values in every timing field (u64::MAX publish time,
/// clock times, durations, latency, a nonsense time code) never crashes a consumer, and its
/// frames still arrive with the right bytes.
#[test]
fn extreme_timing_values_from_a_producer_never_crash_a_consumer() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fake.sock");
    let fake = FakeProducer::new(&sock);
    let consumer = checker(&sock, &["--frames", "8", "--no-reconnect"]);
    let mut c = fake.accept();
    let extremes = [u64::MAX, u64::MAX - 1, 0, 1 << 63];
    for n in 0..8u64 {
        let x = extremes[n as usize % extremes.len()];
        let meta = FrameMeta {
            pts: x,
            dts: x,
            duration: x,
            pts_clock: x,
            dts_clock: extremes[(n as usize + 1) % 4],
            publish_ns: x,
            latency: x,
            buffer_flags: u32::MAX,
            timecode: Some(TimeCode {
                fps_n: u32::MAX,
                fps_d: n as u32 % 2,
                flags: u32::MAX,
                hours: u32::MAX,
                minutes: 99,
                seconds: 99,
                frames: u32::MAX,
                field_count: 7,
            }),
            ..Default::default()
        };
        fake.send(&mut c, n, meta);
        std::thread::sleep(Duration::from_millis(30));
    }
    let (status, out) = consumer.finish(Duration::from_secs(20));
    assert!(
        status.code().is_some(),
        "the consumer died from a signal: {status:?}\n{}",
        out.join("\n")
    );
    let got: Vec<&String> = out.iter().filter(|l| l.starts_with("FRAME ")).collect();
    assert_eq!(got.len(), 8, "{}", out.join("\n"));
    for (n, l) in got.iter().enumerate() {
        let f = fields(std::slice::from_ref(*l), "FRAME ");
        assert_eq!(num(&f, "n") as usize, n);
        assert_eq!(
            f["plane_sums"],
            (n * 64 * 48).to_string(),
            "frame {n} bytes: {l}"
        );
    }
    drop(c);
}

/// Metas a hostile producer sends beside its frames (FrameMetas, on the control socket) never
/// crash a consumer nor reach its pipeline wrongly: a serialized meta whose name length
/// overflows GStreamer's own check (8 + 0xFFFFFFFF + 2 wraps to 9), another process's CUDA
/// pointers (GpuShmCudaMeta), a spoofed publish time, a video layout meta, a kind that does
/// not exist, a frame flagged with metas that never came. (A NUL byte in any string ends
/// the connection: the wire refuses it, see `wire::tests`.) Every frame arrives with its bytes;
/// the only metas the consumer sees are the valid custom ones on frames 0 and 3 (frame 3's
/// near the 64 KiB a message holds).
#[test]
fn hostile_metas_from_a_producer_are_skipped_and_every_frame_arrives() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fake.sock");
    let fake = FakeProducer::new(&sock);
    let consumer = checker(&sock, &["--frames", "8", "--no-reconnect", "--lossless"]);
    let mut c = fake.accept();
    let serialized = |name: &[u8], name_len: u32| {
        let mut v = ((8 + name.len() + 2) as u32).to_le_bytes().to_vec();
        v.extend_from_slice(&name_len.to_le_bytes());
        v.extend_from_slice(name);
        v.extend_from_slice(&[0, 1]);
        format!("s {}\n", gst::glib::base64_encode(&v))
    };
    let big = format!(
        "c gpushm-big x, blob=(string){};\n",
        "y".repeat(gpushm::wire::MAX_PAYLOAD as usize - 200)
    );
    let payloads: [Option<String>; 8] = [
        Some("c gpushm-ok x, n=(int)1;\n".into()),
        Some(serialized(b"abcd", u32::MAX)),
        Some(
            "c GpuShmCudaMeta x, cuda-device=(int)0, device-ptr=(guint64)4096, size=(guint64)3072, read-only=(boolean)true;\n"
                .into(),
        ),
        Some(big),
        Some("r 5 - timestamp/x-gpushm-publish\nz what is this\n".into()),
        Some(serialized(b"GstVideoMeta", 12)),
        Some("c 9bad x, n=(int)1;\nc gpushm-ok not a structure ((\n".into()),
        None,
    ];
    for (n, payload) in payloads.into_iter().enumerate() {
        let n = n as u64;
        if let Some(payload) = payload {
            c.conn
                .send(
                    &Message::FrameMetas {
                        seq: n + 1,
                        payload,
                    },
                    &[],
                )
                .unwrap();
        }
        let meta = FrameMeta {
            has_metas: true,
            ..Default::default()
        };
        fake.send(&mut c, n, meta);
        std::thread::sleep(Duration::from_millis(30));
    }
    let (status, out) = consumer.finish(Duration::from_secs(20));
    assert!(status.success(), "{status:?}\n{}", out.join("\n"));
    let got: Vec<&String> = out.iter().filter(|l| l.starts_with("FRAME ")).collect();
    assert_eq!(got.len(), 8, "{}", out.join("\n"));
    for (n, l) in got.iter().enumerate() {
        let f = fields(std::slice::from_ref(*l), "FRAME ");
        assert_eq!(f["plane_sums"], (n * 64 * 48).to_string(), "frame {n}: {l}");
    }
    let metas: Vec<&String> = out
        .iter()
        .filter(|l| l.starts_with("META ") || l.starts_with("REFTS "))
        .collect();
    let short: Vec<String> = metas.iter().map(|l| gpushm::wire::cut_str(l, 60)).collect();
    assert_eq!(metas.len(), 2, "{short:#?}");
    assert_eq!(metas[0], "META n=0 gpushm-ok gpushm-ok, n=(int)1;");
    assert!(
        metas[1].starts_with("META n=3 gpushm-big gpushm-big, blob=(string)yyy"),
        "{short:#?}"
    );
    drop(c);
}

/// Item 5: a plane whose stride is narrower than a row (stride 1, the plane at the end of
/// the slot) is refused with a clear error instead of being read past its end.
#[test]
fn a_stride_narrower_than_a_row_is_refused_not_read_past() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("stride.sock");
    let fake = FakeProducer::new(&sock);
    let consumer = checker(&sock, &["--no-reconnect", "--chain", "videoconvert"]);
    let mut c = fake.accept();
    let mut meta = FrameMeta {
        n_planes: 1,
        ..Default::default()
    };
    meta.plane_stride = [1; MAX_PLANES];
    meta.plane_offset[0] = 64 * 48 - 48;
    fake.send(&mut c, 0, meta);
    let (status, out) = consumer.finish(Duration::from_secs(20));
    assert_eq!(status.code(), Some(2), "{}", out.join("\n"));
    assert!(
        out.iter()
            .any(|l| l.starts_with("ERROR") && l.contains("narrower than its 64 visible bytes")),
        "{}",
        out.join("\n")
    );
}

/// Item 6: descriptors beyond what a message carries are closed, on both sides: a client
/// sending 10 per message 300 times, and a producer doing the same to a reconnecting consumer.
#[test]
fn extra_descriptors_are_closed_on_both_sides() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fds.sock");
    let mut p = producer(&sock, &[]);
    let pid = p.child.id();
    std::thread::sleep(Duration::from_millis(500));
    let before = fd_count(pid);
    let hello = Message::Hello {
        flags: 0,
        pid: 1,
        name: "fds".into(),
    }
    .encode();
    let spare: Vec<std::fs::File> = (0..10)
        .map(|_| std::fs::File::open("/dev/null").unwrap())
        .collect();
    let raw: Vec<i32> = spare.iter().map(|f| f.as_raw_fd()).collect();
    for _ in 0..300 {
        let s = UnixStream::connect(&sock).unwrap();
        let _ = nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
            s.as_raw_fd(),
            &[std::io::IoSlice::new(&hello)],
            &[nix::sys::socket::ControlMessage::ScmRights(&raw)],
            nix::sys::socket::MsgFlags::empty(),
            None,
        );
    }
    std::thread::sleep(Duration::from_millis(1500));
    let after = fd_count(pid);
    assert!(
        after <= before + 2,
        "the producer leaked descriptors: {before} -> {after}"
    );
    // It still serves.
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    p.kill9();
    drop(v);

    // The other way: a fake producer that answers with the start of a Welcome carrying 10
    // descriptors, then hangs up; the consumer tries again each time (it waits for a real
    // producer) and must close what it received.
    let sock2 = dir.path().join("fds2.sock");
    let listener = UnixListener::bind(&sock2).unwrap();
    let mut consumer = checker(
        &sock2,
        &[
            "--src-props",
            "reconnect-interval=1000000 timeout=60000000000",
        ],
    );
    let welcome = Message::Welcome {
        client_id: 1,
        queue_capacity: 128,
    }
    .encode();
    let mut counts = Vec::new();
    // As many descriptors as fit in one receive (more are cut off by the kernel and refused).
    let five = &raw[..5];
    listener.set_nonblocking(true).unwrap();
    for i in 0..100 {
        let deadline = Instant::now() + Duration::from_secs(5);
        let s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("the consumer stopped reconnecting at {i}: {e}"),
            }
        };
        let _ = nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
            s.as_raw_fd(),
            &[std::io::IoSlice::new(&welcome[..10])],
            &[nix::sys::socket::ControlMessage::ScmRights(five)],
            nix::sys::socket::MsgFlags::empty(),
            None,
        );
        std::thread::sleep(Duration::from_millis(5));
        drop(s);
        if i == 10 || i == 99 {
            std::thread::sleep(Duration::from_millis(100));
            counts.push(fd_count(consumer.child.id()));
        }
    }
    assert!(consumer.is_running(), "the consumer kept trying");
    assert!(counts[0] > 0);
    assert!(
        counts[1] <= counts[0] + 2,
        "the consumer leaked descriptors over 90 reconnects: {counts:?}"
    );
}

/// Item 7: a flood of idle, fully connected clients under `ulimit -n 1024` never exhausts the
/// producer's descriptors: past max-clients they are refused with a message saying why, the
/// victim keeps its full rate, and new consumers get in once the flood is gone.
#[test]
fn a_connection_flood_cannot_exhaust_the_producer() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("flood.sock");
    let pp = build_dir_example("pattern_producer");
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        &format!(
            "ulimit -n 1024 && exec {} --socket {} --frames 0 --fps 30 --width 320 --height 240 --format I420",
            pp.display(),
            sock.display()
        ),
    ]);
    let mut p = Proc::spawn(cmd, "producer (ulimit -n 1024)");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let from = now();
    let mut flood = Vec::new();
    let mut refused = 0;
    for _ in 0..300 {
        let Ok(s) = UnixStream::connect(&sock) else {
            continue;
        };
        let mut conn = Conn::new(s);
        let _ = conn.send(
            &Message::Hello {
                flags: 0,
                pid: 1,
                name: "flood".into(),
            },
            &[],
        );
        match conn.recv_timeout(Duration::from_secs(2), None) {
            Ok(Some((Message::Error { message }, _))) => {
                assert!(message.contains("max-clients"), "{message}");
                refused += 1;
            }
            Ok(Some((Message::Welcome { .. }, fds))) => flood.push((conn, fds)),
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert!(refused >= 300 - 64, "refused {refused}");
    // Descriptors parked on connections: each sends the first byte of a message with 16
    // descriptors attached. The producer refuses them at once instead of keeping them.
    let spare: Vec<std::fs::File> = (0..16)
        .map(|_| std::fs::File::open("/dev/null").unwrap())
        .collect();
    let raw: Vec<i32> = spare.iter().map(|f| f.as_raw_fd()).collect();
    let mut parked = Vec::new();
    for _ in 0..100 {
        let Ok(s) = UnixStream::connect(&sock) else {
            continue;
        };
        let _ = nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
            s.as_raw_fd(),
            &[std::io::IoSlice::new(b"G")],
            &[nix::sys::socket::ControlMessage::ScmRights(&raw)],
            nix::sys::socket::MsgFlags::empty(),
            None,
        );
        parked.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    let fds = fd_count(p.child.id());
    assert!(
        fds < 64 * 4 + 100,
        "the producer holds {fds} descriptors with 100 connections parking 16 each"
    );
    drop(parked);
    std::thread::sleep(Duration::from_secs(1));
    let to = now();
    drop(flood);
    std::thread::sleep(Duration::from_millis(500));
    let mut late = victim(&sock);
    late.wait_line("FRAME ", Duration::from_secs(20));
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
}

fn build_dir_example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join(name)
}

/// Item 8: under umask 000 the socket never exists with wider permissions than `perms`: it
/// appears at its path already 0600, and nothing else is left in the directory.
#[test]
fn the_socket_never_has_wider_permissions_than_perms() {
    let _s = serial();
    for i in 0..5 {
        let dir = tmpdir();
        let sock = dir.path().join(format!("umask{i}.sock"));
        let mut launch = gst_launch(&format!(
            "videotestsrc is-live=true ! video/x-raw,width=64,height=48 ! gpushmsink socket-path={}",
            sock.display()
        ));
        let prog = launch.get_program().to_owned();
        let args: Vec<String> = launch
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let envs: Vec<(std::ffi::OsString, std::ffi::OsString)> = launch
            .get_envs()
            .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned())))
            .collect();
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg("umask 000 && exec \"$@\"")
            .arg("sh")
            .arg(prog)
            .args(args)
            .envs(envs);
        launch = cmd;
        let _p = Proc::spawn(launch, "producer (umask 000)");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mode = loop {
            if let Ok(m) = std::fs::symlink_metadata(&sock) {
                break m.permissions().mode() & 0o777;
            }
            assert!(Instant::now() < deadline, "no socket");
            std::thread::sleep(Duration::from_micros(200));
        };
        assert_eq!(mode, 0o600, "the socket appeared with mode {mode:o}");
        // The private directory goes right after the move: give it a moment.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let others: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n != &format!("umask{i}.sock"))
                .collect();
            if others.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "left behind: {others:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Item 12: a socket path near the 107-byte limit works end to end; one over it gets an error
/// naming the limit, on both sides.
#[test]
fn socket_paths_up_to_the_limit_work_and_longer_ones_say_why() {
    let _s = serial();
    init();
    let dir = tmpdir();
    let base = dir.path().display().to_string();
    let fill = 107 - base.len() - 1;
    let ok = format!("{base}/{}", "p".repeat(fill));
    assert_eq!(ok.len(), 107);
    let sock = Path::new(&ok);
    let mut p = producer(sock, &[]);
    let mut v = victim(sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    p.kill9();
    drop(v);
    let long = format!("{base}/{}", "q".repeat(fill + 10));
    let pipeline =
        gst::parse::launch(&format!("videotestsrc ! gpushmsink socket-path={long}")).unwrap();
    assert!(pipeline.set_state(gst::State::Playing).is_err());
    let bus = pipeline.bus().unwrap();
    let msg = bus
        .timed_pop_filtered(gst::ClockTime::from_seconds(5), &[gst::MessageType::Error])
        .expect("an error");
    let gst::MessageView::Error(e) = msg.view() else {
        unreachable!()
    };
    let text = e.error().to_string();
    assert!(text.contains("at most 107 bytes"), "{text}");
    pipeline.set_state(gst::State::Null).unwrap();
}

/// Item 13: a second message in the same write as Hello is refused, not ignored.
#[test]
fn a_message_sent_with_hello_is_refused() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("two.sock");
    let mut p = producer(&sock, &[]);
    let mut bytes = Message::Hello {
        flags: 0,
        pid: 1,
        name: "two".into(),
    }
    .encode();
    bytes.extend(Message::Eos.encode());
    let mut s = UnixStream::connect(&sock).unwrap();
    s.write_all(&bytes).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut conn = Conn::new(s);
    let reply = conn.recv_timeout(Duration::from_secs(5), None).unwrap();
    match reply {
        Some((Message::Error { message }, _)) => {
            assert!(message.contains("more than Hello"), "{message}")
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    p.kill9();
}

/// A directory every user may write to (and replace files in: no sticky bit), as a careless
/// shared directory would be.
fn shared_dir() -> tempfile::TempDir {
    let d = tmpdir();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

/// Item 9: another user cannot take over a live producer's socket: it cannot check it
/// (EACCES), so it refuses to start instead of replacing it, and the consumer keeps the real
/// producer's frames.
#[test]
fn second_user_cannot_take_over_a_live_socket() {
    let _s = serial();
    let dir = shared_dir();
    let sock = dir.path().join("cam");
    let mut p = producer(&sock, &[]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let from = now();
    let mut impostor = gst_launch(&format!(
        "videotestsrc is-live=true ! video/x-raw,width=160,height=120 ! gpushmsink perms=438 socket-path={}",
        sock.display()
    ));
    as_nobody(&mut impostor, dir.path());
    let (status, out) = Proc::spawn(impostor, "impostor").finish(Duration::from_secs(20));
    assert!(
        !status.success(),
        "the impostor started:\n{}",
        out.join("\n")
    );
    assert!(
        out.iter().any(|l| l.contains("cannot be checked")),
        "{}",
        out.join("\n")
    );
    std::thread::sleep(Duration::from_secs(1));
    let to = now();
    p.kill9();
    let (_, vout) = v.finish(Duration::from_secs(10));
    assert_full_rate(&vout, from, to);
    assert!(!vout.iter().any(|l| l.contains("width=(int)160")));
}

/// Item 10: after the producer stops, another user binds the same path; a consumer waiting to
/// reconnect refuses it (SO_PEERCRED), unless producer-uid names that user.
#[test]
fn second_user_squatting_the_path_gets_no_consumer() {
    let _s = serial();
    let dir = shared_dir();
    let sock = dir.path().join("cam");
    let p = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=64,height=48 ! gpushmsink socket-path={}",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let mut c = checker(&sock, &["--src-props", "reconnect-interval=10000000"]);
    c.wait_line("FRAME ", Duration::from_secs(20));
    // A clean stop (gst-launch on SIGINT) removes the socket.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.child.id() as i32),
        nix::sys::signal::SIGINT,
    )
    .unwrap();
    let _ = p.finish(Duration::from_secs(10));
    let mut impostor = gst_launch(&format!(
        "videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=160,height=120 ! gpushmsink perms=438 socket-path={}",
        sock.display()
    ));
    as_nobody(&mut impostor, dir.path());
    let mut imp = Proc::spawn(impostor, "impostor");
    wait_for_path(&sock, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));
    // The same user's consumer took nothing from it; one that names its uid does.
    let mut named = checker(&sock, &["--src-props", "producer-uid=65534"]);
    named.wait_line("FRAME ", Duration::from_secs(20));
    imp.kill9();
    // Both would wait for a producer forever (reconnect=true).
    c.kill9();
    named.kill9();
    let (_, out) = c.finish(Duration::from_secs(10));
    assert!(
        !out.iter().any(|l| l.contains("width=(int)160")),
        "the consumer took the impostor's frames:\n{}",
        out.join("\n")
    );
    let (_, nout) = named.finish(Duration::from_secs(10));
    assert!(nout.iter().any(|l| l.contains("width=(int)160")));
}

/// Clients that take frames and never give them back (they break no rule) cannot stop the
/// producer: once they hold every slot for a moment, the one holding most is disconnected,
/// and the victim goes on.
#[test]
fn clients_that_take_and_hold_every_slot_cannot_stop_the_producer() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("hold.sock");
    let mut p = producer(&sock, &["--slots", "8"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    // Three lossless hoarders take every frame delivered to them and release nothing.
    let hoarders: Vec<Raw> = (0..3).map(|_| raw_connect(&sock, FLAG_LOSSLESS)).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let taker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for h in &hoarders {
                    while let Ok(Some(_)) = h.ch.take() {}
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            hoarders
        })
    };
    std::thread::sleep(Duration::from_secs(4));
    let from = now() - 2_000_000_000;
    let to = now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _hoarders = taker.join().unwrap();
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    // The last two seconds: every frame, at full rate.
    assert_full_rate(&out, from, to);
}

/// Close, the message a consumer sends when it stops taking frames but keeps some: clients
/// that take frames, hold them and close cannot stall the producer (closed holders have no
/// share of the ring and are cut first once every slot is held), a client that closes holding
/// nothing is let go at once (it takes no client place), and one that says Close twice is cut.
/// The victim keeps its full rate.
#[test]
fn clients_that_close_cannot_stall_or_crowd_the_producer() {
    use gpushm::wire::Message;
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("close.sock");
    let mut p = producer(&sock, &["--slots", "8"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let reason = |r: &mut RawClient| -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match r.conn.recv_timeout(Duration::from_millis(200), None) {
                Ok(Some((Message::Error { message }, _))) => return message,
                Ok(_) | Err(gpushm::Error::Timeout(_)) => {}
                Err(e) => return format!("no reason, {e}"),
            }
        }
        "nothing said".into()
    };
    // Closes holding nothing: let go at once.
    let mut idle = raw_connect(&sock, 0);
    idle.conn.send(&Message::Close, &[]).unwrap();
    let why = reason(&mut idle);
    assert!(why.contains("gave every frame back"), "{why}");
    // Says Close twice: cut.
    let mut twice = raw_connect(&sock, FLAG_LOSSLESS);
    let _held = take(&twice);
    twice.conn.send(&Message::Close, &[]).unwrap();
    twice.conn.send(&Message::Close, &[]).unwrap();
    let why = reason(&mut twice);
    assert!(why.contains("unexpected Close"), "{why}");
    // Three lossless hoarders take all they are given, release nothing, and close.
    let hoarders: Vec<Raw> = (0..3).map(|_| raw_connect(&sock, FLAG_LOSSLESS)).collect();
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        for h in &hoarders {
            while let Ok(Some(_)) = h.ch.take() {}
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    for h in &hoarders {
        h.conn.send(&Message::Close, &[]).unwrap();
    }
    std::thread::sleep(Duration::from_secs(3));
    let from = now() - 2_000_000_000;
    let to = now();
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    // The last two seconds: every frame, at full rate.
    assert_full_rate(&out, from, to);
    drop(hoarders);
}

/// Issue 27, item 1: a consumer that makes its wake-up descriptors blocking and full, and
/// asks to be woken after every frame, cannot make the producer block: the victim keeps its
/// full rate (the producer used to block in write(2) with its lock held, for good).
#[test]
fn a_consumer_cannot_block_the_producer_through_its_wake_up_descriptors() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("flags.sock");
    let mut p = producer(&sock, &[]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let hostile = raw_connect(&sock, 0);
    make_blocking(hostile.ready.as_fd(), true);
    make_blocking(hostile.release.as_fd(), false);
    // "Wake me after every delivery" (and ahead of each frame: gpushmsink's wake-early),
    // and never read.
    hostile.ch.set_waiting(gpushm::ring::layout::WAITS_SLEEPING);
    std::thread::sleep(Duration::from_secs(3));
    let from = now() - 2_000_000_000;
    let to = now();
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
    drop(hostile);
}

/// Issue 27, item 2: a producer that makes the wake-up descriptors it handed out blocking and
/// full, and asks to be woken after every release, cannot make a consumer block: waiting for
/// a frame times out as asked, and dropping a frame returns (both used to block in read(2) /
/// write(2) for good).
#[test]
fn a_producer_cannot_block_a_consumer_through_its_wake_up_descriptors() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fake-flags.sock");
    let fake = FakeProducer::new(&sock);
    let (tx, rx) = std::sync::mpsc::channel();
    let path = sock.clone();
    let consumer = std::thread::spawn(move || {
        let mut sub =
            gpushm::subscriber::Subscriber::connect(&path, Default::default()).expect("connect");
        let first = sub.next_frame(Some(Duration::from_secs(10)));
        tx.send(format!(
            "frame: {}",
            first.as_ref().is_ok_and(|f| f.is_some())
        ))
        .unwrap();
        // Its release wakes the producer, which asked for that.
        drop(first);
        tx.send("released".to_string()).unwrap();
        for _ in 0..3 {
            let r = sub.next_frame(Some(Duration::from_millis(300)));
            tx.send(format!(
                "waited: {}",
                r.err().map(|e| e.to_string()).unwrap_or_default()
            ))
            .unwrap();
        }
    });
    let mut c = fake.accept();
    // The consumer's own ends: an empty one to wait on, a full one to ring.
    make_blocking(c.ready_theirs.as_fd(), false);
    make_blocking(c.release_theirs.as_fd(), true);
    c.ch.set_producer_waits(true);
    fake.send(&mut c, 0, FrameMeta::default());
    let mut said = Vec::new();
    while said.len() < 5 {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) => said.push(line),
            Err(_) => panic!("the consumer blocked; it said {said:?}"),
        }
    }
    assert_eq!(said[0], "frame: true", "{said:?}");
    for w in &said[2..] {
        assert!(w.contains("no frame"), "{said:?}");
    }
    consumer.join().unwrap();
    drop(c);
}

/// Issue 48: a client that closes its end of the slot-released doorbell and stays connected.
/// The producer's end then reports a hang-up on every poll: its connection thread used to
/// drain it (reading nothing) and poll again at once, a whole core for as long as the client
/// stayed. A hang-up is the client leaving: it is let go, and the producer's other consumer
/// keeps every frame. (The producer's CPU over the attack is printed.)
#[test]
fn a_client_that_closes_its_release_doorbell_is_let_go() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("closed-doorbell.sock");
    let mut p = producer(&sock, &[]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let RawClient {
        conn, ch, release, ..
    } = raw_connect(&sock, 0);
    let (from, cpu0) = (now(), process_cpu_time(p.child.id()));
    drop(release);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ch.revoked() {
        assert!(
            Instant::now() < deadline,
            "the client that closed its doorbell is still served"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_secs(2));
    let (to, cpu1) = (now(), process_cpu_time(p.child.id()));
    eprintln!(
        "producer at {:.0} % of a core",
        (cpu1 - cpu0).as_secs_f64() * 1e9 / (to - from) as f64 * 100.0
    );
    drop((conn, ch));
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
}

/// What [`subscriber_waiting`]'s subscriber says: whether its first frame came, then how its
/// wait for the next ended (the error, if it was one) and how long it took.
type Heard = Result<bool, (Option<String>, Duration)>;

/// A default subscriber of `sock`, in a thread: it takes one frame, then waits up to `wait`
/// for the next, and says so on the channel returned.
fn subscriber_waiting(
    sock: &Path,
    wait: Duration,
) -> (
    std::sync::mpsc::Receiver<Heard>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = sock.to_owned();
    let consumer = std::thread::spawn(move || {
        let mut sub =
            gpushm::subscriber::Subscriber::connect(&path, Default::default()).expect("connect");
        let first = sub.next_frame(Some(Duration::from_secs(10)));
        tx.send(Ok(first.is_ok_and(|f| f.is_some()))).unwrap();
        let start = Instant::now();
        let r = sub.next_frame(Some(wait));
        tx.send(Err((r.err().map(|e| e.to_string()), start.elapsed())))
            .unwrap();
    });
    (rx, consumer)
}

/// Issue 48, the other way: a producer that closes its end of a consumer's frame-ready
/// doorbell and keeps the connection. The consumer's end then polls readable for good: waiting
/// for a frame used to spin until its timeout. The consumer now says the producer is gone
/// at once, and spins nothing.
#[test]
fn a_producer_that_closes_the_frame_doorbell_is_gone_for_its_consumer() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fake-closed.sock");
    let fake = FakeProducer::new(&sock);
    let (rx, consumer) = subscriber_waiting(&sock, Duration::from_secs(10));
    let mut c = fake.accept();
    fake.send(&mut c, 0, FrameMeta::default());
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        Ok(true),
        "the first frame"
    );
    let FakeClient {
        conn, ch, ready, ..
    } = c;
    drop(ready);
    let (why, took) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the consumer's wait ended")
        .unwrap_err();
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("frame-ready doorbell")),
        "{why:?}"
    );
    assert!(took < Duration::from_secs(5), "it waited {took:?}");
    consumer.join().unwrap();
    drop((conn, ch));
}

/// A client that rings its slot-released doorbell in a loop (the doorbell says a release
/// waits, while the producer waits for one): each ring used to cost the connection thread a
/// round of work under the engine's lock, up to a core for as long as it went on. Now a ring
/// for nothing (nobody waits) stops the polling of that doorbell until the next wait: the
/// producer stops reading it, which the flooder sees as a full doorbell (a count the load of
/// the machine cannot change), and the other consumer keeps every frame.
#[test]
fn a_client_ringing_its_release_doorbell_in_a_loop_is_not_heard() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("ring-flood.sock");
    let mut p = producer(&sock, &[]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let flooder = raw_connect(&sock, 0);
    let (from, cpu0) = (now(), process_cpu_time(p.child.id()));
    let chunk = [1u8; 4096];
    let mut accepted = 0usize;
    let end = Instant::now() + Duration::from_secs(3);
    while Instant::now() < end {
        // What the producer does not read stays in the doorbell's buffer, which fills.
        match nix::sys::socket::send(
            flooder.release.as_raw_fd(),
            &chunk,
            nix::sys::socket::MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(n) => accepted += n,
            Err(_) => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    let (to, cpu1) = (now(), process_cpu_time(p.child.id()));
    eprintln!(
        "the doorbell took {} KiB in 3 s; producer at {:.0} % of a core",
        accepted / 1024,
        (cpu1 - cpu0).as_secs_f64() * 1e9 / (to - from) as f64 * 100.0
    );
    drop(flooder);
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
    // A socket's buffer (a few hundred KiB here), not the gigabytes a producer reading it
    // would let through in 3 s.
    assert!(
        accepted < 8 << 20,
        "the producer read {} MiB of rings in 3 s",
        accepted >> 20
    );
}

/// A producer that floods its socket with announcements (Caps, again and again, no frame):
/// the consumer used to read them while any byte waited, past its timeout, deaf to an
/// interrupt, at a core. Now it reads a bounded number a look, and a producer that sends
/// hundreds of messages and no frame is broken: the wait ends at once with an error.
#[test]
fn a_producer_flooding_its_socket_cannot_hold_a_consumer_past_its_timeout() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fake-flood.sock");
    let fake = FakeProducer::new(&sock);
    let (rx, consumer) = subscriber_waiting(&sock, Duration::from_millis(500));
    let mut c = fake.accept();
    fake.send(&mut c, 0, FrameMeta::default());
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), Ok(true));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c.conn.send(
                    &Message::Caps {
                        caps_gen: 1,
                        caps: String::new(),
                    },
                    &[],
                );
            }
            c
        })
    };
    let (why, took) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the consumer's wait ended")
        .unwrap_err();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let c = flood.join().unwrap();
    eprintln!("{why:?} after {took:?}");
    assert!(
        why.as_deref().is_some_and(|w| w.contains("flood")),
        "{why:?}"
    );
    assert!(took < Duration::from_secs(5), "it waited {took:?}");
    consumer.join().unwrap();
    drop(c);
}

/// A producer that never takes back what its consumer releases: the consumer used to keep
/// every release it could not write, 16 bytes a frame without end. It keeps a bounded number,
/// then says the producer takes nothing back.
#[test]
fn a_producer_that_takes_nothing_back_cannot_grow_a_consumer_without_end() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fake-noreclaim.sock");
    let fake = FakeProducer::new(&sock);
    let (tx, rx) = std::sync::mpsc::channel();
    let path = sock.clone();
    let consumer = std::thread::spawn(move || {
        let mut sub =
            gpushm::subscriber::Subscriber::connect(&path, Default::default()).expect("connect");
        let mut got = 0u64;
        let r = loop {
            match sub.next_frame(Some(Duration::from_secs(10))) {
                Ok(Some(f)) => {
                    got += 1;
                    drop(f);
                    tx.send(got).ok();
                }
                r => break r.map(|_| ()),
            }
        };
        (got, r.err().map(|e| e.to_string()))
    });
    let mut c = fake.accept();
    // Frames delivered as fast as the consumer takes them, releases never read.
    let mut n = 0u64;
    let mut taken = 0u64;
    while !consumer.is_finished() && n < 20_000 {
        if n < taken + 8 {
            fake.send(&mut c, n, FrameMeta::default());
            n += 1;
        } else if let Ok(t) = rx.recv_timeout(Duration::from_millis(100)) {
            taken = t;
        }
        while let Ok(t) = rx.try_recv() {
            taken = t;
        }
    }
    let (got, why) = consumer.join().unwrap();
    eprintln!("{got} frames, then {why:?}");
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("takes back none")),
        "{why:?} after {got} frames"
    );
    assert!(got < 5_000, "{got} frames given back into nowhere");
    drop(c);
}

/// Connects a default subscriber to `sock` (5 s timeout) and takes one frame: how long the
/// connection took, or why it failed.
fn connect_and_take(sock: &Path) -> Result<Duration, String> {
    let start = Instant::now();
    let opts = gpushm::subscriber::ConnectOptions {
        timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let mut sub = gpushm::subscriber::Subscriber::connect(sock, opts).map_err(|e| e.to_string())?;
    let took = start.elapsed();
    match sub.next_frame(Some(Duration::from_secs(5))) {
        Ok(Some(_)) => Ok(took),
        r => Err(format!(
            "connected, then no frame: {:?}",
            r.map(|f| f.is_some())
        )),
    }
}

/// Issue 27, item 5: sockets that connect and never say Hello, reopened as soon as the
/// producer drops them (more of them than it keeps in their handshake), cannot keep a
/// consumer out: it connects within 1 s and gets frames (it used to be refused: "16
/// connections are already in their handshake; try again").
#[test]
fn silent_connections_cannot_lock_consumers_out() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("slowloris.sock");
    let mut p = producer(&sock, &[]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attacker = {
        let (stop, sock) = (stop.clone(), sock.clone());
        std::thread::spawn(move || {
            let mut open: Vec<UnixStream> = Vec::new();
            let mut made = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Drop those the producer closed (readable: its Error, or EOF), open more.
                open.retain(|s| {
                    use std::io::Read;
                    let mut r: &UnixStream = s;
                    matches!(
                        r.read(&mut [0u8; 1]),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                    )
                });
                while open.len() < 100 {
                    if let Ok(s) = UnixStream::connect(&sock) {
                        s.set_nonblocking(true).unwrap();
                        open.push(s);
                        made += 1;
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            made
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    for round in 0..3 {
        let took = connect_and_take(&sock)
            .unwrap_or_else(|e| panic!("round {round}: a consumer was kept out: {e}"));
        assert!(
            took < Duration::from_secs(1),
            "round {round}: connecting took {took:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let made = attacker.join().unwrap();
    assert!(made > 100, "the attack opened only {made} connections");
    p.kill9();
}

/// Issue 27, item 5: max-clients raw clients that take no frame cannot keep a consumer out
/// (it used to be refused for as long as they stayed): a new consumer takes the place of the
/// one stalled longest, connects within 1 s and gets frames.
#[test]
fn idle_clients_cannot_lock_consumers_out() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("idle.sock");
    let mut p = producer(&sock, &[]);
    let idle: Vec<Raw> = (0..64).map(|_| raw_client(&sock, 0)).collect();
    // Frames wait for them, untaken, long enough for them to count as stalled.
    std::thread::sleep(Duration::from_millis(1500));
    for round in 0..3 {
        let took = connect_and_take(&sock)
            .unwrap_or_else(|e| panic!("round {round}: a consumer was kept out: {e}"));
        assert!(
            took < Duration::from_secs(1),
            "round {round}: connecting took {took:?}"
        );
    }
    drop(idle);
    p.kill9();
}

/// Issue 27, item 5: 64 consumers connecting at once (released together by a barrier), as
/// services started together at boot would, all get in within 5 s and get frames.
#[test]
fn sixty_four_consumers_connecting_at_once_all_get_in() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("boot.sock");
    let mut p = producer(&sock, &["--slots", "16"]);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(64));
    let threads: Vec<_> = (0..64)
        .map(|_| {
            let (barrier, sock) = (barrier.clone(), sock.clone());
            std::thread::spawn(move || {
                barrier.wait();
                connect_and_take(&sock)
            })
        })
        .collect();
    let results: Vec<Result<Duration, String>> =
        threads.into_iter().map(|t| t.join().unwrap()).collect();
    p.kill9();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of 64 failed: {failed:?}",
        failed.len()
    );
    let slowest = results.iter().map(|r| *r.as_ref().unwrap()).max().unwrap();
    assert!(
        slowest < Duration::from_secs(5),
        "the slowest took {slowest:?}"
    );
}

/// Issue 27, item 4: in a shared directory (0777, no sticky bit) another user renames the
/// producer's fresh private directory away and puts one of theirs in its place whose `s`
/// links to a file of the producer's user, hoping the producer chmods (perms=0666) or renames
/// through it. 300 starts against an attacker racing every one: the file keeps its mode
/// (starts the swap spoils may fail, saying why).
#[test]
fn second_user_swapping_the_private_directory_cannot_redirect_the_socket() {
    let _s = serial();
    let shared = shared_dir();
    let keep = tmpdir();
    let target = keep.path().join("secret");
    std::fs::write(&target, b"mine").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let script = r#"
import os, sys, time
shared, target, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.time() + secs
swaps = 0
mine = set()
while time.time() < end and not os.path.exists(os.path.join(shared, 'stop')):
    try:
        names = os.listdir(shared)
    except OSError:
        continue
    for n in names:
        if not n.startswith('.gpushm-') or len(n) != len('.gpushm-XXXXXX') or n in mine:
            continue
        d = os.path.join(shared, n)
        try:
            os.rename(d, d + '.%d' % swaps)
            os.mkdir(d, 0o777)
            mine.add(n)
            os.symlink(target, os.path.join(d, 's'))
            swaps += 1
        except OSError:
            pass
print('SWAPS', swaps, flush=True)
"#;
    let mut attacker = std::process::Command::new("python3");
    attacker.args([
        "-c",
        script,
        shared.path().to_str().unwrap(),
        target.to_str().unwrap(),
        "60",
    ]);
    as_nobody(&mut attacker, shared.path());
    let attacker = Proc::spawn(attacker, "attacker");
    std::thread::sleep(Duration::from_millis(300));
    let layout =
        gpushm::format::FrameLayout::new(gpushm::format::VideoFormat::Gray8, 64, 48).unwrap();
    let config = gpushm::publisher::Config {
        perms: 0o666,
        ..Default::default()
    };
    let (mut started, mut refused) = (0, Vec::new());
    for start in 0..300 {
        match gpushm::publisher::Publisher::new(
            &shared.path().join("cam"),
            layout.clone(),
            (30, 1),
            2,
            config.clone(),
        ) {
            Ok(p) => {
                started += 1;
                drop(p);
            }
            Err(e) => refused.push(e.to_string()),
        }
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            mode, 0o600,
            "start {start}: the attacker made the producer chmod its own file"
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"mine");
        std::thread::sleep(Duration::from_millis(3));
    }
    std::fs::write(shared.path().join("stop"), b"").unwrap();
    let (_, out) = attacker.finish(Duration::from_secs(30));
    let swaps: usize = out
        .iter()
        .find_map(|l| l.strip_prefix("SWAPS ").map(|n| n.trim().parse().unwrap()))
        .unwrap_or(0);
    eprintln!(
        "{started} starts, {} refused, attacker swapped {swaps}: {:?}",
        refused.len(),
        refused.first()
    );
    assert!(started > 0, "no start succeeded: {refused:?}");
}

/// Issue 27, item 3: a group of leaky clients that together hold every slot the victim does
/// not, each giving one frame back every 400 ms and taking a new one (which used to reset the
/// starvation timer and kept the victim at ~2.5 fps for good), cannot starve a consumer that
/// keeps up: within a few seconds the victim gets the producer's rate again.
#[test]
fn a_hoarding_group_cannot_starve_a_consumer_that_keeps_up() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("hoard.sock");
    let mut p = producer(&sock, &["--slots", "8"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let hoarders: Vec<Raw> = (0..3).map(|_| raw_connect(&sock, FLAG_LOSSLESS)).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let group = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held: Vec<std::collections::VecDeque<Entry>> =
                hoarders.iter().map(|_| Default::default()).collect();
            let mut last_release = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (h, held) in hoarders.iter().zip(held.iter_mut()) {
                    while let Ok(Some(e)) = h.ch.take() {
                        held.push_back(e);
                    }
                }
                if last_release.elapsed() >= Duration::from_millis(400) {
                    last_release = Instant::now();
                    for (h, held) in hoarders.iter().zip(held.iter_mut()) {
                        if let Some(e) = held.pop_front() {
                            h.ch.release(e);
                            h.release.ring();
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            hoarders
        })
    };
    std::thread::sleep(Duration::from_secs(6));
    let from = now() - 2_000_000_000;
    let to = now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let hoarders = group.join().unwrap();
    let cut = hoarders.iter().filter(|h| h.ch.revoked()).count();
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    let f = frames(&out);
    let per_s: Vec<usize> = (0..8)
        .map(|s| {
            f.iter()
                .filter(|&&(_, t)| {
                    t >= to - (8 - s) * 1_000_000_000 && t < to - (7 - s) * 1_000_000_000
                })
                .count()
        })
        .collect();
    eprintln!("hoarders cut: {cut}; victim frames per second: {per_s:?}");
    // The last two seconds: every frame, at full rate.
    assert_full_rate(&out, from, to);
}

/// Issue 48: hoarders that take turns. Three clients keep at most 3 frames each (their own
/// cap), together every slot of an 8-slot ring; every 400 ms one of them gives one frame back
/// and takes the next. Each release used to reset the producer's starvation clock, and the
/// producer (and a lossless consumer that keeps up) ran at the relay's pace, 2.5 fps. Now
/// no client gets more than its share of the ring, and the producer's own wait for a slot is
/// what times a cut: the consumer that keeps up gets its frames at the stream's rate, leaky
/// relay or lossless. (The rate is asserted with a margin a busy machine cannot reach, the
/// longest gap is printed; on an idle machine: at least 20 fps, no gap over 300 ms.)
#[test]
fn hoarders_taking_turns_cannot_set_the_pace_of_a_consumer_that_keeps_up() {
    let _s = serial();
    for (name, flags) in [("leaky", 0), ("lossless", FLAG_LOSSLESS)] {
        let dir = tmpdir();
        let sock = dir.path().join("relay.sock");
        let mut p = producer(&sock, &["--slots", "8"]);
        let mut v = victim(&sock);
        v.wait_line("FRAME ", Duration::from_secs(20));
        let hoarders: Vec<Raw> = (0..3).map(|_| raw_connect(&sock, flags)).collect();
        let from = now();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relay = {
            let stop = stop.clone();
            std::thread::spawn(move || relay(hoarders, 3, Duration::from_millis(400), stop))
        };
        std::thread::sleep(Duration::from_secs(12));
        let to = now();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let hoarders = relay.join().unwrap();
        let cut = hoarders.iter().filter(|h| h.ch.revoked()).count();
        p.kill9();
        let (_, out) = v.finish(Duration::from_secs(10));
        let f: Vec<(u64, u64)> = frames(&out)
            .into_iter()
            .filter(|&(_, t)| t >= from && t <= to)
            .collect();
        let secs = (to - from) as f64 / 1e9;
        let fps = f.len() as f64 / secs;
        let gap = f
            .windows(2)
            .map(|w| w[1].1 - w[0].1)
            .max()
            .unwrap_or(u64::MAX);
        eprintln!(
            "{name} relay: {cut} of 3 cut; the consumer that keeps up got {fps:.1} fps, longest gap {:.0} ms",
            gap as f64 / 1e6
        );
        for w in f.windows(2) {
            assert!(w[1].0 > w[0].0, "{name}: frames out of order: {w:?}");
        }
        assert!(
            fps >= 15.0,
            "{name} relay: the consumer that keeps up got {fps:.1} fps (the stream has 30)"
        );
        assert!(
            gap < 1_000_000_000,
            "{name} relay: a gap of {:.0} ms",
            gap as f64 / 1e6
        );
    }
}

/// Issue 27, item 3: eight clients that each take one frame and hold it for good (as many as
/// the ring has slots), each replaced by a new one as soon as it is cut, cannot starve a
/// consumer that keeps up.
#[test]
fn one_slot_hoarders_replaced_when_cut_cannot_starve_a_consumer_that_keeps_up() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("hoard1.sock");
    let mut p = producer(&sock, &["--slots", "8"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let group = {
        let (stop, sock) = (stop.clone(), sock.clone());
        std::thread::spawn(move || {
            let mut hoarders: Vec<(Raw, Option<Entry>)> = Vec::new();
            let mut replaced = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                hoarders.retain(|(h, _)| !h.ch.revoked());
                while hoarders.len() < 8 {
                    hoarders.push((raw_connect(&sock, 0), None));
                    replaced += 1;
                }
                // Each keeps a slot no other hoarder holds, giving back the rest.
                let mut pinned: Vec<u32> = hoarders
                    .iter()
                    .filter_map(|(_, held)| held.map(|e| e.slot))
                    .collect();
                for (h, held) in hoarders.iter_mut() {
                    while let Ok(Some(e)) = h.ch.take() {
                        if held.is_none() && !pinned.contains(&e.slot) {
                            *held = Some(e);
                            pinned.push(e.slot);
                        } else {
                            h.ch.release(e);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            replaced
        })
    };
    std::thread::sleep(Duration::from_secs(6));
    let from = now() - 2_000_000_000;
    let to = now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let replaced = group.join().unwrap();
    p.kill9();
    let (_, out) = v.finish(Duration::from_secs(10));
    let f = frames(&out);
    let per_s: Vec<usize> = (0..8)
        .map(|s| {
            f.iter()
                .filter(|&&(_, t)| {
                    t >= to - (8 - s) * 1_000_000_000 && t < to - (7 - s) * 1_000_000_000
                })
                .count()
        })
        .collect();
    eprintln!(
        "hoarders connected: {replaced}; victim frames per second: {per_s:?}\n{}",
        out.iter()
            .filter(|l| !l.starts_with("FRAME"))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_full_rate(&out, from, to);
}

/// The counterpart of the hoarder tests: more consumers than the ring has slots, each keeping
/// its last frame in a syncing sink (fakesink keeps its last sample), are not cut as hoarders:
/// while crowded their budget is one frame, so gpushmsrc copies what its sink keeps. Each of
/// 9 consumers on an 8-slot ring gets its 60 frames and exits cleanly.
#[test]
fn more_consumers_than_slots_that_keep_their_last_frame_are_not_cut() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("crowd.sock");
    let mut p = producer(&sock, &["--slots", "8"]);
    let consumers: Vec<Proc> = (0..9)
        .map(|i| {
            Proc::spawn(
                gst_launch(&format!(
                    "gpushmsrc socket-path={} num-buffers=60 ! fakesink sync=true enable-last-sample=true",
                    sock.display()
                )),
                &format!("consumer {i}"),
            )
        })
        .collect();
    for (i, c) in consumers.into_iter().enumerate() {
        let (status, out) = c.finish(Duration::from_secs(30));
        assert!(
            status.success(),
            "consumer {i} failed: {status}\n{}",
            out.join("\n")
        );
    }
    p.kill9();
}

/// Issue 27, item 6: clients that connect, say Hello and hang up, from two threads as fast as
/// they can, are let in at `ACCEPT_RATE` at most (counted by the producer: a bound the load
/// of the machine cannot change; the CPU share it costs is printed, a benchmark's figure),
/// its consumer keeps every frame at full rate, and a consumer that starts during the flood
/// gets in within 1 s. Before, such a flood kept the producer's connection thread, and the
/// lock frames are published under, busy: its consumer got one frame in 4 s, at a whole
/// core.
#[test]
fn a_connection_flood_costs_the_producer_a_bounded_share_and_its_consumers_nothing() {
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("reconnect-flood.sock");
    let mut p = producer(&sock, &["--admission-every", "100"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let made = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let flooders: Vec<_> = (0..2)
        .map(|_| {
            let (stop, made, sock) = (stop.clone(), made.clone(), sock.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(s) = UnixStream::connect(&sock) {
                        let _ = Conn::new(s).send(
                            &Message::Hello {
                                flags: 0,
                                pid: 1,
                                name: "reconnect-flood".into(),
                            },
                            &[],
                        );
                        made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let (from, cpu0) = (now(), process_cpu_time(p.child.id()));
    std::thread::sleep(Duration::from_millis(1500));
    let late = connect_and_take(&sock);
    std::thread::sleep(Duration::from_millis(1500));
    let (to, cpu1) = (now(), process_cpu_time(p.child.id()));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for f in flooders {
        f.join().unwrap();
    }
    let share = (cpu1 - cpu0).as_secs_f64() / ((to - from) as f64 / 1e9);
    let n = made.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "{n} connections; producer at {:.0} % of a core",
        share * 100.0
    );
    p.kill9();
    let (_, pout) = p.finish(Duration::from_secs(10));
    let (accepted, _, secs) = admitted(&pout, from, to);
    eprintln!("the producer accepted {accepted} connections in {secs:.1} s");
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
    let took = late.expect("a consumer starting during the flood");
    assert!(
        took < Duration::from_secs(1),
        "a consumer took {took:?} to connect during the flood"
    );
    assert!(accepted > 0, "the flood's connections were accepted");
    assert!(
        accepted <= most_accepted(secs),
        "the producer accepted {accepted} connections in {secs:.1} s"
    );
}

/// Issue 30: the read-only stats request (`gpushm list/top/inspect`) abused every way a tool
/// could: floods of queries from two threads (one reading its reports, one not), queries
/// announcing a payload beyond the limit, malformed ones (trailing bytes, descriptors sent
/// along), and 80 slowloris connections that send half a header and hold on. The producer's
/// consumer keeps every frame at full rate, the producer spends a bounded share of a core,
/// and an honest query made during the attack is answered within a second with figures that
/// name the victim. The cost is bounded by count: connections accepted at the admission rate,
/// at most one report built per `REPORT_INTERVAL` (the CPU share is printed, a benchmark's
/// figure).
#[test]
fn hostile_stats_queries_change_nothing_for_the_producers_consumers() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    let _s = serial();
    let dir = tmpdir();
    let sock = dir.path().join("stats-attack.sock");
    let mut p = producer(&sock, &["--admission-every", "100"]);
    let mut v = victim(&sock);
    v.wait_line("FRAME ", Duration::from_secs(20));
    let stop = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(AtomicU64::new(0));
    let query_bytes = Message::Query { flags: 0 }.encode();
    let mut attackers = Vec::new();
    for reader in [true, false] {
        let (stop, reports, sock, q) = (
            stop.clone(),
            reports.clone(),
            sock.clone(),
            query_bytes.clone(),
        );
        attackers.push(std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let Ok(mut s) = UnixStream::connect(&sock) else {
                    continue;
                };
                let _ = s.write_all(&q);
                if reader {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut c = Conn::new(s);
                    if let Ok(Some((Message::Report(_), _))) =
                        c.recv_timeout(Duration::from_millis(500), None)
                    {
                        reports.fetch_add(1, Relaxed);
                    }
                }
            }
        }));
    }
    {
        // Malformed, oversized and fd-carrying queries, in a loop.
        let (stop, sock, q) = (stop.clone(), sock.clone(), query_bytes.clone());
        attackers.push(std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let mut huge = q.clone();
                huge[8..12].copy_from_slice(&(1u32 << 30).to_le_bytes());
                let mut trailing = q.clone();
                trailing[8..12].copy_from_slice(&8u32.to_le_bytes());
                trailing.extend_from_slice(&[0xff; 4]);
                for bytes in [huge, trailing] {
                    if let Ok(mut s) = UnixStream::connect(&sock) {
                        let _ = s.write_all(&bytes);
                    }
                }
                if let Ok(s) = UnixStream::connect(&sock) {
                    let f = std::fs::File::open("/dev/null").unwrap();
                    let _ = nix::sys::socket::sendmsg::<()>(
                        s.as_raw_fd(),
                        &[std::io::IoSlice::new(&q)],
                        &[nix::sys::socket::ControlMessage::ScmRights(
                            &[f.as_raw_fd()],
                        )],
                        nix::sys::socket::MsgFlags::empty(),
                        None,
                    );
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }));
    }
    // Slowloris: half a header each, held open (and reopened when dropped).
    let slow: Vec<UnixStream> = (0..80)
        .filter_map(|_| {
            let mut s = UnixStream::connect(&sock).ok()?;
            s.write_all(&query_bytes[..7]).ok()?;
            Some(s)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let (from, cpu0) = (now(), process_cpu_time(p.child.id()));
    std::thread::sleep(Duration::from_millis(1500));
    let asked = Instant::now();
    // (Answered in 0.25-0.66 s on the 2-core dev VM, with a tail past 1 s in about one run of
    // eight: 2 s keeps the test about the attack, not about the machine's load.)
    let honest = gpushm::subscriber::query(
        &gpushm::names::Endpoint::Path(sock.clone()),
        Duration::from_secs(2),
    );
    let took = asked.elapsed();
    let late = connect_and_take(&sock);
    std::thread::sleep(Duration::from_millis(1500));
    let (to, cpu1) = (now(), process_cpu_time(p.child.id()));
    stop.store(true, Relaxed);
    for a in attackers {
        a.join().unwrap();
    }
    drop(slow);
    let share = (cpu1 - cpu0).as_secs_f64() / ((to - from) as f64 / 1e9);
    eprintln!(
        "{} reports read by the flood; producer at {:.0} % of a core; honest query in {took:?}",
        reports.load(Relaxed),
        share * 100.0
    );
    let vpid = v.child.id() as i32;
    p.kill9();
    let (_, pout) = p.finish(Duration::from_secs(10));
    let (accepted, built, secs) = admitted(&pout, from, to);
    eprintln!(
        "the producer accepted {accepted} connections and built {built} reports in {secs:.1} s"
    );
    let (_, out) = v.finish(Duration::from_secs(10));
    assert_full_rate(&out, from, to);
    let honest = honest.expect("an honest query during the attack");
    assert!(
        took < Duration::from_secs(2),
        "the honest query took {took:?}"
    );
    assert!(
        honest
            .report
            .clients
            .iter()
            .any(|c| c.pid == vpid && c.lossless && c.taken > 30),
        "the report names the victim: {:?}",
        honest.report.clients
    );
    assert!(reports.load(Relaxed) > 0, "the flood's queries got reports");
    late.expect("a consumer connecting during the attack");
    assert!(
        accepted <= most_accepted(secs),
        "the producer accepted {accepted} connections in {secs:.1} s"
    );
    let most_reports = (secs / gpushm::wire::REPORT_INTERVAL.as_secs_f64()) as u64 + 2;
    assert!(
        (1..=most_reports).contains(&built),
        "the producer built {built} reports in {secs:.1} s (at most {most_reports})"
    );
}

/// A producer that takes no connections (stopped, its listen queue full) cannot hold a
/// consumer past its timeout, nor the `gpushm` tool's query past its own: connect(2) on a
/// full queue used to block until the producer woke up, whatever the timeout said.
#[test]
fn a_producer_whose_queue_is_full_cannot_hang_a_consumer_past_its_timeout() {
    use nix::sys::socket::{
        bind, connect, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
    };
    let dir = tmpdir();
    let sock = dir.path().join("full.sock");
    let addr = UnixAddr::new(&sock).unwrap();
    let l = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind(l.as_raw_fd(), &addr).unwrap();
    listen(&l, Backlog::new(0).unwrap()).unwrap();
    // Fill its queue: it never accepts.
    let mut fillers = Vec::new();
    loop {
        let s = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        match connect(s.as_raw_fd(), &addr) {
            Ok(()) => fillers.push(s),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(e) => panic!("filling the queue: {e}"),
        }
        assert!(fillers.len() < 100, "the queue never filled");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let path = sock.clone();
    std::thread::spawn(move || {
        let started = Instant::now();
        let opts = gpushm::subscriber::ConnectOptions {
            timeout: Duration::from_secs(1),
            ..Default::default()
        };
        let sub = gpushm::subscriber::Subscriber::connect(&path, opts).map(|_| ());
        let took = started.elapsed();
        let started = Instant::now();
        let q = gpushm::subscriber::query(
            &gpushm::names::Endpoint::Path(path.clone()),
            Duration::from_secs(1),
        )
        .map(|_| ());
        let _ = tx.send((sub, took, q, started.elapsed()));
    });
    let (sub, took, q, qtook) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the consumer or the query hung on the producer's full queue");
    let e = sub.expect_err("connected to a listener that never accepts");
    assert!(e.to_string().contains("queue is full"), "{e}");
    assert!(
        took < Duration::from_secs(3),
        "the consumer waited {took:?}"
    );
    assert!(
        q.is_err() && qtook < Duration::from_secs(3),
        "the query: {q:?} after {qtook:?}"
    );
    drop(fillers);
}
