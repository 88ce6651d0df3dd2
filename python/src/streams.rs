// SPDX-License-Identifier: MPL-2.0
//! `gpushm.streams()` and `gpushm.inspect()`: what the `gpushm list` / `inspect` command shows,
//! as dictionaries with the same keys as its `--json` output (`python -m gpushm` prints them).

use std::path::PathBuf;
use std::time::Duration;

use gpushm::inspect::{self as schema, Fields, Value};
use gpushm::names::{self, Endpoint};
use gpushm::subscriber::{query, Queried};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::to_py;

const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

/// The core's fields ([`gpushm::inspect`], one schema for Python and the `gpushm` command) as a dict.
fn dict<'py>(py: Python<'py>, fields: Fields) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in fields {
        match v {
            Value::Null => d.set_item(k, py.None())?,
            Value::Bool(b) => d.set_item(k, b)?,
            Value::Int(i) => d.set_item(k, i)?,
            Value::Float(f) => d.set_item(k, f)?,
            Value::Text(t) => d.set_item(k, t)?,
            Value::List(list) => {
                let l = PyList::empty(py);
                for f in list {
                    l.append(dict(py, f)?)?;
                }
                d.set_item(k, l)?
            }
        }
    }
    Ok(d)
}

fn stream<'py>(
    py: Python<'py>,
    name: &str,
    path: PathBuf,
    answer: Result<Queried, gpushm::Error>,
) -> PyResult<Bound<'py, PyDict>> {
    dict(py, schema::stream(name, &path, &answer, true))
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
