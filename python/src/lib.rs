// SPDX-License-Identifier: MPL-2.0
//! `gpushm` for Python: live frames from a gpushmsink (or any gpushm publisher) as read-only
//! NumPy views into the shared ring, and on a CUDA machine as device arrays for PyTorch and
//! CuPy, with no copy. Built on the `gpushm` crate: no GStreamer, no PyGObject.
//!
//! Views use the NumPy array interface (`__array_interface__`), CUDA's
//! (`__cuda_array_interface__`, v3) and DLPack (`__dlpack__`), so the extension needs no NumPy
//! headers and works with the stable ABI (abi3, CPython ≥ 3.9).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpushm::client::{ConnectOptions, SlotLease, Subscriber as CoreSubscriber, Waker};
use gpushm::format::{FrameLayout, VideoFormat};
use gpushm::frame::FrameMeta;
use gpushm::layout::NONE_U64;
use gpushm::publisher::{Config, FramePublisher, SlotLease as PublishLease};
use gpushm::Error as CoreError;
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

mod cuda;
mod dlpack;

pyo3::create_exception!(
    gpushm,
    Error,
    PyRuntimeError,
    "A gpushm error: the producer refused us, sent something invalid, or a system call failed."
);
pyo3::create_exception!(
    gpushm,
    ProducerLost,
    Error,
    "The producer went away (it stopped or crashed) or closed our connection."
);
pyo3::create_exception!(
    gpushm,
    EndOfStream,
    Error,
    "The producer sent end-of-stream: no frame follows. Iteration simply stops there."
);
pyo3::create_exception!(
    gpushm,
    Timeout,
    PyTimeoutError,
    "No frame (or no producer) within the timeout."
);

fn to_py(e: CoreError) -> PyErr {
    match e {
        CoreError::Disconnected => {
            ProducerLost::new_err("the producer went away (gpushmsink stopped or crashed)")
        }
        CoreError::Refused(m) => ProducerLost::new_err(m),
        CoreError::Timeout(m) => Timeout::new_err(m),
        CoreError::Interrupted => Error::new_err("interrupted: the subscriber was closed"),
        e => Error::new_err(e.to_string()),
    }
}

fn secs(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        // Beyond what a Duration holds: as good as forever.
        Some(s) if s >= 0.0 => Ok(Some(
            Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX),
        )),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a number of seconds ≥ 0 or None, not {s}"
        ))),
    }
}

/// A frame's lease, held by the frame and by every view of it: the slot goes back to the
/// producer when the last of them is gone.
struct FrameData {
    meta: FrameMeta,
    /// Address of the first byte (inside the lease's mapping).
    ptr: usize,
    layout: FrameLayout,
    lease: LeaseHolder,
    cuda_device: i32,
}

struct LeaseHolder(SlotLease);

// SAFETY: the lease is only read (its ring, for CUDA registration, which the ring guards with
// its own once-cell) and dropped; SlotLease's drop may run on any thread.
unsafe impl Sync for LeaseHolder {}
// SAFETY: as above; the raw frame pointer lives in FrameData as an address.
unsafe impl Send for LeaseHolder {}

impl FrameData {
    fn packed_channels(&self) -> Option<usize> {
        match self.layout.format {
            VideoFormat::Gray8 => Some(1),
            VideoFormat::Rgba => Some(4),
            VideoFormat::I420 | VideoFormat::Nv12 => None,
        }
    }

    /// (shape, strides, byte offset) of the whole frame: (height, width, channels) for packed
    /// formats, the payload as 1-D otherwise.
    fn frame_geometry(&self) -> (Vec<usize>, Vec<isize>, u64) {
        match self.packed_channels() {
            Some(c) => {
                let p = self.layout.planes[0];
                (
                    vec![self.layout.height as usize, self.layout.width as usize, c],
                    vec![p.stride as isize, c as isize, 1],
                    p.offset,
                )
            }
            None => (vec![self.meta.payload_size as usize], vec![1], 0),
        }
    }

    fn plane_geometry(&self, i: usize) -> (Vec<usize>, Vec<isize>, u64) {
        let p = self.layout.planes[i];
        (
            vec![p.rows as usize, p.row_bytes as usize],
            vec![p.stride as isize, 1],
            p.offset,
        )
    }
}

