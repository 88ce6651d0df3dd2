// SPDX-License-Identifier: MPL-2.0
//! The `cpu-latency-us` property gpushmsink and gpushmsrc share: a request to the kernel to
//! keep the CPUs out of deep idle states while the element runs (see the gpushm crate's
//! `cpu_latency` module for why and what it costs).

use gst::glib;
use gst::prelude::*;

use gpushm::cpu_latency::{CpuLatency, MAX_US};

/// The property's default: the system's own setting.
pub const DEFAULT: i32 = -1;

/// The property, described once for both elements.
pub fn param_spec() -> glib::ParamSpec {
    glib::ParamSpecInt::builder("cpu-latency-us")
        .nick("CPU wake-up latency")
        .blurb("Keeps this machine's CPUs in idle states that wake within this many microseconds while the element runs (the kernel's CPU latency QoS, /dev/cpu_dma_latency; -1 = the system's setting; read when the element starts). A core that slept in a deep idle state wakes with cold caches, and a frame's way after it costs several µs more on each side (about 10 on the dev VM): 0 with spin-us on the consumers gives the lowest latency. Costs power and no CPU time of this process, but with 0 idle cores poll instead of sleeping (in a VM each vCPU keeps a host core busy); a few µs still allows the lightest sleep states on most CPUs. Needs write access to /dev/cpu_dma_latency (root, or a udev rule), else a warning says so and the stream goes on; changes nothing where the kernel has no cpuidle driver (some VMs)")
        .minimum(-1)
        .maximum(MAX_US as i32)
        .default_value(DEFAULT)
        .mutable_ready()
        .build()
}

/// Asks for `us` (-1: nothing) for as long as the result lives. Refused (no access, no such
/// device): a warning on the bus that says why, and the element goes on without it.
pub fn hold(element: &impl IsA<gst::Element>, us: i32) -> Option<CpuLatency> {
    let us = u32::try_from(us).ok()?;
    match CpuLatency::request(us) {
        Ok(held) => {
            gst::info!(
                crate::CAT,
                obj = element,
                "CPUs kept in idle states that wake within {us} µs"
            );
            Some(held)
        }
        Err(e) => {
            gst::element_warning!(
                element,
                gst::ResourceError::OpenWrite,
                ("cpu-latency-us={} is not applied: {}", us, e)
            );
            None
        }
    }
}
