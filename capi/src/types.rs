// SPDX-License-Identifier: MPL-2.0
//! What C sees: the status codes, the opaque handle types and the structs of gpushm.h.

use super::*;

/// What every function returns: `GPUSHM_OK` (0), a positive outcome that is not an error
/// (`GPUSHM_TIMEOUT`, `GPUSHM_EOS`, `GPUSHM_INTERRUPTED`), or a negative error code.
pub type gpushm_status = c_int;

/// Success.
pub const GPUSHM_OK: gpushm_status = 0;
/// Nothing came within the timeout (a frame, a free slot, a producer).
pub const GPUSHM_TIMEOUT: gpushm_status = 1;
/// The producer ended the stream: no frame follows.
pub const GPUSHM_EOS: gpushm_status = 2;
/// The wait was interrupted by `gpushm_subscriber_interrupt` (or the subscriber's destroy).
pub const GPUSHM_INTERRUPTED: gpushm_status = 3;
/// A NULL pointer, an out-of-range value or a malformed string among the arguments.
pub const GPUSHM_ERROR_INVALID_ARGUMENT: gpushm_status = -1;
/// A handle that is NULL, destroyed already, or of another kind.
pub const GPUSHM_ERROR_BAD_HANDLE: gpushm_status = -2;
/// A frame used after `gpushm_frame_release`, or a slot after it was published or discarded.
pub const GPUSHM_ERROR_RELEASED: gpushm_status = -3;
/// The producer went away (and `reconnect` is off, or no producer came back in time).
pub const GPUSHM_ERROR_DISCONNECTED: gpushm_status = -4;
/// The producer refused this consumer, saying why (see `gpushm_last_error`).
pub const GPUSHM_ERROR_REFUSED: gpushm_status = -5;
/// The peer broke the protocol or wrote invalid shared memory.
pub const GPUSHM_ERROR_PROTOCOL: gpushm_status = -6;
/// A system call failed (see `gpushm_last_error`).
pub const GPUSHM_ERROR_SYSTEM: gpushm_status = -7;
/// The request needs a CUDA GPU this process cannot use.
pub const GPUSHM_ERROR_NO_GPU: gpushm_status = -8;
/// A bug in gpushm, caught at the boundary (please report `gpushm_last_error`).
pub const GPUSHM_ERROR_INTERNAL: gpushm_status = -9;
/// The producer took the frame back: it cut this consumer for holding every slot of its ring
/// for too long (see `gpushm_frame_is_valid`). Pointers into the frame may show newer frames.
pub const GPUSHM_ERROR_REVOKED: gpushm_status = -10;

/// A timestamp that is not set (PTS, DTS, duration).
pub const GPUSHM_TIME_NONE: u64 = u64::MAX;
/// Planes described at most.
pub const GPUSHM_MAX_PLANES: usize = 4;

/// A subscriber: one connection to a producer (a gpushmsink or a publisher).
pub struct gpushm_subscriber {
    _opaque: [u8; 0],
}

/// A frame received: its slot is never reused by the producer until `gpushm_frame_release` (or
/// `gpushm_frame_destroy`), even after its subscriber is destroyed or its producer dies, with
/// one exception: a producer that must go on cuts a consumer that held every slot of its ring
/// for 0.5 s without giving one back (more than its fair share), and takes its slots back.
/// `gpushm_frame_is_valid` then says 0 and calls on the frame return GPUSHM_ERROR_REVOKED.
/// Keep fewer frames than the ring has slots (or copy what you keep) and it never happens.
pub struct gpushm_frame {
    _opaque: [u8; 0],
}

/// A publisher: serves frames at a socket path to any number of subscribers and gpushmsrc.
pub struct gpushm_publisher {
    _opaque: [u8; 0],
}

/// A held request that keeps the CPUs out of deep idle states
/// (`gpushm_cpu_latency_request`).
pub struct gpushm_cpu_latency {
    _opaque: [u8; 0],
}

/// A free slot lent by a publisher, to fill and then publish (or discard).
pub struct gpushm_slot {
    _opaque: [u8; 0],
}