/// A view of (part of) a frame for array libraries: `numpy.asarray(view)` and CuPy/PyTorch
/// read it in place. It keeps the frame's slot until it is garbage-collected.
#[pyclass(module = "gpushm", name = "FrameView", frozen)]
struct View {
    source: Source,
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: u64,
}

/// What a view keeps alive.
enum Source {
    /// A received frame: read-only.
    Frame(Arc<FrameData>),
    /// A publisher's slot being filled: writable.
    Slot(Arc<WritableSlot>),
}

fn shape_tuple<'py>(py: Python<'py>, v: &[usize]) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, v)
}

#[pymethods]
impl View {
    /// The NumPy array interface (version 3): read-only, zero-copy.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", shape_tuple(py, &self.shape)?)?;
        d.set_item("strides", PyTuple::new(py, &self.strides)?)?;
        d.set_item("typestr", "|u1")?;
        let (base, read_only) = match &self.source {
            Source::Slot(w) => (w.ptr, false),
            Source::Frame(f) => (f.ptr, true),
        };
        d.set_item("data", (base + self.offset as usize, read_only))?;
        Ok(d)
    }

    /// The CUDA array interface (version 3) of this view, registering the frame's ring with
    /// CUDA the first time (once per ring mapping, never per frame). Read-only.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (dev_ptr, _) = self.device_ptr(py)?;
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", shape_tuple(py, &self.shape)?)?;
        d.set_item("strides", PyTuple::new(py, &self.strides)?)?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (dev_ptr, true))?;
        // Host memory registered with CUDA: nothing to synchronise with.
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// DLPack export (read-only CUDA memory): `torch.from_dlpack(view)`, `cupy.from_dlpack(view)`.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Host memory registered with CUDA, written before the frame was published: there is
        // nothing to order on the consumer's stream.
        let _ = (stream, max_version);
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "gpushm frames are exported without copies (copy=True is not supported)",
            ));
        }
        let py = slf.py();
        let this = slf.get();
        if let Some(d) = dl_device.as_ref().filter(|d| !d.is_none()) {
            let want: (i32, i32) = d.extract()?;
            if want != (dlpack::KDL_CUDA, this.frame()?.cuda_device) {
                return Err(PyBufferError::new_err(format!(
                    "gpushm frames are on CUDA device {}; dl_device {want:?} would need a copy",
                    this.frame()?.cuda_device
                )));
            }
        }
        let (dev_ptr, device) = this.device_ptr(py)?;
        dlpack::capsule(
            py,
            dev_ptr,
            device,
            &this.shape,
            &this.strides,
            slf.clone().into_any().unbind(),
        )
    }

    /// `(kDLCUDA, device)`.
    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        Ok((dlpack::KDL_CUDA, self.frame()?.cuda_device))
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.shape)
    }
}

impl View {
    fn frame(&self) -> PyResult<&Arc<FrameData>> {
        match &self.source {
            Source::Frame(f) => Ok(f),
            Source::Slot(_) => Err(PyTypeError::new_err(
                "a publisher's slot is not registered with CUDA: fill it from NumPy",
            )),
        }
    }

    fn device_ptr(&self, py: Python<'_>) -> PyResult<(u64, i32)> {
        let data = self.frame()?.clone();
        let (base, device) = py
            .detach(move || cuda::device_ptr(&data))
            .map_err(Error::new_err)?;
        Ok((base + self.offset, device))
    }
}

/// One frame: metadata, and views into the ring that stay valid while the frame (or any view
/// of it) lives.
///
/// `release()` (or leaving a `with` block) gives up the frame's own hold: its attributes that
/// make views then raise, and the slot goes back to the producer as soon as the views already
/// made are gone too. A released frame's views never see a reused slot.
#[pyclass(module = "gpushm", name = "Frame", frozen)]
struct Frame {
    data: Mutex<Option<Arc<FrameData>>>,
    /// Set when the frame itself was handed out through `__cuda_array_interface__`: the array
    /// made from it references this Frame, not a view, so the lease stays until the Frame is
    /// garbage-collected, whatever release() says.
    pinned: Mutex<Option<Arc<FrameData>>>,
    /// Copied out, so they stay readable after release().
    meta: FrameMeta,
    seq: u64,
    caps: Arc<str>,
    layout: FrameLayout,
}

