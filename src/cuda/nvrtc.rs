// SPDX-License-Identifier: MPL-2.0
//! NVRTC, loaded at run time from whichever CUDA toolkit is installed: libnvrtc.so,
//! libnvrtc.so.13 (JetPack 7, CUDA 13), .12 (JetPack 6) or .11. cudarc's loader looks for
//! .12 and older only, so the few calls needed are bound here with libloading.

use std::ffi::{c_char, c_int, CStr, CString};

use libloading::Library;
use once_cell::sync::OnceCell;

use super::{CudaError, Result};

/// The names tried, in order.
pub const LIBRARY_NAMES: [&str; 4] = [
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11",
];

type Program = *mut std::ffi::c_void;
type Status = c_int;

struct Nvrtc {
    /// Keeps the symbols below loaded.
    _lib: Library,
    name: &'static str,
    f: Fns,
}

struct Fns {
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// # Safety
/// `lib` must be an NVRTC library (the symbols have these C signatures since CUDA 11.1).
unsafe fn bind(lib: &Library) -> std::result::Result<Fns, libloading::Error> {
    // SAFETY: the caller's contract.
    unsafe {
        Ok(Fns {
            create: *lib.get(b"nvrtcCreateProgram\0")?,
            compile: *lib.get(b"nvrtcCompileProgram\0")?,
            log_size: *lib.get(b"nvrtcGetProgramLogSize\0")?,
            log: *lib.get(b"nvrtcGetProgramLog\0")?,
            cubin_size: *lib.get(b"nvrtcGetCUBINSize\0")?,
            cubin: *lib.get(b"nvrtcGetCUBIN\0")?,
            ptx_size: *lib.get(b"nvrtcGetPTXSize\0")?,
            ptx: *lib.get(b"nvrtcGetPTX\0")?,
            destroy: *lib.get(b"nvrtcDestroyProgram\0")?,
            error_string: *lib.get(b"nvrtcGetErrorString\0")?,
        })
    }
}

// SAFETY: NVRTC's API is thread-safe; only function pointers are stored.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

fn open() -> std::result::Result<Nvrtc, String> {
    let mut tried = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: loading NVRTC runs no initialisers with preconditions.
        let lib = match unsafe { Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{name} ({e})"));
                continue;
            }
        };
        // SAFETY: a library of that name is NVRTC.
        match unsafe { bind(&lib) } {
            Ok(f) => return Ok(Nvrtc { _lib: lib, name, f }),
            Err(e) => tried.push(format!("{name} (lacks a symbol: {e})")),
        }
    }
    Err(tried.join(", "))
}

fn nvrtc() -> Result<&'static Nvrtc> {
    static LIB: OnceCell<std::result::Result<Nvrtc, String>> = OnceCell::new();
    LIB.get_or_init(open).as_ref().map_err(|tried| {
        CudaError(format!(
            "NVRTC is not installed (tried {tried}): install the CUDA toolkit's NVRTC (cuda-nvrtc), or build gpushm with nvcc on PATH so the kernels are built in"
        ))
    })
}

/// The library NVRTC was loaded from, if it could be.
pub fn library() -> Result<&'static str> {
    nvrtc().map(|n| n.name)
}

/// What to ask NVRTC for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Machine code for `sm_XY`: loads without the driver's JIT compiler.
    Cubin,
    /// PTX for `compute_XY`, JIT-compiled by the driver.
    Ptx,
}

/// Compiles CUDA C `src` for compute capability `cc`. Returns the image for cuModuleLoadData
/// (PTX text is NUL-terminated).
pub fn compile(src: &str, cc: (i32, i32), output: Output) -> Result<Vec<u8>> {
    let lib = nvrtc()?;
    let n = &lib.f;
    let arch = match output {
        Output::Cubin => format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
        Output::Ptx => format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
    };
    let err = |what: &str, s: Status| {
        // SAFETY: returns a static string for any status.
        let text = unsafe { CStr::from_ptr((n.error_string)(s)) };
        CudaError(format!("{what} failed: {}", text.to_string_lossy()))
    };
    let c_src = CString::new(src).map_err(|_| CudaError("kernel source holds a NUL".into()))?;
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers.
    let s = unsafe {
        (n.create)(
            &mut prog,
            c_src.as_ptr(),
            c"sum.cu".as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if s != 0 {
        return Err(err("nvrtcCreateProgram", s));
    }
    struct Guard<'a>(&'a Fns, Program);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once.
            unsafe { (self.0.destroy)(&mut self.1) };
        }
    }
    let g = Guard(n, prog);
    // NVRTC optimises by default (it has no -O option).
    let opts = [CString::new(arch.clone()).expect("no NUL")];
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` holds valid C strings for the call.
    let s = unsafe { (n.compile)(g.1, ptrs.len() as c_int, ptrs.as_ptr()) };
    if s != 0 {
        let mut len = 0usize;
        let mut log = String::new();
        // SAFETY: the buffer is as large as NVRTC said.
        unsafe {
            if (n.log_size)(g.1, &mut len) == 0 && len > 1 {
                let mut buf = vec![0u8; len];
                if (n.log)(g.1, buf.as_mut_ptr().cast()) == 0 {
                    log = String::from_utf8_lossy(&buf[..len - 1]).into_owned();
                }
            }
        }
        return Err(CudaError(format!(
            "NVRTC ({}) could not compile kernels/sum.cu with {arch}: {}{}",
            lib.name,
            err("nvrtcCompileProgram", s).0,
            if log.is_empty() {
                String::new()
            } else {
                format!("\n{log}")
            }
        )));
    }
    let (size_fn, get_fn, what) = match output {
        Output::Cubin => (n.cubin_size, n.cubin, "nvrtcGetCUBIN"),
        Output::Ptx => (n.ptx_size, n.ptx, "nvrtcGetPTX"),
    };
    let mut len = 0usize;
    // SAFETY: out-parameter.
    let s = unsafe { size_fn(g.1, &mut len) };
    if s != 0 || len == 0 {
        return Err(err(what, s));
    }
    let mut image = vec![0u8; len];
    // SAFETY: the buffer is as large as NVRTC said.
    let s = unsafe { get_fn(g.1, image.as_mut_ptr().cast()) };
    if s != 0 {
        return Err(err(what, s));
    }
    Ok(image)
}
