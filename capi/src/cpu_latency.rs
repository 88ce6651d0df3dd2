// SPDX-License-Identifier: MPL-2.0
//! Keeping the CPUs awake: `gpushm_cpu_latency_*`.

use super::*;

/// Keeps this machine's CPUs in idle states that wake within `us` microseconds (0: the
/// shallowest) until `gpushm_cpu_latency_release`: the kernel's CPU latency QoS
/// (/dev/cpu_dma_latency), the companion of `spin_us` for the lowest latency. A core that
/// slept in a deep idle state wakes with cold caches, and a frame's way after it costs
/// several µs more on each side (about 10 on the dev VM). Costs power and no CPU time of this
/// process, but with 0 idle cores poll instead of sleeping (in a VM each vCPU keeps a host
/// core busy); a few µs still allows the lightest sleep states on most CPUs. The kernel drops
/// the request when the process ends, however it ends. Needs write access to
/// /dev/cpu_dma_latency (root, or a udev rule): GPUSHM_ERROR_SYSTEM otherwise, with
/// `gpushm_last_error` saying so. Changes nothing where the kernel has no cpuidle driver
/// (some VMs). `us` at most 1000000.
#[no_mangle]
pub unsafe extern "C" fn gpushm_cpu_latency_request(
    us: u32,
    out: *mut *mut gpushm_cpu_latency,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let held = CpuLatency::request(us)?;
        let h = insert(&CPU_LATENCIES, Arc::new(held))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(h as *mut gpushm_cpu_latency) };
        Ok(GPUSHM_OK)
    })
}

/// The latency the kernel keeps the CPUs to now (the smallest of all requests), µs. Reading
/// needs access too (read access: root, or the same udev rule).
#[no_mangle]
pub unsafe extern "C" fn gpushm_cpu_latency_current(us: *mut u32) -> gpushm_status {
    guard(|| {
        let out = out_ptr(us, "us")?;
        let v = CpuLatency::current()?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(v) };
        Ok(GPUSHM_OK)
    })
}

/// Withdraws the request and frees it.
#[no_mangle]
pub unsafe extern "C" fn gpushm_cpu_latency_release(
    request: *mut gpushm_cpu_latency,
) -> gpushm_status {
    guard(|| {
        let r = lock(&CPU_LATENCIES)
            .remove(request as u64)
            .ok_or_else(|| bad_handle("cpu latency request"))?;
        // Its descriptor closes after the table's lock.
        drop(r);
        Ok(GPUSHM_OK)
    })
}
