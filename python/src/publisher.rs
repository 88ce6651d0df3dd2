// SPDX-License-Identifier: MPL-2.0
//! `Publisher` and its `Slot`s: frames from Python to any number of consumers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gpushm::format::{FrameLayout, VideoFormat};
use gpushm::publisher::{Config, Publisher as CorePublisher, Slot as CoreSlot};
use gpushm::Error as CoreError;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::{secs, to_py, Error};
use crate::held::WritableSlot;
use crate::view::{asarray, Elem, Source, View};

/// Publishes frames to any number of gpushmsrc / Subscriber consumers at `path`, or as
/// stream name `stream` (consumers then give the same name; the socket is made in
/// $GPUSHM_RUNTIME_DIR if set, else in this user's directory, $XDG_RUNTIME_DIR/gpushm or
/// /tmp/gpushm-UID). Give one of them.
///
/// `format` is "GRAY8", "I420", "NV12" or "RGBA". `publish(array)` copies a uint8 NumPy array
/// (the whole frame in GStreamer's layout, or just its visible bytes) into the next free slot;
/// `acquire()` lends a slot to fill in place (zero-copy) before `publish(slot)`.
///
/// `spin_us` (0, the default: off) is the low-latency mode of `publish()`'s wait for a
/// lossless consumer that holds its whole budget: poll its releases for up to that many µs
/// before sleeping, at most once a frame (at most 100000). Pays off for small frames sent
/// flat out.
///
/// `wake_ahead_us` (0, the default: off; at most 1000) wakes the consumers that sleep waiting
/// for a frame that many µs before each frame is due, as learnt from the intervals between
/// the last frames published, from a thread of the publisher: woken from a sleep of a few ms
/// (tens of µs on a core that idled), they are up and polling (at most 100 µs, once per
/// frame) when the frame lands. For streams of at most 500 fps, never for a frame already
/// half an interval late (a stream that stops costs one wake-up), once per frame, by the rules of
/// `wake_early`.
#[pyclass(module = "gpushm", name = "Publisher", frozen)]
pub struct Publisher {
    inner: Mutex<Option<Arc<CorePublisher>>>,
    layout: FrameLayout,
    /// Tells this publisher's slots from another's.
    id: u64,
}

/// A free slot of a Publisher: fill its `planes` (writable NumPy views), drop them, then
/// `publisher.publish(slot)`. Publishing refuses while a view of the slot is alive, and a
/// published slot gives no more views: nothing writes into a frame consumers are reading.
#[pyclass(module = "gpushm", name = "Slot", frozen)]
pub struct Slot {
    slot: Arc<WritableSlot>,
    layout: FrameLayout,
    publisher: u64,
}

static PUBLISHERS: AtomicU64 = AtomicU64::new(0);

impl Publisher {
    /// For a publisher in GPU memory and a CUDA tensor (`__cuda_array_interface__`: PyTorch,
    /// CuPy, Numba): a slot filled from it with one device-to-device copy. `None` for
    /// anything else (a host array).
    fn device_lease(
        &self,
        py: Python<'_>,
        frame: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<Option<CoreSlot>> {
        if !self.core()?.is_on_device() {
            return Ok(None);
        }
        let Ok(iface) = frame.getattr("__cuda_array_interface__") else {
            return Ok(None);
        };
        let (ptr, _ro): (u64, bool) = iface.get_item("data")?.extract()?;
        let typestr: String = iface.get_item("typestr")?.extract()?;
        if typestr != "|u1" {
            return Err(PyTypeError::new_err(format!(
                "frames are uint8 tensors, not {typestr}"
            )));
        }
        let shape: Vec<usize> = iface.get_item("shape")?.extract()?;
        let n: usize = shape.iter().product();
        let strides: Option<Vec<isize>> = iface
            .get_item("strides")
            .ok()
            .filter(|s| !s.is_none())
            .map(|s| s.extract())
            .transpose()?;
        // C-contiguous: strides absent, or each the product of the sizes after it.
        if let Some(st) = strides {
            let mut want = 1isize;
            for (i, &d) in shape.iter().enumerate().rev() {
                if d > 1 && st.get(i) != Some(&want) {
                    return Err(PyValueError::new_err(
                        "the tensor is not contiguous: call .contiguous() first",
                    ));
                }
                want *= d as isize;
            }
        }
        if n != self.layout.size as usize {
            return Err(PyValueError::new_err(format!(
                "frames for GPU memory are whole frames of {} bytes (padding included), this tensor holds {n}",
                self.layout.size
            )));
        }
        let mut lease = self.acquire_lease(py, timeout)?;
        // The tensor stays alive: the caller holds it (and we hold the GIL through the copy).
        lease.fill_from_device(ptr, n).map_err(to_py)?;
        Ok(Some(lease))
    }

    /// The core publisher, taken out of the lock: waits never hold it (nor the GIL).
    fn core(&self) -> PyResult<Arc<CorePublisher>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::new_err("the publisher is closed"))
    }

    fn acquire_lease(&self, py: Python<'_>, timeout: f64) -> PyResult<CoreSlot> {
        let t = secs(Some(timeout))?.unwrap_or_default();
        let p = self.core()?;
        py.detach(move || p.acquire(t)).map_err(to_py)
    }
}