impl Frame {
    fn data(&self) -> PyResult<Arc<FrameData>> {
        self.data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                Error::new_err("the frame was released: its memory may hold another frame now")
            })
    }

    fn view(&self, geometry: (Vec<usize>, Vec<isize>, u64)) -> PyResult<View> {
        Ok(View {
            source: Source::Frame(self.data()?),
            shape: geometry.0,
            strides: geometry.1,
            offset: geometry.2,
        })
    }
}

fn asarray<'py>(py: Python<'py>, view: View) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    np.call_method1("asarray", (Bound::new(py, view)?,))
}

fn opt_ns(v: u64) -> Option<u64> {
    (v != NONE_U64).then_some(v)
}

#[pymethods]
impl Frame {
    /// Presentation timestamp in ns (the producer's stream time), or None.
    #[getter]
    fn pts(&self) -> Option<u64> {
        opt_ns(self.meta.pts)
    }

    /// Duration in ns, or None.
    #[getter]
    fn duration(&self) -> Option<u64> {
        opt_ns(self.meta.duration)
    }

    /// When the producer published the frame (CLOCK_MONOTONIC ns, as `time.monotonic_ns()`).
    #[getter]
    fn publish_time_ns(&self) -> u64 {
        self.meta.publish_ns
    }

    /// The producer's frame number (GstBuffer offset).
    #[getter]
    fn offset(&self) -> u64 {
        self.meta.offset
    }

    /// This frame's sequence number in the ring.
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }

    /// "GRAY8", "I420", "NV12" or "RGBA".
    #[getter]
    fn format(&self) -> &'static str {
        self.layout.format.name()
    }

    #[getter]
    fn width(&self) -> u32 {
        self.layout.width
    }

    #[getter]
    fn height(&self) -> u32 {
        self.layout.height
    }

    /// The producer's caps (a GStreamer caps string).
    #[getter]
    fn caps(&self) -> &str {
        &self.caps
    }

    /// Bytes of the payload.
    fn __len__(&self) -> usize {
        self.meta.payload_size as usize
    }

    /// Each plane as a read-only 2-D uint8 NumPy view (rows × visible bytes per row, with the
    /// producer's stride). Zero-copy: the views point into the ring and keep the frame.
    #[getter]
    fn planes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let data = self.data()?;
        let views = (0..data.layout.planes.len())
            .map(|i| asarray(py, self.view(data.plane_geometry(i))?))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, views)
    }

    /// The whole frame as a read-only NumPy view: (height, width, channels) for packed formats
    /// (GRAY8, RGBA), the payload as 1-D uint8 otherwise (I420, NV12: use `planes`).
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let data = self.data()?;
        asarray(py, self.view(data.frame_geometry())?)
    }

    /// `numpy.asarray(frame)`: the same as `numpy()` (a view that keeps the frame's slot).
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let a = self.numpy(py)?;
        match (dtype.filter(|d| !d.is_none()), copy) {
            (Some(d), _) => a.call_method1("astype", (d,)),
            (None, Some(true)) => a.call_method0("copy"),
            _ => Ok(a),
        }
    }

    /// The payload as gpushmsrc's buffer holds it (a copy).
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.data()?;
        // SAFETY: the lease keeps payload_size bytes at ptr mapped (checked against the slot
        // when the frame was read).
        let bytes = unsafe {
            std::slice::from_raw_parts(data.ptr as *const u8, data.meta.payload_size as usize)
        };
        Ok(PyBytes::new(py, bytes))
    }

    /// Views for CUDA libraries, one per plane (`torch.from_dlpack(v)`, `cupy.asarray(v)`).
    fn cuda_planes(&self) -> PyResult<Vec<View>> {
        let data = self.data()?;
        (0..data.layout.planes.len())
            .map(|i| self.view(data.plane_geometry(i)))
            .collect()
    }

    /// CUDA array interface of the whole frame (packed formats; planar ones: `cuda_planes()`).
    /// The array made from it references this frame: its slot then stays until the frame is
    /// garbage-collected, even after `release()`.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let view = self.packed_view()?;
        let d = view.__cuda_array_interface__(py)?;
        if let Source::Frame(f) = &view.source {
            *self.pinned.lock().unwrap_or_else(|e| e.into_inner()) = Some(f.clone());
        }
        Ok(d)
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let v = Bound::new(py, self.packed_view()?)?;
        View::__dlpack__(&v, stream, max_version, dl_device, copy)
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        Ok((dlpack::KDL_CUDA, self.data()?.cuda_device))
    }

    /// Gives the frame's hold on its slot back (views already made keep theirs).
    fn release(&self) {
        let old = self.data.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(old);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.release();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpushm.Frame {} {}x{} offset={} pts={}>",
            self.layout.format.name(),
            self.layout.width,
            self.layout.height,
            self.meta.offset,
            opt_ns(self.meta.pts).map_or("None".into(), |p| p.to_string())
        )
    }
}

