// SPDX-License-Identifier: MPL-2.0
//! DLPack export (the "dltensor" capsule of DLPack 0.x, which PyTorch, CuPy and JAX read):
//! read-only uint8 CUDA memory that aliases a registered ring.

use std::ffi::{c_char, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

pub const KDL_CUDA: i32 = 2;
const KDL_UINT: u8 = 1;
const NAME: &[u8] = b"dltensor\0";

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What the tensor owns: its shape and strides, and the Python object that keeps the frame.
struct Ctx {
    shape: Vec<i64>,
    strides: Vec<i64>,
    /// Dropped with the tensor.
    _owner: Py<PyAny>,
}

unsafe extern "C" fn deleter(t: *mut DLManagedTensor) {
    if t.is_null() {
        return;
    }
    // SAFETY: made by capsule() with Box::into_raw, deleted once (by the consumer, or by the
    // capsule's destructor when nobody consumed it).
    let t = unsafe { Box::from_raw(t) };
    // SAFETY: as above.
    let ctx = unsafe { Box::from_raw(t.manager_ctx as *mut Ctx) };
    Python::attach(move |_| drop(ctx));
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; a consumer renames it "used_dltensor".
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr() as *const c_char) == 1 {
            let t = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr() as *const c_char)
                as *mut DLManagedTensor;
            deleter(t);
        }
    }
}

/// A "dltensor" capsule over `shape`/`strides` (in bytes = elements) at `dev_ptr` on CUDA
/// device `device`, keeping `owner` alive until the consumer deletes it.
pub fn capsule<'py>(
    py: Python<'py>,
    dev_ptr: u64,
    device: i32,
    shape: &[usize],
    strides: &[isize],
    owner: Py<PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut ctx = Box::new(Ctx {
        shape: shape.iter().map(|&v| v as i64).collect(),
        strides: strides.iter().map(|&v| v as i64).collect(),
        _owner: owner,
    });
    let t = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: dev_ptr as *mut c_void,
            device: DLDevice {
                device_type: KDL_CUDA,
                device_id: device,
            },
            ndim: ctx.shape.len() as i32,
            dtype: DLDataType {
                code: KDL_UINT,
                bits: 8,
                lanes: 1,
            },
            shape: ctx.shape.as_mut_ptr(),
            strides: ctx.strides.as_mut_ptr(),
            byte_offset: 0,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(deleter),
    });
    let t = Box::into_raw(t);
    // SAFETY: t was just made; the Vecs' buffers do not move when the Box moves.
    unsafe { (*t).manager_ctx = Box::into_raw(ctx) as *mut c_void };
    // SAFETY: a valid pointer and a static NUL-terminated name.
    let cap = unsafe {
        ffi::PyCapsule_New(
            t as *mut c_void,
            NAME.as_ptr() as *const c_char,
            Some(capsule_destructor),
        )
    };
    if cap.is_null() {
        // SAFETY: not handed out: delete it here.
        unsafe { deleter(t) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) })
}
