// SPDX-License-Identifier: MPL-2.0
//! Rings in GPU memory, shared between processes with the CUDA virtual memory API: the
//! producer allocates with `cuMemCreate` (POSIX file descriptor handles) and exports the
//! allocation once per ring as a descriptor, sent over the control socket like the ring's
//! memfd; each consumer imports it and maps it once, read-only. No CUDA IPC memory handles
//! (they do not work on Jetson; this is one mechanism for every case).
//!
//! A device ring mirrors the ring's memfd byte for byte: the pixels of the frame whose bytes
//! would be at offset `o` of the memfd are at offset `o` of the device allocation, so a frame's
//! device address is the allocation's base plus its offset in the ring (see
//! [`DeviceMemory::device_ptr_of`]). The memfd keeps the headers, metadata and queues; its
//! slot bytes are never touched (memfd pages that are not touched take no memory).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{device, driver, CudaError, Device, Result};

/// `CU_STREAM_PER_THREAD` (cuda.h): the calling thread's default stream, which does not
/// wait for the context's other streams as the legacy default stream (0) does.
const CU_STREAM_PER_THREAD: sys::CUstream = 0x2 as sys::CUstream;

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError(format!("{what} failed: {r:?}")))
    }
}

/// The device's UUID, which names it the same way in every process (ordinals depend on
/// CUDA_VISIBLE_DEVICES).
pub fn uuid(device: &Device) -> Result<[u8; 16]> {
    let u = device.ctx.uuid()?;
    Ok(u.bytes.map(|b| b as u8))
}

/// The GPU of this process with UUID `uuid`.
pub fn device_by_uuid(uuid_wanted: &[u8; 16]) -> Result<Arc<Device>> {
    let n = driver()?;
    let mut seen = Vec::new();
    for i in 0..n {
        let d = device(i)?;
        let u = uuid(&d)?;
        if &u == uuid_wanted {
            return Ok(d);
        }
        seen.push(format!("{} ({})", d.name, fmt_uuid(&u)));
    }
    Err(CudaError(format!(
        "the frames are in the memory of GPU {}, which this process cannot see (it sees {}; check CUDA_VISIBLE_DEVICES and the container's devices)",
        fmt_uuid(uuid_wanted),
        seen.join(", ")
    )))
}

/// A UUID as nvidia-smi writes it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
pub fn fmt_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

fn location(device: &Device) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device.ordinal as i32,
    }
}

fn properties(device: &Device) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its documented default.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location = location(device);
    p
}

/// `len` rounded up to the device's allocation granularity.
fn granular(device: &Device, len: usize) -> Result<usize> {
    let p = properties(device);
    let mut g = 0usize;
    // SAFETY: valid out-pointer and properties.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    let g = g.max(1);
    len.checked_next_multiple_of(g)
        .filter(|&n| n > 0)
        .ok_or_else(|| CudaError(format!("{len} bytes cannot be allocated")))
}

/// GPU memory mapped into this process: allocated here ([`Self::allocate`], read-write) or
/// imported from another process ([`Self::import`], read-only). Unmapped and released on drop;
/// the physical memory goes when the last process lets go of it (a consumer keeps frames of a
/// producer that exited).
pub struct DeviceMemory {
    device: Arc<Device>,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: sys::CUdeviceptr,
    /// Bytes reserved at `ptr` (and mapped, once `mapped`).
    len: usize,
    mapped: bool,
    read_only: bool,
    /// Host address the allocation mirrors (the ring's mapping), for [`Self::device_ptr_of`].
    host: usize,
    host_len: usize,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes of GPU {} memory at {:#x}{}",
            self.len,
            self.device.ordinal,
            self.ptr,
            if self.read_only { " (read-only)" } else { "" }
        )
    }
}

