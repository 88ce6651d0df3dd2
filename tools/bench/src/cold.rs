// SPDX-License-Identifier: MPL-2.0
//! What taking a frame costs with cold caches (`bench cold`).

use std::time::Duration;

use crate::measure::now;
use crate::num;

/// The Rust side of capi/bench/c_cold.c (`bench cold [--frames N] [--evict-mib M]
/// [--sleep-us U]`): what taking a frame costs with cold caches, as after a consumer's sleep. A
/// publisher and a subscriber in this process; per frame, publish, sleep and write M MiB (the
/// caches and the TLB lose what the frame's way reads), then time `next_frame` and the frame's
/// drop (the frame is there already: no wait). The same COLD lines as c_cold.
pub fn cold(args: &[String]) -> Result<(), String> {
    use gpushm::format::{FrameLayout, VideoFormat};
    use gpushm::publisher::{Config, Publisher};
    let n = num(args, "--frames", 500).max(1) as usize;
    let evict_mib = num(args, "--evict-mib", 16) as usize;
    let nap = Duration::from_micros(num(args, "--sleep-us", 1000));
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("cold.sock");
    let layout =
        FrameLayout::new(VideoFormat::from_name("GRAY8").ok_or("GRAY8")?, 64, 64).ok_or("64x64")?;
    let p =
        Publisher::new(&path, layout, (60, 1), 8, Config::default()).map_err(|e| e.to_string())?;
    let opts = gpushm::subscriber::ConnectOptions {
        mode: gpushm::policy::Delivery::Lossless,
        ..Default::default()
    };
    let mut sub =
        gpushm::subscriber::Subscriber::connect(&path, opts).map_err(|e| e.to_string())?;
    let mut evict = vec![0u8; evict_mib << 20];
    let second = Some(Duration::from_secs(1));
    for (pass, what) in ["rust cold", "rust warm"].into_iter().enumerate() {
        let mut v = Vec::with_capacity(n);
        // The first frames set the subscriber up (caps, ring): not counted.
        for i in 0..n + 10 {
            let lease = p
                .acquire(Duration::from_secs(1))
                .map_err(|e| e.to_string())?;
            p.publish(lease, None).map_err(|e| e.to_string())?;
            if pass == 0 {
                std::thread::sleep(nap);
                for o in (0..evict.len()).step_by(64) {
                    evict[o] = (o + i) as u8;
                }
                std::hint::black_box(&evict);
            }
            let t0 = now();
            let f = sub
                .next_frame(second)
                .map_err(|e| e.to_string())?
                .ok_or("end of stream")?;
            std::hint::black_box(f.as_ptr());
            drop(f);
            let t1 = now();
            if i >= 10 {
                v.push(t1 - t0);
            }
        }
        let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
        v.sort_unstable();
        println!(
            "COLD {what} frames={n} median_ns={} mean_ns={mean:.0} p90_ns={}",
            v[v.len() / 2],
            v[v.len() * 9 / 10]
        );
    }
    Ok(())
}
