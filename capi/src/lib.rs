// SPDX-License-Identifier: MPL-2.0
//! The C API of gpushm (`libgpushm.so`, `gpushm.h`, `gpushm.pc`): a thin layer over the core
//! crate for C, C++ and OpenCV apps.
//!
//! Every function returns a status (`GPUSHM_OK`, a positive outcome such as `GPUSHM_TIMEOUT`,
//! or a negative error) and leaves a message for the calling thread in
//! [`gpushm_last_error`]. No call panics across the boundary (a caught panic is
//! `GPUSHM_ERROR_INTERNAL`). Handles are generation-checked ids, not pointers to memory: a
//! handle used after its destroy call, a NULL handle or one of another kind is
//! `GPUSHM_ERROR_BAD_HANDLE`, never undefined behaviour. The header is generated from this file
//! by cbindgen (`make capi-header`); CI checks it is current.

//!
//! # Safety
//! The contract of every function is the C one, stated once here rather than on each: pointer
//! arguments are NULL (an error code) or point to what their type says, strings are
//! NUL-terminated, buffers are as long as the length passed with them.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("gpushm's C API hands out 64-bit handle ids in pointers: 64-bit targets only");

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use gpushm_core::cpu_latency::CpuLatency;
use gpushm_core::names::Endpoint;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpushm_core::format::{FrameGeometry, FrameLayout, VideoFormat};
use gpushm_core::publisher::{Config, Publisher, Slot};
use gpushm_core::subscriber::{ConnectOptions, Delivery, Frame, Link, Waker};
use gpushm_core::Error;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};

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

// ------------------------------------------------------------------------------------------
// Errors and the boundary.

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Set once any thread was given a message: until then, a successful call has none to clear
/// and does not touch its thread-local (a per-frame cost in a library: its thread-locals are
/// reached through the dynamic linker).
static ANY_ERROR: AtomicBool = AtomicBool::new(false);

fn set_error(msg: &str) {
    if msg.is_empty() {
        if !ANY_ERROR.load(Ordering::Relaxed) {
            return;
        }
    } else {
        ANY_ERROR.store(true, Ordering::Relaxed);
    }
    // try_with: a call from a thread-local destructor must not abort.
    let _ = LAST_ERROR.try_with(|e| {
        let mut e = e.borrow_mut();
        // Every successful call clears the message: without allocating when it is clear.
        if msg.is_empty() && e.as_bytes().is_empty() {
            return;
        }
        *e = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    });
}

/// A status and its message.
struct Fail(gpushm_status, String);

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Timeout(_) => GPUSHM_TIMEOUT,
            Error::Interrupted => GPUSHM_INTERRUPTED,
            Error::Disconnected => GPUSHM_ERROR_DISCONNECTED,
            Error::Refused(_) | Error::WrongPeer(_) | Error::Busy(_) => GPUSHM_ERROR_REFUSED,
            Error::Protocol(_) | Error::Corrupt(_) => GPUSHM_ERROR_PROTOCOL,
            Error::Invalid(_) => GPUSHM_ERROR_INVALID_ARGUMENT,
            _ => GPUSHM_ERROR_SYSTEM,
        };
        Fail(code, e.to_string())
    }
}

fn invalid(msg: impl Into<String>) -> Fail {
    Fail(GPUSHM_ERROR_INVALID_ARGUMENT, msg.into())
}

/// Runs `f` at the boundary: its status, its message for gpushm_last_error, panics caught.
#[inline(always)]
fn guard(f: impl FnOnce() -> Result<gpushm_status, Fail>) -> gpushm_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => {
            if code == GPUSHM_OK {
                set_error("");
            }
            code
        }
        Ok(Err(Fail(code, msg))) => {
            set_error(&msg);
            code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_error(&format!("internal error (a bug in gpushm): {what}"));
            GPUSHM_ERROR_INTERNAL
        }
    }
}

