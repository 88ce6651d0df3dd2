// SPDX-License-Identifier: MPL-2.0
//! `Frame`: one received frame, its metadata, and zero-copy views of it laid out from the
//! geometry its producer published (any raw video format, no table here).

use std::sync::{Arc, Mutex};

use gpushm::format::{FrameGeometry, Plane};
use gpushm::ring::frame::FrameMeta;
use gpushm::ring::layout::NONE_U64;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::dlpack;
use crate::errors::Error;
use crate::held::{FrameData, LeaseHolder};
use crate::view::{asarray, Elem, Source, View};

/// Shape, strides (bytes), byte offset and elements of one plane: rows × components of a row,
/// as whole elements when the plane's components are whole bytes and aligned, else as bytes.
fn plane_view(p: &Plane) -> (Vec<usize>, Vec<isize>, u64, Elem) {
    let c = p.components;
    let b = c.bytes as u64;
    if b > 1 && (p.stride as u64).is_multiple_of(b) && p.offset.is_multiple_of(b) {
        return (
            vec![p.rows as usize, (p.row_bytes as u64 / b) as usize],
            vec![p.stride as isize, b as isize],
            p.offset,
            Elem {
                bytes: c.bytes,
                big_endian: c.big_endian,
            },
        );
    }
    (
        vec![p.rows as usize, p.row_bytes as usize],
        vec![p.stride as isize, 1],
        p.offset,
        Elem::U8,
    )
}

/// One frame: metadata, and views into the ring that stay valid while the frame (or any view
/// of it) lives, whatever happens to the Subscriber it came from.
///
/// `release()` (or leaving a `with` block) gives up the frame's own hold: its attributes that
/// make views then raise, and the slot goes back to the producer as soon as the views already
/// made are gone too. A released frame's views never see a reused slot. The one exception is a
/// subscriber the producer cuts (it held more than its share of the ring for too long):
/// `valid` turns false, making views raises `FrameRevoked`, and views made before may show
/// newer frames. The rule, once for every binding: the gpushm crate's `subscriber` module docs,
/// "Held frames".
#[pyclass(module = "gpushm", name = "Frame", frozen)]
pub struct Frame {
    data: Mutex<Option<Arc<FrameData>>>,
    /// Set when the frame itself was handed out through `__cuda_array_interface__`: the array
    /// made from it references this Frame, not a view, so the lease stays until the Frame is
    /// garbage-collected, whatever release() says.
    pinned: Mutex<Option<Arc<FrameData>>>,
    /// Copied out, so they stay readable after release().
    meta: FrameMeta,
    seq: u64,
    caps: Arc<str>,
    /// The producer's geometry, or why the frame cannot be viewed plane by plane.
    geometry: Result<FrameGeometry, String>,
}

impl Frame {
    pub fn new(f: gpushm::subscriber::Frame, cuda_device: i32) -> Self {
        let geometry = f.layout();
        let on_device = f.is_on_device();
        // A device ring's frames are on the producer's GPU, whatever cuda_device says.
        let cuda_device = match f.device_ptr() {
            Some((_, d)) if on_device => d,
            _ => cuda_device,
        };
        let gpushm::subscriber::Frame {
            meta,
            seq,
            ptr,
            caps,
            lease,
            // The producer's GStreamer events: nothing a Python reader of frames acts on.
            events: _,
            metas: _,
        } = f;
        let data = Arc::new(FrameData {
            meta,
            ptr: ptr as usize,
            lease: LeaseHolder(lease),
            cuda_device,
            on_device,
        });
        Frame {
            data: Mutex::new(Some(data)),
            pinned: Mutex::new(None),
            meta,
            seq,
            caps,
            geometry,
        }
    }

