// SPDX-License-Identifier: MPL-2.0
#![allow(dead_code)]
//! Helpers shared by the integration tests.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[path = "raw_client.rs"]
mod raw_client;
#[allow(unused_imports)]
pub use raw_client::*;

pub fn init() {
    use std::sync::Once;
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        gst::init().expect("gst::init");
        gstgpushm::plugin_register_static().expect("register gpushm");
    });
}

/// A fresh directory for one test's sockets.
pub fn tmpdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("gpushm-test")
        .tempdir()
        .expect("tempdir")
}

/// Directory of the test binary's build: target/<profile>/ locally, .device/ when packed,
/// `GPUSHM_TEST_BUILD_DIR` when set (a test binary run by a GStreamer bundle's `run`, which
/// starts a relocated copy of it).
fn build_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GPUSHM_TEST_BUILD_DIR") {
        return d.into();
    }
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary has a grandparent")
        .to_owned()
}

/// The GStreamer bundle the tests run on (`GPUSHM_TEST_GST`: a directory made by
/// `../shared/tools/gst126/make-bundle`), `None` for the system's GStreamer. Child processes
/// then run on it too: gst-launch is the bundle's, our programs start through its `run`.
fn gst_bundle() -> Option<PathBuf> {
    std::env::var_os("GPUSHM_TEST_GST").map(PathBuf::from)
}

/// A binary built as a cargo example: the test tools of tests/helpers/ and the examples
/// (target/<profile>/examples/NAME, or .device/examples/NAME).
pub fn example(name: &str) -> Command {
    let path = build_dir().join("examples").join(name);
    assert!(
        path.exists(),
        "{} missing: build the examples (cargo test builds them)",
        path.display()
    );
    match gst_bundle() {
        Some(b) => {
            let mut c = Command::new(b.join("run"));
            c.arg(path);
            // The bundle's scripts start with the host's shell: not with the bundle's libc,
            // which `run` gave this process.
            c.env_remove("LD_LIBRARY_PATH");
            c
        }
        None => Command::new(path),
    }
}

/// The gst-launch-1.0 the tests run: the system's, or the bundle's (see [`gst_bundle`]).
pub fn gst_launch_program() -> Command {
    match gst_bundle() {
        Some(b) => {
            let mut c = Command::new(b.join("gst-launch"));
            c.env_remove("LD_LIBRARY_PATH");
            c
        }
        None => Command::new("gst-launch-1.0"),
    }
}

/// gst-launch-1.0 with this build's plugin on the plugin path.
pub fn gst_launch(pipeline: &str) -> Command {
    let mut c = gst_launch_program();
    c.arg("-q");
    c.args(pipeline.split_whitespace());
    with_plugin_path(&mut c);
    c
}

/// gst-launch-1.0 with `-v` (not quiet): it prints each `silent=false` element's
/// last-message (fakesink, identity), one line per event and buffer.
pub fn gst_launch_verbose(pipeline: &str) -> Command {
    let mut c = gst_launch_program();
    c.arg("-v");
    c.args(pipeline.split_whitespace());
    with_plugin_path(&mut c);
    c
}

/// Puts this build's plugin on GST_PLUGIN_PATH for a child process that loads it by name.
pub fn with_plugin_path(c: &mut Command) {
    let dir = build_dir();
    // Locally the plugin sits beside the test binaries' deps/ folder; when packed for the GPU
    // machine it is on GST_PLUGIN_SYSTEM_PATH instead.
    assert!(
        dir.join("libgstgpushm.so").exists()
            || std::env::var_os("GST_PLUGIN_SYSTEM_PATH").is_some(),
        "{}/libgstgpushm.so is missing: run `cargo build` before `cargo test` (make test does)",
        dir.display()
    );
    let path = match std::env::var_os("GST_PLUGIN_PATH") {
        Some(p) => {
            let mut v = std::env::split_paths(&p).collect::<Vec<_>>();
            v.insert(0, dir);
            std::env::join_paths(v).expect("join paths")
        }
        None => dir.into_os_string(),
    };
    c.env("GST_PLUGIN_PATH", path);
}