#[inline(always)]
fn out_ptr<T>(p: *mut T, what: &str) -> Result<*mut T, Fail> {
    if p.is_null() {
        Err(invalid(format!("{what} is NULL")))
    } else {
        Ok(p)
    }
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn string(s: *const c_char, what: &str) -> Result<String, Fail> {
    if s.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map(str::to_owned)
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

#[inline(always)]
fn timeout(ns: i64) -> Option<Duration> {
    (ns >= 0).then(|| Duration::from_nanos(ns as u64))
}

// ------------------------------------------------------------------------------------------
// Handles: generation-checked ids in opaque pointers.

/// Kinds of handle (the id's top byte).
const KIND_SUBSCRIBER: u64 = 1;
const KIND_FRAME: u64 = 2;
const KIND_PUBLISHER: u64 = 3;
const KIND_SLOT: u64 = 4;
const KIND_CPU_LATENCY: u64 = 5;
const GEN_BITS: u32 = 32;
/// Handles alive at once, per kind, at most (the id's index field).
const MAX_INDEX: usize = (1 << 24) - 2;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;

struct Entry<T> {
    gen: u64,
    item: Option<Arc<T>>,
}

struct Table<T> {
    kind: u64,
    entries: Vec<Entry<T>>,
    free: Vec<usize>,
    /// Objects given back for reuse (frames: a frame's way then calls neither malloc nor
    /// free, two more pages of code after a sleep).
    spare: Vec<Arc<T>>,
}

/// Frame objects kept for reuse, at most.
const SPARE_FRAMES: usize = 4;

impl<T> Table<T> {
    const fn new(kind: u64) -> Self {
        Self {
            kind,
            entries: Vec::new(),
            free: Vec::new(),
            spare: Vec::new(),
        }
    }

    #[inline(always)]
    fn id(&self, index: usize, gen: u64) -> u64 {
        (self.kind << 56) | (((index as u64) + 1) << GEN_BITS) | gen
    }

    /// A handle for `item`; `item` back with the error when none is left (to be dropped
    /// after the table's lock: see [`insert`]).
    #[inline(always)]
    fn insert(&mut self, item: Arc<T>) -> Result<u64, (Fail, Arc<T>)> {
        let index = match self.free.pop() {
            Some(i) => i,
            None if self.entries.len() > MAX_INDEX => {
                return Err((
                    Fail(
                        GPUSHM_ERROR_SYSTEM,
                        "too many live handles (release and destroy what you no longer use)".into(),
                    ),
                    item,
                ))
            }
            None => {
                self.entries.push(Entry { gen: 1, item: None });
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[index];
        e.item = Some(item);
        let gen = e.gen;
        Ok(self.id(index, gen))
    }

    #[inline(always)]
    fn index(&self, id: u64) -> Option<usize> {
        if id >> 56 != self.kind {
            return None;
        }
        let i = ((id & ((1 << 56) - 1)) >> GEN_BITS).checked_sub(1)? as usize;
        let e = self.entries.get(i)?;
        (e.gen == id & GEN_MASK && e.item.is_some()).then_some(i)
    }

    #[inline(always)]
    fn get(&self, id: u64) -> Option<Arc<T>> {
        self.index(id).and_then(|i| self.entries[i].item.clone())
    }

    #[inline(always)]
    fn remove(&mut self, id: u64) -> Option<Arc<T>> {
        let i = self.index(id)?;
        let e = &mut self.entries[i];
        // Generation 0 is never handed out (ids are never NULL), and an index whose 32-bit
        // generation ran out is retired: a stale id never matches a later handle.
        e.gen = (e.gen + 1) & GEN_MASK;
        if e.gen != 0 {
            self.free.push(i);
        }
        e.item.take()
    }
}

#[inline(always)]
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static SUBSCRIBERS: Mutex<Table<SubObj>> = Mutex::new(Table::new(KIND_SUBSCRIBER));
static FRAMES: Mutex<Table<FrameObj>> = Mutex::new(Table::new(KIND_FRAME));
static PUBLISHERS: Mutex<Table<PubObj>> = Mutex::new(Table::new(KIND_PUBLISHER));
static SLOTS: Mutex<Table<SlotObj>> = Mutex::new(Table::new(KIND_SLOT));
static CPU_LATENCIES: Mutex<Table<CpuLatency>> = Mutex::new(Table::new(KIND_CPU_LATENCY));

#[cold]
#[inline(never)]
fn bad_handle(what: &str) -> Fail {
    Fail(
        GPUSHM_ERROR_BAD_HANDLE,
        format!("not a live {what} handle (NULL, destroyed, or another kind)"),
    )
}

/// A handle in `table` for `item`. Refused (no handle left), `item` is dropped after the
/// table's lock: dropping a frame or a connection may ring or close descriptors.
#[inline(always)]
fn insert<T>(table: &Mutex<Table<T>>, item: Arc<T>) -> Result<u64, Fail> {
    let r = lock(table).insert(item);
    r.map_err(|(fail, item)| {
        drop(item);
        fail
    })
}

#[inline(always)]
fn get<T>(table: &Mutex<Table<T>>, h: *const std::ffi::c_void, what: &str) -> Result<Arc<T>, Fail> {
    lock(table).get(h as u64).ok_or_else(|| bad_handle(what))
}

// ------------------------------------------------------------------------------------------
// Subscribers.

struct SubObj {
    reconnect: bool,
    /// Interrupts a wait (its connection's too).
    waker: Waker,
    /// Destroyed: waits end, and no new one starts.
    closed: AtomicBool,
    conn: Mutex<ConnState>,
    /// What `gpushm_subscriber_fd` returns: readable when the connection's descriptors are
    /// (once that fd was asked for), or when `retry` fires (no connection: the next call
    /// connects again).
    epoll: Epoll,
    /// Armed every [`RETRY`] while the producer is gone (reconnect on).
    retry: TimerFd,
}

/// How often a subscriber with no producer (reconnect on) makes its fd readable.
const RETRY: Duration = Duration::from_millis(100);

struct ConnState {
    /// The connection (none after the producer went away, until it is reconnected).
    link: Link,
    /// The connection's descriptors in the epoll set (removed before it is dropped: a
    /// connection whose frames are still held keeps its socket open).
    watched: Vec<RawFd>,
    /// gpushm_subscriber_fd was called: watch every connection's descriptors. (Until then
    /// the producer is not asked to ring the frame doorbell for us.)
    watching: bool,
    /// The last frames' caps and layout, and their [`Shape`] (see [`shape`]).
    shape: Option<(LayoutKey, Arc<Shape>)>,
}

impl SubObj {
    #[inline(always)]
    fn watch(&self, st: &mut ConnState) -> Result<(), Fail> {
        if st.link.current().is_none() || !st.watching || !st.watched.is_empty() {
            return Ok(());
        }
        self.add_watches(st)
    }

    /// Puts the connection's descriptors in the epoll set (once per connection).
    #[cold]
    #[inline(never)]
    fn add_watches(&self, st: &mut ConnState) -> Result<(), Fail> {
        let Some(sub) = st.link.current() else {
            return Ok(());
        };
        for fd in sub.poll_fds() {
            // SAFETY: the subscriber keeps `fd` open while it lives; unwatch() removes it
            // before the subscriber goes.
            let b = unsafe { BorrowedFd::borrow_raw(fd) };
            self.epoll
                .add(b, EpollEvent::new(EpollFlags::EPOLLIN, fd as u64))
                .map_err(|e| Fail(GPUSHM_ERROR_SYSTEM, format!("epoll_ctl: {e}")))?;
            st.watched.push(fd);
        }
        Ok(())
    }

    /// Drops the connection, its descriptors out of the epoll set first, and arms the retry
    /// timer.
    fn disconnect(&self, st: &mut ConnState) {
        for fd in st.watched.drain(..) {
            // SAFETY: still open: the subscriber holding it is dropped below.
            let _ = self.epoll.delete(unsafe { BorrowedFd::borrow_raw(fd) });
        }
        st.link.lost(None);
        let _ = self.retry.set(
            Expiration::Interval(TimeSpec::from_duration(RETRY)),
            TimerSetTimeFlags::empty(),
        );
    }

    /// The producer went away: connects again (reconnect is on). Out of the frame's way.
    #[cold]
    #[inline(never)]
    fn reconnect(&self, st: &mut ConnState, deadline: Option<Instant>) -> Result<(), Fail> {
        let _ = self.retry.wait();
        let limit = st.link.options().timeout;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match st.link.connect(Some(left.map_or(limit, |l| l.min(limit)))) {
            Ok(()) => {}
            Err(Error::Interrupted) => {
                // connect does not take the wake-up back: the next wait must block.
                self.waker.clear();
                return Err(Fail(GPUSHM_INTERRUPTED, "interrupted".into()));
            }
            Err(Error::Timeout(_))
                if deadline.is_some_and(|d| Instant::now() >= d)
                    && st.link.gone_since().is_some_and(|g| g.elapsed() < limit) =>
            {
                return Err(Fail(
                    GPUSHM_TIMEOUT,
                    "no producer came back within the timeout".into(),
                ))
            }
            Err(Error::Timeout(_)) => {
                return Err(Fail(
                    GPUSHM_ERROR_DISCONNECTED,
                    format!(
                        "the producer went away and none came back within connect_timeout_ns at {}",
                        st.link.endpoint()
                    ),
                ))
            }
            Err(e) => return Err(e.into()),
        }
        let _ = self.retry.unset();
        Ok(())
    }

    #[inline(always)]
    fn closed(&self) -> Result<(), Fail> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Fail(
                GPUSHM_INTERRUPTED,
                "the subscriber was destroyed".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for SubObj {
    fn drop(&mut self) {
        let st = self.conn.get_mut().unwrap_or_else(|e| e.into_inner());
        for fd in st.watched.drain(..) {
            // SAFETY: still open: the subscriber is dropped after this.
            let _ = self.epoll.delete(unsafe { BorrowedFd::borrow_raw(fd) });
        }
    }
}

/// Fills `opts` with the defaults: auto delivery, 5 s to connect, producers of this user (or
/// root) only, no reconnect, host memory only, no name.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_options_init(
    opts: *mut gpushm_subscriber_options,
) -> gpushm_status {
    guard(|| {
        let o = out_ptr(opts, "opts")?;
        // SAFETY: checked non-NULL; the caller's struct.
        unsafe {
            o.write(gpushm_subscriber_options {
                mode: 0,
                connect_timeout_ns: 5_000_000_000,
                producer_uid: -1,
                reconnect: 0,
                device_memory: 0,
                name: std::ptr::null(),
                spin_us: 0,
            })
        };
        Ok(GPUSHM_OK)
    })
}

/// Connects to the producer serving `path` (waiting up to `opts->connect_timeout_ns` for one to
/// appear; NULL `opts`: the defaults). On success `*out` is a subscriber to destroy with
/// `gpushm_subscriber_destroy`. GPUSHM_TIMEOUT when no producer came.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_open(
    path: *const c_char,
    opts: *const gpushm_subscriber_options,
    out: *mut *mut gpushm_subscriber,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let path = PathBuf::from(unsafe { string(path, "path") }?);
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_subscriber(Endpoint::Path(path), opts, out) }
    })
}

/// Connects like `gpushm_subscriber_open` to the producer of stream `name` (gpushmsink
/// stream=NAME, `gpushm_publisher_open_stream`): found in $GPUSHM_RUNTIME_DIR if set, else in
/// this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID) and then /run/gpushm,
/// looked up again at each attempt while waiting. GPUSHM_ERROR_INVALID for a name that is not
/// 1 to 64 letters, digits and . _ - @ + : (not starting with . or -).
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_open_stream(
    name: *const c_char,
    opts: *const gpushm_subscriber_options,
    out: *mut *mut gpushm_subscriber,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let name = unsafe { string(name, "name") }?;
        gpushm_core::names::check_name(&name)?;
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_subscriber(Endpoint::Stream(name), opts, out) }
    })
}

