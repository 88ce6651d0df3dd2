// SPDX-License-Identifier: MPL-2.0
//! `gpushm`: find, watch and inspect the gpushm streams of this machine.
//!
//! ```text
//! gpushm list [--json] [PATH|DIR ...]     streams in the stream directories (and PATHs)
//! gpushm top [--json] [--interval S] [--count N] [NAME|PATH ...]
//! gpushm inspect [--json] NAME|PATH
//! ```
//!
//! Figures come from each producer over its socket (a read-only Query, see `gpushm::wire`):
//! the tool never becomes a client and takes no frame. A NAME is looked up as gpushmsrc's
//! `stream` is (see `gpushm::names`); anything with a `/` is a socket path.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpushm::inspect::{self as schema, Fields};
use gpushm::names::{self, Endpoint};
use gpushm::ring::layout::{latency_percentile, LATENCY_BUCKETS};
use gpushm::subscriber::{query, Queried};
use gpushm::wire::{ClientReport, StreamReport};
use serde_json::{json, Value};

/// How long one producer may take to answer.
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(
    name = "gpushm",
    version,
    about = "Find, watch and inspect gpushm streams (gpushmsink producers) on this machine",
    after_help = "Streams are looked for in $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID) and /run/gpushm. A NAME is a stream name (gpushmsink stream=NAME); anything with a '/' is a socket path (socket-path=...)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every stream in the stream directories (and the sockets or directories given), with
    /// caps, frame rate, slots, ring size and clients; stale sockets are shown as such.
    List {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
        /// More sockets, or directories of sockets, to list.
        paths: Vec<PathBuf>,
    },
    /// Live figures per stream and per client, refreshed: frames delivered, dropped and
    /// skipped, slots held, delivery mode, latency p50/p99 from publish to arrival, the
    /// producer's CPU per frame.
    Top {
        /// One JSON object per refresh (a line each) instead of a screen.
        #[arg(long)]
        json: bool,
        /// Seconds between refreshes.
        #[arg(long, short = 'd', default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes (0: run until interrupted).
        #[arg(long, short = 'n', default_value_t = 0)]
        count: u64,
        /// Streams (names or socket paths) to watch; all of them by default.
        streams: Vec<String>,
    },
    /// One stream: caps, ring layout, uptime and every client.
    Inspect {
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
        /// A stream name or a socket path.
        stream: String,
    },
}

fn endpoint(s: &str) -> Result<Endpoint, String> {
    if s.contains('/') {
        Ok(Endpoint::Path(PathBuf::from(s)))
    } else {
        names::check_name(s).map_err(|e| e.to_string())?;
        Ok(Endpoint::Stream(s.to_string()))
    }
}

/// A stream found, and what its producer said (or why it said nothing).
struct Probe {
    name: String,
    path: PathBuf,
    answer: Result<Queried, gpushm::Error>,
}

impl Probe {
    fn of(name: String, ep: &Endpoint) -> Self {
        let path = ep.resolve().unwrap_or_default();
        Self {
            name,
            path,
            answer: query(ep, QUERY_TIMEOUT),
        }
    }

    fn state(&self) -> &'static str {
        schema::state(&self.answer)
    }
}

/// Every stream of the stream directories, then every socket given (or found in a directory
/// given).
fn discover(paths: &[PathBuf]) -> Result<Vec<(String, Endpoint)>, String> {
    let mut out: Vec<(String, Endpoint)> = names::list()
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|f| (f.name, Endpoint::Path(f.path)))
        .collect();
    for p in paths {
        let found = if p.is_dir() {
            names::list_dir(p).map_err(|e| e.to_string())?
        } else {
            vec![names::Found {
                name: p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                path: p.clone(),
            }]
        };
        for f in found {
            if !out
                .iter()
                .any(|(_, e)| matches!(e, Endpoint::Path(q) if same_file(q, &f.path)))
            {
                out.push((f.name, Endpoint::Path(f.path)));
            }
        }
    }
    Ok(out)
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => a == b,
    }
}

