// SPDX-License-Identifier: MPL-2.0
//! The `stats` property: the server's counters and each client's, as a structure.

use super::pool::Server;

/// The `stats` structure of `server` (all zeros and no clients when the element is stopped).
pub(super) fn structure(server: Option<&Server>) -> gst::Structure {
    let (s, clients) = server.map(|s| s.stats()).unwrap_or_default();
    let clients: Vec<gst::Structure> = clients
        .into_iter()
        .map(|c| {
            gst::Structure::builder("client")
                .field("id", c.id)
                .field("pid", c.pid)
                .field("mode", c.mode.name())
                .field("lossless", c.lossless)
                .field("frames-sent", c.sent)
                .field("frames-dropped", c.dropped)
                .field("held-slots", c.held as u32)
                .field("frames-copied", c.copied)
                .field("lagging", c.lagging)
                .field("times-lagged", c.times_lagged)
                .field("closed", c.closed)
                .field("uid", c.uid)
                .field("name", &c.name)
                .field("frames-taken", c.taken)
                .field("frames-skipped", c.skipped)
                .field(
                    "latency-p50",
                    c.latency_p50_ns().map_or(-1i64, |n| n as i64),
                )
                .field(
                    "latency-p99",
                    c.latency_p99_ns().map_or(-1i64, |n| n as i64),
                )
                .build()
        })
        .collect();
    gst::Structure::builder("application/x-gpushmsink-stats")
        .field("frames-sent", s.frames_sent)
        .field("frames-copied", s.frames_copied)
        .field("frames-dropped", s.frames_dropped)
        .field("times-lagged", s.times_lagged)
        .field("spin-caught", s.spin_caught)
        .field("spin-missed", s.spin_missed)
        .field("woken", s.woken)
        .field("woken-early", s.woken_early)
        .field("woken-ahead", s.woken_ahead)
        .field("connections-accepted", s.connections_accepted)
        .field("reports-built", s.reports_built)
        .field("clients", gst::Array::new(clients))
        .build()
}