impl DeviceMemory {
    /// At least `len` bytes of `device`'s memory, exportable as a descriptor, mapped
    /// read-write here.
    pub fn allocate(device: &Arc<Device>, len: usize) -> Result<Self> {
        device.ctx.bind_to_thread()?;
        let size = granular(device, len)?;
        let p = properties(device);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and properties.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &p, 0)
        })
        .map_err(|e| {
            CudaError(format!(
                "{e}: cannot allocate {size} bytes of {} memory shareable as a file descriptor (the CUDA virtual memory API)",
                device.name
            ))
        })?;
        Self::map(device, handle, size, false)
    }

    /// Maps `handle` (ours from here on, released on failure) and sets its access.
    fn map(
        device: &Arc<Device>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        read_only: bool,
    ) -> Result<Self> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; no fixed address asked for.
        let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) };
        if let Err(e) = check("cuMemAddressReserve", r) {
            // SAFETY: the handle is ours.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // From here on Drop undoes what was done.
        let mut m = Self {
            device: device.clone(),
            handle,
            ptr,
            len: size,
            mapped: false,
            read_only,
            host: 0,
            host_len: 0,
        };
        // SAFETY: the reserved range is `size` bytes, the handle at least that (the caller
        // checked an imported one's size: a smaller allocation fails here).
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        })?;
        m.mapped = true;
        let access = sys::CUmemAccessDesc {
            location: location(device),
            flags: if read_only {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
            } else {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            },
        };
        // SAFETY: the range is mapped.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        })?;
        Ok(m)
    }

    /// A descriptor for the allocation, to send to a consumer. Each call makes a new one.
    pub fn export(&self) -> Result<OwnedFd> {
        self.device.ctx.bind_to_thread()?;
        let mut fd: i32 = -1;
        // SAFETY: for POSIX handles the out-parameter is an int.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut c_void,
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError(
                "cuMemExportToShareableHandle gave no descriptor".into(),
            ));
        }
        // SAFETY: the driver made this descriptor for us.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Maps the allocation behind `fd` (sent by a producer), `len` bytes of it, read-only.
    /// A descriptor that is not a CUDA allocation, or one smaller than `len`, is an error.
    pub fn import(device: &Arc<Device>, fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        device.ctx.bind_to_thread()?;
        let size = granular(device, len)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX handles the OS handle is the descriptor's number; the driver
        // does not take the descriptor (we close it).
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })
        .map_err(|e| {
            CudaError(format!(
                "{e}: the producer's GPU memory cannot be imported into this process"
            ))
        })?;
        Self::map(device, handle, size, true)
    }

    /// Says which host range this allocation mirrors (the ring's mapping): see
    /// [`Self::device_ptr_of`].
    pub fn mirror(&mut self, host: *const u8, host_len: usize) {
        self.host = host as usize;
        self.host_len = host_len.min(self.len);
    }

    /// Device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Device address that mirrors the host byte at `ptr`, if it is inside the mirrored
    /// range.
    pub fn device_ptr_of(&self, ptr: *const u8) -> Option<u64> {
        let p = ptr as usize;
        (p >= self.host && p < self.host + self.host_len).then(|| self.ptr + (p - self.host) as u64)
    }

    /// The host address a device address inside the mirrored range mirrors: the inverse of
    /// [`Self::device_ptr_of`].
    pub fn host_ptr_of(&self, device_ptr: u64) -> Option<*const u8> {
        let rel = device_ptr.checked_sub(self.ptr)?;
        (rel < self.host_len as u64).then(|| (self.host + rel as usize) as *const u8)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// An error unless `len` bytes at device address `at` lie inside this allocation (and it
    /// is writable here, for `write`).
    fn check_range(&self, at: u64, len: usize, write: bool) -> Result<()> {
        if write && self.read_only {
            return Err(CudaError(format!("{self:?} cannot be written")));
        }
        let end = self.ptr + self.len as u64;
        if at < self.ptr || at.checked_add(len as u64).is_none_or(|e| e > end) {
            return Err(CudaError(format!(
                "{len} bytes at {at:#x} are outside {self:?}"
            )));
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from device address `src` (inside this allocation) to host
    /// memory.
    pub fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(src, dst.len(), false)?;
        self.device.ctx.bind_to_thread()?;
        // SAFETY: both ranges are checked to be inside their allocations.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len())
        })
    }

    /// Copies host bytes `src` to device address `dst` (inside this allocation, which must be
    /// writable here). Complete when this returns.
    pub fn copy_from_host(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.check_range(dst, src.len(), true)?;
        self.device.ctx.bind_to_thread()?;
        // SAFETY: both ranges are checked to be inside their allocations.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len())
        })?;
        // From pageable memory the copy may return once the bytes are staged, before they
        // reached the GPU: a frame is published only once they are all there.
        // SAFETY: plain driver call.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl DeviceMemory {
    /// Copies `len` bytes from device address `src` (any memory this process's CUDA context
    /// on this GPU can read: a PyTorch or CuPy tensor) to `dst` inside this allocation. Work
    /// queued before on the context's streams is finished first, and the copy is complete
    /// when this returns: a frame published next holds it all.
    pub fn copy_from_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.check_range(dst, len, true)?;
        self.device.ctx.bind_to_thread()?;
        // SAFETY: plain driver calls; `dst` is checked, `src` is the caller's device memory
        // (the driver refuses addresses it does not know).
        unsafe {
            check("cuCtxSynchronize", sys::cuCtxSynchronize())?;
            check("cuMemcpyDtoD", sys::cuMemcpyDtoD_v2(dst, src, len))?;
            check("cuCtxSynchronize", sys::cuCtxSynchronize())
        }
    }
}

