// SPDX-License-Identifier: MPL-2.0
//! GstMemory over a slot of a mapped ring, without copying and without forming Rust
//! references to the shared bytes.

use gst::glib::translate::from_glib_full;

/// Wraps `len` bytes at `ptr` (inside a slot of `maxsize` bytes) in a GstMemory. `keep` is
/// dropped when the memory is freed: it keeps the mapping alive and, on the consumer side,
/// gives the slot back to the producer.
pub fn wrap_slot_memory<K: Send + 'static>(
    ptr: *mut u8,
    maxsize: usize,
    len: usize,
    readonly: bool,
    keep: Box<K>,
) -> gst::Memory {
    wrap(ptr, maxsize, len, readonly, keep).0
}

/// [`wrap_slot_memory`], also returning where `keep` now lives: the consumer makes memories
/// ahead of their frames and puts the frame's lease in when the frame comes.
///
/// # Safety
/// `keep` stays at the returned pointer until the memory is freed. Write through it only while
/// holding the memory's only reference (before the memory is handed on or mapped), and make
/// `keep` keep `ptr` mapped before the memory is handed on or mapped.
pub unsafe fn wrap_slot_memory_keeping<K: Send + 'static>(
    ptr: *mut u8,
    maxsize: usize,
    len: usize,
    readonly: bool,
    keep: Box<K>,
) -> (gst::Memory, *mut K) {
    wrap(ptr, maxsize, len, readonly, keep)
}

fn wrap<K: Send + 'static>(
    ptr: *mut u8,
    maxsize: usize,
    len: usize,
    readonly: bool,
    keep: Box<K>,
) -> (gst::Memory, *mut K) {
    unsafe extern "C" fn destroy<K>(data: gst::glib::ffi::gpointer) {
        // SAFETY: `data` is the Box leaked below, freed exactly once by GStreamer.
        drop(unsafe { Box::from_raw(data as *mut K) });
    }
    let user_data = Box::into_raw(keep);
    let flags = if readonly {
        gst::ffi::GST_MEMORY_FLAG_READONLY
    } else {
        0
    };
    // SAFETY: `ptr..ptr+maxsize` stays mapped while `keep` lives (a memory made ahead: from
    // when its `keep` is filled in, before anyone maps it), which GStreamer guarantees until
    // `destroy` runs.
    let mem = unsafe {
        from_glib_full(gst::ffi::gst_memory_new_wrapped(
            flags,
            ptr as gst::glib::ffi::gpointer,
            maxsize,
            0,
            len.min(maxsize),
            user_data as gst::glib::ffi::gpointer,
            Some(destroy::<K>),
        ))
    };
    (mem, user_data)
}

/// The `mem_type` of [`wrap_device_slot_memory`]'s memories.
pub const DEVICE_SLOT_MEMORY: &str = "GpuShmDeviceMemory";

/// Copies a device frame's bytes to host memory (the destination is the frame's length).
pub type CopyToHost = Box<dyn Fn(&mut [u8]) -> Result<(), String> + Send + Sync>;

/// A GstMemory over a frame of a device ring (GPU memory), without copying it: mapped with
/// GST_MAP_CUDA (gst/cuda's flag) it gives the frame's device address, as a GstCudaMemory
/// does; mapped for reading by the CPU it gives a host copy made at the first such map
/// (`copy`) and kept with the memory. It is read-only and cannot be shared (sub-buffers copy
/// it). `keep` is dropped when the memory is freed: it holds the frame's lease, so the
/// device address stays valid and unchanged until then.
pub fn wrap_device_slot_memory<K: Send + 'static>(
    device_ptr: u64,
    len: usize,
    copy: CopyToHost,
    keep: Box<K>,
) -> gst::Memory {
    device::wrap(device_ptr, len, copy, keep)
}

mod device {
    use std::sync::OnceLock;

    use gst::glib;
    use gst::glib::translate::{from_glib_full, ToGlibPtr};
    use gst::prelude::*;
    use gst::subclass::prelude::*;

    use super::CopyToHost;

    #[repr(C)]
    struct DeviceSlotMemory {
        mem: gst::ffi::GstMemory,
        device_ptr: u64,
        copy: CopyToHost,
        /// The host copy, made at the first CPU map (`None`: it failed).
        host: OnceLock<Option<Box<[u8]>>>,
        keep: Box<dyn Send>,
    }

    glib::wrapper! {
        pub struct DeviceSlotAllocator(ObjectSubclass<imp::DeviceSlotAllocator>)
            @extends gst::Allocator, gst::Object;
    }