/// Waits until the producer's `sink` (gpushmsink) has `n` consumers, 20 s at most: a test
/// pushing into a wait-for-connection sink from its own thread would wait forever for a
/// consumer process that failed to start.
pub fn wait_for_clients(sink: &gst::Element, n: u32) {
    use gst::prelude::*;
    let end = Instant::now() + Duration::from_secs(20);
    while sink.property::<u32>("num-clients") < n {
        assert!(Instant::now() < end, "{n} consumers did not connect");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process that is killed when dropped, so a failing test leaves nothing running.
pub struct Proc {
    pub child: Child,
    pub name: String,
    lines: Option<mpsc::Receiver<String>>,
    collected: Vec<String>,
}

impl Proc {
    pub fn spawn(mut cmd: Command, name: &str) -> Self {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let (tx, rx) = mpsc::channel();
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Self {
            child,
            name: name.into(),
            lines: Some(rx),
            collected: Vec::new(),
        }
    }

    /// Waits for a line that starts with `prefix`.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let rx = self.lines.as_ref().expect("output");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) => {
                    self.collected.push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "{}: no line starting with {prefix:?} within {timeout:?}; output:\n{}",
                    self.name,
                    self.collected.join("\n")
                ),
            }
        }
    }

    /// Waits for exit (killing the process past `timeout`); returns the exit status and all output.
    pub fn finish(mut self, timeout: Duration) -> (std::process::ExitStatus, Vec<String>) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let out = self.drain().join("\n");
                panic!(
                    "{} did not finish within {timeout:?}; output so far:\n{out}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let out = self.drain();
        (status, out)
    }

    fn drain(&mut self) -> Vec<String> {
        let mut out = std::mem::take(&mut self.collected);
        if let Some(rx) = self.lines.take() {
            // The reader threads end when the process's pipes close.
            while let Ok(l) = rx.recv_timeout(Duration::from_secs(2)) {
                out.push(l);
            }
        }
        out
    }

    pub fn kill9(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::SIGKILL,
        );
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `key=value` pairs of the first line starting with `prefix`.
pub fn fields(lines: &[String], prefix: &str) -> std::collections::HashMap<String, String> {
    let line = lines
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} line in:\n{}", lines.join("\n")));
    line[prefix.len()..]
        .split_whitespace()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

pub fn num(f: &std::collections::HashMap<String, String>, k: &str) -> f64 {
    f.get(k)
        .unwrap_or_else(|| panic!("no {k} in {f:?}"))
        .parse()
        .expect("number")
}

/// A producer of the seed prototype's frame: 4x4 GRAY8 holding 1..16 (sum 136), `frames`
/// times, waiting for a consumer.
pub fn seed_producer(sock: &Path, frames: u32) -> Proc {
    let mut p = example("pattern_producer");
    p.args([
        "--socket",
        sock.to_str().unwrap(),
        "--seed",
        "--format",
        "GRAY8",
        "--width",
        "4",
        "--height",
        "4",
    ]);
    // 16 slots: the consumer keeps every frame zero-copy however many its appsink queues.
    p.args([
        "--frames",
        &frames.to_string(),
        "--fps",
        "0",
        "--wait",
        "--slots",
        "16",
    ]);
    let producer = Proc::spawn(p, "pattern_producer");
    wait_for_path(sock, Duration::from_secs(10));
    producer
}

/// What is in /dev/shm now.
pub fn dev_shm() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until `path` exists (a producer's socket).
pub fn wait_for_path(path: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} did not appear within {timeout:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` as user nobody (65534), which needs root.
pub fn as_nobody(cmd: &mut Command, home: &Path) {
    use std::os::unix::process::CommandExt;
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test runs a second user (nobody) and needs root; skip it with --skip second_user"
    );
    cmd.uid(65534).gid(65534);
    cmd.env("HOME", home)
        .env("GST_REGISTRY", home.join("registry.bin"));
}

/// CPU time (user + system) process `pid` spent so far, from /proc (in clock ticks, 10 ms).
pub fn process_cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which may hold spaces, in parentheses.
    let rest = stat.rsplit_once(')').unwrap().1;
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|v| v.parse::<u64>().unwrap())
        .sum();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .unwrap()
        .unwrap_or(100) as u64;
    Duration::from_micros(ticks * 1_000_000 / hz)
}