/// # Safety
/// `opts` is NULL or the caller's initialised struct; `out` is NULL or writable.
unsafe fn open_subscriber(
    endpoint: Endpoint,
    opts: *const gpushm_subscriber_options,
    out: *mut *mut gpushm_subscriber,
) -> Result<gpushm_status, Fail> {
    {
        let out = out_ptr(out, "out")?;
        let mut o = ConnectOptions::default();
        let mut reconnect = false;
        if !opts.is_null() {
            // SAFETY: non-NULL, the caller's initialised struct.
            let opts = unsafe { &*opts };
            o.mode = match opts.mode {
                0 => Delivery::Auto,
                1 => Delivery::Lossless,
                2 => Delivery::Leaky,
                m => {
                    return Err(invalid(format!(
                        "mode {m}: 0 (auto), 1 (lossless) or 2 (leaky)"
                    )))
                }
            };
            o.timeout = Duration::from_nanos(opts.connect_timeout_ns.max(0) as u64);
            o.producer_uid = match opts.producer_uid {
                -1 => None,
                u if (0..=u32::MAX as i64).contains(&u) => Some(u as u32),
                u => return Err(invalid(format!("producer_uid {u}: a user id, or -1"))),
            };
            reconnect = opts.reconnect != 0;
            o.device_memory = opts.device_memory != 0;
            // Checked when connecting (at most gpushm::policy::MAX_SPIN).
            o.spin = Duration::from_micros(opts.spin_us.into());
            if !opts.name.is_null() {
                // SAFETY: non-NULL, the caller's string.
                o.name = unsafe { string(opts.name, "name") }?;
            }
        }
        let waker = Waker::new()?;
        let mut link = Link::new(endpoint, o, waker.clone());
        link.connect(None)?;
        let sys = |what: &str, e: nix::Error| Fail(GPUSHM_ERROR_SYSTEM, format!("{what}: {e}"));
        let epoll =
            Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(|e| sys("epoll_create", e))?;
        let retry = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_CLOEXEC | TimerFlags::TFD_NONBLOCK,
        )
        .map_err(|e| sys("timerfd_create", e))?;
        epoll
            .add(
                retry.as_fd(),
                EpollEvent::new(EpollFlags::EPOLLIN, u64::MAX),
            )
            .map_err(|e| sys("epoll_ctl", e))?;
        let obj = SubObj {
            reconnect,
            waker,
            closed: AtomicBool::new(false),
            conn: Mutex::new(ConnState {
                link,
                watched: Vec::new(),
                watching: false,
                shape: None,
            }),
            epoll,
            retry,
        };
        let id = insert(&SUBSCRIBERS, Arc::new(obj))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(id as *mut gpushm_subscriber) };
        Ok(GPUSHM_OK)
    }
}

/// Waits up to `timeout_ns` (negative: as long as it takes; 0: only looks) for the next
/// frame. GPUSHM_OK: `*frame` is a frame to release and destroy. GPUSHM_TIMEOUT: none came
/// (with 0, also when another thread is waiting on this subscriber). GPUSHM_EOS: the stream
/// ended. GPUSHM_INTERRUPTED: `gpushm_subscriber_interrupt` was called, or the subscriber
/// destroyed. Calls on one subscriber from several threads take turns.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_subscriber_next_frame(
    sub: *mut gpushm_subscriber,
    timeout_ns: i64,
    frame: *mut *mut gpushm_frame,
) -> gpushm_status {
    // SAFETY: the caller's pointers, as documented.
    guard(|| unsafe { next_frame(sub, timeout_ns, frame, None) })
}

/// `gpushm_subscriber_next_frame` and `gpushm_frame_get_info` in one call: on GPUSHM_OK,
/// `*frame` is the frame (to release and destroy) and `*info` describes it. One handle
/// lookup less per frame: the way to take frames where every microsecond counts.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_subscriber_next_frame_info(
    sub: *mut gpushm_subscriber,
    timeout_ns: i64,
    frame: *mut *mut gpushm_frame,
    info: *mut gpushm_frame_info,
) -> gpushm_status {
    guard(|| {
        let info = out_ptr(info, "info")?;
        // SAFETY: the caller's pointers, as documented.
        unsafe { next_frame(sub, timeout_ns, frame, Some(info)) }
    })
}

