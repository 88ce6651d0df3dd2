// SPDX-License-Identifier: MPL-2.0
//! A connection flood against a live producer (`bench flood`).

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::measure::now;
use crate::{arg, num};

/// CPU time (user + system) of process `pid` so far, in µs.
pub fn proc_cpu_us(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Fields after the command name (which may hold spaces): utime and stime are the 12th
    // and 13th of them.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as u64;
    f.iter().sum::<u64>() * 1_000_000 / hz.max(1)
}

/// A connection flood against a live producer (pattern_producer, 320x240 I420 at 30 fps):
/// `--threads N` clients connect and hang up (`--mode hangup`), or connect, say Hello and hang
/// up (`--mode hello`), as fast as they can for `--seconds S`. Prints connections per second,
/// the producer's CPU (in % of one core) before and during the flood, and the frames one
/// honest consumer got and its longest gap.
pub fn flood(args: &[String]) -> Result<(), String> {
    let secs = num(args, "--seconds", 5);
    let threads = num(args, "--threads", 1).max(1);
    let mode = arg(args, "--mode").unwrap_or_else(|| "hangup".into());
    if mode != "hangup" && mode != "hello" {
        return Err(format!("--mode {mode}: hangup or hello"));
    }
    let dir = std::env::temp_dir().join(format!("gpushm-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let sock = dir.join("s");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // Beside bench where the device pack puts both (examples/), or in a local build's
    // target/release/examples/ beside target/release/bench.
    let pp = exe.with_file_name("pattern_producer");
    let pp = match exe.with_file_name("examples").join("pattern_producer") {
        local if !pp.exists() && local.exists() => local,
        _ => pp,
    };
    let mut child = Command::new(&pp)
        .args([
            "--socket",
            sock.to_str().unwrap_or_default(),
            "--frames",
            "0",
        ])
        .args([
            "--fps", "30", "--width", "320", "--height", "240", "--format", "I420",
        ])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", pp.display()))?;
    let pid = child.id();
    let result = (|| {
        let opts = gpushm::subscriber::ConnectOptions {
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let mut sub =
            gpushm::subscriber::Subscriber::connect(&sock, opts).map_err(|e| e.to_string())?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The consumer: frames and the longest gap between two, per phase.
        let phase = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = Arc::new(Mutex::new([(0u64, 0u64); 2]));
        let consumer = {
            let (stop, phase, seen) = (stop.clone(), phase.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut last = now();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(Some(f)) = sub.next_frame(Some(Duration::from_millis(200))) {
                        drop(f);
                        let t = now();
                        let p = phase.load(std::sync::atomic::Ordering::Relaxed) as usize;
                        let mut s = seen.lock().unwrap();
                        s[p].0 += 1;
                        s[p].1 = s[p].1.max(t - last);
                        last = t;
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_secs(1));
        let (c0, t0) = (proc_cpu_us(pid), now());
        std::thread::sleep(Duration::from_secs(secs));
        let (c1, t1) = (proc_cpu_us(pid), now());
        phase.store(1, std::sync::atomic::Ordering::Relaxed);
        let conns = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let flooders: Vec<_> = (0..threads)
            .map(|_| {
                let (stop, conns, sock, mode) =
                    (stop.clone(), conns.clone(), sock.clone(), mode.clone());
                std::thread::spawn(move || {
                    let hello = gpushm::wire::Message::Hello {
                        flags: 0,
                        pid: std::process::id(),
                        name: "flood".into(),
                    };
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let Ok(s) = std::os::unix::net::UnixStream::connect(&sock) else {
                            continue;
                        };
                        if mode == "hello" {
                            let c = gpushm::wire::Conn::new(s);
                            let _ = c.send(&hello, &[]);
                        }
                        conns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let (c2, t2) = (proc_cpu_us(pid), now());
        std::thread::sleep(Duration::from_secs(secs) / 2);
        // A consumer that starts during the flood: how long until its first frame.
        let late = (|| {
            let start = now();
            let opts = gpushm::subscriber::ConnectOptions {
                timeout: Duration::from_secs(30),
                ..Default::default()
            };
            let mut s =
                gpushm::subscriber::Subscriber::connect(&sock, opts).map_err(|e| e.to_string())?;
            match s.next_frame(Some(Duration::from_secs(30))) {
                Ok(Some(_)) => Ok((now() - start) as f64 / 1e6),
                Ok(None) => Err("end of stream".to_string()),
                Err(e) => Err(e.to_string()),
            }
        })();
        std::thread::sleep(Duration::from_nanos(
            (t2 + secs * 1_000_000_000).saturating_sub(now()),
        ));
        let (c3, t3, n) = (
            proc_cpu_us(pid),
            now(),
            conns.load(std::sync::atomic::Ordering::Relaxed),
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for f in flooders {
            let _ = f.join();
        }
        let _ = consumer.join();
        let s = *seen.lock().unwrap();
        let pct = |c: u64, t: u64| c as f64 / (t as f64 / 1000.0) * 100.0;
        println!("\n## Connection flood ({mode}, {threads} thread(s), {secs} s) against a 320x240 I420 producer at 30 fps\n");
        println!("| phase | connections/s | producer CPU (% of a core) | consumer frames | longest gap ms |");
        println!("|---|---|---|---|---|");
        println!(
            "| quiet | 0 | {:.1} | {} | {:.1} |",
            pct(c1 - c0, t1 - t0),
            s[0].0,
            s[0].1 as f64 / 1e6
        );
        println!(
            "| flood | {:.0} | {:.1} | {} | {:.1} |",
            n as f64 / ((t3 - t2) as f64 / 1e9),
            pct(c3 - c2, t3 - t2),
            s[1].0,
            s[1].1 as f64 / 1e6
        );
        match late {
            Ok(ms) => println!(
                "\nA consumer started during the flood had its first frame after {ms:.0} ms."
            ),
            Err(e) => println!("\nA consumer started during the flood failed: {e}"),
        }
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