#[pymethods]
impl Publisher {
    #[new]
    #[pyo3(signature = (path=None, format=None, width=None, height=None, fps=30.0, slots=8, perms=0o600, cuda_device=None, stream=None, spin_us=0, wake_ahead_us=0))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        format: Option<&str>,
        width: Option<u32>,
        height: Option<u32>,
        fps: Option<f64>,
        slots: u32,
        perms: u32,
        cuda_device: Option<i32>,
        stream: Option<String>,
        spin_us: u32,
        wake_ahead_us: u32,
    ) -> PyResult<Self> {
        let spin = crate::errors::spin(spin_us)?;
        let wake_ahead = std::time::Duration::from_micros(wake_ahead_us.into());
        gpushm::policy::check_wake_ahead(wake_ahead)
            .map_err(|e| PyValueError::new_err(format!("wake_ahead_us={wake_ahead_us}: {e}")))?;
        let path = match crate::errors::endpoint(path, stream)? {
            gpushm::names::Endpoint::Path(p) => p,
            gpushm::names::Endpoint::Stream(n) => {
                gpushm::names::producer_path(&n).map_err(|e| match e {
                    CoreError::Invalid(m) => PyValueError::new_err(m),
                    e => to_py(e),
                })?
            }
        };
        let (Some(format), Some(width), Some(height)) = (format, width, height) else {
            return Err(PyTypeError::new_err(
                "Publisher() needs format, width and height",
            ));
        };
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
        if !(2..=gpushm::ring::layout::MAX_SLOTS).contains(&slots) {
            return Err(PyValueError::new_err(format!(
                "slots must be 2 to {}, not {slots}",
                gpushm::ring::layout::MAX_SLOTS
            )));
        }
        let rate = ((fps * 1000.0).round() as u32, 1000);
        let config = Config {
            perms,
            ..Default::default()
        };
        let l = layout.clone();
        let p = py
            .detach(move || match cuda_device {
                None => CorePublisher::new(&path, l, rate, slots, config),
                Some(d) => gpushm::cuda::device(d)
                    .map_err(|e| CoreError::Invalid(format!("cuda_device={d}: {e}")))
                    .and_then(|dev| {
                        CorePublisher::new_on_device(&path, l, rate, slots, config, dev)
                    }),
            })
            .map_err(|e| match e {
                CoreError::Invalid(m) => PyValueError::new_err(m),
                e => to_py(e),
            })?;
        p.set_spin(spin).map_err(to_py)?;
        p.set_wake_ahead(wake_ahead).map_err(to_py)?;
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
        if lease.is_on_device() {
            return Err(PyTypeError::new_err(
                "this publisher's slots are in GPU memory: publish(tensor) copies a CUDA tensor (or a NumPy array) into one",
            ));
        }
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
        let core = self.core()?;
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
        } else if let Some(lease) = self.device_lease(py, frame, timeout)? {
            lease
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
            if lease.is_on_device() {
                if n != self.layout.size as usize {
                    return Err(PyValueError::new_err(format!(
                        "frames for GPU memory are whole frames of {} bytes (padding included), this array holds {n}",
                        self.layout.size
                    )));
                }
                lease.fill_from_host(src).map_err(to_py)?;
                return py
                    .detach(move || core.publish(lease, capture_ns))
                    .map_err(to_py);
            }
            let dst = lease.bytes_mut();
            if n == self.layout.size as usize {
                gpushm::frame_copy::copy_frame(&mut dst[..n], src);
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
        py.detach(move || core.publish(lease, capture_ns))
            .map_err(to_py)
    }

    /// Whether frames go into GPU memory (made with `cuda_device=`).
    #[getter]
    fn on_device(&self) -> PyResult<bool> {
        Ok(self.core()?.is_on_device())
    }

    /// Consumers connected and taking frames now (closed ones still holding frames are not counted).
    #[getter]
    fn num_clients(&self) -> PyResult<usize> {
        Ok(self.core()?.num_clients())
    }

    /// The low-latency mode's figures (`spin_us`): `(caught, missed)`, waits for a lossless
    /// consumer that polling ended and that ended asleep all the same; (0, 0) when it is off.
    #[getter]
    fn spin_stats(&self) -> PyResult<(u64, u64)> {
        let st = self.core()?.stats().0;
        Ok((st.spin_caught, st.spin_missed))
    }

    /// Wakes the consumers that sleep waiting for a frame (gpushmsrc, Python, C and Rust
    /// subscribers),
    /// ahead of the next frame: call it a few µs before `publish` (as the frame's last step
    /// starts), so that their wake-up (tens of µs on a core that idled) runs meanwhile. Once
    /// per frame; it wakes nobody less than 0.5 ms after the last frame, nor a consumer that
    /// went to sleep on this thread's CPU, nor one polled by an event loop (a Python
    /// `Subscriber` once its `fileno()` was called). A consumer woken before the frame is
    /// published waits for it as usual.
    fn wake_early(&self) -> PyResult<()> {
        self.core()?.wake_early();
        Ok(())
    }

    /// Consumers woken ahead of a frame by `wake_early` (and `wake_ahead_us`), one per
    /// consumer and frame.
    #[getter]
    fn woken_early(&self) -> PyResult<u64> {
        Ok(self.core()?.stats().0.woken_early)
    }

    /// Consumers woken before a frame was due (`wake_ahead_us`), one per consumer and frame.
    #[getter]
    fn woken_ahead(&self) -> PyResult<u64> {
        Ok(self.core()?.stats().0.woken_ahead)
    }

    /// Tells every consumer that no frame follows.
    fn send_eos(&self) -> PyResult<()> {
        self.core()?.send_eos();
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
                        elem: Elem::U8,
                    },
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, views)
    }
}
