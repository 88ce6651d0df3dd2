// SPDX-License-Identifier: MPL-2.0
//! A consumer without GStreamer: prints, for each frame, its number, format and the sum of
//! every visible byte of each plane, read in place from the shared ring. With --verify it also
//! checks every byte against the test pattern (synthetic_camera, pattern_producer).
//!
//!     cargo run --release -p gpushm --example plane_sums -- --socket /tmp/cam --frames 100
//!
//! Options: --socket PATH (required), --frames N (stop after N), --lossless, --verify,
//! --timeout SECONDS (wait that long for a producer, 5). Exit code: 0 when every frame checked
//! out, 1 when a check failed, 2 when the producer could not be reached or went away.

use std::time::Duration;

use gpushm::format::pattern_value;
use gpushm::subscriber::{ConnectOptions, Subscriber};

fn main() {
    let mut socket = None;
    let (mut frames, mut lossless, mut verify, mut timeout) = (None, false, false, 5.0f64);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bad = |what: &str| -> ! {
        eprintln!("plane_sums: {what}");
        std::process::exit(2)
    };
    let mut i = 0;
    while i < args.len() {
        let value = || {
            args.get(i + 1)
                .cloned()
                .unwrap_or_else(|| bad(&format!("{} needs a value", args[i])))
        };
        match args[i].as_str() {
            "--socket" => socket = Some(value()),
            "--frames" => {
                frames = Some(value().parse::<u64>().unwrap_or_else(|_| bad("--frames N")))
            }
            "--timeout" => timeout = value().parse().unwrap_or_else(|_| bad("--timeout SECONDS")),
            "--lossless" => {
                lossless = true;
                i += 1;
                continue;
            }
            "--verify" => {
                verify = true;
                i += 1;
                continue;
            }
            k => bad(&format!("unknown option {k}")),
        }
        i += 2;
    }
    let Some(socket) = socket else {
        eprintln!("plane_sums: --socket PATH is required");
        std::process::exit(2);
    };
    let opts = ConnectOptions {
        lossless,
        timeout: Duration::from_secs_f64(timeout),
        name: "plane_sums".into(),
        ..Default::default()
    };
    let mut sub = match Subscriber::connect(socket.as_ref(), opts) {
        Ok(s) => s,
        Err(e) => {
            println!("ERROR {e}");
            std::process::exit(2);
        }
    };
    let (mut n, mut bad_frames) = (0u64, 0u64);
    loop {
        if frames.is_some_and(|f| n >= f) {
            break;
        }
        let frame = match sub.next_frame(None) {
            Ok(Some(f)) => f,
            Ok(None) => {
                println!("EOS");
                break;
            }
            Err(e) => {
                println!("ERROR {e}");
                std::process::exit(2);
            }
        };
        let layout = match frame.layout() {
            Ok(l) => l,
            Err(e) => {
                println!("ERROR invalid frame {}: {e}", frame.meta.offset);
                std::process::exit(2);
            }
        };
        let bytes = frame.to_vec();
        let mut sums = Vec::new();
        let mut ok = true;
        for (p, plane) in layout.planes.iter().enumerate() {
            let mut sum = 0u64;
            for r in 0..plane.rows as usize {
                let start = plane.offset as usize + r * plane.stride as usize;
                let row = &bytes[start..start + plane.row_bytes as usize];
                sum += row.iter().map(|&b| b as u64).sum::<u64>();
                if verify
                    && row
                        .iter()
                        .any(|&b| b != pattern_value(frame.meta.offset, p, r))
                {
                    ok = false;
                }
            }
            sums.push(sum.to_string());
        }
        if !ok {
            bad_frames += 1;
        }
        println!(
            "FRAME n={} format={} {}x{} pts={} plane_sums={} ok={ok}",
            frame.meta.offset,
            layout.format,
            layout.width,
            layout.height,
            frame.meta.pts,
            sums.join(",")
        );
        n += 1;
    }
    println!(
        "SUMMARY frames={n} bad={bad_frames} dropped={}",
        sub.dropped()
    );
    std::process::exit(if bad_frames > 0 { 1 } else { 0 });
}
