// SPDX-License-Identifier: MPL-2.0
//! `FrameView`: (part of) a frame or of a publisher's slot, for array libraries. NumPy reads
//! it through `__array_interface__`, CuPy and PyTorch through `__cuda_array_interface__` and
//! DLPack; each view keeps the frame's slot (see "Held frames" in the gpushm crate's `subscriber`
//! module) until it is garbage-collected.

use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::dlpack;
use crate::errors::Error;
use crate::held::{FrameData, WritableSlot};

/// What a view keeps alive.
pub enum Source {
    /// A received frame: read-only.
    Frame(Arc<FrameData>),
    /// A publisher's slot being filled: writable.
    Slot(Arc<WritableSlot>),
}

/// The elements of a view: unsigned integers of `bytes` bytes.
#[derive(Clone, Copy)]
pub struct Elem {
    pub bytes: u8,
    pub big_endian: bool,
}

impl Elem {
    pub const U8: Elem = Elem {
        bytes: 1,
        big_endian: false,
    };

    /// NumPy's type string: `|u1`, `<u2`, `>u2`, `<u4`.
    pub fn typestr(self) -> String {
        let order = match (self.bytes, self.big_endian) {
            (1, _) => '|',
            (_, true) => '>',
            _ => '<',
        };
        format!("{order}u{}", self.bytes)
    }
}

/// A view of (part of) a frame for array libraries: `numpy.asarray(view)` and CuPy/PyTorch
/// read it in place. It keeps the frame's slot until it is garbage-collected.
#[pyclass(module = "gpushm", name = "FrameView", frozen)]
pub struct View {
    pub source: Source,
    pub shape: Vec<usize>,
    /// In bytes.
    pub strides: Vec<isize>,
    pub offset: u64,
    pub elem: Elem,
}

#[pymethods]
impl View {
    /// The NumPy array interface (version 3): read-only for frames, zero-copy.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (base, read_only) = match &self.source {
            Source::Slot(w) => (w.ptr, false),
            Source::Frame(f) => {
                f.check()?;
                if f.on_device {
                    return Err(PyBufferError::new_err(format!(
                        "this frame is in GPU memory (CUDA device {}): NumPy cannot view it; use torch.from_dlpack(frame) or cupy.from_dlpack(frame), or bytes(frame) for a host copy",
                        f.cuda_device
                    )));
                }
                (f.ptr, true)
            }
        };
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("strides", PyTuple::new(py, &self.strides)?)?;
        d.set_item("typestr", self.elem.typestr())?;
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
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("strides", PyTuple::new(py, &self.strides)?)?;
        d.set_item("typestr", self.elem.typestr())?;
        d.set_item("data", (dev_ptr, true))?;
        // Host memory registered with CUDA: nothing to synchronise with.
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// DLPack export, read-only and without copies: on the CUDA device by default
    /// (`torch.from_dlpack(view)`, `cupy.from_dlpack(view)`), on the CPU when the caller asks
    /// with `dl_device=(1, 0)` (`numpy.from_dlpack(view, device="cpu")`). A DLPack 1.x capsule
    /// (read-only flag set) when `max_version` allows, else the 0.x one.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Written (host memory, or a device ring's GPU memory with a synchronous copy) before
        // the frame was published: there is nothing to order on the consumer's stream.
        let _ = stream;
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "gpushm frames are exported without copies (copy=True is not supported)",
            ));
        }
        let py = slf.py();
        let this = slf.get();
        let frame = this.frame()?;
        frame.check()?;
        if this.elem.big_endian {
            return Err(PyBufferError::new_err(
                "DLPack has no byte order for big-endian frames: use numpy() (it says the order)",
            ));
        }
        let bytes = this.elem.bytes as isize;
        if this.strides.iter().any(|s| s % bytes != 0) {
            return Err(PyBufferError::new_err(
                "this view's strides are not whole elements, which DLPack needs: use numpy()",
            ));
        }
        let strides: Vec<isize> = this.strides.iter().map(|s| s / bytes).collect();
        if !(frame.ptr as u64 + this.offset).is_multiple_of(bytes as u64) {
            return Err(PyBufferError::new_err(
                "this view's first element is not aligned, which DLPack needs: use numpy()",
            ));
        }
        let (ptr, device) = match dl_device {
            Some((dlpack::KDL_CPU, _)) if frame.on_device => {
                return Err(PyBufferError::new_err(format!(
                    "this frame is in GPU memory (CUDA device {}); the CPU would need a copy: bytes(frame)",
                    frame.cuda_device
                )))
            }
            Some((dlpack::KDL_CPU, _)) => (
                (frame.ptr + this.offset as usize) as u64,
                (dlpack::KDL_CPU, 0),
            ),
            Some((dlpack::KDL_CUDA, d)) if d == frame.cuda_device => {
                let (p, d) = this.device_ptr(py)?;
                (p, (dlpack::KDL_CUDA, d))
            }
            None => {
                let (p, d) = this.device_ptr(py)?;
                (p, (dlpack::KDL_CUDA, d))
            }
            Some(want) => {
                return Err(PyBufferError::new_err(format!(
                    "gpushm frames are in host memory, seen by CUDA device {}; dl_device {want:?} would need a copy",
                    frame.cuda_device
                )))
            }
        };
        dlpack::capsule(
            py,
            dlpack::Tensor {
                ptr,
                device,
                shape: &this.shape,
                strides: &strides,
                bits: this.elem.bytes * 8,
            },
            slf.clone().into_any().unbind(),
            max_version.is_some_and(|v| v.0 >= 1),
        )
    }

    /// `(kDLCUDA, device)`: DLPack consumers that do not ask get CUDA memory.
    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        Ok((dlpack::KDL_CUDA, self.frame()?.cuda_device))
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
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
        data.check()?;
        let (base, device) = py
            .detach(move || crate::cuda::device_ptr(&data))
            .map_err(Error::new_err)?;
        Ok((base + self.offset, device))
    }
}

/// `numpy.asarray(view)`: an array whose base is the view.
pub fn asarray<'py>(py: Python<'py>, view: View) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    np.call_method1("asarray", (Bound::new(py, view)?,))
}
