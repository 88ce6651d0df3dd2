// SPDX-License-Identifier: MPL-2.0
//! `Subscriber`: receives frames from a gpushmsink (or any gpushm publisher).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpushm::subscriber::{ConnectOptions, Delivery, Subscriber as CoreSubscriber, Waker};
use gpushm::Error as CoreError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::{secs, to_py, EndOfStream, Error, Timeout};
use crate::frame::Frame;

/// Receives frames from a gpushmsink (or a gpushm Publisher) at `path`, or from the one
/// serving stream name `stream` (gpushmsink stream=NAME, `Publisher(stream=NAME)`): looked for
/// in $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm or
/// /tmp/gpushm-UID) and /run/gpushm. Give one of them.
///
/// `mode` says whether the producer may skip frames this subscriber is too slow for:
/// "lossless" makes it wait (up to its max-wait), "leaky" lets it skip, and "auto" (the
/// default) is lossless except for live raw video (a camera), which is leaky: audio, encoded
/// video and streams that are not live lose nothing (of a live stream, an "auto" subscriber
/// holds the producer up at most 10 % of the time, 1 s at once; beyond that it loses what it
/// has no room for rather than slow the source down to its pace). `lossless=True` / `False` (kept for older
/// code) is `mode="lossless"` / `"leaky"`. `timeout` (seconds, None = forever) applies to waiting
/// for the producer and to each `next_frame()`. Frames are NumPy views into the ring: a frame
/// you hold keeps its slot, and the producer has only so many (its `client-budget`).
///
/// Frames (and every view, array or tensor made from them) keep their slots until the last of
/// them is gone, also after `close()`; see `Frame` and the gpushm crate's "Held frames".
///
/// `device_memory=True`: the producer may keep its frames in GPU memory (a device ring, e.g.
/// `Publisher(..., cuda_device=0)`): this subscriber then maps it read-only and its frames are
/// `on_device` (`torch.from_dlpack(frame)`, CuPy; `numpy()` refuses, `bytes(frame)` copies).
/// Without it, a producer with a device ring turns the subscriber away, saying why.
///
/// `spin_us` (0, the default: off) is the low-latency mode: CPU time in µs this subscriber may
/// spend per frame polling the ring around the time the next frame is due (learnt from the
/// producer's cadence) instead of sleeping until the frame wakes it. It saves the wake-up of
/// a sleeping core (tens of µs) for a bounded spin; a frame earlier or later than expected
/// still wakes it, and a paused producer costs one budget, then nothing.
#[pyclass(module = "gpushm", name = "Subscriber", frozen)]
pub struct Subscriber {
    inner: Mutex<Option<CoreSubscriber>>,
    waker: Waker,
    poll: nix::sys::epoll::Epoll,
    timeout: Option<Duration>,
    cuda_device: i32,
    /// The connection's descriptors, in `poll` from the first `fileno()` on (until then the
    /// producer rings this subscriber only while it waits, and ahead of frames: its
    /// wake-early).
    fds: Mutex<Option<[std::os::fd::RawFd; 2]>>,
}

