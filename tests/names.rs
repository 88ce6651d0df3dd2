// SPDX-License-Identifier: MPL-2.0
//! Stream names (gpushmsink/gpushmsrc `stream=NAME`), with real producer and consumer
//! processes: where the socket goes, that a consumer finds it, that two users' streams of the
//! same name never meet, and that bad names and untrusted directories are clear errors.
//! Tests that run a second user (nobody) need root.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// A pattern producer of `frames` WxH GRAY8 frames as stream `name`, waiting for a consumer,
/// with `env` set (and XDG_RUNTIME_DIR / GPUSHM_RUNTIME_DIR only where `env` sets them).
fn producer(name: &str, w: u32, env: &[(&str, &Path)]) -> Command {
    let mut p = example("pattern_producer");
    p.args([
        "--stream", name, "--format", "GRAY8", "--height", "16", "--frames", "20",
    ])
    .args([
        "--width",
        &w.to_string(),
        "--fps",
        "0",
        "--wait",
        "--slots",
        "16",
    ]);
    scrub(&mut p, env);
    p
}

fn consumer(name: &str, env: &[(&str, &Path)]) -> Command {
    let mut c = example("frame_checker");
    c.args([
        "--stream",
        name,
        "--verify",
        "--lossless",
        "--expect",
        "20",
        "--no-reconnect",
    ]);
    scrub(&mut c, env);
    c
}

fn scrub(c: &mut Command, env: &[(&str, &Path)]) {
    c.env_remove("XDG_RUNTIME_DIR")
        .env_remove("GPUSHM_RUNTIME_DIR");
    for (k, v) in env {
        c.env(k, v);
    }
}

/// The caps line and the summary of a frame_checker that must have passed.
fn passed(c: Proc) -> Vec<String> {
    let (status, out) = c.finish(Duration::from_secs(60));
    assert!(
        status.success(),
        "frame_checker failed:\n{}",
        out.join("\n")
    );
    assert!(
        out.iter().any(|l| l.starts_with("SUMMARY frames=20 bad=0")),
        "{}",
        out.join("\n")
    );
    out
}

#[test]
fn a_stream_name_meets_its_producer_in_the_users_runtime_directory() {
    let run = tmpdir();
    let env = [("XDG_RUNTIME_DIR", run.path())];
    let p = Proc::spawn(producer("front-cam", 64, &env), "producer");
    let sock = run.path().join("gpushm").join("front-cam");
    wait_for_path(&sock, Duration::from_secs(10));
    let dir = std::fs::metadata(run.path().join("gpushm")).unwrap();
    assert_eq!(dir.mode() & 0o777, 0o700, "the stream directory is private");
    assert_eq!(dir.uid(), nix::unistd::geteuid().as_raw());
    let out = passed(Proc::spawn(consumer("front-cam", &env), "consumer"));
    assert!(
        out.iter().any(|l| l.contains("width=(int)64")),
        "{}",
        out.join("\n")
    );
    let (status, _) = p.finish(Duration::from_secs(20));
    assert!(status.success());
    assert!(!sock.exists(), "the producer removes its socket");
}

#[test]
fn without_a_runtime_directory_streams_go_to_tmp_gpushm_uid() {
    let name = format!("names-test-{}", std::process::id());
    let dir = Path::new("/tmp").join(format!("gpushm-{}", nix::unistd::geteuid().as_raw()));
    let p = Proc::spawn(producer(&name, 32, &[]), "producer");
    wait_for_path(&dir.join(&name), Duration::from_secs(10));
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.mode() & 0o077, 0, "{:o}", meta.mode());
    passed(Proc::spawn(consumer(&name, &[]), "consumer"));
    assert!(p.finish(Duration::from_secs(20)).0.success());
}

#[test]
fn gpushm_runtime_dir_is_the_one_place_when_set() {
    let shared = tmpdir();
    let env = [("GPUSHM_RUNTIME_DIR", shared.path())];
    let p = Proc::spawn(producer("cam", 48, &env), "producer");
    wait_for_path(&shared.path().join("cam"), Duration::from_secs(10));
    let out = passed(Proc::spawn(consumer("cam", &env), "consumer"));
    assert!(
        out.iter().any(|l| l.contains("width=(int)48")),
        "{}",
        out.join("\n")
    );
    assert!(p.finish(Duration::from_secs(20)).0.success());
}

