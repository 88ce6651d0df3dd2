// SPDX-License-Identifier: MPL-2.0
//! The package's exception classes and how core errors map onto them.

use std::time::Duration;

use gpushm::Error as CoreError;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    gpushm,
    Error,
    PyRuntimeError,
    "A gpushm error: the producer refused us, sent something invalid, or a system call failed."
);
pyo3::create_exception!(
    gpushm,
    ProducerLost,
    Error,
    "The producer went away (it stopped or crashed) or closed our connection."
);
pyo3::create_exception!(
    gpushm,
    EndOfStream,
    Error,
    "The producer sent end-of-stream: no frame follows. Iteration simply stops there."
);
pyo3::create_exception!(
    gpushm,
    Timeout,
    PyTimeoutError,
    "No frame (or no producer) within the timeout."
);
pyo3::create_exception!(
    gpushm,
    FrameRevoked,
    Error,
    "The producer cut this subscriber and took its frames back: a frame's memory may hold \
another frame now (see Frame.valid)."
);

pub fn to_py(e: CoreError) -> PyErr {
    match e {
        CoreError::Disconnected => {
            ProducerLost::new_err("the producer went away (gpushmsink stopped or crashed)")
        }
        CoreError::Refused(m) => ProducerLost::new_err(m),
        CoreError::Timeout(m) => Timeout::new_err(m),
        CoreError::Interrupted => Error::new_err("interrupted: the subscriber was closed"),
        e => Error::new_err(e.to_string()),
    }
}

/// A timeout in seconds (None: forever) as a Duration.
pub fn secs(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        // Beyond what a Duration holds: as good as forever.
        Some(s) if s >= 0.0 => Ok(Some(
            Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX),
        )),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a number of seconds ≥ 0 or None, not {s}"
        ))),
    }
}

/// Where to connect or publish: `path` or `stream` (a name, see gpushm.names), exactly one;
/// neither is a TypeError (a missing argument), anything else wrong a ValueError saying why.
pub fn endpoint(
    path: Option<std::path::PathBuf>,
    stream: Option<String>,
) -> PyResult<gpushm::names::Endpoint> {
    if path.is_none() && stream.is_none() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "give the producer's path or its stream name (stream=...)",
        ));
    }
    gpushm::names::Endpoint::from_settings(path, stream, "path")
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A `spin_us` argument as a budget, refused over the core's bound with its reason.
pub fn spin(spin_us: u32) -> PyResult<Duration> {
    let spin = Duration::from_micros(spin_us.into());
    gpushm::policy::check_spin(spin)
        .map_err(|e| PyValueError::new_err(format!("spin_us={spin_us}: {e}")))?;
    Ok(spin)
}