/// # Safety
/// `frame` and `info` are NULL or writable; `sub` is any value.
#[link_section = ".text.hot.gpushm"]
unsafe fn next_frame(
    sub: *mut gpushm_subscriber,
    timeout_ns: i64,
    frame: *mut *mut gpushm_frame,
    info: Option<*mut gpushm_frame_info>,
) -> Result<gpushm_status, Fail> {
    {
        let out = out_ptr(frame, "frame")?;
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        s.closed()?;
        let deadline = timeout(timeout_ns).and_then(|t| Instant::now().checked_add(t));
        let mut st = if timeout_ns == 0 {
            match s.conn.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(Fail(
                        GPUSHM_TIMEOUT,
                        "another thread is waiting on this subscriber".into(),
                    ))
                }
            }
        } else {
            lock(&s.conn)
        };
        loop {
            s.closed()?;
            if st.link.current().is_none() {
                s.reconnect(&mut st, deadline)?;
            }
            s.watch(&mut st)?;
            let Some(c) = st.link.current_mut() else {
                return Err(Fail(GPUSHM_ERROR_DISCONNECTED, "not connected".into()));
            };
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            match c.next_frame(left) {
                Ok(Some(f)) => {
                    let shape = shape(&f, &mut st.shape);
                    if let Some(info) = info {
                        // SAFETY: checked non-NULL by the caller. Described before the frame
                        // moves into its object: its pointers are into the mapping, not into
                        // the Frame.
                        unsafe { describe_frame(&shape, &f, info) };
                    }
                    // A frame object kept from an earlier frame, filled outside the table's
                    // lock (it frees the shape it held, or allocates).
                    let spare = lock(&FRAMES).spare.pop();
                    let obj = match spare {
                        Some(mut obj) => match Arc::get_mut(&mut obj) {
                            // Only the table held it (a spare is unique).
                            Some(o) => {
                                *o.frame.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(f);
                                o.shape = shape;
                                obj
                            }
                            None => Arc::new(FrameObj {
                                frame: Mutex::new(Some(f)),
                                shape,
                            }),
                        },
                        None => Arc::new(FrameObj {
                            frame: Mutex::new(Some(f)),
                            shape,
                        }),
                    };
                    let id = insert(&FRAMES, obj)?;
                    // SAFETY: checked non-NULL.
                    unsafe { out.write(id as *mut gpushm_frame) };
                    return Ok(GPUSHM_OK);
                }
                Ok(None) => {
                    set_error("the producer ended the stream");
                    return Ok(GPUSHM_EOS);
                }
                Err(Error::Disconnected) if s.reconnect => s.disconnect(&mut st),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// A descriptor to wait on with poll/epoll/select (or an event loop such as a ROS executor)
/// instead of blocking in `gpushm_subscriber_next_frame`: it is readable when a frame (or
/// EOS, or news from the producer) may be there; then call `gpushm_subscriber_next_frame` with
/// a timeout of 0. It belongs to the subscriber: do not close it. (From the first call on, the
/// producer rings a doorbell for each frame, which a blocking user does not need.) Ask for it
/// before another thread waits on the subscriber: this call waits while one does.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_fd(
    sub: *mut gpushm_subscriber,
    fd: *mut c_int,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(fd, "fd")?;
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        {
            let mut st = lock(&s.conn);
            st.watching = true;
            s.watch(&mut st)?;
        }
        let raw: RawFd = s.epoll.0.as_raw_fd();
        // SAFETY: checked non-NULL.
        unsafe { out.write(raw) };
        Ok(GPUSHM_OK)
    })
}

/// How the low-latency mode (`spin_us`) fares on the current connection: frames that came
/// while the ring was polled (`caught`, each saved a wake-up) and polls that ended without one
/// (`missed`, each cost its budget). Both 0 without the mode, before the first frame and after
/// a reconnect. Misses that grow with every frame mean the producer jitters more than the
/// budget covers. Like `gpushm_subscriber_fd`, it waits while another thread waits on the
/// subscriber.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_spin_stats(
    sub: *mut gpushm_subscriber,
    caught: *mut u64,
    missed: *mut u64,
) -> gpushm_status {
    guard(|| {
        let caught = out_ptr(caught, "caught")?;
        let missed = out_ptr(missed, "missed")?;
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        let st = lock(&s.conn)
            .link
            .current()
            .map(|c| c.spin_stats())
            .unwrap_or_default();
        // SAFETY: both checked non-NULL.
        unsafe {
            caught.write(st.caught);
            missed.write(st.missed);
        }
        Ok(GPUSHM_OK)
    })
}

/// Makes a `gpushm_subscriber_next_frame` waiting on this subscriber (in another thread)
/// return GPUSHM_INTERRUPTED now (or the next one, if none waits).
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_interrupt(sub: *mut gpushm_subscriber) -> gpushm_status {
    guard(|| {
        get(&SUBSCRIBERS, sub as _, "subscriber")?.waker.wake();
        Ok(GPUSHM_OK)
    })
}

/// The producer's caps (a GStreamer caps string), copied into `buf` (`len` bytes, with the
/// terminating NUL; truncated if longer). `*needed` (if not NULL) gets the length with NUL.
/// Waits while another thread waits for a frame on this subscriber.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_caps(
    sub: *mut gpushm_subscriber,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> gpushm_status {
    guard(|| {
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        let caps = lock(&s.conn)
            .link
            .current()
            .and_then(|c| c.caps())
            .map(|c| c.to_string())
            .unwrap_or_default();
        // SAFETY: the caller's buffer of `len` bytes, or NULL.
        unsafe { copy_string(&caps, buf, len, needed) }
    })
}

/// Closes the connection and frees the subscriber. Frames it gave stay valid until released.
/// Every `gpushm_subscriber_next_frame` waiting on it in other threads returns
/// GPUSHM_INTERRUPTED.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_destroy(sub: *mut gpushm_subscriber) -> gpushm_status {
    guard(|| {
        let s = lock(&SUBSCRIBERS)
            .remove(sub as u64)
            .ok_or_else(|| bad_handle("subscriber"))?;
        s.closed.store(true, Ordering::Release);
        s.waker.wake();
        drop(s);
        Ok(GPUSHM_OK)
    })
}

/// # Safety
/// `buf` is NULL or `len` writable bytes; `needed` NULL or writable.
unsafe fn copy_string(
    s: &str,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> Result<gpushm_status, Fail> {
    if !needed.is_null() {
        // SAFETY: the caller's contract.
        unsafe { needed.write(s.len() + 1) };
    }
    if buf.is_null() || len == 0 {
        return if needed.is_null() {
            Err(invalid("buf is NULL (or len 0) and needed is NULL"))
        } else {
            Ok(GPUSHM_OK)
        };
    }
    let n = s.len().min(len - 1);
    // SAFETY: `n + 1 <= len` bytes of the caller's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, n);
        buf.add(n).write(0);
    }
    Ok(GPUSHM_OK)
}

// ------------------------------------------------------------------------------------------
// Frames.

struct FrameObj {
    /// The frame (its lease keeps the slot and the ring's mapping), until released.
    frame: Mutex<Option<Frame>>,
    /// Its caps and plane layout, shared by every frame of that caps and layout.
    shape: Arc<Shape>,
}

/// A frame's or slot's description (plain data, with pointers into a mapping).
struct InfoCell(gpushm_frame_info);
// SAFETY: plain data; its pointers are into a mapping, only handed to the caller.
unsafe impl Send for InfoCell {}
unsafe impl Sync for InfoCell {}

