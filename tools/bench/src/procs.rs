// SPDX-License-Identifier: MPL-2.0
//! Shared process helpers: one producer, relay and consumer line of processes per run, and
//! the knobs they inherit (environment, CPU pinning, address-space randomisation, timeouts).

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use crate::capi::c_consumer;
use crate::measure::{parse, Fields};

pub struct Run {
    pub producer: Option<Fields>,
    pub consumer: Option<Fields>,
    /// The relays of `--chain`, in order.
    pub relays: Vec<Option<Fields>>,
}

/// One producer process and (unless `transport` is "none") one consumer process, NV12.
pub fn run(
    transport: &str,
    w: u64,
    h: u64,
    frames: u64,
    fps: u64,
    copy: bool,
    cudasum: bool,
) -> Run {
    run_format(transport, "NV12", w, h, frames, fps, copy, cudasum)
}

#[allow(clippy::too_many_arguments)]
pub fn run_format(
    transport: &str,
    format: &str,
    w: u64,
    h: u64,
    frames: u64,
    fps: u64,
    copy: bool,
    cudasum: bool,
) -> Run {
    let exe = std::env::current_exe().expect("current_exe");
    let other = OTHER_BUILD.lock().unwrap().clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("bench.sock");
    let sock_s = sock.to_str().unwrap().to_string();
    // The Rust subscriber ("sub") and the C API's consumer ("capi") read a gpushmsink.
    let producer_transport = match transport {
        "sub" | "capi" => "gpushm",
        t => t,
    };
    let common = |role: &str, socket: &str| {
        // Another build's processes (`bench throughput --compare`), or ours.
        // Leading `NAME=value` words are the environment the other build runs with (as
        // env(1) takes them, without running env, which a bundled runtime's libc would
        // break); with nothing after them, it is this build.
        let mut c = match &other {
            Some(cmd) => {
                let vars = cmd.iter().take_while(|w| is_assignment(w)).count();
                let mut c = match cmd.get(vars) {
                    Some(program) => Command::new(program),
                    None => Command::new(&exe),
                };
                c.args(cmd.iter().skip(vars + 1));
                for w in &cmd[..vars] {
                    if let Some((k, v)) = w.split_once('=') {
                        c.env(k, v);
                    }
                }
                c
            }
            None => Command::new(&exe),
        };
        let t = if role == "produce" {
            producer_transport
        } else {
            transport
        };
        c.args([role, "--transport", t, "--socket", socket]);
        c.args([
            "--width",
            &w.to_string(),
            "--height",
            &h.to_string(),
            "--frames",
            &frames.to_string(),
            "--format",
            format,
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let mut p = common("produce", &sock_s);
    p.args(["--fps", &fps.to_string()]);
    if std::env::var_os("GPUSHM_BENCH_PRERENDERED").is_some() {
        p.arg("--prerendered");
    }
    if copy {
        p.arg("--copy");
    }
    // --chain: relays in a line between the producer and the consumer, which reads the last
    // relay. Started from the consumer's end, each waiting for its input to appear, so that
    // the whole line is connected before the producer's first frame (a relay that queued
    // frames while waiting for its consumer would add that backlog to every frame).
    let relays_n = if transport == "gpushm" {
        chain_len()
    } else {
        0
    };
    let socks: Vec<String> = std::iter::once(sock_s.clone())
        .chain((0..relays_n).map(|i| {
            dir.path()
                .join(format!("relay{i}.sock"))
                .to_str()
                .unwrap()
                .to_string()
        }))
        .collect();
    let last = socks.last().unwrap().clone();
    let pinned = *PIN.lock().unwrap();
    if let Some((cpu, _)) = pinned {
        pin(&mut p, cpu);
    }
    let spawn_consumer = || {
        let mut c = if transport == "capi" {
            let mut c = Command::new(c_consumer());
            c.args([&last, &frames.to_string()]);
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            c
        } else {
            // The last relay's socket (the producer's without relays).
            common("consume", &last)
        };
        if cudasum {
            c.arg("--cudasum");
        }
        if let Some((_, cpu)) = pinned {
            pin(&mut c, cpu);
        }
        if NO_ASLR.load(std::sync::atomic::Ordering::Relaxed) {
            no_aslr(&mut c);
        }
        c.spawn().unwrap_or_else(|e| {
            panic!(
                "spawn consumer: {e} (for capi: GPUSHM_C_CONSUMER or c_consumer beside bench; \
                 --no-aslr needs personality(2), which some containers forbid)"
            )
        })
    };
    let mut relays = Vec::new();
    let (producer, consumer) = if relays_n > 0 {
        let consumer = spawn_consumer();
        for i in (0..relays_n as usize).rev() {
            relays.push(
                Command::new(&exe)
                    .args(["relay", "--in", &socks[i], "--out", &socks[i + 1]])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn relay"),
            );
        }
        relays.reverse();
        (p.spawn().expect("spawn producer"), Some(consumer))
    } else {
        let producer = p.spawn().expect("spawn producer");
        let consumer = (transport != "none").then(|| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !sock.exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            spawn_consumer()
        });
        (producer, consumer)
    };
    // shmsink/shmsrc can deadlock (see tiny_frames): give up on both after the pipelines'
    // own timeout, and kill them if they do not end by themselves.
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout_s() + 15);
    let cout = consumer.map(|c| finish(c, deadline));
    let pout = finish(producer, deadline);
    let rout: Vec<_> = relays.into_iter().map(|r| finish(r, deadline)).collect();
    let show = |o: &std::process::Output| {
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
    };
    #[cfg(feature = "stages")]
    if let Some(line) = cout.as_ref().and_then(|o| {
        show(o)
            .lines()
            .find(|l| l.starts_with("STAGES "))
            .map(String::from)
    }) {
        eprintln!(
            "bench: {transport} {w}x{h} spin={} (µs p50/p90): {line}",
            spin_us()
        );
    }
    let run = Run {
        producer: parse(&show(&pout), "PRODUCER "),
        consumer: cout.as_ref().and_then(|o| parse(&show(o), "CONSUMER ")),
        relays: rout.iter().map(|o| parse(&show(o), "RELAY ")).collect(),
    };
    for (i, o) in rout.iter().enumerate() {
        if run.relays[i].is_none() {
            eprintln!("bench: relay {i} failed:\n{}", show(o));
        }
    }
    if run.producer.is_none() || (transport != "none" && run.consumer.is_none()) {
        eprintln!(
            "bench: {transport} {w}x{h} failed:\n{}\n{}",
            show(&pout),
            cout.as_ref().map(show).unwrap_or_default()
        );
    }
    run
}

/// The consumers' and relays' low-latency budget (`GPUSHM_BENCH_SPIN_US`, µs; 0: off).
pub fn spin_us() -> u64 {
    std::env::var("GPUSHM_BENCH_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// gpushmsink's and gpushmsrc's `cpu-latency-us` (`GPUSHM_BENCH_CPU_LATENCY_US`; unset: not
/// set), as a property to append to their launch lines.
pub fn cpu_latency_prop() -> String {
    std::env::var("GPUSHM_BENCH_CPU_LATENCY_US")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(String::new(), |us| format!(" cpu-latency-us={us}"))
}

/// Relays (`gpushmsrc ! gpushmsink` processes) between a gpushm producer and its consumer
/// (`GPUSHM_BENCH_CHAIN`; 0: none).
pub fn chain_len() -> u64 {
    std::env::var("GPUSHM_BENCH_CHAIN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The command (a program and its first arguments) whose `produce` and `consume` run instead
/// of this binary's: another build, compared in the same run (`bench throughput --compare`).
pub static OTHER_BUILD: Mutex<Option<Vec<String>>> = Mutex::new(None);

/// CPUs that `bench capi` and `bench latency --pin` pin the producer and consumer to (none: the
/// scheduler places them).
pub static PIN: Mutex<Option<(usize, usize)>> = Mutex::new(None);

/// `bench capi --no-aslr`: consumers start with address-space randomisation off, each at the
/// same addresses every run.
pub static NO_ASLR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts the process `c` starts with address-space randomisation off.
pub fn no_aslr(c: &mut Command) {
    use nix::sys::personality::{self, Persona};
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only system calls run (no allocation, no lock).
    unsafe {
        c.pre_exec(|| {
            let p = personality::get().map_err(std::io::Error::from)?;
            personality::set(p | Persona::ADDR_NO_RANDOMIZE)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
}

/// The last two CPUs this process may run on (CPU 0 takes more of the machine's interrupts).
pub fn two_cpus() -> Option<(usize, usize)> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    match cpus[..] {
        [.., a, b] => Some((a, b)),
        _ => None,
    }
}

/// Whether `word` of `--compare` is `NAME=value` with NAME a variable's name (letters, digits
/// and `_`, not starting with a digit): a program's path with a `=` in it is not one.
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        name.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Runs the process `c` starts on `cpu` only (its threads inherit it).
pub fn pin(c: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_err() {
        return;
    }
    // SAFETY: between fork and exec only a system call runs (no allocation, no lock).
    unsafe {
        c.pre_exec(move || {
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                .map_err(std::io::Error::from)
        });
    }
}

/// How long each pipeline of a run may take (`GPUSHM_BENCH_TIMEOUT`, seconds; 120).
pub fn timeout_s() -> u64 {
    std::env::var("GPUSHM_BENCH_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120)
}

/// Waits for `child` until `deadline`, then kills it; its output either way.
pub fn finish(
    mut child: std::process::Child,
    deadline: std::time::Instant,
) -> std::process::Output {
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().expect("child output")
}

/// `run` with the pre-rendered producer (4K NV12 republished without redrawing).
pub fn run_prerendered(transport: &str, frames: u64, cudasum: bool) -> Run {
    std::env::set_var("GPUSHM_BENCH_PRERENDERED", "1");
    let r = run(transport, 3840, 2160, frames, 0, false, cudasum);
    std::env::remove_var("GPUSHM_BENCH_PRERENDERED");
    r
}

pub fn have(element: &str) -> bool {
    gst::ElementFactory::find(element).is_some()
}
