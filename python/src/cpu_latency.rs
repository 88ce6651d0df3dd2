// SPDX-License-Identifier: MPL-2.0
//! `CpuLatency`: keeping the CPUs out of deep idle states (the gpushm crate's `cpu_latency`).

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use gpushm::cpu_latency::CpuLatency as Held;
use gpushm::Error as CoreError;

fn to_py(e: CoreError) -> PyErr {
    match e {
        CoreError::Invalid(m) => PyValueError::new_err(m),
        e => crate::errors::to_py(e),
    }
}

/// Keeps this machine's CPUs in idle states that wake within `us` microseconds (0 to
/// 1000000; 0: the shallowest) until closed: the kernel's CPU latency QoS
/// (/dev/cpu_dma_latency), the companion of ``spin_us`` for the lowest latency. A core that
/// slept in a deep idle state wakes with cold caches, and a frame's way after it costs several
/// µs more on each side (about 10 on the dev VM). Costs power and no CPU time of this process,
/// but with 0 idle cores poll instead of sleeping (in a VM each vCPU keeps a host core busy);
/// a few µs still allows the lightest sleep states on most CPUs. The kernel drops the request
/// when the process ends, however it ends. Needs write access to /dev/cpu_dma_latency (root,
/// or a udev rule): ``gpushm.Error`` otherwise, saying so (``ValueError`` for a value out of
/// range). Changes nothing where the kernel has no cpuidle driver (some VMs)::
///
///     with gpushm.CpuLatency(0), gpushm.Subscriber("/tmp/cam", spin_us=300) as sub:
///         for frame in sub: ...
#[pyclass(module = "gpushm", name = "CpuLatency", frozen)]
pub struct CpuLatency {
    held: Mutex<Option<Held>>,
    us: u32,
}

#[pymethods]
impl CpuLatency {
    #[new]
    fn new(us: u32) -> PyResult<Self> {
        let held = Held::request(us).map_err(to_py)?;
        Ok(CpuLatency {
            held: Mutex::new(Some(held)),
            us,
        })
    }

    /// The latency asked for, µs.
    #[getter]
    fn us(&self) -> u32 {
        self.us
    }

    /// Whether the request still holds (not closed).
    #[getter]
    fn held(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The latency the kernel keeps the CPUs to now (the smallest of all requests), µs.
    /// Reading needs access too (read access: root, or the same udev rule).
    #[staticmethod]
    fn current() -> PyResult<u32> {
        Held::current().map_err(to_py)
    }

    /// Withdraws the request (again: nothing).
    fn close(&self) {
        let old = self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(old);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "gpushm.CpuLatency({}{})",
            self.us,
            if self.held() { "" } else { ", closed" }
        )
    }
}
