// SPDX-License-Identifier: MPL-2.0
//! The kernels of `kernels/sum.cu`, from the first of these that loads on the device:
//! 1. the file named by `GPUSHM_KERNELS` (a fatbin, cubin or PTX, e.g. from
//!    `scripts/build-kernels.sh`);
//! 2. the fatbin built in by nvcc at build time (real code for sm_72 where the toolkit allows,
//!    sm_87 and sm_90, plus PTX the driver JIT-compiles for other GPUs);
//! 3. NVRTC at run time (libnvrtc.so, .13, .12 or .11): a cubin for the device (no JIT
//!    needed), else PTX; cached on disk.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use once_cell::sync::Lazy;

use super::nvrtc::{self, Output};
use super::{CudaError, Device, Result};

/// The CUDA C source, embedded for NVRTC.
pub const SUM_SOURCE: &str = include_str!("../../kernels/sum.cu");

#[cfg(gpushm_prebuilt_fatbin)]
const PREBUILT: Option<(&[u8], &str)> = Some((
    include_bytes!(concat!(env!("OUT_DIR"), "/sum.fatbin")),
    env!("GPUSHM_FATBIN_ARCHS"),
));
#[cfg(not(gpushm_prebuilt_fatbin))]
const PREBUILT: Option<(&[u8], &str)> = None;

/// Names a kernel image to load instead of the built-in ones.
pub const KERNELS_ENV: &str = "GPUSHM_KERNELS";

/// Threads per block of every launch.
const THREADS: u32 = 256;
/// Chunks each thread handles per loop turn (UNROLL in sum.cu).
const UNROLL: u32 = 4;

pub struct SumKernels {
    _module: Arc<CudaModule>,
    sum_plane: CudaFunction,
    read_only: CudaFunction,
    /// Where the code came from, e.g. "built-in fatbin (sm_87 sm_90 PTX:compute_75)",
    /// "NVRTC cubin sm_90 (libnvrtc.so.13)".
    pub origin: String,
}

fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn cache_path(arch: &str, ext: &str) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(
        base.join("gpushm")
            .join(format!("sum-{:016x}-{arch}.{ext}", fnv64(SUM_SOURCE))),
    )
}

fn load(device: &Device, image: Vec<u8>, origin: String) -> Result<SumKernels> {
    let module = device.ctx.load_module(Ptx::from_binary(image))?;
    Ok(SumKernels {
        sum_plane: module.load_function("gpushm_sum_plane")?,
        read_only: module.load_function("gpushm_read_only")?,
        _module: module,
        origin,
    })
}

/// A PTX text as cuModuleLoadData wants it: NUL-terminated.
fn nul_terminated(mut image: Vec<u8>) -> Vec<u8> {
    let text = image.starts_with(b"//") || image.starts_with(b".version");
    if text && image.last() != Some(&0) {
        image.push(0);
    }
    image
}