/// What frames of one caps and layout share: the caps as a C string and the checked plane
/// layout, made once per caps and layout, not per frame (parsing the caps costs more than the
/// rest of a frame's way through this API).
struct Shape {
    caps: CString,
    /// Format, width, height and planes (their `data` NULL) of raw video; all 0 otherwise.
    template: InfoCell,
}

/// What decides a frame's [`Shape`]: its caps and the layout fields of its descriptor.
struct LayoutKey {
    caps: Arc<str>,
    fields: [u64; 4 + 4 * 4],
}

/// The [`Shape`] of `f`: `last`'s when the caps and layout are the last frame's (the
/// subscriber's own cache, under the lock its frames are taken with).
#[inline(always)]
fn shape(f: &Frame, last: &mut Option<(LayoutKey, Arc<Shape>)>) -> Arc<Shape> {
    let m = &f.meta;
    let mut fields = [0u64; 20];
    fields[..4].copy_from_slice(&[
        m.video_format as u64,
        m.width as u64,
        m.height as u64,
        m.n_planes as u64,
    ]);
    for p in 0..4 {
        fields[4 + p * 4..8 + p * 4].copy_from_slice(&[
            m.plane_offset[p],
            m.plane_stride[p] as u64,
            m.plane_rows[p] as u64,
            m.plane_row_bytes[p] as u64,
        ]);
    }
    if let Some((k, s)) = last.as_ref() {
        // Compared in line: `==` on the arrays calls libc's memcmp, a page of code the
        // frame's way touches for nothing else.
        let differ = k
            .fields
            .iter()
            .zip(&fields)
            .fold(0, |d, (a, b)| d | (a ^ b));
        if differ == 0 && (Arc::ptr_eq(&k.caps, &f.caps) || k.caps == f.caps) {
            return s.clone();
        }
    }
    new_shape(f, fields, last)
}

/// Makes the [`Shape`] of `f` (new caps or layout), keeps it in `last`.
#[cold]
#[inline(never)]
fn new_shape(
    f: &Frame,
    fields: [u64; 20],
    last: &mut Option<(LayoutKey, Arc<Shape>)>,
) -> Arc<Shape> {
    let m = &f.meta;
    let mut template = empty_info();
    if let Ok(g) = FrameGeometry::of_frame(m, &f.caps) {
        describe(
            &mut template,
            &g.format,
            g.width,
            g.height,
            &g.planes,
            std::ptr::null_mut(),
        );
    }
    let s = Arc::new(Shape {
        caps: CString::new(f.caps.replace('\0', " ")).unwrap_or_default(),
        template: InfoCell(template),
    });
    let key = LayoutKey {
        caps: f.caps.clone(),
        fields,
    };
    *last = Some((key, s.clone()));
    s
}

fn empty_info() -> gpushm_frame_info {
    gpushm_frame_info {
        format: [0; 16],
        width: 0,
        height: 0,
        n_planes: 0,
        planes: [gpushm_plane {
            data: std::ptr::null_mut(),
            stride: 0,
            rows: 0,
            row_bytes: 0,
            offset: 0,
        }; GPUSHM_MAX_PLANES],
        data: std::ptr::null_mut(),
        size: 0,
        pts: GPUSHM_TIME_NONE,
        dts: GPUSHM_TIME_NONE,
        duration: GPUSHM_TIME_NONE,
        offset: 0,
        flags: 0,
        publish_ns: 0,
        on_device: 0,
    }
}

fn set_format(info: &mut gpushm_frame_info, name: &str) {
    for (d, s) in info.format.iter_mut().zip(name.bytes().take(15)) {
        *d = s as c_char;
    }
}

/// Writes `f`'s description (of `shape`, its caps and layout) to `out`, in place: a frame
/// arrives to cold caches after a sleep, and each line of the stack a copy of the 300-byte
/// description goes through is a miss (see the README's "What the C layer costs").
///
/// # Safety
/// `out` is writable.
#[inline(always)]
unsafe fn describe_frame(shape: &Shape, f: &Frame, out: *mut gpushm_frame_info) {
    // SAFETY: the caller's pointer; the template is plain data.
    let info = unsafe {
        out.write(shape.template.0);
        &mut *out
    };
    let on_device = f.is_on_device();
    let (ptr, size) = f.as_ptr();
    let base = if on_device {
        std::ptr::null_mut()
    } else {
        ptr as *mut u8
    };
    info.data = base;
    info.size = size as u64;
    info.pts = f.meta.pts;
    info.dts = f.meta.dts;
    info.duration = f.meta.duration;
    info.offset = f.meta.offset;
    // Bits below GST_MINI_OBJECT_FLAG_LAST (1 << 4) are the mini object's, not the buffer's.
    info.flags = f.meta.buffer_flags & !0xf;
    info.publish_ns = f.meta.publish_ns;
    info.on_device = on_device as c_int;
    if !base.is_null() {
        let n = (info.n_planes as usize).min(GPUSHM_MAX_PLANES);
        for p in &mut info.planes[..n] {
            p.data = base.wrapping_add(p.offset as usize);
        }
    }
}

fn describe(
    info: &mut gpushm_frame_info,
    format: &str,
    width: u32,
    height: u32,
    planes: &[gpushm_core::format::Plane],
    base: *mut u8,
) {
    set_format(info, format);
    info.width = width;
    info.height = height;
    info.n_planes = planes.len().min(GPUSHM_MAX_PLANES) as u32;
    for (d, p) in info.planes.iter_mut().zip(planes) {
        *d = gpushm_plane {
            data: if base.is_null() {
                std::ptr::null_mut()
            } else {
                base.wrapping_add(p.offset as usize)
            },
            stride: p.stride,
            rows: p.rows,
            row_bytes: p.row_bytes,
            offset: p.offset,
        };
    }
}

/// Why `held` (a frame object's content) cannot be used, if it cannot.
fn unusable(held: Option<&Frame>) -> Option<Fail> {
    match held {
        None => Some(Fail(GPUSHM_ERROR_RELEASED, "the frame was released".into())),
        Some(h) if !h.lease.is_valid() => Some(Fail(
            GPUSHM_ERROR_REVOKED,
            format!(
                "the producer took the frame back: {}",
                h.lease.revoked().unwrap_or_default()
            ),
        )),
        Some(_) => None,
    }
}

fn live_frame(frame: *const gpushm_frame) -> Result<Arc<FrameObj>, Fail> {
    let f = get(&FRAMES, frame as _, "frame")?;
    let why = unusable(lock(&f.frame).as_ref());
    why.map_or(Ok(f), Err)
}

/// `*valid` is 1 while the frame is still this consumer's, 0 once the producer took it back
/// (see gpushm_frame): check it after reading a frame you kept for long, and drop what you
/// read if it is 0. GPUSHM_ERROR_RELEASED after release.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_is_valid(
    frame: *const gpushm_frame,
    valid: *mut c_int,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(valid, "valid")?;
        let v = match live_frame(frame) {
            Ok(_) => 1,
            Err(Fail(GPUSHM_ERROR_REVOKED, _)) => 0,
            Err(e) => return Err(e),
        };
        // SAFETY: checked non-NULL.
        unsafe { out.write(v) };
        Ok(GPUSHM_OK)
    })
}

