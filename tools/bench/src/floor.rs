// SPDX-License-Identifier: MPL-2.0
//! The wake-up floor (`bench floor`): the latency no transport can avoid on this machine.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::measure::{now, parse, percentile, Fields};
use crate::num;

/// The wake-up floor, waiting side: blocks in poll() on an inherited eventfd whose counter the
/// writer sets to its CLOCK_MONOTONIC time, and reports how late each wake-up came.
pub fn floor_wait(args: &[String]) -> Result<(), String> {
    use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
    let fd = num(args, "--fd", u64::MAX);
    let frames = num(args, "--frames", 90);
    let fd = i32::try_from(fd).map_err(|_| "--fd N is required")?;
    // SAFETY: the parent handed us this eventfd and nothing else uses it here.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let efd: BorrowedFd<'_> = owned.as_fd();
    println!("READY");
    let mut lat = Vec::new();
    while (lat.len() as u64) < frames {
        let mut pfd = [nix::poll::PollFd::new(efd, nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(5000u16))
            .map_err(|e| format!("poll: {e}"))?;
        let mut buf = [0u8; 8];
        if nix::unistd::read(efd, &mut buf).map_err(|e| format!("read: {e}"))? != 8 {
            return Err("short read".into());
        }
        let t = now();
        lat.push(t.saturating_sub(u64::from_ne_bytes(buf)));
    }
    lat.sort_unstable();
    println!(
        "FLOOR p50_us={:.1} p99_us={:.1}",
        percentile(&lat, 0.5) as f64 / 1e3,
        percentile(&lat, 0.99) as f64 / 1e3
    );
    Ok(())
}

/// The latency no transport can avoid on this machine: one process writes an eventfd at `fps`,
/// another blocked in poll() wakes. Measured in the same run as the transports.
pub fn floor(fps: u64, frames: u64) -> Option<Fields> {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    // Inherited by the child: no CLOEXEC.
    let efd =
        nix::sys::eventfd::EventFd::from_value_and_flags(0, nix::sys::eventfd::EfdFlags::empty())
            .ok()?;
    let mut child = Command::new(std::env::current_exe().ok()?)
        .args([
            "floor-wait",
            "--fd",
            &efd.as_raw_fd().to_string(),
            "--frames",
            &frames.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    let mut out = std::io::BufReader::new(child.stdout.take()?);
    let mut line = String::new();
    out.read_line(&mut line).ok()?;
    let period = Duration::from_nanos(1_000_000_000 / fps.max(1));
    let mut next = std::time::Instant::now() + period;
    for _ in 0..frames {
        std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
        next += period;
        let _ = efd.write(now());
    }
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    let _ = child.wait();
    parse(&rest, "FLOOR ")
}