impl Frame {
    fn packed_view(&self) -> PyResult<View> {
        let data = self.data()?;
        if data.packed_channels().is_none() {
            return Err(PyTypeError::new_err(format!(
                "{} frames have several planes: use frame.cuda_planes() for one array per plane",
                data.layout.format.name()
            )));
        }
        self.view(data.frame_geometry())
    }
}

/// Receives frames from a gpushmsink (or a gpushm Publisher) at `path`.
///
/// `lossless=True` makes the producer wait for this subscriber (up to its max-wait) instead of
/// skipping frames it is too slow for. `timeout` (seconds, None = forever) applies to waiting
/// for the producer and to each `next_frame()`. Frames are NumPy views into the ring: a frame
/// you hold keeps its slot, and the producer has only so many (its `client-budget`).
#[pyclass(module = "gpushm", name = "Subscriber", frozen)]
struct Subscriber {
    inner: Mutex<Option<CoreSubscriber>>,
    waker: Waker,
    poll: nix::sys::epoll::Epoll,
    timeout: Option<Duration>,
    cuda_device: i32,
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

    fn wrap(&self, f: gpushm::client::Frame) -> PyResult<Frame> {
        let layout = f.layout().map_err(|e| {
            Error::new_err(format!(
                "cannot view this frame ({}): {e}; gpushm's Python package reads GRAY8, I420, NV12 and RGBA",
                f.caps
            ))
        })?;
        let gpushm::client::Frame {
            meta,
            seq,
            ptr,
            caps,
            lease,
        } = f;
        let data = Arc::new(FrameData {
            meta,
            ptr: ptr as usize,
            layout: layout.clone(),
            lease: LeaseHolder(lease),
            cuda_device: self.cuda_device,
        });
        Ok(Frame {
            data: Mutex::new(Some(data)),
            pinned: Mutex::new(None),
            meta,
            seq,
            caps,
            layout,
        })
    }
}

