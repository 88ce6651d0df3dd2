// SPDX-License-Identifier: MPL-2.0
//! What a consumer asks for when it connects.

use std::time::Duration;

use crate::policy::Delivery;

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Whether the producer may skip frames for us ([`Delivery::Auto`] by default).
    pub mode: Delivery,
    /// Kept for older code: `true` is `mode: Delivery::Lossless`, whatever `mode` says.
    pub lossless: bool,
    /// Ask for a writable ring descriptor (for GPUs that cannot register read-only memory).
    pub writable_ring: bool,
    /// Shown in the producer's logs.
    pub name: String,
    /// How long to wait for a producer to appear.
    pub timeout: Duration,
    /// How often to try while waiting.
    pub retry: Duration,
    /// The user the producer must run as; `None`: this process's user, or root. Checked with
    /// SO_PEERCRED, so that a process of another user that binds the path (after the
    /// producer stopped, in a shared directory) cannot feed us frames.
    pub producer_uid: Option<u32>,
    /// Frames may be in GPU memory (a producer's device ring): this consumer maps it
    /// read-only and reads frames through [`Frame::device_ptr`](crate::subscriber::Frame::device_ptr) (or copies them with
    /// [`Frame::to_vec`](crate::subscriber::Frame::to_vec)). Needs the `cuda` feature. Without it, a producer with a device
    /// ring turns this consumer away, saying why.
    pub device_memory: bool,
    /// Low-latency mode: the CPU time (a budget per frame) a waiting consumer may spend
    /// polling the ring around the time the next frame is due, instead of sleeping on its
    /// wake-up descriptor (zero, the default: off). The consumer learns the producer's
    /// cadence from the frames' publish times, sleeps until a little before the next frame,
    /// then polls for at most this long; a frame that comes earlier or later still wakes it
    /// as without it, and a paused or stopped stream costs one budget, then nothing. Worth it
    /// where a hop's latency matters (control loops, teleoperation): the wake-up of a sleeping
    /// core is most of it. 100–500 µs covers the producer's jitter on most machines.
    pub spin: Duration,
}

impl ConnectOptions {
    /// The delivery asked for: `lossless` (kept for older code) wins over `mode`.
    pub fn delivery(&self) -> Delivery {
        if self.lossless {
            Delivery::Lossless
        } else {
            self.mode
        }
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            mode: Delivery::Auto,
            lossless: false,
            writable_ring: false,
            name: format!("pid {}", std::process::id()),
            timeout: Duration::from_secs(5),
            retry: Duration::from_millis(100),
            producer_uid: None,
            device_memory: false,
            spin: Duration::ZERO,
        }
    }
}
