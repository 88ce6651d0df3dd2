// SPDX-License-Identifier: MPL-2.0
//! What every process measures and prints: the clock, its own CPU time and faults, the
//! `KEY=value` result lines the orchestrating process reads back, medians and percentiles.

/// The frame sizes the copy benches measure (NV12): name, width, height.
pub const FRAME_SIZES: [(&str, usize, usize); 3] = [
    ("720p", 1280, 720),
    ("1080p", 1920, 1080),
    ("4K", 3840, 2160),
];

/// The CPUs this process may run on, as every bench's heading reports them (0: unknown).
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

pub fn now() -> u64 {
    gpushm::monotonic_ns()
}

pub fn rusage() -> (u64, u64) {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(r) => {
            let t =
                |tv: nix::sys::time::TimeVal| tv.tv_sec() as u64 * 1_000_000 + tv.tv_usec() as u64;
            (t(r.user_time()) + t(r.system_time()), r.max_rss() as u64)
        }
        Err(_) => (0, 0),
    }
}

/// Voluntary context switches (sleeps) of the calling thread so far.
pub fn thread_sleeps() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0, |r| r.voluntary_context_switches() as u64)
}

/// The calling thread's CPU time so far, in ns.
pub fn thread_cpu_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

/// Minor page faults and context switches (voluntary, involuntary) of this process so far.
pub fn faults_and_switches() -> (u64, u64, u64) {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(r) => (
            r.minor_page_faults() as u64,
            r.voluntary_context_switches() as u64,
            r.involuntary_context_switches() as u64,
        ),
        Err(_) => (0, 0, 0),
    }
}

/// The median of the finite values of `v` (NaN when there are none).
pub fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub type Fields = std::collections::HashMap<String, String>;

pub fn parse(out: &str, prefix: &str) -> Option<Fields> {
    let line = out.lines().find(|l| l.starts_with(prefix))?;
    Some(
        line[prefix.len()..]
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.into(), v.into()))
            .collect(),
    )
}

pub fn f(m: &Option<Fields>, k: &str) -> f64 {
    m.as_ref()
        .and_then(|m| m.get(k))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}