/// Describes the frame: format, size, planes (pointers into the ring, valid until the frame
/// is released), time stamps, flags.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_get_info(
    frame: *const gpushm_frame,
    info: *mut gpushm_frame_info,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(info, "info")?;
        let f = get(&FRAMES, frame as _, "frame")?;
        let held = lock(&f.frame);
        if let Some(why) = unusable(held.as_ref()) {
            return Err(why);
        }
        // SAFETY: checked non-NULL.
        unsafe { describe_frame(&f.shape, held.as_ref().expect("checked"), out) };
        Ok(GPUSHM_OK)
    })
}

/// The frame's caps (a GStreamer caps string); the pointer stays valid until the frame is
/// destroyed.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_get_caps(
    frame: *const gpushm_frame,
    caps: *mut *const c_char,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(caps, "caps")?;
        let f = get(&FRAMES, frame as _, "frame")?;
        // SAFETY: checked non-NULL; the string lives in the frame's shape, which the frame
        // object keeps until its destroy call (a reused object takes another frame's shape
        // only after that).
        unsafe { out.write(f.shape.caps.as_ptr()) };
        Ok(GPUSHM_OK)
    })
}

/// The frame's address for CUDA kernels on `cuda_device` (an ordinal; -1: the first GPU), in
/// `*device_ptr` (a CUdeviceptr). A frame of a device ring is read there in place; a frame of a
/// host ring is read in place over the bus (or at memory speed on Jetson) once its ring is
/// registered with CUDA, which the first call for a ring does (once per ring, never per frame;
/// it creates this process's CUDA context). GPUSHM_ERROR_NO_GPU without a usable GPU.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_cuda_ptr(
    frame: *const gpushm_frame,
    cuda_device: c_int,
    device_ptr: *mut u64,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(device_ptr, "device_ptr")?;
        let f = live_frame(frame)?;
        let guard = lock(&f.frame);
        let held = guard
            .as_ref()
            .ok_or_else(|| Fail(GPUSHM_ERROR_RELEASED, "the frame was released".into()))?;
        let frame = held;
        if frame.device_ptr().is_none() && !frame.is_on_device() {
            let dev = gpushm_core::cuda::device(cuda_device)
                .map_err(|e| Fail(GPUSHM_ERROR_NO_GPU, e.to_string()))?;
            let ring = frame.lease.ring();
            // One registration per ring, whichever threads ask at once.
            static REGISTERING: Mutex<()> = Mutex::new(());
            let _one = lock(&REGISTERING);
            if ring.attachment().is_none() {
                let (base, len) = ring.mapping();
                // SAFETY: the registration is attached to the ring and dropped with it,
                // before its mapping.
                let att = unsafe {
                    gpushm_core::cuda::register::register_mapping(
                        &dev,
                        base,
                        len,
                        !ring.is_writable(),
                    )
                };
                ring.attach(att);
            }
            if let Some(why) = ring
                .attachment()
                .and_then(|a| a.downcast_ref::<gpushm_core::cuda::register::NotRegistered>())
            {
                return Err(Fail(
                    GPUSHM_ERROR_NO_GPU,
                    format!("the ring cannot be registered with {}: {}", dev.name, why.0),
                ));
            }
        }
        let (ptr, dev) = frame.device_ptr().ok_or_else(|| {
            Fail(
                GPUSHM_ERROR_NO_GPU,
                "the frame has no device address".into(),
            )
        })?;
        if cuda_device >= 0 && dev != cuda_device {
            return Err(Fail(
                GPUSHM_ERROR_NO_GPU,
                format!("the frame is on GPU {dev}, not {cuda_device}"),
            ));
        }
        // SAFETY: checked non-NULL.
        unsafe { out.write(ptr) };
        Ok(GPUSHM_OK)
    })
}

/// Gives the frame back to the producer: its pointers are invalid from now on, and further
/// calls on it (but `gpushm_frame_destroy`) return GPUSHM_ERROR_RELEASED.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_frame_release(frame: *mut gpushm_frame) -> gpushm_status {
    guard(|| {
        let f = get(&FRAMES, frame as _, "frame")?;
        let held = lock(&f.frame).take();
        match held {
            Some(h) => {
                drop(h);
                Ok(GPUSHM_OK)
            }
            None => Err(Fail(
                GPUSHM_ERROR_RELEASED,
                "the frame was released already".into(),
            )),
        }
    })
}

/// Frees the frame handle, releasing the frame first if it was not.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_frame_destroy(frame: *mut gpushm_frame) -> gpushm_status {
    guard(|| {
        let mut f = lock(&FRAMES)
            .remove(frame as u64)
            .ok_or_else(|| bad_handle("frame"))?;
        // The last holder (no other thread is in a call on it): its frame goes back now,
        // outside the table's lock (a release may ring the producer), and the object is kept
        // for the next frame.
        if let Some(o) = Arc::get_mut(&mut f) {
            drop(o.frame.get_mut().unwrap_or_else(|e| e.into_inner()).take());
            let mut frames = lock(&FRAMES);
            if frames.spare.len() < SPARE_FRAMES {
                frames.spare.push(f);
                return Ok(GPUSHM_OK);
            }
        }
        drop(f);
        Ok(GPUSHM_OK)
    })
}

// ------------------------------------------------------------------------------------------
// Publishers.

struct PubObj {
    p: Publisher,
}

struct SlotObj {
    lease: Mutex<Option<HeldSlot>>,
    publisher: u64,
    info: InfoCell,
}

struct HeldSlot(Slot);
// SAFETY: a lease of a slot of the publisher's ring; nothing in it is tied to a thread.
unsafe impl Send for HeldSlot {}

/// Fills `opts` with the defaults: GRAY8 (set format, width and height), 30/1 fps, 8 slots,
/// socket permissions 0600, host memory.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_options_init(
    opts: *mut gpushm_publisher_options,
) -> gpushm_status {
    guard(|| {
        let o = out_ptr(opts, "opts")?;
        // SAFETY: checked non-NULL; the caller's struct.
        unsafe {
            o.write(gpushm_publisher_options {
                format: std::ptr::null(),
                width: 0,
                height: 0,
                fps_n: 30,
                fps_d: 1,
                slots: 8,
                perms: 0o600,
                cuda_device: -1,
                spin_us: 0,
            })
        };
        Ok(GPUSHM_OK)
    })
}

/// Serves raw video at `path` (a unix socket it creates, removed on destroy; gpushmsrc and
/// subscribers connect there). `*out` is a publisher to destroy with
/// `gpushm_publisher_destroy`.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_open(
    path: *const c_char,
    opts: *const gpushm_publisher_options,
    out: *mut *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let path = PathBuf::from(unsafe { string(path, "path") }?);
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_publisher(path, opts, out) }
    })
}