/// Text a peer wrote (a client's name, caps, a producer's error), safe to print on a
/// terminal: control characters and invisible formatting ones (bidirectional overrides,
/// zero-width characters) are shown escaped.
fn clean(s: &str) -> String {
    let invisible = |c: char| {
        matches!(c as u32,
            0xad | 0x061c | 0x180e | 0x200b..=0x200f | 0x202a..=0x202e | 0x2060..=0x2069 | 0xfeff)
    };
    s.chars()
        .flat_map(|c| {
            if c.is_control() || invisible(c) {
                c.escape_unicode().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// `video/x-raw, format=NV12, width=1920, ...` as `video/x-raw NV12 1920x1080`.
fn short_caps(caps: &str) -> String {
    let mut parts = caps.split(',').map(str::trim);
    let media = parts.next().unwrap_or("");
    let field = |k: &str| {
        caps.split(',').map(str::trim).find_map(|f| {
            let (key, v) = f.split_once('=')?;
            (key.trim() == k).then(|| {
                let v = v.trim();
                v.rsplit(')').next().unwrap_or(v).trim().to_string()
            })
        })
    };
    let mut out = media.to_string();
    if let Some(f) = field("format") {
        out += &format!(" {f}");
    }
    if let (Some(w), Some(h)) = (field("width"), field("height")) {
        out += &format!(" {w}x{h}");
    }
    clean(&out)
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// Nanoseconds as microseconds, as the schema shows them.
fn us(ns: Option<u64>) -> Value {
    value(ns.into())
}

fn us_text(ns: Option<u64>) -> String {
    match ns {
        None => "-".into(),
        Some(n) if n >= 10_000_000 => format!("{:.0}ms", n as f64 / 1e6),
        Some(n) if n >= 1_000_000 => format!("{:.1}ms", n as f64 / 1e6),
        Some(n) => format!("{}us", n / 1000),
    }
}

/// Consumers connected and taking frames (closed ones still holding frames not counted), as
/// gpushmsink's num-clients.
fn open_clients(r: &StreamReport) -> usize {
    r.clients.iter().filter(|c| !c.closed).count()
}

/// The core's fields ([`gpushm::inspect`], one schema for this command and Python) as JSON.
fn to_json(fields: Fields) -> Value {
    Value::Object(
        fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), value(v)))
            .collect(),
    )
}

fn value(v: schema::Value) -> Value {
    match v {
        schema::Value::Null => Value::Null,
        schema::Value::Bool(b) => json!(b),
        schema::Value::Int(i) => json!(i),
        schema::Value::Float(f) => json!(f),
        schema::Value::Text(t) => json!(t),
        schema::Value::List(list) => Value::Array(list.into_iter().map(to_json).collect()),
    }
}

fn client_json(c: &ClientReport) -> Value {
    to_json(schema::client(c))
}

fn stream_json(p: &Probe, clients: bool) -> Value {
    to_json(schema::stream(&p.name, &p.path, &p.answer, clients))
}

fn list(json_out: bool, paths: &[PathBuf]) -> Result<(), String> {
    let probes: Vec<Probe> = discover(paths)?
        .into_iter()
        .map(|(n, ep)| Probe::of(n, &ep))
        .collect();
    if json_out {
        let v: Vec<Value> = probes.iter().map(|p| stream_json(p, false)).collect();
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(());
    }
    if probes.is_empty() {
        println!(
            "no streams in {}",
            names::search_dirs()
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(());
    }
    println!(
        "{:<20} {:>7} {:>7} {:>5} {:>10}  CAPS",
        "NAME", "CLIENTS", "FPS", "SLOTS", "RING"
    );
    for p in &probes {
        match &p.answer {
            Ok(q) => {
                let r = &q.report;
                println!(
                    "{:<20} {:>7} {:>7.1} {:>5} {:>10}  {}{}",
                    clean(&p.name),
                    open_clients(r),
                    r.fps,
                    r.slot_count,
                    bytes(r.ring_size),
                    short_caps(&r.caps),
                    if r.device_ring { " (GPU memory)" } else { "" }
                );
            }
            Err(e) => println!(
                "{:<20} {:>7} {:>7} {:>5} {:>10}  {}",
                clean(&p.name),
                "-",
                "-",
                "-",
                "-",
                match p.state() {
                    "stale" => "stale: no producer listens (left by one that was killed)".into(),
                    _ => format!("error: {}", clean(&e.to_string())),
                }
            ),
        }
    }
    Ok(())
}

fn inspect(json_out: bool, stream: &str) -> Result<(), String> {
    let ep = endpoint(stream)?;
    let p = Probe::of(stream.to_string(), &ep);
    if json_out {
        let v = stream_json(&p, true);
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return match &p.answer {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("{}: {}", clean(stream), clean(&e.to_string()))),
        };
    }
    let q = p
        .answer
        .map_err(|e| format!("{}: {}", clean(stream), clean(&e.to_string())))?;
    let r = &q.report;
    println!("stream    {}", clean(stream));
    println!("socket    {}", q.path.display());
    println!(
        "producer  pid {} (uid {}), up {:.1} s{}",
        q.producer_pid,
        q.producer_uid,
        r.uptime_ns as f64 / 1e9,
        if r.eos { ", at end of stream" } else { "" }
    );
    println!("caps      {}", clean(&r.caps));
    println!(
        "ring      {} slots of {} ({} in all){}",
        r.slot_count,
        bytes(r.slot_size),
        bytes(r.ring_size),
        if r.device_ring { ", in GPU memory" } else { "" }
    );
    println!(
        "frames    {} published ({:.1}/s), {} dropped, {} copied",
        r.frames_sent, r.fps, r.frames_dropped, r.frames_copied
    );
    println!("clients   {} of at most {}", open_clients(r), r.max_clients);
    for c in &r.clients {
        println!(
            "  #{} pid {} uid {} \"{}\": {}{}{}, delivered {}, dropped {} (skipped {}), held {}, latency p50 {} p99 {}",
            c.id,
            c.pid,
            c.uid,
            clean(&c.name),
            clean(&c.mode),
            if c.lossless { " (waited for)" } else { "" },
            if c.closed { ", closed" } else if c.lagging { ", lagging" } else { "" },
            c.taken,
            c.dropped,
            c.skipped,
            c.held,
            us_text(c.latency_p50_ns()),
            us_text(c.latency_p99_ns())
        );
    }
    if r.clients_left_out > 0 {
        println!(
            "  ({} more clients did not fit in the report)",
            r.clients_left_out
        );
    }
    Ok(())
}

fn top(json_out: bool, interval: f64, count: u64, streams: &[String]) -> Result<(), String> {
    let pause = Duration::try_from_secs_f64(interval)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("--interval {interval}: give a number of seconds above 0"))?;
    let wanted: Vec<(String, Endpoint)> = streams
        .iter()
        .map(|s| endpoint(s).map(|e| (s.clone(), e)))
        .collect::<Result<_, _>>()?;
    let mut last: std::collections::HashMap<PathBuf, StreamReport> = Default::default();
    let tty = std::io::stdout().is_terminal() && !json_out;
    let mut n = 0u64;
    loop {
        let targets = if wanted.is_empty() {
            discover(&[])?
        } else {
            wanted.clone()
        };
        let mut rows = Vec::new();
        let mut seen_now = std::collections::HashMap::new();
        for (name, ep) in targets {
            let p = Probe::of(name, &ep);
            let prev = last.get(&p.path);
            rows.push(top_row(&p, prev));
            if let Ok(q) = p.answer {
                seen_now.insert(p.path.clone(), q.report);
            }
        }
        last = seen_now;
        let mut out = std::io::stdout().lock();
        if json_out {
            let v = json!({
                "time_s": std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0),
                "streams": rows,
            });
            let _ = writeln!(out, "{v}");
        } else {
            if tty {
                let _ = write!(out, "\x1b[H\x1b[2J");
            }
            print_top(&mut out, &rows);
        }
        let _ = out.flush();
        n += 1;
        if count != 0 && n >= count {
            return Ok(());
        }
        std::thread::sleep(pause);
    }
}