    fn data(&self) -> PyResult<Arc<FrameData>> {
        let d = self
            .data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                Error::new_err("the frame was released: its memory may hold another frame now")
            })?;
        d.check()?;
        Ok(d)
    }

    fn geometry(&self) -> PyResult<&FrameGeometry> {
        self.geometry.as_ref().map_err(|e| {
            PyTypeError::new_err(format!(
                "this frame cannot be viewed plane by plane ({e}); numpy() and bytes(frame) give its bytes"
            ))
        })
    }

    fn view(
        &self,
        (shape, strides, offset, elem): (Vec<usize>, Vec<isize>, u64, Elem),
    ) -> PyResult<View> {
        Ok(View {
            source: Source::Frame(self.data()?),
            shape,
            strides,
            offset,
            elem,
        })
    }

    /// The whole frame as one array: height × width × components for a frame of one plane
    /// of whole components (height × width with one component), else its bytes.
    fn frame_view(&self) -> PyResult<View> {
        // Elements must be aligned (a producer may place a plane anywhere): else its bytes.
        let aligned = |p: &Plane| {
            let b = p.components.bytes as u64;
            (p.stride as u64).is_multiple_of(b) && p.offset.is_multiple_of(b)
        };
        match self
            .geometry
            .as_ref()
            .ok()
            .and_then(|g| g.packed().filter(aligned).map(|p| (g, p)))
        {
            Some((g, p)) => {
                let c = p.components;
                let (h, w) = (g.height as usize, g.width as usize);
                let elem = Elem {
                    bytes: c.bytes,
                    big_endian: c.big_endian,
                };
                let (b, px) = (c.bytes as isize, c.pixel_bytes() as isize);
                self.view(if c.per_pixel == 1 {
                    (vec![h, w], vec![p.stride as isize, b], p.offset, elem)
                } else {
                    (
                        vec![h, w, c.per_pixel as usize],
                        vec![p.stride as isize, px, b],
                        p.offset,
                        elem,
                    )
                })
            }
            None => self.view((vec![self.meta.payload_size as usize], vec![1], 0, Elem::U8)),
        }
    }

    /// The whole frame for CUDA libraries: only frames of one plane.
    fn packed_view(&self) -> PyResult<View> {
        let g = self.geometry()?;
        if g.packed().is_none() {
            return Err(PyTypeError::new_err(format!(
                "{} frames have {} planes: use frame.cuda_planes() for one array per plane",
                g.format,
                g.planes.len()
            )));
        }
        self.frame_view()
    }
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

    /// Decoding timestamp in ns, or None.
    #[getter]
    fn dts(&self) -> Option<u64> {
        opt_ns(self.meta.dts)
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

    /// The format's name in the caps ("BGRx", "NV12", "GRAY16_LE"), None for streams that
    /// are not raw video.
    #[getter]
    fn format(&self) -> Option<String> {
        match &self.geometry {
            Ok(g) => Some(g.format.clone()),
            Err(_) => gpushm::format::caps_field(&self.caps, "format")
                .filter(|_| self.caps.starts_with("video/x-raw"))
                .map(str::to_string),
        }
    }

    #[getter]
    fn width(&self) -> u32 {
        self.meta.width
    }

    #[getter]
    fn height(&self) -> u32 {
        self.meta.height
    }

    /// The producer's caps (a GStreamer caps string).
    #[getter]
    fn caps(&self) -> &str {
        &self.caps
    }

    /// False once the frame was released, or the producer cut the subscriber and took the
    /// frame back (views made before may then show newer frames).
    #[getter]
    fn valid(&self) -> bool {
        let d = self.data.lock().unwrap_or_else(|e| e.into_inner()).clone();
        d.is_some_and(|d| d.lease.0.is_valid())
    }

    /// Bytes of the payload.
    fn __len__(&self) -> usize {
        self.meta.payload_size as usize
    }

    /// Each plane as a read-only 2-D NumPy view (rows × components of a row, with the
    /// producer's stride): uint8 for 8-bit formats (an NV12 UV plane is rows × 2·(width/2)),
    /// uint16 for 16-bit and 10/12-bit ones (P010, I420_10LE), bytes for packings that are not
    /// whole bytes. Zero-copy: the views point into the ring and keep the frame.
    #[getter]
    fn planes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let views = self
            .geometry()?
            .planes
            .iter()
            .map(|p| asarray(py, self.view(plane_view(p))?))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, views)
    }

    /// The whole frame as a read-only NumPy view. Frames of one plane of whole components:
    /// height × width × components (BGRx, RGBA: ×4; RGB, BGR: ×3; YUY2, UYVY: ×2, uint8),
    /// height × width for one component (GRAY8 uint8, GRAY16_LE uint16). Planar formats (I420,
    /// NV12, P010) and anything else: the payload's bytes, 1-D (use `planes`).
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        asarray(py, self.frame_view()?)
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

    /// Whether the frame is in GPU memory (a producer's device ring, for a subscriber made
    /// with `device_memory=True`): read it with `torch.from_dlpack(frame)` or CuPy, on
    /// `cuda_device`; `bytes(frame)` copies it to the host; `numpy()` refuses.
    #[getter]
    fn on_device(&self) -> PyResult<bool> {
        Ok(self.data()?.on_device)
    }

    /// The CUDA device the frame's CUDA views are on.
    #[getter]
    fn cuda_device(&self) -> PyResult<i32> {
        Ok(self.data()?.cuda_device)
    }

    /// The payload as gpushmsrc's buffer holds it (a copy; from the GPU for a frame
    /// `on_device`).
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.data()?;
        if data.on_device {
            let d = data.clone();
            let v = py
                .detach(move || crate::cuda::copy_to_host(&d))
                .map_err(Error::new_err)?;
            return Ok(PyBytes::new(py, &v));
        }
        // SAFETY: the lease keeps payload_size bytes at ptr mapped (checked against the slot
        // when the frame was read).
        let bytes = unsafe {
            std::slice::from_raw_parts(data.ptr as *const u8, data.meta.payload_size as usize)
        };
        Ok(PyBytes::new(py, bytes))
    }

    /// Views for CUDA libraries, one per plane (`torch.from_dlpack(v)`, `cupy.asarray(v)`),
    /// with the shapes and element types of `planes`.
    fn cuda_planes(&self) -> PyResult<Vec<View>> {
        self.geometry()?
            .planes
            .iter()
            .map(|p| self.view(plane_view(p)))
            .collect()
    }

    /// CUDA array interface of the whole frame (frames of one plane; planar ones:
    /// `cuda_planes()`). The array made from it references this frame: its slot then stays
    /// until the frame is garbage-collected, even after `release()`.
    #[getter]
    fn __cuda_array_interface__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let view = self.packed_view()?;
        let d = Bound::new(py, view)?
            .getattr("__cuda_array_interface__")?
            .cast_into()?;
        if let Some(f) = self.data.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            *self.pinned.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
        }
        Ok(d)
    }

    /// DLPack export of the whole frame (frames of one plane): see `FrameView.__dlpack__`.
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
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("stream", stream)?;
        kwargs.set_item("max_version", max_version)?;
        kwargs.set_item("dl_device", dl_device)?;
        kwargs.set_item("copy", copy)?;
        v.call_method("__dlpack__", (), Some(&kwargs))
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
            self.format().unwrap_or_else(|| "bytes".into()),
            self.meta.width,
            self.meta.height,
            self.meta.offset,
            opt_ns(self.meta.pts).map_or("None".into(), |p| p.to_string())
        )
    }
}