/// Serves raw video like `gpushm_publisher_open`, as stream `name`: the socket is made in
/// $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or
/// /tmp/gpushm-UID, created mode 0700). Consumers give the same name (gpushmsrc stream=NAME,
/// `gpushm_subscriber_open_stream`). GPUSHM_ERROR_INVALID for a bad name or a directory that
/// cannot be trusted (another user's), saying why.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_open_stream(
    name: *const c_char,
    opts: *const gpushm_publisher_options,
    out: *mut *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let name = unsafe { string(name, "name") }?;
        let path = gpushm_core::names::producer_path(&name)?;
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_publisher(path, opts, out) }
    })
}

/// # Safety
/// `opts` is NULL or the caller's initialised struct; `out` is NULL or writable.
unsafe fn open_publisher(
    path: PathBuf,
    opts: *const gpushm_publisher_options,
    out: *mut *mut gpushm_publisher,
) -> Result<gpushm_status, Fail> {
    {
        let out = out_ptr(out, "out")?;
        if opts.is_null() {
            return Err(invalid(
                "opts is NULL (format, width and height are needed)",
            ));
        }
        // SAFETY: non-NULL, the caller's initialised struct.
        let o = unsafe { &*opts };
        // SAFETY: the caller's string.
        let name = unsafe { string(o.format, "opts->format") }?;
        let format = VideoFormat::from_name(&name)
            .ok_or_else(|| invalid(format!("format {name:?} is not one gpushm publishes")))?;
        let layout = FrameLayout::new(format, o.width, o.height)
            .ok_or_else(|| invalid(format!("{}x{} is not a frame size", o.width, o.height)))?;
        if o.fps_n == 0 || o.fps_d == 0 {
            return Err(invalid(format!("frame rate {}/{}", o.fps_n, o.fps_d)));
        }
        if !(2..=64).contains(&o.slots) {
            return Err(invalid(format!("{} slots: 2 to 64", o.slots)));
        }
        // Checked before the stream is served.
        let spin = Duration::from_micros(o.spin_us.into());
        gpushm_core::policy::check_spin(spin)?;
        let config = Config {
            perms: o.perms & 0o777,
            ..Config::default()
        };
        let p = if o.cuda_device >= 0 {
            let dev = gpushm_core::cuda::device(o.cuda_device)
                .map_err(|e| Fail(GPUSHM_ERROR_NO_GPU, e.to_string()))?;
            Publisher::new_on_device(&path, layout, (o.fps_n, o.fps_d), o.slots, config, dev)?
        } else {
            Publisher::new(&path, layout, (o.fps_n, o.fps_d), o.slots, config)?
        };
        p.set_spin(spin)?;
        let id = insert(&PUBLISHERS, Arc::new(PubObj { p }))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(id as *mut gpushm_publisher) };
        Ok(GPUSHM_OK)
    }
}

/// Lends a free slot to fill, waiting up to `timeout_ns` (negative: as long as it takes) while
/// consumers hold them all (GPUSHM_TIMEOUT). Fill it through `gpushm_slot_get_info`, then
/// `gpushm_publisher_publish` it (or `gpushm_slot_discard` it).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_acquire(
    publisher: *mut gpushm_publisher,
    timeout_ns: i64,
    slot: *mut *mut gpushm_slot,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(slot, "slot")?;
        let p = get(&PUBLISHERS, publisher as _, "publisher")?;
        let t = timeout(timeout_ns).unwrap_or(Duration::MAX);
        let mut lease = p.p.acquire(t)?;
        let mut info = empty_info();
        let on_device = lease.is_on_device();
        let layout = lease.layout().clone();
        let bytes = lease.bytes_mut();
        let base = if on_device {
            std::ptr::null_mut()
        } else {
            bytes.as_mut_ptr()
        };
        info.data = base;
        info.size = layout.size;
        info.on_device = on_device as c_int;
        describe(
            &mut info,
            layout.format.name(),
            layout.width,
            layout.height,
            &layout.planes,
            base,
        );
        let obj = SlotObj {
            lease: Mutex::new(Some(HeldSlot(lease))),
            publisher: publisher as u64,
            info: InfoCell(info),
        };
        let id = insert(&SLOTS, Arc::new(obj))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(id as *mut gpushm_slot) };
        Ok(GPUSHM_OK)
    })
}

/// Where to write the frame: the slot's planes (`data` NULL for a device ring's slot: write it
/// with `gpushm_slot_cuda_ptr`).
#[no_mangle]
pub unsafe extern "C" fn gpushm_slot_get_info(
    slot: *const gpushm_slot,
    info: *mut gpushm_frame_info,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(info, "info")?;
        let s = get(&SLOTS, slot as _, "slot")?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(s.info.0) };
        Ok(GPUSHM_OK)
    })
}

/// The device address of a device ring's slot (write the frame there with CUDA, and finish
/// before publishing); GPUSHM_ERROR_NO_GPU for a slot in host memory.
#[no_mangle]
pub unsafe extern "C" fn gpushm_slot_cuda_ptr(
    slot: *const gpushm_slot,
    device_ptr: *mut u64,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(device_ptr, "device_ptr")?;
        let s = get(&SLOTS, slot as _, "slot")?;
        let l = lock(&s.lease);
        let ptr = l
            .as_ref()
            .ok_or_else(|| Fail(GPUSHM_ERROR_RELEASED, "the slot was published".into()))?
            .0
            .device_ptr()
            .ok_or_else(|| Fail(GPUSHM_ERROR_NO_GPU, "the slot is in host memory".into()))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(ptr) };
        Ok(GPUSHM_OK)
    })
}

/// Publishes a filled slot to every consumer; `capture_ns` is when it was captured
/// (CLOCK_MONOTONIC ns; 0: now). The slot handle is gone after this call, whatever it returns.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_publish(
    publisher: *mut gpushm_publisher,
    slot: *mut gpushm_slot,
    capture_ns: u64,
) -> gpushm_status {
    guard(|| {
        let s = lock(&SLOTS)
            .remove(slot as u64)
            .ok_or_else(|| bad_handle("slot"))?;
        let p = get(&PUBLISHERS, publisher as _, "publisher")?;
        if s.publisher != publisher as u64 {
            return Err(invalid("the slot was lent by another publisher"));
        }
        let lease = lock(&s.lease)
            .take()
            .ok_or_else(|| Fail(GPUSHM_ERROR_RELEASED, "the slot was published".into()))?;
        p.p.publish(lease.0, (capture_ns != 0).then_some(capture_ns))?;
        Ok(GPUSHM_OK)
    })
}

/// Gives a slot back unpublished; the handle is gone after this call.
#[no_mangle]
pub unsafe extern "C" fn gpushm_slot_discard(slot: *mut gpushm_slot) -> gpushm_status {
    guard(|| {
        let s = lock(&SLOTS)
            .remove(slot as u64)
            .ok_or_else(|| bad_handle("slot"))?;
        drop(s);
        Ok(GPUSHM_OK)
    })
}