/// One plane of a 2-D copy: `rows` rows of `row_bytes`, from `src_offset` (rows `src_pitch`
/// apart) to `dst_offset` (rows `dst_pitch` apart).
#[derive(Debug, Clone, Copy)]
pub struct Plane2d {
    pub src_offset: u64,
    pub src_pitch: u64,
    pub dst_offset: u64,
    pub dst_pitch: u64,
    pub row_bytes: u64,
    pub rows: u64,
}

impl Plane2d {
    /// Bytes from the plane's start to the end of its last row, at `pitch`.
    fn span(&self, pitch: u64) -> Option<u64> {
        if self.rows == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(pitch)?
            .checked_add(self.row_bytes)
    }
}

/// The other side of a copy: memory of another element (an address of it) and the CUstream
/// its owner orders its work on (0 for none).
struct Foreign {
    at: u64,
    stream: u64,
}

impl DeviceMemory {
    /// Copies the planes of a frame at device address `src` (`src_len` bytes: another
    /// element's CUDA memory, in whatever context of this GPU owns it) to `dst` inside this
    /// allocation, on the GPU, queued on `stream` (the source's CUstream, 0 for none: see
    /// [`Self::copy_planes`]). Every plane is checked to lie inside both. Complete when this
    /// returns.
    pub fn copy_planes_from_device(
        &self,
        dst: u64,
        src: u64,
        src_len: u64,
        planes: &[Plane2d],
        stream: u64,
    ) -> Result<()> {
        if self.read_only {
            return Err(CudaError(format!("{self:?} cannot be written")));
        }
        self.copy_planes(
            src,
            (src, src_len),
            dst,
            (self.ptr, self.len as u64),
            Foreign { at: src, stream },
            planes,
        )
    }

    /// Copies the planes of a frame at `src` inside this allocation to device address `dst`
    /// (`dst_len` bytes: another element's CUDA memory, a GStreamer CUDA buffer pool's), on
    /// the GPU, queued on `stream` (the destination's CUstream, 0 for none). Every plane is
    /// checked to lie inside both. Complete when this returns.
    pub fn copy_planes_to_device(
        &self,
        src: u64,
        dst: u64,
        dst_len: u64,
        planes: &[Plane2d],
        stream: u64,
    ) -> Result<()> {
        self.copy_planes(
            src,
            (self.ptr, self.len as u64),
            dst,
            (dst, dst_len),
            Foreign { at: dst, stream },
            planes,
        )
    }