/// A consumer started before a system service finds it in /run/gpushm: it keeps looking in
/// every directory while it waits, past a stale socket of the same name in its own.
#[test]
fn as_root_a_waiting_consumer_finds_a_service_in_the_system_directory() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test writes /run/gpushm and needs root; skip it with --skip as_root"
    );
    let name = format!("names-service-{}", std::process::id());
    let system = Path::new(gpushm::names::SYSTEM_DIR);
    let made = !system.exists();
    std::fs::create_dir_all(system).unwrap();
    let run = tmpdir();
    // A socket of the same name left in the user's own directory by a producer that was
    // killed: looked at first, passed over because nobody serves it.
    let mine = run.path().join("gpushm");
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o700)).unwrap();
    drop(std::os::unix::net::UnixListener::bind(mine.join(&name)).unwrap());
    let mut c = consumer(&name, &[("XDG_RUNTIME_DIR", run.path())]);
    c.args(["--src-props", "timeout=20000000000"]);
    let c = Proc::spawn(c, "consumer");
    std::thread::sleep(Duration::from_millis(500));
    let p = Proc::spawn(
        producer(&name, 40, &[("GPUSHM_RUNTIME_DIR", system)]),
        "service",
    );
    let out = passed(c);
    assert!(
        out.iter().any(|l| l.contains("width=(int)40")),
        "{}",
        out.join("\n")
    );
    assert!(p.finish(Duration::from_secs(20)).0.success());
    if made {
        let _ = std::fs::remove_dir(system);
    }
}

#[test]
fn second_user_streams_of_the_same_name_do_not_meet() {
    let name = format!("names-both-{}", std::process::id());
    let home = tmpdir();
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    // Root's stream is 64 wide, nobody's 32: each consumer must get its own user's.
    let mine = Proc::spawn(producer(&name, 64, &[]), "root's producer");
    let mut theirs = producer(&name, 32, &[]);
    as_nobody(&mut theirs, home.path());
    let theirs = Proc::spawn(theirs, "nobody's producer");
    wait_for_path(
        &Path::new("/tmp/gpushm-65534").join(&name),
        Duration::from_secs(10),
    );
    let mut their_consumer = consumer(&name, &[]);
    as_nobody(&mut their_consumer, home.path());
    let out = passed(Proc::spawn(their_consumer, "nobody's consumer"));
    assert!(
        out.iter().any(|l| l.contains("width=(int)32")),
        "{}",
        out.join("\n")
    );
    let out = passed(Proc::spawn(consumer(&name, &[]), "root's consumer"));
    assert!(
        out.iter().any(|l| l.contains("width=(int)64")),
        "{}",
        out.join("\n")
    );
    assert!(mine.finish(Duration::from_secs(20)).0.success());
    assert!(theirs.finish(Duration::from_secs(20)).0.success());
}

#[test]
fn second_user_owning_the_stream_directory_is_refused_with_the_reason() {
    let run = tmpdir();
    let dir = run.path().join("gpushm");
    std::fs::create_dir(&dir).unwrap();
    nix::unistd::chown(&dir, Some(65534.into()), Some(65534.into()))
        .expect("chown needs root; skip with --skip second_user");
    let mut p = gst_launch("videotestsrc num-buffers=1 ! gpushmsink stream=cam");
    scrub(&mut p, &[("XDG_RUNTIME_DIR", run.path())]);
    let (status, out) = Proc::spawn(p, "producer").finish(Duration::from_secs(20));
    assert!(!status.success());
    assert!(
        out.iter().any(|l| l.contains("belongs to uid 65534")),
        "{}",
        out.join("\n")
    );
}

#[test]
fn bad_stream_names_and_both_settings_are_refused_saying_why() {
    let run = tmpdir();
    for (pipeline, want) in [
        (
            "videotestsrc num-buffers=1 ! gpushmsink stream=a/b",
            "stream name \"a/b\" is not valid",
        ),
        (
            "videotestsrc num-buffers=1 ! gpushmsink stream=..",
            "starts with '.'",
        ),
        ("gpushmsrc stream=-x ! fakesink", "starts with '-'"),
        (
            "videotestsrc num-buffers=1 ! gpushmsink stream=cam socket-path=/tmp/x",
            "both socket-path and stream are set",
        ),
    ] {
        let mut c = gst_launch(pipeline);
        c.env("XDG_RUNTIME_DIR", run.path());
        let (status, out) = Proc::spawn(c, "gst-launch").finish(Duration::from_secs(20));
        assert!(!status.success(), "{pipeline}");
        assert!(
            out.iter().any(|l| l.contains(want)),
            "{pipeline}: {}",
            out.join("\n")
        );
    }
}