    pub(super) fn wrap<K: Send + 'static>(
        device_ptr: u64,
        len: usize,
        copy: CopyToHost,
        keep: Box<K>,
    ) -> gst::Memory {
        static ALLOCATOR: OnceLock<DeviceSlotAllocator> = OnceLock::new();
        let allocator = ALLOCATOR.get_or_init(glib::Object::new);
        let m = Box::into_raw(Box::new(DeviceSlotMemory {
            // SAFETY: a plain C struct; gst_memory_init below sets every field.
            mem: unsafe { std::mem::zeroed() },
            device_ptr,
            copy,
            host: OnceLock::new(),
            keep,
        }));
        // SAFETY: `m` is a fresh DeviceSlotMemory whose first field is its GstMemory; the
        // allocator frees it (imp::free) when the last reference goes.
        unsafe {
            let a: *mut gst::ffi::GstAllocator =
                allocator.upcast_ref::<gst::Allocator>().to_glib_none().0;
            gst::ffi::gst_memory_init(
                std::ptr::addr_of_mut!((*m).mem),
                gst::ffi::GST_MEMORY_FLAG_READONLY | gst::ffi::GST_MEMORY_FLAG_NO_SHARE,
                a,
                std::ptr::null_mut(),
                len,
                0,
                0,
                len,
            );
            from_glib_full(m as *mut gst::ffi::GstMemory)
        }
    }

    pub mod imp {
        use super::*;

        #[derive(Default)]
        pub struct DeviceSlotAllocator;

        impl ObjectImpl for DeviceSlotAllocator {}
        impl GstObjectImpl for DeviceSlotAllocator {}

        // SAFETY: alloc gives nothing (CUSTOM_ALLOC: memories are made by wrap() only) and
        // free takes back exactly what wrap() made.
        unsafe impl AllocatorImpl for DeviceSlotAllocator {
            unsafe fn alloc(
                &self,
                _size: usize,
                _params: &gst::AllocationParams,
            ) -> *mut gst::ffi::GstMemory {
                std::ptr::null_mut()
            }

            unsafe fn free(&self, mem: *mut gst::ffi::GstMemory) {
                // SAFETY: made by wrap() (NO_SHARE: no sub-memories), freed once.
                drop(unsafe { Box::from_raw(mem as *mut DeviceSlotMemory) });
            }
        }

        #[glib::object_subclass]
        impl ObjectSubclass for DeviceSlotAllocator {
            const NAME: &'static str = "GstGpuShmDeviceSlotAllocator";
            type Type = super::DeviceSlotAllocator;
            type ParentType = gst::Allocator;

            fn instance_init(obj: &glib::subclass::InitializingObject<Self>) {
                static MEM_TYPE: &[u8] = b"GpuShmDeviceMemory\0";
                // SAFETY: setting the allocator's vfuncs while it is being made.
                unsafe {
                    let a = obj.as_ptr() as *mut gst::ffi::GstAllocator;
                    (*a).mem_type = MEM_TYPE.as_ptr() as *const _;
                    (*a).mem_map = Some(mem_map);
                    (*a).mem_unmap = Some(mem_unmap);
                    (*a).mem_share = Some(mem_share);
                    (*a).object.flags |= gst::ffi::GST_ALLOCATOR_FLAG_CUSTOM_ALLOC;
                }
            }
        }

        unsafe extern "C" fn mem_map(
            mem: *mut gst::ffi::GstMemory,
            _maxsize: usize,
            flags: gst::ffi::GstMapFlags,
        ) -> glib::ffi::gpointer {
            // SAFETY: a memory made by wrap(), alive while mapped.
            let m = unsafe { &*(mem as *const DeviceSlotMemory) };
            if flags & crate::cuda::gstcuda::MAP_CUDA != 0 {
                return m.device_ptr as glib::ffi::gpointer;
            }
            if flags & gst::ffi::GST_MAP_WRITE != 0 {
                return std::ptr::null_mut();
            }
            let host = m.host.get_or_init(|| {
                let mut v = vec![0u8; m.mem.maxsize].into_boxed_slice();
                (m.copy)(&mut v).ok().map(|_| v)
            });
            match host {
                Some(v) => v.as_ptr() as glib::ffi::gpointer,
                None => std::ptr::null_mut(),
            }
        }

        unsafe extern "C" fn mem_unmap(_mem: *mut gst::ffi::GstMemory) {}

        unsafe extern "C" fn mem_share(
            _mem: *mut gst::ffi::GstMemory,
            _offset: isize,
            _size: isize,
        ) -> *mut gst::ffi::GstMemory {
            // NO_SHARE: GStreamer copies instead.
            std::ptr::null_mut()
        }
    }
}