/// Tells every consumer the stream ended (they get GPUSHM_EOS after the frames before).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_send_eos(
    publisher: *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        get(&PUBLISHERS, publisher as _, "publisher")?.p.send_eos();
        Ok(GPUSHM_OK)
    })
}

/// Wakes the consumers that sleep waiting for a frame, ahead of the next one: call it a few
/// µs before `gpushm_publisher_publish` (as the frame's last step starts), so that their
/// wake-up (tens of µs on a core that idled) runs meanwhile. Once per frame; it wakes nobody
/// less than 0.5 ms after the last frame, nor a consumer that went to sleep on this thread's
/// CPU, nor one whose event loop polls `gpushm_subscriber_fd`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_wake_early(
    publisher: *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        get(&PUBLISHERS, publisher as _, "publisher")?
            .p
            .wake_early();
        Ok(GPUSHM_OK)
    })
}

/// Consumers woken ahead of a frame by `gpushm_publisher_wake_early` so far, one per consumer
/// and frame.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_woken_early(
    publisher: *mut gpushm_publisher,
    count: *mut u64,
) -> gpushm_status {
    publisher_count(publisher, count, |s| s.woken_early)
}

/// Writes one of `publisher`'s counts (picked from its stats) into `*count`.
fn publisher_count(
    publisher: *mut gpushm_publisher,
    count: *mut u64,
    pick: fn(&gpushm_core::publisher::Stats) -> u64,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(count, "count")?;
        let n = pick(&get(&PUBLISHERS, publisher as _, "publisher")?.p.stats().0);
        // SAFETY: checked non-NULL.
        unsafe { out.write(n) };
        Ok(GPUSHM_OK)
    })
}

/// Wakes the consumers that sleep waiting for a frame `us` microseconds before each frame is
/// due, as learnt from the intervals between the last frames published, from a thread of the
/// publisher (0, the default: never; at most 1000). A consumer woken from a sleep of a few ms
/// takes tens of µs to run (60-80 on the H100 machine): woken ahead, it is up and polling
/// (at most 100 µs, once per frame) when the frame lands. For streams of at most 500 frames
/// a second, never for a frame already half an interval late (a stream that stops costs
/// one wake-up), once per frame (`gpushm_publisher_wake_early` rings again only for a frame
/// that came more than 200 µs after it), by the same rules as `gpushm_publisher_wake_early`
/// (its CPU is the one the last frame was published from).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_set_wake_ahead(
    publisher: *mut gpushm_publisher,
    us: u32,
) -> gpushm_status {
    guard(|| {
        get(&PUBLISHERS, publisher as _, "publisher")?
            .p
            .set_wake_ahead(std::time::Duration::from_micros(us.into()))?;
        Ok(GPUSHM_OK)
    })
}

/// Consumers woken before a frame was due (`gpushm_publisher_set_wake_ahead`) so far, one per
/// consumer and frame (counted in `gpushm_publisher_woken_early` too).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_woken_ahead(
    publisher: *mut gpushm_publisher,
    count: *mut u64,
) -> gpushm_status {
    publisher_count(publisher, count, |s| s.woken_ahead)
}

/// Consumers connected now.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_num_clients(
    publisher: *mut gpushm_publisher,
    count: *mut u32,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(count, "count")?;
        let n = get(&PUBLISHERS, publisher as _, "publisher")?
            .p
            .num_clients();
        // SAFETY: checked non-NULL.
        unsafe { out.write(n.min(u32::MAX as usize) as u32) };
        Ok(GPUSHM_OK)
    })
}

/// Stops serving (the socket file goes) and frees the publisher. Frames consumers hold stay
/// valid for them; slots it lent and not published are given back.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_destroy(
    publisher: *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        let p = lock(&PUBLISHERS)
            .remove(publisher as u64)
            .ok_or_else(|| bad_handle("publisher"))?;
        drop(p);
        Ok(GPUSHM_OK)
    })
}

// ------------------------------------------------------------------------------------------
// Keeping the CPUs awake.

/// Keeps this machine's CPUs in idle states that wake within `us` microseconds (0: the
/// shallowest) until `gpushm_cpu_latency_release`: the kernel's CPU latency QoS
/// (/dev/cpu_dma_latency), the companion of `spin_us` for the lowest latency. A core that
/// slept in a deep idle state wakes with cold caches, and a frame's way after it costs
/// several µs more on each side (about 10 on the dev VM). Costs power and no CPU time of this
/// process, but with 0 idle cores poll instead of sleeping (in a VM each vCPU keeps a host
/// core busy); a few µs still allows the lightest sleep states on most CPUs. The kernel drops
/// the request when the process ends, however it ends. Needs write access to
/// /dev/cpu_dma_latency (root, or a udev rule): GPUSHM_ERROR_SYSTEM otherwise, with
/// `gpushm_last_error` saying so. Changes nothing where the kernel has no cpuidle driver
/// (some VMs). `us` at most 1000000.
#[no_mangle]
pub unsafe extern "C" fn gpushm_cpu_latency_request(
    us: u32,
    out: *mut *mut gpushm_cpu_latency,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let held = CpuLatency::request(us)?;
        let h = insert(&CPU_LATENCIES, Arc::new(held))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(h as *mut gpushm_cpu_latency) };
        Ok(GPUSHM_OK)
    })
}

/// The latency the kernel keeps the CPUs to now (the smallest of all requests), µs. Reading
/// needs access too (read access: root, or the same udev rule).
#[no_mangle]
pub unsafe extern "C" fn gpushm_cpu_latency_current(us: *mut u32) -> gpushm_status {
    guard(|| {
        let out = out_ptr(us, "us")?;
        let v = CpuLatency::current()?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(v) };
        Ok(GPUSHM_OK)
    })
}

/// Withdraws the request and frees it.
#[no_mangle]
pub unsafe extern "C" fn gpushm_cpu_latency_release(
    request: *mut gpushm_cpu_latency,
) -> gpushm_status {
    guard(|| {
        let r = lock(&CPU_LATENCIES)
            .remove(request as u64)
            .ok_or_else(|| bad_handle("cpu latency request"))?;
        // Its descriptor closes after the table's lock.
        drop(r);
        Ok(GPUSHM_OK)
    })
}

// ------------------------------------------------------------------------------------------

/// The calling thread's message for the last call that did not return GPUSHM_OK (empty after
/// one that did). Valid until this thread's next gpushm call.
#[no_mangle]
pub extern "C" fn gpushm_last_error() -> *const c_char {
    static GONE: &[u8] = b"(this thread is exiting)\0";
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(GONE.as_ptr() as *const c_char)
}

/// The library's version, "MAJOR.MINOR.PATCH".
#[no_mangle]
pub extern "C" fn gpushm_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}
