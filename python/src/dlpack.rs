// SPDX-License-Identifier: MPL-2.0
//! DLPack export of read-only frames: the "dltensor" capsule of DLPack 0.x for every caller,
//! and the versioned "dltensor_versioned" capsule of DLPack 1.x (with its read-only flag) for
//! callers that ask with `max_version=(1, …)`. Memory on CUDA (a registered ring) or on the
//! CPU (the ring itself).

use std::ffi::{c_char, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

pub const KDL_CPU: i32 = 1;
pub const KDL_CUDA: i32 = 2;
const KDL_UINT: u8 = 1;
const NAME: &[u8] = b"dltensor\0";
const NAME_VERSIONED: &[u8] = b"dltensor_versioned\0";
/// DLPACK_FLAG_BITMASK_READ_ONLY.
const FLAG_READ_ONLY: u64 = 1;

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

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What the tensor owns: its shape and strides, and the Python object that keeps the frame.
struct Ctx {
    shape: Vec<i64>,
    strides: Vec<i64>,
    owner: Option<Py<PyAny>>,
}

impl Drop for Ctx {
    /// Deleters run wherever the consumer frees the tensor: with the GIL, without it, or after
    /// the interpreter finalized (a torch tensor alive at exit). The owner is released through
    /// Python only while Python is there to take it; otherwise it is leaked (the process is
    /// ending, and the frame's slot goes with it). Never a panic.
    fn drop(&mut self) {
        let mut owner = self.owner.take();
        if !finalizing() {
            let _ = Python::try_attach(|_| drop(owner.take()));
        }
        // Not taken: Python cannot be attached to. Leaked, touching nothing.
        std::mem::forget(owner);
    }
}

/// Whether the interpreter is shutting down: `Py_IsFinalizing` (3.13) or `_Py_IsFinalizing`
/// (3.7 to 3.12), looked up at run time because the stable ABI has neither. pyo3's
/// `try_attach` checks this itself only when built for 3.13. Best effort, as CPython offers
/// nothing better: a deleter on another thread can still race the start of finalization, and
/// where libpython was loaded RTLD_LOCAL neither symbol is found (then only `try_attach`'s own
/// checks apply).
fn finalizing() -> bool {
    type IsFinalizing = unsafe extern "C" fn() -> std::ffi::c_int;
    static F: std::sync::OnceLock<Option<IsFinalizing>> = std::sync::OnceLock::new();
    let f = F.get_or_init(|| {
        [c"Py_IsFinalizing", c"_Py_IsFinalizing"]
            .into_iter()
            .find_map(|name| {
                // SAFETY: dlsym with a NUL-terminated name; the symbol, when found, is
                // CPython's function of this signature.
                let p = unsafe { nix::libc::dlsym(nix::libc::RTLD_DEFAULT, name.as_ptr()) };
                (!p.is_null())
                    .then(|| unsafe { std::mem::transmute::<*mut c_void, IsFinalizing>(p) })
            })
    });
    // SAFETY: CPython's own function, callable at any time.
    f.is_some_and(|f| unsafe { f() } != 0)
}

/// Frees what `capsule()` allocated; catches any panic (this runs from C).
fn free(ctx: *mut c_void, tensor: Box<dyn std::any::Any>) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        drop(tensor);
        if !ctx.is_null() {
            // SAFETY: made by capsule() with Box::into_raw, freed once (by the deleter).
            drop(unsafe { Box::from_raw(ctx as *mut Ctx) });
        }
    }));
}

unsafe extern "C" fn deleter(t: *mut DLManagedTensor) {
    if t.is_null() {
        return;
    }
    // SAFETY: made by capsule() with Box::into_raw, deleted once (by the consumer, or by the
    // capsule's destructor when nobody consumed it).
    let t = unsafe { Box::from_raw(t) };
    free(t.manager_ctx, t);
}

unsafe extern "C" fn deleter_versioned(t: *mut DLManagedTensorVersioned) {
    if t.is_null() {
        return;
    }
    // SAFETY: as deleter().
    let t = unsafe { Box::from_raw(t) };
    free(t.manager_ctx, t);
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

unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as capsule_destructor(); a consumer renames it "used_dltensor_versioned".
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME_VERSIONED.as_ptr() as *const c_char) == 1 {
            let t = ffi::PyCapsule_GetPointer(capsule, NAME_VERSIONED.as_ptr() as *const c_char)
                as *mut DLManagedTensorVersioned;
            deleter_versioned(t);
        }
    }
}

/// A managed tensor made for a capsule: its pointer, the capsule's name and destructor, and
/// how to free it should the capsule not be made.
type Made = (
    *mut c_void,
    &'static [u8],
    Option<ffi::PyCapsule_Destructor>,
    unsafe fn(*mut c_void),
);

/// Where and what the tensor is.
pub struct Tensor<'a> {
    pub ptr: u64,
    /// (kDLCPU or kDLCUDA, device id).
    pub device: (i32, i32),
    pub shape: &'a [usize],
    /// In elements.
    pub strides: &'a [isize],
    /// Bits of one unsigned element.
    pub bits: u8,
}

/// A read-only DLPack capsule over `t`, keeping `owner` alive until the consumer deletes it:
/// versioned (DLPack 1.0, read-only flag set) when `versioned`, else the 0.x "dltensor".
pub fn capsule<'py>(
    py: Python<'py>,
    t: Tensor<'_>,
    owner: Py<PyAny>,
    versioned: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let mut ctx = Box::new(Ctx {
        shape: t.shape.iter().map(|&v| v as i64).collect(),
        strides: t.strides.iter().map(|&v| v as i64).collect(),
        owner: Some(owner),
    });
    let dl_tensor = DLTensor {
        data: t.ptr as *mut c_void,
        device: DLDevice {
            device_type: t.device.0,
            device_id: t.device.1,
        },
        ndim: ctx.shape.len() as i32,
        dtype: DLDataType {
            code: KDL_UINT,
            bits: t.bits,
            lanes: 1,
        },
        // The Vecs' buffers do not move when the Box moves.
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx.strides.as_mut_ptr(),
        byte_offset: 0,
    };
    let ctx = Box::into_raw(ctx) as *mut c_void;
    // SAFETY: the pointers are fresh Box allocations handed to the capsule, which frees them
    // through the deleters exactly once; a failed PyCapsule_New frees them here.
    unsafe {
        let (ptr, name, destructor, free_now): Made = if versioned {
            let m = Box::into_raw(Box::new(DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: ctx,
                deleter: Some(deleter_versioned),
                flags: FLAG_READ_ONLY,
                dl_tensor,
            }));
            (
                m as *mut c_void,
                NAME_VERSIONED,
                Some(capsule_destructor_versioned),
                |p| deleter_versioned(p as *mut DLManagedTensorVersioned),
            )
        } else {
            let m = Box::into_raw(Box::new(DLManagedTensor {
                dl_tensor,
                manager_ctx: ctx,
                deleter: Some(deleter),
            }));
            (m as *mut c_void, NAME, Some(capsule_destructor), |p| {
                deleter(p as *mut DLManagedTensor)
            })
        };
        let cap = ffi::PyCapsule_New(ptr, name.as_ptr() as *const c_char, destructor);
        if cap.is_null() {
            free_now(ptr);
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, cap))
    }
}
