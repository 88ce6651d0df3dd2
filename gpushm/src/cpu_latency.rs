// SPDX-License-Identifier: MPL-2.0
//! Keeping the CPUs out of deep idle states while a low-latency stream runs: a request to the
//! kernel's CPU latency QoS (`/dev/cpu_dma_latency`), held as long as a [`CpuLatency`] lives.
//!
//! Why: between two frames at 30 fps a core sleeps for tens of milliseconds. In a deep idle
//! state (or, in a VM, halted and given to other work) it loses its caches, TLB and branch
//! history, and the next frame's way pays for every miss: on the 2-core dev VM
//! (`bench latency --cpu-latency-us 0`, built with per-stage times) the producer's part (stamp
//! to publish) took 9.9–14.8 µs after such a sleep and 5.2–6.4 µs with the cores kept out of
//! it, and gpushmsrc's way from the ring to its source pad in low-latency mode 13–17 µs
//! against 2.5–5.4. Polling (`spin-us`) keeps only the polling thread's core awake, and only
//! for its budget; this request keeps every core in idle states that wake within the given
//! time, for as long as it is held.
//!
//! What it costs: power, and no CPU time of this process; but with 0 idle cores poll instead
//! of sleeping (in a VM each vCPU then keeps a host core busy, on bare metal a busy
//! hyperthread sibling loses some throughput), where a few µs still allows the lightest sleep
//! states that keep the caches on most CPUs. What it needs: write access to
//! `/dev/cpu_dma_latency` (root, or a udev rule such as
//! `KERNEL=="cpu_dma_latency", GROUP="video", MODE="0660"`). Where the kernel has no cpuidle
//! driver (`/sys/devices/system/cpu/cpuidle/current_driver` reads `none`, as in some VMs) an
//! idle core halts whatever is asked, and the request changes nothing.
//!
//! The kernel keeps the smallest value of all requests and drops ours when its descriptor
//! closes, a killed process's included: nothing is left behind.

use std::fs::OpenOptions;
use std::io::{Read, Write};

use crate::{Error, Result};

/// The kernel's interface.
pub const DEVICE: &str = "/dev/cpu_dma_latency";

/// The largest latency one may ask for, µs (1 s: anything longer asks for nothing).
pub const MAX_US: u32 = 1_000_000;

/// A held request: every CPU stays in idle states that wake within [`Self::us`] µs until it
/// is dropped.
#[derive(Debug)]
pub struct CpuLatency {
    _device: std::fs::File,
    us: u32,
}

impl CpuLatency {
    /// Asks the kernel to keep every CPU in idle states that wake within `us` µs (0: the
    /// shallowest, or polling), for as long as the returned value lives.
    pub fn request(us: u32) -> Result<Self> {
        if us > MAX_US {
            return Err(Error::Invalid(format!(
                "a CPU latency of {us} µs is over the largest, {MAX_US} µs"
            )));
        }
        // (std opens it close-on-exec.)
        let mut device = OpenOptions::new()
            .write(true)
            .open(DEVICE)
            .map_err(|e| os_error(&format!("opening {DEVICE}"), &e))?;
        // The kernel takes a binary s32 in one write of 4 bytes (anything else is read as a hex
        // string): a short write is refused, never completed by a second one.
        let what = format!("writing {us} µs to {DEVICE}");
        match device.write(&(us as i32).to_ne_bytes()) {
            Ok(4) => {}
            Ok(n) => return Err(Error::Invalid(format!("{what}: {n} of 4 bytes written"))),
            Err(e) => return Err(os_error(&what, &e)),
        }
        Ok(CpuLatency {
            _device: device,
            us,
        })
    }

    /// The latency this request asks for, µs.
    pub fn us(&self) -> u32 {
        self.us
    }

    /// The latency the kernel keeps the CPUs to now (the smallest of all requests; 2 000 s
    /// when none), µs. Reading needs access too (read access: root, or the same udev rule).
    pub fn current() -> Result<u32> {
        let mut v = [0u8; 4];
        std::fs::File::open(DEVICE)
            .and_then(|mut f| f.read_exact(&mut v))
            .map_err(|e| os_error(&format!("reading {DEVICE}"), &e))?;
        Ok(i32::from_ne_bytes(v).max(0) as u32)
    }
}

/// An [`Error::Os`] that says how to get access where the answer is "permission denied" or
/// "no such device".
fn os_error(what: &str, e: &std::io::Error) -> Error {
    let errno = nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0));
    let hint = match errno {
        nix::errno::Errno::EACCES | nix::errno::Errno::EPERM => {
            " (asking the kernel to keep the CPUs awake needs access to it: run as root, or add a udev rule such as KERNEL==\"cpu_dma_latency\", GROUP=\"video\", MODE=\"0660\")"
        }
        nix::errno::Errno::ENOENT | nix::errno::Errno::ENODEV => {
            " (this kernel or container has no CPU latency QoS device)"
        }
        _ => "",
    };
    Error::os(format!("{what}{hint}"), errno)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_the_largest_is_refused_saying_so() {
        let e = CpuLatency::request(MAX_US + 1).unwrap_err().to_string();
        assert!(e.contains("1000001 µs") && e.contains("largest"), "{e}");
    }

    /// Where the device is writable (root, or a udev rule): the request holds while it lives
    /// and goes with it. Missing (a container): refused, saying so. Otherwise: refused with a
    /// message that says what access it needs.
    #[test]
    fn a_request_holds_while_it_lives_or_says_why_not() {
        match writable() {
            Some(true) => holds_while_it_lives(),
            Some(false) => {
                let e = CpuLatency::request(0).unwrap_err().to_string();
                assert!(e.contains(DEVICE) && e.contains("udev rule"), "{e}");
            }
            None => {
                let e = CpuLatency::request(0).unwrap_err().to_string();
                assert!(e.contains("no CPU latency QoS device"), "{e}");
            }
        }
    }

    /// Whether this process may write the device (`None`: there is none).
    fn writable() -> Option<bool> {
        if !std::path::Path::new(DEVICE).exists() {
            return None;
        }
        Some(nix::unistd::access(DEVICE, nix::unistd::AccessFlags::W_OK).is_ok())
    }

    fn holds_while_it_lives() {
        let before = CpuLatency::current().unwrap();
        // A value no other holder is likely to have asked for, below the default.
        let r = CpuLatency::request(37).unwrap();
        assert_eq!(r.us(), 37);
        let held = CpuLatency::current().unwrap();
        assert_eq!(held, before.min(37));
        let r2 = CpuLatency::request(12).unwrap();
        assert_eq!(CpuLatency::current().unwrap(), before.min(12));
        drop(r2);
        assert_eq!(CpuLatency::current().unwrap(), before.min(37));
        drop(r);
        assert_eq!(CpuLatency::current().unwrap(), before);
    }
}