/// The difference of two histograms (a client's frames between refreshes; the counts wrap
/// at 2^32); the whole histogram where there is no earlier one (its first refresh).
fn window(now: &[u32], before: Option<&[u32]>) -> Vec<u32> {
    match before {
        Some(b) if b.len() == now.len() => {
            now.iter().zip(b).map(|(x, y)| x.wrapping_sub(*y)).collect()
        }
        _ => now.to_vec(),
    }
}

fn top_row(p: &Probe, prev: Option<&StreamReport>) -> Value {
    let mut v = stream_json(p, false);
    let Ok(q) = &p.answer else { return v };
    let r = &q.report;
    // The same producer (its uptime went on): the time between two reports by its own clock.
    // A report answered again from its cache has the same uptime: no rates from it.
    let prev = prev.filter(|s| s.uptime_ns <= r.uptime_ns && s.frames_sent <= r.frames_sent);
    let dt = prev
        .map(|s| (r.uptime_ns - s.uptime_ns) as f64 / 1e9)
        .filter(|&dt| dt > 0.0);
    let prev = prev.filter(|_| dt.is_some());
    let frames = prev.map(|s| r.frames_sent - s.frames_sent);
    let cpu = prev.map(|s| r.cpu_ns.saturating_sub(s.cpu_ns));
    let o = v.as_object_mut().expect("object");
    if let (Some(dt), Some(f)) = (dt, frames) {
        if dt > 0.0 {
            o.insert("fps".into(), json!(f as f64 / dt));
        }
    }
    o.insert(
        "cpu_per_frame_us".into(),
        match (cpu, frames) {
            (Some(c), Some(f)) if f > 0 => json!(c as f64 / f as f64 / 1000.0),
            _ => Value::Null,
        },
    );
    let clients: Vec<Value> = r
        .clients
        .iter()
        .map(|c| {
            let before = prev.and_then(|s| s.clients.iter().find(|b| b.id == c.id));
            let mut cv = client_json(c);
            let co = cv.as_object_mut().expect("object");
            let hist = window(&c.latency, before.map(|b| b.latency.as_slice()));
            debug_assert_eq!(hist.len(), LATENCY_BUCKETS);
            co.insert("latency_p50_us".into(), us(latency_percentile(&hist, 50.0)));
            co.insert("latency_p99_us".into(), us(latency_percentile(&hist, 99.0)));
            if let (Some(b), Some(dt)) = (before, dt) {
                if dt > 0.0 {
                    co.insert(
                        "delivered_per_s".into(),
                        json!(c.taken.saturating_sub(b.taken) as f64 / dt),
                    );
                    co.insert(
                        "dropped_per_s".into(),
                        json!(c.dropped.saturating_sub(b.dropped) as f64 / dt),
                    );
                }
            }
            cv
        })
        .collect();
    o.insert("client_list".into(), Value::Array(clients));
    v
}

