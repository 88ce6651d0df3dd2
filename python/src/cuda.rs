// SPDX-License-Identifier: MPL-2.0
//! Registering a ring with CUDA for `__cuda_array_interface__` and DLPack: once per ring
//! mapping, on the first GPU use of one of its frames. Until then this process loads no CUDA
//! library and creates no context.

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use gpushm::consumer::ConsumerRing;

use crate::frame::FrameData;

static REGISTRATIONS: AtomicU64 = AtomicU64::new(0);
/// Registering and attaching happen under one lock: two threads never register one range.
static REGISTER: Mutex<()> = Mutex::new(());

pub fn registrations() -> u64 {
    REGISTRATIONS.load(Ordering::Relaxed)
}

/// A ring mapping registered with CUDA; unregistered when the ring drops it (before unmapping).
struct Registration {
    ctx: Arc<CudaContext>,
    host: usize,
    len: usize,
    dev_ptr: u64,
    device: i32,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in register(), still mapped (the ring drops us before unmapping).
        unsafe { sys::cuMemHostUnregister(self.host as *mut c_void) };
    }
}

/// Why a ring could not be registered, kept so that no frame tries again.
struct Failed(String);

fn check(what: &str, r: sys::CUresult) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

fn register(ring: &ConsumerRing, device: i32) -> Result<Registration, String> {
    // SAFETY: only dlopens; cudarc panics on use without the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "no CUDA driver: libcuda.so was not found (no NVIDIA GPU or driver on this machine)"
                .into(),
        );
    }
    let ordinal = usize::try_from(device)
        .map_err(|_| format!("cuda_device={device} is not a device number"))?;
    let ctx =
        CudaContext::new(ordinal).map_err(|e| format!("cannot open CUDA device {device}: {e}"))?;
    use sys::CUdevice_attribute as A;
    let attr = |a: A| ctx.attribute(a).unwrap_or(0);
    let name = ctx.name().unwrap_or_else(|_| format!("GPU {device}"));
    if attr(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 0 {
        return Err(format!("{name} cannot register host memory"));
    }
    let read_only = !ring.is_writable();
    if read_only && attr(A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) == 0 {
        return Err(format!(
            "{name} cannot register read-only host memory, and frames are read-only; copy them (numpy) instead"
        ));
    }
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let (base, len) = ring.mapping();
    let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    if read_only {
        flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
    }
    // SAFETY: the ring keeps base..base+len mapped while its attachment (the registration)
    // lives.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(base as *mut c_void, len, flags)
    })?;
    REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
    let mut dev_ptr: sys::CUdeviceptr = 0;
    // SAFETY: just registered with DEVICEMAP.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, base as *mut c_void, 0) };
    let reg = Registration {
        ctx,
        host: base as usize,
        len,
        dev_ptr,
        device,
    };
    check("cuMemHostGetDevicePointer", r)?;
    Ok(reg)
}

/// The device address of a frame's first byte and its device, registering its ring first if
/// needed.
pub fn device_ptr(data: &FrameData) -> Result<(u64, i32), String> {
    let ring = data.lease.0.ring();
    if ring.attachment().is_none() {
        let _guard = REGISTER.lock().unwrap_or_else(|e| e.into_inner());
        if ring.attachment().is_none() {
            let att: Box<dyn Any + Send + Sync> = match register(ring, data.cuda_device) {
                Ok(r) => Box::new(r),
                Err(e) => Box::new(Failed(e)),
            };
            ring.attach(att);
        }
    }
    let att = ring
        .attachment()
        .ok_or("the ring has no CUDA registration")?;
    if let Some(Failed(why)) = att.downcast_ref::<Failed>() {
        return Err(why.clone());
    }
    let reg = att
        .downcast_ref::<Registration>()
        .ok_or("the ring carries something else than a CUDA registration")?;
    if data.ptr < reg.host || data.ptr >= reg.host + reg.len {
        return Err("the frame lies outside its ring's registration".into());
    }
    Ok((reg.dev_ptr + (data.ptr - reg.host) as u64, reg.device))
}