/// How a subscriber receives frames. Fill it with `gpushm_subscriber_options_init` first.
/// Until gpushm 1.0 the option structs may grow at their end from one release to the next
/// (spin_us came so): build against the gpushm.h of the libgpushm you run with.
#[repr(C)]
pub struct gpushm_subscriber_options {
    /// 0: auto (lossless from a producer that is not live, newest frames from a live one),
    /// 1: lossless (the producer waits for this consumer), 2: leaky (newest frames, never
    /// waited for).
    pub mode: c_int,
    /// How long `gpushm_subscriber_open` waits for a producer to appear, and a reconnect for
    /// one to come back, in nanoseconds.
    pub connect_timeout_ns: i64,
    /// Accept frames only from a producer running as this user id. -1 (the default): a
    /// producer running as this process's user or as root only (frames from another user's
    /// process are refused unless named here).
    pub producer_uid: i64,
    /// Non-zero: when the producer goes away, `gpushm_subscriber_next_frame` connects again
    /// (waiting up to connect_timeout_ns, within its own timeout) instead of returning
    /// GPUSHM_ERROR_DISCONNECTED; it returns that when no producer came back in
    /// connect_timeout_ns. While none is there, the subscriber's fd wakes every 100 ms.
    pub reconnect: c_int,
    /// Non-zero: accept a producer's device ring (frames in GPU memory: read them through
    /// `gpushm_frame_cuda_ptr`, their `data` pointers are NULL).
    pub device_memory: c_int,
    /// A name for the producer's logs and statistics (NULL: "pid N").
    pub name: *const c_char,
    /// Low-latency mode (0, the default: off): CPU time in microseconds a waiting
    /// `gpushm_subscriber_next_frame` may spend per frame polling the ring around the time the
    /// next frame is due (learnt from the producer's cadence) instead of sleeping until the
    /// frame wakes it. Saves the wake-up of a sleeping core (tens of µs) for a bounded spin; a
    /// frame earlier or later than expected still wakes it, a paused producer costs one
    /// budget, then nothing. 100 to 500 suits most machines; at most 100000.
    pub spin_us: u32,
}

/// One plane of a frame or slot.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gpushm_plane {
    /// The plane's first byte (NULL for a frame in GPU memory). A received frame is mapped
    /// read-only: only a publisher's slot may be written.
    pub data: *mut u8,
    /// Bytes from one row to the next.
    pub stride: u32,
    /// Rows.
    pub rows: u32,
    /// Visible bytes of each row.
    pub row_bytes: u32,
    /// Bytes from the frame's first byte to the plane's.
    pub offset: u64,
}

/// What a frame (or a slot to fill) is. Pointers stay valid until the frame is released (the
/// slot published or discarded).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gpushm_frame_info {
    /// GStreamer's name of the raw video format ("NV12", "RGBA", ...), empty when the stream
    /// is not raw video (its bytes are then in `data`/`size` only).
    pub format: [c_char; 16],
    pub width: u32,
    pub height: u32,
    pub n_planes: u32,
    pub planes: [gpushm_plane; GPUSHM_MAX_PLANES],
    /// The whole frame (NULL for a frame in GPU memory) and its size in bytes.
    pub data: *mut u8,
    pub size: u64,
    /// Presentation and decoding time stamps and duration in ns, as the producer set them
    /// (GPUSHM_TIME_NONE: not set).
    pub pts: u64,
    pub dts: u64,
    pub duration: u64,
    /// The producer's frame counter (GstBuffer offset).
    pub offset: u64,
    /// GstBufferFlags of the frame (keyframe: not GST_BUFFER_FLAG_DELTA_UNIT = 1 << 13).
    pub flags: u32,
    /// When the producer published it (CLOCK_MONOTONIC ns).
    pub publish_ns: u64,
    /// Non-zero: the frame is in GPU memory (a device ring): use `gpushm_frame_cuda_ptr`.
    pub on_device: c_int,
}

/// How a publisher serves frames. Fill it with `gpushm_publisher_options_init` first (see
/// gpushm_subscriber_options on how the option structs may change before 1.0).
#[repr(C)]
pub struct gpushm_publisher_options {
    /// Raw video format, GStreamer's name ("NV12", "I420", "RGBA", "BGRx", "GRAY8", ...).
    pub format: *const c_char,
    pub width: u32,
    pub height: u32,
    /// Frame rate, fps_n / fps_d.
    pub fps_n: u32,
    pub fps_d: u32,
    /// Frames in the ring (2..64).
    pub slots: u32,
    /// Permissions of the socket file (0600 by default: this user only).
    pub perms: u32,
    /// -1 (the default): the ring in host memory; a CUDA device ordinal: a device ring in
    /// that GPU's memory (consumers must accept device memory).
    pub cuda_device: c_int,
    /// Low-latency mode of `gpushm_publisher_publish`'s wait for a lossless consumer that
    /// holds its whole budget (0, the default: off): poll its releases for up to this many µs
    /// before sleeping, at most once a frame. Pays off for small frames sent flat out. At
    /// most 100000 (GPUSHM_ERROR_INVALID_ARGUMENT above).
    pub spin_us: u32,
}