#[pymethods]
impl Subscriber {
    #[new]
    #[pyo3(signature = (path, lossless=false, timeout=Some(5.0), name=None, producer_uid=None, cuda_device=0))]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        lossless: bool,
        timeout: Option<f64>,
        name: Option<String>,
        producer_uid: Option<u32>,
        cuda_device: i32,
    ) -> PyResult<Self> {
        let timeout = secs(timeout)?;
        let mut opts = ConnectOptions {
            lossless,
            timeout: timeout.unwrap_or(Duration::MAX),
            producer_uid,
            ..Default::default()
        };
        if let Some(n) = name {
            opts.name = n;
        }
        let waker = Waker::new().map_err(to_py)?;
        let w = waker.clone();
        let sub = py
            .detach(move || CoreSubscriber::connect_with_waker(&path, &opts, &w))
            .map_err(to_py)?;
        let poll = nix::sys::epoll::Epoll::new(nix::sys::epoll::EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| Error::new_err(format!("epoll_create: {e}")))?;
        for fd in sub.poll_fds() {
            // SAFETY: the subscriber owns fd and lives as long as the epoll set.
            let bfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            poll.add(
                bfd,
                nix::sys::epoll::EpollEvent::new(nix::sys::epoll::EpollFlags::EPOLLIN, fd as u64),
            )
            .map_err(|e| Error::new_err(format!("epoll_ctl: {e}")))?;
        }
        Ok(Self {
            inner: Mutex::new(Some(sub)),
            waker,
            poll,
            timeout,
            cuda_device,
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
    /// `next_frame(timeout=0)`.
    fn fileno(&self) -> i32 {
        self.poll.0.as_fd().as_raw_fd()
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

    /// Disconnects. Frames still held stay valid until they are dropped.
    fn close(&self) {
        self.waker.wake();
        let old = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
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

/// A slot lent to a Python publisher, to fill in place.
struct WritableSlot {
    lease: Mutex<Option<PublishLease>>,
    ptr: usize,
}

/// Publishes frames to any number of gpushmsrc / Subscriber consumers at `path`.
///
/// `format` is "GRAY8", "I420", "NV12" or "RGBA". `publish(array)` copies a uint8 NumPy array
/// (the whole frame in GStreamer's layout, or just its visible bytes) into the next free slot;
/// `acquire()` lends a slot to fill in place (zero-copy) before `publish(slot)`.
#[pyclass(module = "gpushm", name = "Publisher", frozen)]
struct Publisher {
    inner: Mutex<Option<Arc<FramePublisher>>>,
    layout: FrameLayout,
    /// Tells this publisher's slots from another's.
    id: u64,
}

/// A free slot of a Publisher: fill its `planes` (writable NumPy views), drop them, then
/// `publisher.publish(slot)`. Publishing refuses while a view of the slot is alive, and a
/// published slot gives no more views: nothing writes into a frame consumers are reading.
#[pyclass(module = "gpushm", name = "Slot", frozen)]
struct Slot {
    slot: Arc<WritableSlot>,
    layout: FrameLayout,
    publisher: u64,
}

static PUBLISHERS: AtomicU64 = AtomicU64::new(0);

impl Publisher {
    /// The engine, taken out of the lock: waits never hold it (nor the GIL).
    fn engine(&self) -> PyResult<Arc<FramePublisher>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::new_err("the publisher is closed"))
    }

    fn acquire_lease(&self, py: Python<'_>, timeout: f64) -> PyResult<PublishLease> {
        let t = secs(Some(timeout))?.unwrap_or_default();
        let p = self.engine()?;
        py.detach(move || p.acquire(t)).map_err(to_py)
    }
}

#[pymethods]
impl Publisher {
    #[new]
    #[pyo3(signature = (path, format, width, height, fps=30.0, slots=8, perms=0o600))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        format: &str,
        width: u32,
        height: u32,
        fps: Option<f64>,
        slots: u32,
        perms: u32,
    ) -> PyResult<Self> {
        let f = VideoFormat::from_name(format).ok_or_else(|| {
            PyValueError::new_err(format!(
                "format {format:?} is not one of GRAY8, I420, NV12, RGBA"
            ))
        })?;
        let layout = FrameLayout::new(f, width, height).ok_or_else(|| {
            PyValueError::new_err(format!("{width}x{height} is not a usable frame size"))
        })?;
        let fps = fps.unwrap_or(30.0);
        if !(fps.is_finite() && fps > 0.0 && fps <= 10_000.0) {
            return Err(PyValueError::new_err(format!(
                "fps {fps} is not a frame rate"
            )));
        }
        if !(2..=gpushm::layout::MAX_SLOTS).contains(&slots) {
            return Err(PyValueError::new_err(format!(
                "slots must be 2 to {}, not {slots}",
                gpushm::layout::MAX_SLOTS
            )));
        }
        let rate = ((fps * 1000.0).round() as u32, 1000);
        let config = Config {
            perms,
            ..Default::default()
        };
        let l = layout.clone();
        let p = py
            .detach(move || FramePublisher::new(&path, l, rate, slots, config))
            .map_err(|e| match e {
                CoreError::Invalid(m) => PyValueError::new_err(m),
                e => to_py(e),
            })?;
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(p))),
            layout,
            id: PUBLISHERS.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// A free slot to fill in place (waits up to `timeout` s for consumers to give one back).
    #[pyo3(signature = (timeout=1.0))]
    fn acquire(&self, py: Python<'_>, timeout: f64) -> PyResult<Slot> {
        let mut lease = self.acquire_lease(py, timeout)?;
        let ptr = lease.bytes_mut().as_mut_ptr() as usize;
        Ok(Slot {
            slot: Arc::new(WritableSlot {
                lease: Mutex::new(Some(lease)),
                ptr,
            }),
            layout: self.layout.clone(),
            publisher: self.id,
        })
    }

    /// Publishes a frame: a filled `Slot` (whose views are gone), or a uint8 NumPy array
    /// (copied into a free slot). `capture_ns`: when it was captured (CLOCK_MONOTONIC ns,
    /// `time.monotonic_ns()`), default now.
    #[pyo3(signature = (frame, capture_ns=None, timeout=1.0))]
    fn publish(
        &self,
        py: Python<'_>,
        frame: &Bound<'_, PyAny>,
        capture_ns: Option<u64>,
        timeout: f64,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        let lease = if let Ok(slot) = frame.cast::<Slot>() {
            let slot = slot.get();
            if slot.publisher != self.id {
                return Err(PyValueError::new_err(
                    "this slot belongs to another Publisher",
                ));
            }
            if Arc::strong_count(&slot.slot) > 1 {
                return Err(Error::new_err(
                    "views of this slot are still alive: drop them (del) before publishing, so nothing writes into a published frame",
                ));
            }
            slot.slot
                .lease
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .ok_or_else(|| Error::new_err("this slot was already published"))?
        } else {
            let np = py.import("numpy")?;
            let arr = np.call_method1("asarray", (frame,))?;
            if !arr.getattr("dtype")?.eq(np.getattr("uint8")?)? {
                return Err(PyTypeError::new_err(format!(
                    "frames are uint8 arrays, not {}",
                    arr.getattr("dtype")?
                )));
            }
            let visible: usize = self
                .layout
                .planes
                .iter()
                .map(|p| p.rows as usize * p.row_bytes as usize)
                .sum();
            let n: usize = arr.getattr("nbytes")?.extract()?;
            if n != self.layout.size as usize && n != visible {
                return Err(PyValueError::new_err(format!(
                    "a {} {}x{} frame is {} bytes ({} visible), this array holds {n}",
                    self.layout.format.name(),
                    self.layout.width,
                    self.layout.height,
                    self.layout.size,
                    visible
                )));
            }
            // The slot first (waiting without the GIL), then the copy with the GIL held, so
            // that no other thread can resize or free the array meanwhile.
            let mut lease = self.acquire_lease(py, timeout)?;
            let arr = np.call_method1("ascontiguousarray", (arr,))?;
            let iface = arr.getattr("__array_interface__")?;
            let (addr, _ro): (usize, bool) = iface.get_item("data")?.extract()?;
            // SAFETY: `arr` is a contiguous uint8 array of n bytes at addr, alive and not
            // resizable by others while we hold the GIL.
            let src = unsafe { std::slice::from_raw_parts(addr as *const u8, n) };
            let dst = lease.bytes_mut();
            if n == self.layout.size as usize {
                dst[..n].copy_from_slice(src);
            } else {
                let mut at = 0;
                for p in &self.layout.planes {
                    for r in 0..p.rows as usize {
                        let o = p.offset as usize + r * p.stride as usize;
                        let w = p.row_bytes as usize;
                        dst[o..o + w].copy_from_slice(&src[at..at + w]);
                        at += w;
                    }
                }
            }
            lease
        };
        py.detach(move || engine.publish(lease, capture_ns))
            .map_err(to_py)
    }

    /// Consumers connected now.
    #[getter]
    fn num_clients(&self) -> PyResult<usize> {
        Ok(self.engine()?.num_clients())
    }

    /// Tells every consumer that no frame follows.
    fn send_eos(&self) -> PyResult<()> {
        self.engine()?.send_eos();
        Ok(())
    }

    /// Stops serving (consumers see the producer go away); the socket file is removed.
    fn close(&self) {
        let old = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
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

#[pymethods]
impl Slot {
    /// Each plane as a writable 2-D uint8 NumPy view into the slot (until it is published).
    #[getter]
    fn planes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        if self
            .slot
            .lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            return Err(Error::new_err(
                "this slot was published: it is no longer yours to write",
            ));
        }
        let views = self
            .layout
            .planes
            .iter()
            .map(|p| {
                asarray(
                    py,
                    View {
                        source: Source::Slot(self.slot.clone()),
                        shape: vec![p.rows as usize, p.row_bytes as usize],
                        strides: vec![p.stride as isize, 1],
                        offset: p.offset,
                    },
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, views)
    }
}

/// cuMemHostRegister calls made by this process (one per ring, never one per frame).
#[pyfunction]
fn cuda_registrations() -> u64 {
    cuda::registrations()
}

#[pymodule]
fn _gpushm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Subscriber>()?;
    m.add_class::<Frame>()?;
    m.add_class::<View>()?;
    m.add_class::<Publisher>()?;
    m.add_class::<Slot>()?;
    m.add_function(wrap_pyfunction!(cuda_registrations, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("ProducerLost", py.get_type::<ProducerLost>())?;
    m.add("EndOfStream", py.get_type::<EndOfStream>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    Ok(())
}
