// SPDX-License-Identifier: MPL-2.0
//! `gpushm` for Python: live frames from a gpushmsink (or any gpushm publisher) as read-only
//! NumPy views into the shared ring, and on a CUDA machine as device arrays for PyTorch and
//! CuPy, with no copy. Built on the `gpushm` crate: no GStreamer, no PyGObject.
//!
//! Views use the NumPy array interface (`__array_interface__`), CUDA's
//! (`__cuda_array_interface__`, v3) and DLPack (`__dlpack__`, 0.x and 1.x), so the extension
//! needs no NumPy headers and works with the stable ABI (abi3, CPython ≥ 3.9).
//!
//! One module per class: `subscriber` (Subscriber), `frame` (Frame), `view` (FrameView),
//! `publisher` (Publisher, Slot); `cpu_latency` (CpuLatency); `streams` (streams(), inspect()); `errors` (exception classes), `dlpack` and `cuda` (export
//! and ring registration).

use pyo3::prelude::*;

mod cpu_latency;
mod cuda;
mod dlpack;
mod errors;
mod frame;
mod held;
mod publisher;
mod streams;
mod subscriber;
mod view;

use errors::{EndOfStream, Error, FrameRevoked, ProducerLost, Timeout};

/// cuMemHostRegister calls made by this process (one per ring, never one per frame).
#[pyfunction]
fn cuda_registrations() -> u64 {
    cuda::registrations()
}

#[pymodule]
fn _gpushm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<subscriber::Subscriber>()?;
    m.add_class::<frame::Frame>()?;
    m.add_class::<view::View>()?;
    m.add_class::<publisher::Publisher>()?;
    m.add_class::<publisher::Slot>()?;
    m.add_class::<cpu_latency::CpuLatency>()?;
    m.add_function(wrap_pyfunction!(cuda_registrations, m)?)?;
    m.add_function(wrap_pyfunction!(streams::streams, m)?)?;
    m.add_function(wrap_pyfunction!(streams::inspect, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("ProducerLost", py.get_type::<ProducerLost>())?;
    m.add("EndOfStream", py.get_type::<EndOfStream>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("FrameRevoked", py.get_type::<FrameRevoked>())?;
    Ok(())
}
