// SPDX-License-Identifier: MPL-2.0
//! What a tool shows of a stream, as named fields: the one schema behind `gpushm list` /
//! `inspect --json` and Python's `gpushm.streams()` / `gpushm.inspect()`. The `gpushm`
//! command renders these fields as JSON (and adds `top`'s rates), Python as dictionaries;
//! neither lists the keys again.

use std::path::Path;

use crate::subscriber::Queried;
use crate::wire::ClientReport;

/// One figure.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
    /// A list of records (the clients).
    List(Vec<Fields>),
}

/// A record: named figures, in the order they are shown.
pub type Fields = Vec<(&'static str, Value)>;

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::Int(v.into())
    }
}

impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Value::Int(v.into())
    }
}

impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}

impl From<Option<u64>> for Value {
    /// Nanoseconds as microseconds, or null.
    fn from(ns: Option<u64>) -> Self {
        ns.map_or(Value::Null, |n| Value::Float(n as f64 / 1000.0))
    }
}

/// Whether a producer answered (`live`), nobody listens on its socket (`stale`: left by a
/// producer that died), or something else went wrong (`error`).
pub fn state(answer: &crate::Result<Queried>) -> &'static str {
    match answer {
        Ok(_) => "live",
        Err(crate::Error::Os {
            errno: nix::errno::Errno::ECONNREFUSED,
            ..
        }) => "stale",
        Err(_) => "error",
    }
}

/// A stream found at `path` under `name`, as its producer answered (or why it did not);
/// with `clients`, each client's fields under `client_list`.
pub fn stream(name: &str, path: &Path, answer: &crate::Result<Queried>, clients: bool) -> Fields {
    let mut f: Fields = vec![
        ("name", name.into()),
        ("path", Value::Text(path.display().to_string())),
        ("state", state(answer).into()),
    ];
    match answer {
        Ok(q) => {
            let r = &q.report;
            f.extend([
                ("caps", r.caps.as_str().into()),
                // Consumers taking frames (closed ones still holding frames are not counted),
                // as gpushmsink's num-clients.
                (
                    "clients",
                    r.clients.iter().filter(|c| !c.closed).count().into(),
                ),
                ("fps", r.fps.into()),
                ("slots", r.slot_count.into()),
                ("slot_size", r.slot_size.into()),
                ("ring_size", r.ring_size.into()),
                ("device_ring", r.device_ring.into()),
                ("eos", r.eos.into()),
                ("frames_sent", r.frames_sent.into()),
                ("frames_dropped", r.frames_dropped.into()),
                ("frames_copied", r.frames_copied.into()),
                ("uptime_s", (r.uptime_ns as f64 / 1e9).into()),
                ("producer_pid", q.producer_pid.into()),
                ("producer_uid", q.producer_uid.into()),
                ("max_clients", r.max_clients.into()),
            ]);
            if clients {
                f.push((
                    "client_list",
                    Value::List(r.clients.iter().map(client).collect()),
                ));
            }
        }
        Err(e) => f.extend([
            ("error", Value::Text(e.to_string())),
            ("clients", Value::Int(0)),
            ("caps", Value::Null),
        ]),
    }
    f
}

/// One client of a producer's report.
pub fn client(c: &ClientReport) -> Fields {
    vec![
        ("id", c.id.into()),
        ("pid", c.pid.into()),
        ("uid", c.uid.into()),
        ("name", c.name.as_str().into()),
        ("mode", c.mode.as_str().into()),
        ("lossless", c.lossless.into()),
        ("lagging", c.lagging.into()),
        ("closed", c.closed.into()),
        ("sent", c.sent.into()),
        ("delivered", c.taken.into()),
        ("dropped", c.dropped.into()),
        ("skipped", c.skipped.into()),
        ("copied", c.copied.into()),
        ("times_lagged", c.times_lagged.into()),
        ("held", c.held.into()),
        ("connected_s", (c.connected_ns as f64 / 1e9).into()),
        ("latency_p50_us", c.latency_p50_ns().into()),
        ("latency_p99_us", c.latency_p99_ns().into()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_socket_says_so_and_shows_no_figures() {
        let answer = Err(crate::Error::os("connect", nix::errno::Errno::ECONNREFUSED));
        let f = stream("cam", Path::new("/tmp/cam"), &answer, true);
        let keys: Vec<&str> = f.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["name", "path", "state", "error", "clients", "caps"]);
        assert_eq!(f[2].1, Value::Text("stale".into()));
    }

    #[test]
    fn a_live_stream_lists_its_clients_when_asked() {
        let report = crate::wire::StreamReport {
            clients: vec![ClientReport {
                id: 7,
                mode: "lossless".into(),
                taken: 5,
                ..Default::default()
            }],
            ..Default::default()
        };
        let q = Queried {
            path: "/tmp/cam".into(),
            producer_uid: 1000,
            producer_pid: 42,
            report,
        };
        let answer = Ok(q);
        let with = stream("cam", Path::new("/tmp/cam"), &answer, true);
        let Some((_, Value::List(list))) = with.iter().find(|(k, _)| *k == "client_list") else {
            panic!("no client_list: {with:?}");
        };
        assert!(list[0].contains(&("delivered", Value::Int(5))));
        assert!(list[0].contains(&("latency_p50_us", Value::Null)));
        let without = stream("cam", Path::new("/tmp/cam"), &answer, false);
        assert!(without.iter().all(|(k, _)| *k != "client_list"));
        assert!(without.contains(&("clients", Value::Int(1))));
    }
}
