// SPDX-License-Identifier: MPL-2.0
//! gpushm: the transport that shares live video frames between processes, with no GStreamer
//! and no GLib. A producer renders into slots of a sealed memfd ring; consumers map it
//! read-only and read frames in place (CUDA can register the mapping and read it too).
//!
//! - [`ring`]: the shared-memory ring and the client queues, both ends ([`ring::layout`]
//!   is where frames live in shared memory).
//! - [`wire`]: what goes over the unix socket, byte by byte.
//! - [`policy`]: delivery modes and every limit the producer holds clients to.
//! - [`server`]: the producer's engine: socket, clients, who gets which frame, who is cut.
//! - [`publisher`]: the producer for apps ([`publisher::Publisher`]), over a server.
//! - [`subscriber`]: the consumer ([`subscriber::Subscriber`]): connect, wait, frames, leases.
//! - [`names`]: stream names instead of socket paths.
//! - [`inspect`]: what tools show of a stream (one schema for the `gpushm` command and Python).
//! - [`format`](mod@format): raw video formats, plane geometry and caps strings, for apps.
//! - [`frame_copy`]: the copy of a whole frame into a slot, for producers that do not render
//!   in place.
//! - [`time`]: the one mapping of a producer's timestamps into a consumer's running time.
//! - [`cpu_latency`]: keeping the CPUs out of deep idle states for a low-latency stream.
//! - [`cuda`] (feature `cuda`): registering host rings with CUDA, device rings.
//!
//! The GStreamer elements (gpushmsink, gpushmsrc), the Python package and the C library are
//! thin layers over this crate.

mod cadence;
pub mod cpu_latency;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod format;
pub mod frame_copy;
pub mod inspect;
pub mod names;
pub mod policy;
pub mod publisher;
pub mod ring;
pub mod server;
pub mod subscriber;
pub mod time;
pub mod wire;

use std::fmt;

/// Everything that can go wrong in the transport. Each variant reads as a sentence for users.
#[derive(Debug)]
pub enum Error {
    /// A system call failed.
    Os {
        what: String,
        errno: nix::errno::Errno,
    },
    /// A peer sent or wrote something that breaks the protocol.
    Protocol(String),
    /// Shared memory holds a value outside its valid range.
    Corrupt(String),
    /// The peer closed the connection.
    Disconnected,
    /// No answer within the allowed time.
    Timeout(String),
    /// The wait was interrupted on purpose (unlock, shutdown).
    Interrupted,
    /// A local request that cannot work (a path too long, a size out of range): retrying does
    /// not help.
    Invalid(String),
    /// The peer refused us or closed the connection, saying why.
    Refused(String),
    /// The socket is served by a process of a user we do not accept frames from.
    WrongPeer(String),
    /// The producer is busy (every handshake place taken, or at max-clients) and said to try
    /// again: connecting retries, with backoff, until its timeout.
    Busy(String),
}

impl Error {
    pub fn os(what: impl Into<String>, errno: nix::errno::Errno) -> Self {
        Error::Os {
            what: what.into(),
            errno,
        }
    }
    pub fn protocol(msg: impl Into<String>) -> Self {
        Error::Protocol(msg.into())
    }
    pub fn corrupt(msg: impl Into<String>) -> Self {
        Error::Corrupt(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Os { what, errno } => write!(f, "{what}: {}", errno.desc()),
            Error::Protocol(m) => write!(f, "protocol error: {m}"),
            Error::Corrupt(m) => write!(f, "invalid shared memory: {m}"),
            Error::Disconnected => write!(f, "the peer closed the connection"),
            Error::Timeout(m) => write!(f, "timed out: {m}"),
            Error::Interrupted => write!(f, "interrupted"),
            Error::Invalid(m) | Error::Refused(m) | Error::WrongPeer(m) | Error::Busy(m) => {
                write!(f, "{m}")
            }
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Longest unix socket path, in bytes (sun_path holds 108 including the final NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// CLOCK_MONOTONIC in nanoseconds: the clock GStreamer's system clock uses by default, so
/// stamps taken in two processes compare directly.
pub fn monotonic_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64,
        Err(_) => 0,
    }
}

/// Tests that time wake-ups between threads pinned to two CPUs: one at a time (a 2-core CI
/// machine runs two tests at once, and one spinning would delay the other's wake-ups).
#[cfg(test)]
pub(crate) fn timing_test() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