    /// Copies `planes` from `src` to `dst`, each inside its `(start, len)` region, in the
    /// context that owns `foreign` (GStreamer's CUDA elements make their own). This
    /// allocation is mapped for the whole device (cuMemSetAccess), so every context on it
    /// reaches it.
    ///
    /// The copy is queued on `stream`, the foreign memory's own stream (GStreamer 1.24+), so
    /// it is ordered after the work its owner queued there (a decoder's copy out of its
    /// surface, which it does not wait for); with none (0) the memory is ready, and the copy
    /// goes on this thread's default stream. Only that stream is waited for: waiting for the
    /// whole context (cuCtxSynchronize) or using the legacy default stream would also wait for
    /// the frames a decoder sharing the context is working on next.
    fn copy_planes(
        &self,
        src: u64,
        src_region: (u64, u64),
        dst: u64,
        dst_region: (u64, u64),
        Foreign {
            at: foreign,
            stream,
        }: Foreign,
        planes: &[Plane2d],
    ) -> Result<()> {
        let inside = |base: u64, offset: u64, pitch: u64, p: &Plane2d, (start, len): (u64, u64)| {
            let end = base
                .checked_add(offset)
                .and_then(|b| b.checked_add(p.span(pitch)?));
            base >= start && end.is_some_and(|e| e <= start.saturating_add(len))
        };
        for p in planes {
            let pitches_fit =
                p.row_bytes <= p.src_pitch.max(p.row_bytes) && p.row_bytes <= p.dst_pitch;
            if !pitches_fit
                || !inside(
                    src,
                    p.src_offset,
                    p.src_pitch.max(p.row_bytes),
                    p,
                    src_region,
                )
            {
                return Err(CudaError(format!(
                    "a plane {p:?} lies outside the source frame ({} bytes at {:#x})",
                    src_region.1, src_region.0
                )));
            }
            if !inside(dst, p.dst_offset, p.dst_pitch, p, dst_region) {
                return Err(CudaError(format!(
                    "a plane {p:?} lies outside the destination ({} bytes at {:#x})",
                    dst_region.1, dst_region.0
                )));
            }
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // The context the foreign memory's stream belongs to (the memory's own); failing
        // that (or with no stream), the one that owns its address, and the per-thread stream.
        let mut stream = stream;
        // SAFETY: valid out-pointer; the driver checks `stream`.
        let mut r = match stream {
            0 => sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            s => unsafe { sys::cuStreamGetCtx(s as sys::CUstream, &mut ctx) },
        };
        if r != sys::CUresult::CUDA_SUCCESS || ctx.is_null() {
            stream = 0;
            // SAFETY: valid out-pointer; the driver checks `foreign`.
            r = unsafe {
                sys::cuPointerGetAttribute(
                    &mut ctx as *mut sys::CUcontext as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
                    foreign,
                )
            };
        }
        let pushed = r == sys::CUresult::CUDA_SUCCESS && !ctx.is_null();
        if pushed {
            // SAFETY: a live context of this process (it owns `foreign`).
            check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        } else {
            self.device.ctx.bind_to_thread()?;
        }
        let stream = if stream == 0 {
            CU_STREAM_PER_THREAD
        } else {
            stream as sys::CUstream
        };
        let copied = (|| {
            for p in planes {
                // (Not zeroed: CUmemorytype has no zero value.)
                let c = sys::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    srcHost: std::ptr::null(),
                    srcDevice: src + p.src_offset,
                    srcArray: std::ptr::null_mut(),
                    srcPitch: p.src_pitch.max(p.row_bytes) as usize,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    dstHost: std::ptr::null_mut(),
                    dstDevice: dst + p.dst_offset,
                    dstArray: std::ptr::null_mut(),
                    dstPitch: p.dst_pitch as usize,
                    WidthInBytes: p.row_bytes as usize,
                    Height: p.rows as usize,
                };
                // SAFETY: both ranges checked above; `stream` is the foreign memory's (a
                // stream of the context pushed above) or the per-thread default stream.
                check("cuMemcpy2DAsync", unsafe {
                    sys::cuMemcpy2DAsync_v2(&c, stream)
                })?;
            }
            Ok(())
        })();
        // Waited for whatever happened: planes queued before a failed one must be done
        // before this returns (they write into memory its caller may reuse).
        // SAFETY: as above.
        let synced = check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream)
        });
        let copied = copied.and(synced);
        if pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops what we pushed.
            unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
        copied
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // The last frame can be dropped on any thread.
        let _ = self.device.ctx.bind_to_thread();
        // SAFETY: reserved (and mapped, if `mapped`) and created in map()/allocate()/import().
        unsafe {
            if self.mapped {
                sys::cuMemUnmap(self.ptr, self.len);
            }
            sys::cuMemAddressFree(self.ptr, self.len);
            sys::cuMemRelease(self.handle);
        }
    }
}

// SAFETY: only handles and addresses are stored; the driver calls are thread-safe once a
// context is bound.
unsafe impl Send for DeviceMemory {}
unsafe impl Sync for DeviceMemory {}

/// Makes `ring` (not yet announced) a device ring on `device`: GPU memory mirroring its
/// memfd, mapped read-write here (the ring keeps it as its attachment: see
/// [`crate::ring::producer_end::ProducerRing::attachment`]) and exported once for its consumers.
/// Frames are then written through [`device_ptr_of_slot`].
pub fn place_ring(
    ring: &crate::ring::producer_end::ProducerRing,
    device: &Arc<Device>,
) -> Result<()> {
    let (base, len) = ring.mapping();
    let mut mem = DeviceMemory::allocate(device, len)?;
    mem.mirror(base, len);
    let share = crate::ring::producer_end::DeviceShare {
        gpu_uuid: uuid(device)?,
        size: mem.len() as u64,
        fd: mem.export()?,
    };
    if !ring.set_device(share) || !ring.attach(Box::new(mem)) {
        return Err(CudaError(
            "the ring is already placed or registered with CUDA".into(),
        ));
    }
    Ok(())
}

/// The GPU memory of a device ring (producer or consumer side), from its attachment.
pub fn of(attachment: Option<&(dyn std::any::Any + Send + Sync)>) -> Option<&DeviceMemory> {
    attachment?.downcast_ref::<DeviceMemory>()
}

/// Device address of `slot` of a producer's device ring.
pub fn device_ptr_of_slot(
    ring: &crate::ring::producer_end::ProducerRing,
    slot: u32,
) -> Option<u64> {
    of(ring.attachment())?.device_ptr_of(ring.slot_ptr(slot))
}

/// The slot of a producer's device ring whose GPU memory starts at `device_ptr`, if `len`
/// bytes from there fit in it: what a buffer in CUDA memory that an upstream element rendered
/// into one of the ring's slots is.
pub fn slot_of_device_ptr(
    ring: &crate::ring::producer_end::ProducerRing,
    device_ptr: u64,
    len: u64,
) -> Option<u32> {
    let host = of(ring.attachment())?.host_ptr_of(device_ptr)?;
    let slot = ring.slot_of_ptr(host)?;
    (len <= ring.slot_size()).then_some(slot)
}
