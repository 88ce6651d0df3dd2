// SPDX-License-Identifier: MPL-2.0
//! A camera without GStreamer: publishes numbered test frames through gpushm. Every byte of
//! row `r` of plane `p` of frame `n` is `gpushm::format::pattern_value(n, p, r)`, so any
//! consumer can check what it got (gpushmsrc, or the plane_sums example).
//!
//!     cargo run --release -p gpushm --example synthetic_camera -- --socket /tmp/cam --frames 300
//!     gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink
//!
//! Options: --socket PATH (required), --format GRAY8|I420|NV12|RGBA (I420), --width 640,
//! --height 480, --fps 30, --frames N (300; 0 = until killed), --wait (wait for a consumer
//! before the first frame), --switch-at N (from frame N on, GRAY8 at half the size: a caps
//! change consumers follow), --slots N (8), --spin-us N (0: the low-latency mode of the wait
//! for a lossless consumer, see `Publisher::set_spin`). Prints `STATS frames=N clients=N
//! spin-caught=N spin-missed=N` at the end.

use std::time::Duration;

use gpushm::format::{pattern_value, FrameLayout, VideoFormat};
use gpushm::publisher::{Config, Publisher};

fn main() {
    if let Err(e) = run() {
        eprintln!("synthetic_camera: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut socket = None;
    let (mut format, mut width, mut height, mut fps, mut frames, mut wait) =
        (VideoFormat::I420, 640, 480, 30u32, 300u64, false);
    let mut switch_at = None;
    let mut slots = 8u32;
    let mut spin_us = 0u64;
    let mut args = std::env::args().skip(1);
    while let Some(k) = args.next() {
        let mut v = || args.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--socket" => socket = Some(v()?),
            "--format" => {
                let f = v()?;
                format = VideoFormat::from_name(&f).ok_or(format!("unknown format {f}"))?
            }
            "--width" => width = v()?.parse()?,
            "--height" => height = v()?.parse()?,
            "--fps" => fps = v()?.parse()?,
            "--frames" => frames = v()?.parse()?,
            "--wait" => wait = true,
            "--switch-at" => switch_at = Some(v()?.parse::<u64>()?),
            "--slots" => slots = v()?.parse()?,
            "--spin-us" => spin_us = v()?.parse()?,
            _ => return Err(format!("unknown option {k}").into()),
        }
    }
    let socket = socket.ok_or("--socket PATH is required")?;
    let mut layout = FrameLayout::new(format, width, height).ok_or("bad frame size")?;
    let camera = Publisher::new(
        socket.as_ref(),
        layout.clone(),
        (fps, 1),
        slots,
        Config::default(),
    )?;
    camera.set_spin(Duration::from_micros(spin_us))?;
    if wait {
        while camera.num_clients() == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let period_ns = 1_000_000_000 / fps.max(1) as u64;
    let start = gpushm::monotonic_ns();
    let mut n = 0u64;
    while frames == 0 || n < frames {
        // Frame n is captured at start + n periods (CLOCK_MONOTONIC), like a camera's sensor
        // clock, and published once that time has come.
        if switch_at == Some(n) {
            layout = FrameLayout::new(VideoFormat::Gray8, width / 2, height / 2)
                .ok_or("bad frame size")?;
            camera.set_layout(layout.clone(), (fps, 1))?;
        }
        let captured = start + n * period_ns;
        let now = gpushm::monotonic_ns();
        if captured > now {
            std::thread::sleep(Duration::from_nanos(captured - now));
        }
        let mut slot = camera.acquire(Duration::from_secs(5))?;
        let bytes = slot.bytes_mut();
        for (p, plane) in layout.planes.iter().enumerate() {
            for r in 0..plane.rows as usize {
                let start = plane.offset as usize + r * plane.stride as usize;
                bytes[start..start + plane.row_bytes as usize].fill(pattern_value(n, p, r));
            }
        }
        camera.publish(slot, Some(captured))?;
        n += 1;
    }
    camera.send_eos();
    // Give consumers a moment to take the last frames and the EOS before the socket closes.
    std::thread::sleep(Duration::from_millis(200));
    let st = camera.stats().0;
    println!(
        "STATS frames={n} clients={} spin-caught={} spin-missed={}",
        camera.num_clients(),
        st.spin_caught,
        st.spin_missed
    );
    Ok(())
}
