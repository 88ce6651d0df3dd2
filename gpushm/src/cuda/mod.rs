// SPDX-License-Identifier: MPL-2.0
//! The CUDA layer (feature `cuda`), the one the GStreamer elements and the Python package
//! share: finding libcuda, one cached context per device, registering a ring mapping with
//! CUDA once, and rings in GPU memory shared through the virtual memory API ([`vmm`]).
//!
//! Nothing here runs until asked: libcuda is looked up the first time a caller wants the GPU,
//! so processes that do not use it load no CUDA library, and everything else works on
//! machines without one.

pub mod register;
pub mod vmm;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::CudaContext;
use std::sync::{LazyLock, OnceLock};

#[derive(Debug, Clone)]
pub struct CudaError(pub String);

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CudaError {}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError(format!("CUDA driver error: {e}"))
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Whether a usable CUDA driver with at least one device is present; the reason if not.
pub fn driver() -> Result<i32> {
    static DRIVER: OnceLock<std::result::Result<i32, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the library; cudarc panics on use without it.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("no CUDA driver: libcuda.so was not found (no NVIDIA GPU or driver on this machine)".into());
            }
            match CudaContext::device_count() {
                Ok(0) => Err("the CUDA driver reports no GPU".into()),
                Ok(n) => Ok(n),
                Err(e) => Err(format!("the CUDA driver failed to initialise: {e}")),
            }
        })
        .clone()
        .map_err(CudaError)
}

/// One GPU, with its primary context and what it supports.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// Shares physical memory with the CPU (Jetson): mapped host memory is read at memory speed.
    pub integrated: bool,
    /// cuMemHostRegister works on this device.
    pub host_register: bool,
    /// cuMemHostRegister accepts CU_MEMHOSTREGISTER_READ_ONLY (needed for read-only mappings).
    pub host_register_read_only: bool,
    pub multiprocessors: u32,
    /// What a plane read as a CUDA texture needs (GStreamer's CUDA converters read so): its
    /// address a multiple of `texture_alignment` bytes, its stride of
    /// `texture_pitch_alignment`.
    pub texture_alignment: u64,
    pub texture_pitch_alignment: u64,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPU {} ({}, sm_{}{}, {} SMs, integrated={}, host-register={}, read-only-register={})",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.multiprocessors,
            self.integrated,
            self.host_register,
            self.host_register_read_only
        )
    }
}

/// Test-only switch: when set, every device is treated as unable to register read-only host
/// memory, to exercise the writable-ring fallback on GPUs that can.
pub const TEST_NO_READ_ONLY_REGISTER: &str = "GPUSHM_TEST_NO_READ_ONLY_REGISTER";

/// What [`select`] found.
pub enum Selected {
    Device(Arc<Device>),
    /// `cuda-device-id=-1` and no usable GPU: go on without CUDA, for this reason.
    Unavailable(CudaError),
}

/// The rule every element follows for its `cuda-device-id`: -1 takes the first GPU when there
/// is one and goes on without CUDA otherwise; an explicit id must exist (`Err` otherwise).
/// The first call for a device creates its CUDA context: call it only for work that uses it.
pub fn select(id: i32) -> Result<Selected> {
    match device(id) {
        Ok(d) => Ok(Selected::Device(d)),
        Err(e) if id < 0 => Ok(Selected::Unavailable(e)),
        Err(e) => Err(CudaError(format!("cuda-device-id={id}: {e}"))),
    }
}

/// The device `id` (-1 = the first one), opened once per process.
pub fn device(id: i32) -> Result<Arc<Device>> {
    static DEVICES: LazyLock<Mutex<HashMap<usize, Arc<Device>>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    let count = driver()?;
    let ordinal = if id < 0 { 0 } else { id as usize };
    if ordinal >= count as usize {
        return Err(CudaError(format!(
            "cuda-device-id {id} does not exist: this machine has {count} GPU(s)"
        )));
    }
    let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
    let ctx = CudaContext::new(ordinal)?;
    let attr = |a: Attr| ctx.attribute(a).unwrap_or(0);
    let d = Arc::new(Device {
        ordinal,
        name: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
        compute_capability: ctx.compute_capability()?,
        integrated: attr(Attr::CU_DEVICE_ATTRIBUTE_INTEGRATED) != 0,
        host_register: attr(Attr::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) != 0,
        host_register_read_only: attr(Attr::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)
            != 0
            && std::env::var_os(TEST_NO_READ_ONLY_REGISTER).is_none(),
        multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).max(1) as u32,
        texture_alignment: attr(Attr::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT).max(1) as u64,
        texture_pitch_alignment: attr(Attr::CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT).max(1)
            as u64,
        ctx,
    });
    devices.insert(ordinal, d.clone());
    Ok(d)
}