impl Subscriber {
    fn with<T>(&self, f: impl FnOnce(&mut CoreSubscriber) -> Result<T, CoreError>) -> PyResult<T> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let sub = guard
            .as_mut()
            .ok_or_else(|| Error::new_err("the subscriber is closed"))?;
        f(sub).map_err(to_py)
    }

    fn next_inner(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<Option<Frame>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            // Wait in slices with the GIL released, so Ctrl-C and other threads get through.
            let slice = deadline.map_or(Duration::from_millis(100), |d| {
                d.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(100))
            });
            let r = py.detach(|| self.with(|s| s.next_frame(Some(slice))));
            match r {
                Ok(Some(f)) => return self.wrap(f).map(Some),
                Ok(None) => return Ok(None),
                Err(e) if e.is_instance_of::<Timeout>(py) => {
                    py.check_signals()?;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(Timeout::new_err(format!(
                            "no frame from the producer within {:.3} s",
                            timeout.unwrap_or_default().as_secs_f64()
                        )));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn wrap(&self, f: gpushm::subscriber::Frame) -> PyResult<Frame> {
        Ok(Frame::new(f, self.cuda_device))
    }
}

#[pymethods]
impl Subscriber {
    #[new]
    #[pyo3(signature = (path=None, lossless=None, timeout=Some(5.0), name=None, producer_uid=None, cuda_device=0, mode="auto", device_memory=false, stream=None, spin_us=0))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        lossless: Option<bool>,
        timeout: Option<f64>,
        name: Option<String>,
        producer_uid: Option<u32>,
        cuda_device: i32,
        mode: &str,
        device_memory: bool,
        stream: Option<String>,
        spin_us: u32,
    ) -> PyResult<Self> {
        let endpoint = crate::errors::endpoint(path, stream)?;
        let timeout = secs(timeout)?;
        let mode = match lossless {
            Some(true) => Delivery::Lossless,
            Some(false) => Delivery::Leaky,
            None => Delivery::from_name(mode).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "mode {mode:?} is not one of \"auto\", \"lossless\", \"leaky\""
                ))
            })?,
        };
        let mut opts = ConnectOptions {
            mode,
            timeout: timeout.unwrap_or(Duration::MAX),
            producer_uid,
            device_memory,
            spin: crate::errors::spin(spin_us)?,
            ..Default::default()
        };
        if let Some(n) = name {
            opts.name = n;
        }
        let waker = Waker::new().map_err(to_py)?;
        let w = waker.clone();
        let sub = py
            .detach(move || CoreSubscriber::connect_to(&endpoint, &opts, &w))
            .map_err(to_py)?;
        let poll = nix::sys::epoll::Epoll::new(nix::sys::epoll::EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| Error::new_err(format!("epoll_create: {e}")))?;
        let fds = Mutex::new(None);
        Ok(Self {
            inner: Mutex::new(Some(sub)),
            waker,
            poll,
            timeout,
            cuda_device,
            fds,
        })
    }

    /// The next frame. Raises `Timeout` when none came within `timeout` seconds (default: the
    /// subscriber's), `EndOfStream` after the producer's EOS, `ProducerLost` when it went away.
    #[pyo3(signature = (timeout=-1.0))]
    fn next_frame(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Frame> {
        let t = match timeout {
            // The default, -1: the subscriber's timeout.
            Some(t) if t < 0.0 => self.timeout,
            t => secs(t)?,
        };
        self.next_inner(py, t)?
            .ok_or_else(|| EndOfStream::new_err("the producer sent end-of-stream"))
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Frames until the producer's EOS.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Frame>> {
        self.next_inner(py, self.timeout)
    }

    /// A descriptor that is readable when a frame (or news from the producer) may be waiting:
    /// for `selectors` and `asyncio` (`loop.add_reader(sub.fileno(), ...)`); then call
    /// `next_frame(timeout=0)`. From the first call on, the producer rings this subscriber
    /// after every frame, as an event loop needs (before it, only while `next_frame` waits,
    /// which saves the producer a system call per frame, and ahead of frames: gpushmsink's
    /// wake-early).
    fn fileno(&self) -> PyResult<i32> {
        let mut armed = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        if armed.is_none() {
            let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            // Closed: nothing to watch, the descriptor stays quiet.
            if let Some(sub) = inner.as_ref() {
                let fds = sub.poll_fds();
                for fd in fds {
                    // SAFETY: the subscriber owns fd, and close() takes it out of the set
                    // before the subscriber goes.
                    let bfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
                    self.poll
                        .add(
                            bfd,
                            nix::sys::epoll::EpollEvent::new(
                                nix::sys::epoll::EpollFlags::EPOLLIN,
                                fd as u64,
                            ),
                        )
                        .map_err(|e| Error::new_err(format!("epoll_ctl: {e}")))?;
                }
                *armed = Some(fds);
            }
        }
        Ok(self.poll.0.as_fd().as_raw_fd())
    }

    /// The producer's caps (a GStreamer caps string), once known.
    #[getter]
    fn caps(&self) -> PyResult<Option<String>> {
        self.with(|s| Ok(s.caps().map(|c| c.to_string())))
    }

    /// Frames the producer did not hand us because we fell behind (leaky subscribers).
    #[getter]
    fn dropped(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.dropped()))
    }

    /// The low-latency mode's figures (`spin_us`): `(caught, missed)`, frames that came while
    /// the ring was polled and polls that ended without one; (0, 0) when it is off.
    #[getter]
    fn spin_stats(&self) -> PyResult<(u64, u64)> {
        self.with(|s| {
            let st = s.spin_stats();
            Ok((st.caught, st.missed))
        })
    }

    /// Stops taking frames and tells the producer so: it no longer waits for this subscriber
    /// (even a lossless one) nor delivers to it. Frames still held, and every view, array or
    /// tensor made from them, keep their slots until they are dropped; then the connection
    /// closes.
    fn close(&self) {
        self.waker.wake();
        let old = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        let armed = self.fds.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let (Some(_), Some(fds)) = (&old, armed) {
            // The socket outlives the subscriber while frames are held: `fileno()` must not
            // report it readable any more.
            for fd in fds {
                // SAFETY: the subscriber (still alive here) owns both descriptors.
                let _ = self
                    .poll
                    .delete(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) });
            }
        }
        drop(old);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }
}