fn print_top(out: &mut impl Write, rows: &[Value]) {
    let s = |v: &Value, k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    // A figure as text (Value's Display ignores widths).
    let t = |v: &Value, k: &str| match v.get(k) {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Null) | None => "-".to_string(),
        Some(x) => x.to_string(),
    };
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    let opt =
        |x: Option<f64>, digits: usize| x.map_or("-".to_string(), |x| format!("{x:.digits$}"));
    let _ = writeln!(out, "gpushm top: {} streams", rows.len());
    for r in rows {
        let name = clean(s(r, "name").as_str().unwrap_or(""));
        if s(r, "state") != "live" {
            let _ = writeln!(
                out,
                "\n{name}: {} {}",
                s(r, "state").as_str().unwrap_or(""),
                clean(s(r, "error").as_str().unwrap_or(""))
            );
            continue;
        }
        let _ = writeln!(
            out,
            "\n{name}  {}  {} fps  producer CPU {} us/frame  {} slots  {} clients  sent {}",
            short_caps(s(r, "caps").as_str().unwrap_or("")),
            opt(num(r, "fps"), 1),
            opt(num(r, "cpu_per_frame_us"), 1),
            t(r, "slots"),
            t(r, "clients"),
            t(r, "frames_sent"),
        );
        let _ = writeln!(
            out,
            "  {:>4} {:>8} {:<16} {:<9} {:>10} {:>8} {:>8} {:>8} {:>5} {:>9} {:>9}",
            "ID",
            "PID",
            "NAME",
            "MODE",
            "DELIVERED",
            "/S",
            "DROPPED",
            "SKIPPED",
            "HELD",
            "P50 US",
            "P99 US"
        );
        for c in s(r, "client_list").as_array().into_iter().flatten() {
            let mut mode = clean(s(c, "mode").as_str().unwrap_or(""));
            if s(c, "closed") == true {
                mode += "/closed";
            } else if s(c, "lagging") == true {
                mode += "/lag";
            }
            let cname: String = clean(s(c, "name").as_str().unwrap_or(""))
                .chars()
                .take(16)
                .collect();
            let _ = writeln!(
                out,
                "  {:>4} {:>8} {:<16} {:<9} {:>10} {:>8} {:>8} {:>8} {:>5} {:>9} {:>9}",
                t(c, "id"),
                t(c, "pid"),
                cname,
                mode,
                t(c, "delivered"),
                opt(num(c, "delivered_per_s"), 1),
                t(c, "dropped"),
                t(c, "skipped"),
                t(c, "held"),
                opt(num(c, "latency_p50_us"), 0),
                opt(num(c, "latency_p99_us"), 0),
            );
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::List { json, paths } => list(json, &paths),
        Cmd::Top {
            json,
            interval,
            count,
            streams,
        } => top(json, interval, count, &streams),
        Cmd::Inspect { json, stream } => inspect(json, &stream),
    };
    if let Err(e) = r {
        eprintln!("gpushm: {e}");
        std::process::exit(1);
    }
}