fn compile(device: &Device) -> Result<SumKernels> {
    let mut failures = Vec::new();
    if let Some(path) = std::env::var_os(KERNELS_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        let image = std::fs::read(&path).map_err(|e| {
            CudaError(format!(
                "{KERNELS_ENV}={}: cannot read it: {e}",
                path.display()
            ))
        })?;
        return load(device, nul_terminated(image), format!("{}", path.display())).map_err(|e| {
            CudaError(format!(
                "{KERNELS_ENV}={} does not load on {}: {e}",
                path.display(),
                device.name
            ))
        });
    }
    let (major, minor) = device.compute_capability;
    if let Some((fatbin, archs)) = PREBUILT {
        match load(
            device,
            fatbin.to_vec(),
            format!("built-in fatbin ({archs})"),
        ) {
            Ok(k) => return Ok(k),
            Err(e) => {
                gst::warning!(
                    crate::CAT,
                    "the built-in kernels ({archs}) do not load on {} (sm_{major}{minor}): {e}; using NVRTC",
                    device.name
                );
                failures.push(format!("built-in fatbin ({archs}): {e}"));
            }
        }
    }
    for (output, arch, ext) in [
        (Output::Cubin, format!("sm_{major}{minor}"), "cubin"),
        (Output::Ptx, format!("compute_{major}{minor}"), "ptx"),
    ] {
        let cache = cache_path(&arch, ext);
        if let Some(image) = cache.as_ref().and_then(|p| std::fs::read(p).ok()) {
            if let Ok(k) = load(
                device,
                nul_terminated(image),
                format!("NVRTC {ext} {arch} (cached)"),
            ) {
                return Ok(k);
            }
        }
        let image = match nvrtc::compile(SUM_SOURCE, (major, minor), output) {
            Ok(i) => i,
            Err(e) => {
                failures.push(e.0);
                continue;
            }
        };
        let origin = format!("NVRTC {ext} {arch} ({})", nvrtc::library().unwrap_or("?"));
        match load(device, image.clone(), origin) {
            Ok(k) => {
                if let Some(path) = cache {
                    if let Some(dir) = path.parent() {
                        let tmp = dir.join(format!(".{}.tmp", std::process::id()));
                        let _ = std::fs::create_dir_all(dir)
                            .and_then(|_| std::fs::write(&tmp, &image))
                            .and_then(|_| std::fs::rename(&tmp, &path));
                    }
                }
                return Ok(k);
            }
            Err(e) => failures.push(format!("NVRTC {ext} for {arch} does not load: {e}")),
        }
    }
    Err(CudaError(format!(
        "cannot load the CUDA kernels on {} (sm_{major}{minor}): {}",
        device.name,
        failures.join("; ")
    )))
}

/// The kernels for `device`, compiled or loaded once per process.
pub fn sum_kernels(device: &Arc<Device>) -> Result<Arc<SumKernels>> {
    static CACHE: Lazy<Mutex<HashMap<usize, Arc<SumKernels>>>> =
        Lazy::new(|| Mutex::new(HashMap::new()));
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = cache.get(&device.ordinal) {
        return Ok(k.clone());
    }
    device.ctx.bind_to_thread()?;
    let k = Arc::new(compile(device)?);
    cache.insert(device.ordinal, k.clone());
    Ok(k)
}

/// One plane for gpushm_sum_plane: `rows` rows of `row_bytes` bytes, `stride` apart, starting
/// at device address `dev_ptr`; byte `col` of a row belongs to channel `col % channels`.
#[derive(Debug, Clone, Copy)]
pub struct PlaneJob {
    pub dev_ptr: u64,
    pub stride: u64,
    pub row_bytes: u32,
    pub rows: u32,
    pub channels: u32,
}

/// Runs the sum kernel; owns a stream, the result buffer and a staging area for frames that are
/// not in registered memory.
pub struct GpuSummer {
    device: Arc<Device>,
    kernels: Arc<SumKernels>,
    stream: Arc<CudaStream>,
    out: CudaSlice<u64>,
    staging: Option<(PinnedHostSlice<u8>, CudaSlice<u8>)>,
    start: CudaEvent,
    end: CudaEvent,
}

pub const MAX_JOBS: usize = 4;

