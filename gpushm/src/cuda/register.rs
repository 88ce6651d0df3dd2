// SPDX-License-Identifier: MPL-2.0
//! Registering a whole mapping with CUDA, once, so kernels read it in place.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CudaError, Device, Result};

/// cuMemHostRegister calls made by this process: one per mapping, never one per frame.
static REGISTRATIONS: AtomicU64 = AtomicU64::new(0);

pub fn registrations() -> u64 {
    REGISTRATIONS.load(Ordering::Relaxed)
}

/// A host range registered with CUDA (PORTABLE | DEVICEMAP, plus READ_ONLY for read-only
/// mappings). Unregistered on drop, which must happen before the range is unmapped.
pub struct HostRegistration {
    device: Arc<Device>,
    host: usize,
    len: usize,
    dev_ptr: u64,
    read_only: bool,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes at {:#x} -> device {:#x} on GPU {}",
            self.len, self.host, self.dev_ptr, self.device.ordinal
        )
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError(format!("{what} failed: {r:?}")))
    }
}

impl HostRegistration {
    /// Registers `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the registration is dropped.
    pub unsafe fn new(
        device: &Arc<Device>,
        ptr: *const u8,
        len: usize,
        read_only: bool,
    ) -> Result<Self> {
        if !device.host_register {
            return Err(CudaError(format!(
                "{} cannot register host memory",
                device.name
            )));
        }
        if read_only && !device.host_register_read_only {
            return Err(CudaError(format!(
                "{} cannot register read-only host memory",
                device.name
            )));
        }
        device.ctx.bind_to_thread()?;
        let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        // SAFETY: the caller keeps the range mapped for the registration's lifetime.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags)
        })?;
        REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
        let mut dev_ptr: sys::CUdeviceptr = 0;
        // SAFETY: the range was just registered with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, ptr as *mut c_void, 0) };
        if let Err(e) = check("cuMemHostGetDevicePointer", r) {
            // SAFETY: registered above.
            unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
            return Err(e);
        }
        Ok(Self {
            device: device.clone(),
            host: ptr as usize,
            len,
            dev_ptr,
            read_only,
        })
    }

    /// Device address of the first registered byte.
    pub fn device_ptr(&self) -> u64 {
        self.dev_ptr
    }

    /// Device address of the host byte at `ptr`, if it is inside the registration.
    pub fn device_ptr_of(&self, ptr: *const u8) -> Option<u64> {
        let p = ptr as usize;
        (p >= self.host && p < self.host + self.len).then(|| self.dev_ptr + (p - self.host) as u64)
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // The last buffer can be dropped on any thread.
        let _ = self.device.ctx.bind_to_thread();
        // SAFETY: registered in new(), still mapped (the caller's contract).
        unsafe { sys::cuMemHostUnregister(self.host as *mut c_void) };
    }
}

// SAFETY: only addresses are stored; the driver calls are thread-safe once bound.
unsafe impl Send for HostRegistration {}
unsafe impl Sync for HostRegistration {}

/// Put on a mapping that could not be registered, so that nobody tries again for every frame.
#[derive(Debug)]
pub struct NotRegistered(pub String);

/// Registers a whole ring mapping once and returns what to attach to it: the registration, or
/// the reason it failed.
///
/// # Safety
/// `ptr..ptr+len` must stay mapped for as long as the returned value lives.
pub unsafe fn register_mapping(
    device: &Arc<Device>,
    ptr: *const u8,
    len: usize,
    read_only: bool,
) -> Box<dyn std::any::Any + Send + Sync> {
    // SAFETY: forwarded contract.
    match unsafe { HostRegistration::new(device, ptr, len, read_only) } {
        Ok(r) => Box::new(r),
        Err(e) => Box::new(NotRegistered(e.0)),
    }
}

/// The device address of `ptr` if `attachment` is a registration that covers it, or the GPU
/// memory of a device ring that mirrors it.
pub fn device_ptr_in(
    attachment: Option<&(dyn std::any::Any + Send + Sync)>,
    ptr: *const u8,
) -> Option<(u64, i32)> {
    if let Some(mem) = super::vmm::of(attachment) {
        return Some((mem.device_ptr_of(ptr)?, mem.device().ordinal as i32));
    }
    let reg = attachment?.downcast_ref::<HostRegistration>()?;
    Some((reg.device_ptr_of(ptr)?, reg.device().ordinal as i32))
}
