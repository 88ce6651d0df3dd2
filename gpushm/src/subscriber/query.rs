// SPDX-License-Identifier: MPL-2.0
//! Asking a producer for its figures (a Query, answered with a Report) without becoming its
//! client: what `gpushm list/top/inspect` and Python's `gpushm.streams()` do.

use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::connect::{connect_within, Backoff};
use crate::names::Endpoint;
use crate::wire::{Conn, Message, BUSY_PREFIX};
use crate::{Error, Result};

/// What [`query`] learnt of a producer.
#[derive(Debug, Clone)]
pub struct Queried {
    /// The socket asked.
    pub path: std::path::PathBuf,
    /// The user and process serving it (SO_PEERCRED).
    pub producer_uid: u32,
    pub producer_pid: i32,
    pub report: crate::wire::StreamReport,
}

/// Asks the producer at `ep` for its figures (a Query, see [`crate::wire`]) without becoming
/// its client: no descriptor, no frame. Waits at most `timeout` (a busy producer is asked
/// again within it). A socket nobody listens on is `Error::Os` with ECONNREFUSED (stale).
pub fn query(ep: &Endpoint, timeout: Duration) -> Result<Queried> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    loop {
        // The first candidate that takes the connection (a stale socket passes to the next).
        let candidates = ep.candidates()?;
        let n = candidates.len();
        let mut found = None;
        for (i, path) in candidates.into_iter().enumerate() {
            match connect_within(&path, deadline) {
                Ok(s) => {
                    found = Some((s, path));
                    break;
                }
                Err(Error::Os {
                    errno: nix::errno::Errno::ECONNREFUSED,
                    ..
                }) if i + 1 < n => continue,
                Err(e) => return Err(e),
            }
        }
        let (stream, path) =
            found.ok_or_else(|| Error::Invalid(format!("{ep}: nothing to connect to")))?;
        let peer = getsockopt(&stream, PeerCredentials)
            .map_err(|e| Error::os("reading the producer's credentials (SO_PEERCRED)", e))?;
        let mut conn = Conn::new(stream).refusing_fds();
        conn.send(&Message::Query { flags: 0 }, &[])?;
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = conn
            .recv_timeout(left.max(Duration::from_millis(1)), None)?
            .ok_or_else(|| Error::Timeout(format!("{} did not answer", path.display())))?;
        match answer.0 {
            Message::Report(report) => {
                return Ok(Queried {
                    path,
                    producer_uid: peer.uid(),
                    producer_pid: peer.pid(),
                    report: *report,
                })
            }
            Message::Error { message } if message.starts_with(BUSY_PREFIX) => {
                let pause = backoff.next();
                if Instant::now() + pause >= deadline {
                    return Err(Error::Busy(format!("the producer is busy: {message}")));
                }
                std::thread::sleep(pause);
            }
            Message::Error { message } => {
                return Err(Error::Refused(format!(
                    "the producer refused the query: {message}"
                )))
            }
            m => return Err(Error::protocol(format!("expected Report, got {m:?}"))),
        }
    }
}