impl GpuSummer {
    pub fn new(device: &Arc<Device>) -> Result<Self> {
        let kernels = sum_kernels(device)?;
        device.ctx.bind_to_thread()?;
        let stream = device.ctx.new_stream()?;
        let out = stream.alloc_zeros::<u64>(MAX_JOBS * 4)?;
        let start = device
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = device
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(Self {
            device: device.clone(),
            kernels,
            stream,
            out,
            staging: None,
            start,
            end,
        })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn kernel_origin(&self) -> &str {
        &self.kernels.origin
    }

    fn grid(&self, work_items: u64) -> LaunchConfig {
        let max_blocks = self.device.multiprocessors * 8;
        let blocks = work_items
            .div_ceil((THREADS * UNROLL) as u64)
            .clamp(1, max_blocks as u64) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Per-plane, per-channel sums of `jobs`, and the kernel time in nanoseconds.
    pub fn sum(&mut self, jobs: &[PlaneJob]) -> Result<(Vec<[u64; 4]>, u64)> {
        if jobs.len() > MAX_JOBS {
            return Err(CudaError(format!(
                "{} planes, at most {MAX_JOBS}",
                jobs.len()
            )));
        }
        self.device.ctx.bind_to_thread()?;
        self.stream.memset_zeros(&mut self.out)?;
        let out_base = {
            let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&self.out, &self.stream);
            p
        };
        self.start.record(&self.stream)?;
        for (i, j) in jobs.iter().enumerate() {
            if j.channels == 0 || j.channels > 4 || j.rows == 0 || j.row_bytes == 0 {
                continue;
            }
            let out_ptr = out_base + (i * 4 * 8) as u64;
            let cfg = self.grid(j.row_bytes as u64 * j.rows as u64 / 16);
            let mut b = self.stream.launch_builder(&self.kernels.sum_plane);
            b.arg(&j.dev_ptr)
                .arg(&j.stride)
                .arg(&j.row_bytes)
                .arg(&j.rows)
                .arg(&j.channels)
                .arg(&out_ptr);
            // SAFETY: the kernel reads rows*stride bytes from dev_ptr (checked by the caller to
            // lie in registered or device memory) and writes 4 u64 at out_ptr.
            unsafe { b.launch(cfg) }?;
        }
        self.end.record(&self.stream)?;
        let all = self.stream.clone_dtoh(&self.out)?;
        let ns = (self.start.elapsed_ms(&self.end)? as f64 * 1e6) as u64;
        Ok((
            jobs.iter()
                .enumerate()
                .map(|(i, _)| [all[i * 4], all[i * 4 + 1], all[i * 4 + 2], all[i * 4 + 3]])
                .collect(),
            ns,
        ))
    }

    /// Copies `data` to device memory through a pinned staging buffer; returns its device
    /// address (valid until the next call).
    pub fn stage(&mut self, data: &[u8]) -> Result<u64> {
        self.device.ctx.bind_to_thread()?;
        if self
            .staging
            .as_ref()
            .is_none_or(|(h, _)| h.len() < data.len())
        {
            // SAFETY: filled before use below.
            let host = unsafe { self.device.ctx.alloc_pinned::<u8>(data.len()) }?;
            let dev = self.stream.alloc_zeros::<u8>(data.len())?;
            self.staging = Some((host, dev));
        }
        let (host, dev) = self.staging.as_mut().expect("allocated above");
        host.as_mut_slice()?[..data.len()].copy_from_slice(data);
        self.stream.memcpy_htod(&*host, dev)?;
        let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&*dev, &self.stream);
        Ok(p)
    }

    /// Reads `len` bytes at `dev_ptr` `iterations` times with the plain read kernel; returns
    /// the fastest time in nanoseconds. The bus limit for a benchmark.
    pub fn time_read(&mut self, dev_ptr: u64, len: u64, iterations: u32) -> Result<u64> {
        self.device.ctx.bind_to_thread()?;
        let sink = {
            let (p, _s) = cudarc::driver::DevicePtr::device_ptr(&self.out, &self.stream);
            p
        };
        let n16 = len / 16;
        let cfg = self.grid(n16);
        let mut best = u64::MAX;
        for _ in 0..iterations {
            self.start.record(&self.stream)?;
            let mut b = self.stream.launch_builder(&self.kernels.read_only);
            b.arg(&dev_ptr).arg(&n16).arg(&sink);
            // SAFETY: reads n16*16 bytes at dev_ptr (the caller's buffer), may write 4 bytes at sink.
            unsafe { b.launch(cfg) }?;
            self.end.record(&self.stream)?;
            self.stream.synchronize()?;
            best = best.min((self.start.elapsed_ms(&self.end)? as f64 * 1e6) as u64);
        }
        Ok(best)
    }

    /// Device memory of `len` bytes, for benchmarks.
    pub fn alloc_device(&self, len: usize) -> Result<(CudaSlice<u8>, u64)> {
        let s = self.stream.alloc_zeros::<u8>(len)?;
        let p = {
            let (p, _s) = cudarc::driver::DevicePtr::device_ptr(&s, &self.stream);
            p
        };
        Ok((s, p))
    }
}
