// SPDX-License-Identifier: MPL-2.0
//! `gpushm.streams()` and `gpushm.inspect()`: what the `gpushm list` / `inspect` command shows,
//! as dictionaries with the same keys as its `--json` output (`python -m gpushm` prints them).

use std::path::PathBuf;
use std::time::Duration;

use gpushm::names::{self, Endpoint};
use gpushm::subscriber::{query, Queried};
use gpushm::wire::ClientReport;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::to_py;

const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

fn us(ns: Option<u64>) -> Option<f64> {
    ns.map(|n| n as f64 / 1000.0)
}

fn client<'py>(py: Python<'py>, c: &ClientReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", c.id)?;
    d.set_item("pid", c.pid)?;
    d.set_item("uid", c.uid)?;
    d.set_item("name", &c.name)?;
    d.set_item("mode", &c.mode)?;
    d.set_item("lossless", c.lossless)?;
    d.set_item("lagging", c.lagging)?;
    d.set_item("closed", c.closed)?;
    d.set_item("sent", c.sent)?;
    d.set_item("delivered", c.taken)?;
    d.set_item("dropped", c.dropped)?;
    d.set_item("skipped", c.skipped)?;
    d.set_item("copied", c.copied)?;
    d.set_item("times_lagged", c.times_lagged)?;
    d.set_item("held", c.held)?;
    d.set_item("connected_s", c.connected_ns as f64 / 1e9)?;
    d.set_item("latency_p50_us", us(c.latency_p50_ns()))?;
    d.set_item("latency_p99_us", us(c.latency_p99_ns()))?;
    Ok(d)
}

fn stream<'py>(
    py: Python<'py>,
    name: &str,
    path: PathBuf,
    answer: Result<Queried, gpushm::Error>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", name)?;
    d.set_item("path", path)?;
    match answer {
        Ok(q) => {
            let r = &q.report;
            d.set_item("state", "live")?;
            d.set_item("caps", &r.caps)?;
            d.set_item("clients", r.clients.iter().filter(|c| !c.closed).count())?;
            d.set_item("fps", r.fps)?;
            d.set_item("slots", r.slot_count)?;
            d.set_item("slot_size", r.slot_size)?;
            d.set_item("ring_size", r.ring_size)?;
            d.set_item("device_ring", r.device_ring)?;
            d.set_item("eos", r.eos)?;
            d.set_item("frames_sent", r.frames_sent)?;
            d.set_item("frames_dropped", r.frames_dropped)?;
            d.set_item("frames_copied", r.frames_copied)?;
            d.set_item("uptime_s", r.uptime_ns as f64 / 1e9)?;
            d.set_item("producer_pid", q.producer_pid)?;
            d.set_item("producer_uid", q.producer_uid)?;
            d.set_item("max_clients", r.max_clients)?;
            let list = PyList::empty(py);
            for c in &r.clients {
                list.append(client(py, c)?)?;
            }
            d.set_item("client_list", list)?;
        }
        Err(e) => {
            let stale = matches!(
                e,
                gpushm::Error::Os {
                    errno: nix::errno::Errno::ECONNREFUSED,
                    ..
                }
            );
            d.set_item("state", if stale { "stale" } else { "error" })?;
            d.set_item("error", e.to_string())?;
            d.set_item("clients", 0)?;
            d.set_item("caps", py.None())?;
        }
    }
    Ok(d)
}

/// Every stream of the stream directories ($GPUSHM_RUNTIME_DIR, else this user's directory and
/// /run/gpushm), as `gpushm list --json` gives them: dicts with `name`, `path`, `state`
/// ("live", "stale" or "error"), `caps`, `clients`, `fps`, `slots`, ... and `client_list`.
/// Each producer is asked over its socket; none is joined as a consumer.
#[pyfunction]
pub fn streams(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let found = py.detach(names::list).map_err(to_py)?;
    let out = PyList::empty(py);
    for f in found {
        let ep = Endpoint::Path(f.path.clone());
        let answer = py.detach(|| query(&ep, QUERY_TIMEOUT));
        out.append(stream(py, &f.name, f.path, answer)?)?;
    }
    Ok(out)
}

/// One stream, by name or socket path (anything with a '/'), as `gpushm inspect --json`
/// gives it. Raises gpushm.Error when no producer answers.
#[pyfunction]
pub fn inspect(py: Python<'_>, stream_or_path: String) -> PyResult<Bound<'_, PyDict>> {
    let ep = if stream_or_path.contains('/') {
        Endpoint::Path(PathBuf::from(&stream_or_path))
    } else {
        names::check_name(&stream_or_path)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        Endpoint::Stream(stream_or_path.clone())
    };
    let path = ep.resolve().map_err(to_py)?;
    let answer = py.detach(|| query(&ep, QUERY_TIMEOUT)).map_err(to_py)?;
    stream(py, &stream_or_path, path, Ok(answer))
}
