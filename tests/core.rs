// SPDX-License-Identifier: MPL-2.0
//! The transport crate on its own, across real processes: a publisher and a subscriber with no
//! GStreamer in either (the gpushm crate's examples), and each of them against the GStreamer
//! elements. Every byte of every frame is checked against the test pattern.

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

fn camera(sock: &Path, frames: u32, format: &str) -> Proc {
    let mut c = example("synthetic_camera");
    c.args(["--socket", sock.to_str().unwrap(), "--wait"]);
    c.args(["--frames", &frames.to_string(), "--format", format]);
    c.args(["--width", "320", "--height", "240", "--fps", "30"]);
    let c = Proc::spawn(c, "synthetic_camera");
    wait_for_path(sock, Duration::from_secs(10));
    c
}

fn plane_sums(sock: &Path, extra: &[&str]) -> Proc {
    let mut c = example("plane_sums");
    c.args(["--socket", sock.to_str().unwrap(), "--verify"]);
    c.args(extra);
    Proc::spawn(c, "plane_sums")
}

/// The app examples link no GStreamer (nor GLib) library at all.
#[test]
fn the_core_examples_link_no_gstreamer() {
    for name in ["synthetic_camera", "plane_sums"] {
        let path = example(name).get_program().to_owned();
        let out = std::process::Command::new("ldd")
            .arg(&path)
            .output()
            .expect("ldd");
        let libs = String::from_utf8_lossy(&out.stdout);
        assert!(
            !libs.contains("libgst") && !libs.contains("libglib"),
            "{name} links GStreamer or GLib:\n{libs}"
        );
    }
}

/// A publisher and a subscriber without GStreamer: every frame, every byte, then EOS.
#[test]
fn publisher_to_subscriber_without_gstreamer() {
    for format in ["I420", "NV12", "GRAY8", "RGBA"] {
        let dir = tmpdir();
        let sock = dir.path().join("cam");
        let cam = camera(&sock, 45, format);
        let sub = plane_sums(&sock, &["--lossless"]);
        let (ss, out) = sub.finish(Duration::from_secs(30));
        let (cs, cout) = cam.finish(Duration::from_secs(30));
        assert!(cs.success(), "{}", cout.join("\n"));
        assert!(ss.success(), "{format}: {}", out.join("\n"));
        let frames: Vec<&String> = out.iter().filter(|l| l.starts_with("FRAME ")).collect();
        assert_eq!(frames.len(), 45, "{format}: {}", out.join("\n"));
        for (i, l) in frames.iter().enumerate() {
            assert!(
                l.starts_with(&format!("FRAME n={i} format={format} 320x240")),
                "{l}"
            );
            assert!(l.ends_with("ok=true"), "{l}");
        }
        assert!(out.iter().any(|l| l == "EOS"), "{}", out.join("\n"));
    }
}

/// The GStreamer-free publisher feeds gpushmsrc: bytes, caps and exact timestamps.
#[test]
fn publisher_to_gpushmsrc() {
    let dir = tmpdir();
    let sock = dir.path().join("cam");
    let cam = camera(&sock, 60, "I420");
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--verify",
        "--lossless",
        "--exact-pts",
    ]);
    let (st, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(30));
    let _ = cam.finish(Duration::from_secs(30));
    assert!(st.success(), "{}", out.join("\n"));
    let s = fields(&out, "SUMMARY ");
    assert_eq!(num(&s, "frames"), 60.0);
    assert_eq!(num(&s, "bad"), 0.0);
    assert_eq!(num(&s, "pts_errors"), 0.0);
    assert!(out
        .iter()
        .any(|l| l.contains("format=(string)I420, width=(int)320")));
}

/// gpushmsink feeds the GStreamer-free subscriber.
#[test]
fn gpushmsink_to_subscriber() {
    let dir = tmpdir();
    let sock = dir.path().join("p.sock");
    let mut p = example("pattern_producer");
    p.args([
        "--socket",
        sock.to_str().unwrap(),
        "--wait",
        "--frames",
        "60",
        "--fps",
        "30",
    ]);
    p.args(["--width", "320", "--height", "240", "--format", "I420"]);
    let p = Proc::spawn(p, "pattern_producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let (st, out) = plane_sums(&sock, &["--lossless"]).finish(Duration::from_secs(30));
    let _ = p.finish(Duration::from_secs(30));
    assert!(st.success(), "{}", out.join("\n"));
    let s = fields(&out, "SUMMARY ");
    assert_eq!(num(&s, "frames"), 60.0, "{}", out.join("\n"));
    assert_eq!(num(&s, "bad"), 0.0);
}

/// A publisher killed with SIGKILL: the subscriber says so within a second; a frozen
/// subscriber next to a lossless one does not slow it down.
#[test]
fn producer_kill9_and_a_frozen_subscriber() {
    let dir = tmpdir();
    let sock = dir.path().join("cam");
    let mut cam = camera(&sock, 0, "GRAY8");
    let mut frozen = plane_sums(&sock, &["--lossless"]);
    let mut live = plane_sums(&sock, &["--lossless"]);
    frozen.wait_line("FRAME ", Duration::from_secs(10));
    live.wait_line("FRAME ", Duration::from_secs(10));
    let pid = nix::unistd::Pid::from_raw(frozen.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    cam.kill9();
    let t = Instant::now();
    let (st, out) = live.finish(Duration::from_secs(10));
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "noticed after {:?}",
        t.elapsed()
    );
    assert_eq!(st.code(), Some(2), "{}", out.join("\n"));
    assert!(
        out.iter().any(|l| l.starts_with("ERROR")),
        "{}",
        out.join("\n")
    );
    // About 2 s at 30 fps while the other one was frozen.
    let frames = out.iter().filter(|l| l.starts_with("FRAME ")).count();
    assert!(frames >= 55, "the live subscriber got {frames} frames");
    nix::sys::signal::kill(pid, nix::sys::signal::SIGCONT).unwrap();
    let _ = frozen.finish(Duration::from_secs(10));
}

/// A caps change: the publisher switches to another format and size mid-stream (a new ring);
/// the subscriber follows, and every frame of both layouts is right.
#[test]
fn publisher_caps_change_reaches_the_subscriber() {
    let dir = tmpdir();
    let sock = dir.path().join("cam");
    let mut c = example("synthetic_camera");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--wait",
        "--frames",
        "40",
    ]);
    c.args(["--format", "I420", "--width", "320", "--height", "240"]);
    c.args(["--switch-at", "20"]);
    let cam = Proc::spawn(c, "synthetic_camera");
    wait_for_path(&sock, Duration::from_secs(10));
    let (st, out) = plane_sums(&sock, &["--lossless"]).finish(Duration::from_secs(30));
    let _ = cam.finish(Duration::from_secs(30));
    assert!(st.success(), "{}", out.join("\n"));
    let frames: Vec<&String> = out.iter().filter(|l| l.starts_with("FRAME ")).collect();
    assert_eq!(frames.len(), 40, "{}", out.join("\n"));
    for (i, l) in frames.iter().enumerate() {
        let expect = if i < 20 {
            "format=I420 320x240"
        } else {
            "format=GRAY8 160x120"
        };
        assert!(
            l.contains(expect) && l.ends_with("ok=true"),
            "frame {i}: {l}"
        );
    }
}
