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

/// Copies a device frame's bytes to host memory (the destination is the frame's length).
pub type CopyToHost = Box<dyn Fn(&mut [u8]) -> Result<(), String> + Send + Sync>;

/// A GstMemory over a frame of a device ring (GPU memory), without copying it: mapped with
/// GST_MAP_CUDA (gst/cuda's flag) it gives the frame's device address, as a GstCudaMemory
/// does; mapped for reading by the CPU it gives a host copy made at the first such map
/// (`copy`) and kept with the memory. It is read-only; shares of it (sub-buffers, shallow
/// copies) keep the frame too. `keep` is dropped when the memory and its shares are freed: it
/// holds the frame's lease, so the device address stays valid and unchanged until then.
pub fn wrap_device_slot_memory<K: Send + 'static>(
    device_ptr: u64,
    len: usize,
    copy: CopyToHost,
    keep: Box<K>,
) -> gst::Memory {
    device::wrap(device_ptr, len, copy, keep)
}

mod device {
    use std::sync::{Arc, OnceLock};

    use gst::glib;
    use gst::glib::translate::{from_glib_full, ToGlibPtr};
    use gst::prelude::*;
    use gst::subclass::prelude::*;

    use super::CopyToHost;

    /// What a memory and its shares have in common.
    struct Frame {
        device_ptr: u64,
        copy: CopyToHost,
        /// The host copy of the whole frame, made at the first CPU map (`None`: it failed).
        host: OnceLock<Option<Box<[u8]>>>,
        _keep: Box<dyn Send>,
    }

    // SAFETY: the host copy is written once (OnceLock), then only read; `copy` is Sync.
    unsafe impl Sync for Frame {}

    #[repr(C)]
    struct DeviceSlotMemory {
        mem: gst::ffi::GstMemory,
        frame: Arc<Frame>,
    }

    glib::wrapper! {
        pub struct DeviceSlotAllocator(ObjectSubclass<imp::DeviceSlotAllocator>)
            @extends gst::Allocator, gst::Object;
    }

    fn allocator() -> *mut gst::ffi::GstAllocator {
        static ALLOCATOR: OnceLock<DeviceSlotAllocator> = OnceLock::new();
        let a = ALLOCATOR.get_or_init(glib::Object::new);
        a.upcast_ref::<gst::Allocator>().to_glib_none().0
    }

    /// # Safety
    /// `parent` is NULL or a live DeviceSlotMemory; the other values fit it.
    #[allow(clippy::too_many_arguments)]
    unsafe fn new_memory(
        frame: Arc<Frame>,
        flags: u32,
        parent: *mut gst::ffi::GstMemory,
        maxsize: usize,
        offset: usize,
        size: usize,
    ) -> *mut gst::ffi::GstMemory {
        let m = Box::into_raw(Box::new(DeviceSlotMemory {
            // SAFETY: a plain C struct; gst_memory_init below sets every field.
            mem: unsafe { std::mem::zeroed() },
            frame,
        }));
        // SAFETY: `m` is a fresh DeviceSlotMemory whose first field is its GstMemory; the
        // allocator frees it (imp::free) when the last reference goes.
        unsafe {
            gst::ffi::gst_memory_init(
                std::ptr::addr_of_mut!((*m).mem),
                flags,
                allocator(),
                parent,
                maxsize,
                0,
                offset,
                size,
            );
        }
        m as *mut gst::ffi::GstMemory
    }

    pub(super) fn wrap<K: Send + 'static>(
        device_ptr: u64,
        len: usize,
        copy: CopyToHost,
        keep: Box<K>,
    ) -> gst::Memory {
        let frame = Arc::new(Frame {
            device_ptr,
            copy,
            host: OnceLock::new(),
            _keep: keep,
        });
        // SAFETY: no parent; the memory is handed over with its one reference.
        unsafe {
            from_glib_full(new_memory(
                frame,
                gst::ffi::GST_MEMORY_FLAG_READONLY,
                std::ptr::null_mut(),
                len,
                0,
                len,
            ))
        }
    }

    pub mod imp {
        use super::*;

        #[derive(Default)]
        pub struct DeviceSlotAllocator;

        impl ObjectImpl for DeviceSlotAllocator {}
        impl GstObjectImpl for DeviceSlotAllocator {}

        // SAFETY: alloc gives nothing (CUSTOM_ALLOC: memories are made by wrap() and shares
        // only) and free takes back exactly what new_memory() made.
        unsafe impl AllocatorImpl for DeviceSlotAllocator {
            unsafe fn alloc(
                &self,
                _size: usize,
                _params: &gst::AllocationParams,
            ) -> *mut gst::ffi::GstMemory {
                std::ptr::null_mut()
            }

            unsafe fn free(&self, mem: *mut gst::ffi::GstMemory) {
                // SAFETY: made by new_memory(), freed once (GStreamer unrefs the parent).
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

        /// The frame's device address (GST_MAP_CUDA) or its host copy, both from the first
        /// byte of the whole frame (gst_memory_map adds the memory's offset).
        unsafe extern "C" fn mem_map(
            mem: *mut gst::ffi::GstMemory,
            _maxsize: usize,
            flags: gst::ffi::GstMapFlags,
        ) -> glib::ffi::gpointer {
            // SAFETY: a memory made by new_memory(), alive while mapped.
            let m = unsafe { &*(mem as *const DeviceSlotMemory) };
            if flags & crate::cuda::gstcuda::MAP_CUDA != 0 {
                return m.frame.device_ptr as glib::ffi::gpointer;
            }
            if flags & gst::ffi::GST_MAP_WRITE != 0 {
                return std::ptr::null_mut();
            }
            let f = &m.frame;
            let host = f.host.get_or_init(|| {
                let mut v = vec![0u8; m.mem.maxsize].into_boxed_slice();
                (f.copy)(&mut v).ok().map(|_| v)
            });
            match host {
                Some(v) => v.as_ptr() as glib::ffi::gpointer,
                None => std::ptr::null_mut(),
            }
        }

        unsafe extern "C" fn mem_unmap(_mem: *mut gst::ffi::GstMemory) {}

        /// A share (a sub-buffer, a region): the same frame, a part of it.
        unsafe extern "C" fn mem_share(
            mem: *mut gst::ffi::GstMemory,
            offset: isize,
            size: isize,
        ) -> *mut gst::ffi::GstMemory {
            // SAFETY: a live memory made by new_memory().
            unsafe {
                let m = &*(mem as *const DeviceSlotMemory);
                let parent = if m.mem.parent.is_null() {
                    mem
                } else {
                    m.mem.parent
                };
                // Offsets and sizes wrap around as GStreamer's own memories take them.
                let new_offset = m.mem.offset.wrapping_add(offset as usize);
                let size = if size == -1 {
                    m.mem.size.wrapping_sub(offset as usize)
                } else {
                    size as usize
                };
                if new_offset
                    .checked_add(size)
                    .is_none_or(|e| e > m.mem.maxsize)
                {
                    return std::ptr::null_mut();
                }
                new_memory(
                    m.frame.clone(),
                    m.mem.mini_object.flags | gst::ffi::GST_MINI_OBJECT_FLAG_LOCK_READONLY,
                    parent,
                    m.mem.maxsize,
                    new_offset,
                    size,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A device-slot memory without a GPU: its "device" bytes come from a closure. The CPU
    /// map copies them once; shares and shallow copies keep the frame (and its GpuShmCudaMeta),
    /// a deep copy keeps the bytes but not the meta; the lease goes with the last share.
    #[test]
    fn device_slot_memory_maps_once_shares_and_keeps_its_frame_until_the_last_share() {
        gst::init().unwrap();
        struct Lease(Arc<AtomicUsize>);
        impl Drop for Lease {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let copies = Arc::new(AtomicUsize::new(0));
        let released = Arc::new(AtomicUsize::new(0));
        let c = copies.clone();
        let mem = wrap_device_slot_memory(
            0xdead_0000,
            64,
            Box::new(move |dst: &mut [u8]| {
                c.fetch_add(1, Ordering::SeqCst);
                for (i, b) in dst.iter_mut().enumerate() {
                    *b = i as u8;
                }
                Ok(())
            }),
            Box::new(Lease(released.clone())),
        );
        let mut buf = gst::Buffer::new();
        {
            let b = buf.get_mut().unwrap();
            b.append_memory(mem);
            crate::cudameta::add(
                b,
                crate::cudameta::CudaPtr {
                    device: 0,
                    device_ptr: 0xdead_0000,
                    size: 64,
                    read_only: true,
                },
            );
        }
        assert!(
            buf.peek_memory(0)
                .flags()
                .contains(gst::MemoryFlags::READONLY),
            "a frame is read-only"
        );
        assert!(
            buf.memory(0)
                .unwrap()
                .into_mapped_memory_writable()
                .is_err(),
            "a frame cannot be mapped for writing"
        );
        assert_eq!(&buf.map_readable().unwrap()[..4], &[0, 1, 2, 3]);
        assert_eq!(buf.map_readable().unwrap()[63], 63);
        assert_eq!(copies.load(Ordering::SeqCst), 1, "one host copy per frame");
        // A share: the same frame, from an offset.
        let sub = buf
            .copy_region(gst::BufferCopyFlags::MEMORY, 16..32)
            .unwrap();
        assert_eq!(sub.map_readable().unwrap()[0], 16);
        // A shallow copy keeps the memory and the device pointer.
        let shallow = buf.copy();
        assert!(
            crate::cudameta::get(&shallow).is_some(),
            "a shallow copy keeps the meta"
        );
        // A deep copy: the bytes, not the frame; no device pointer to a slot it does not keep.
        let deep = buf.copy_deep().unwrap();
        assert_eq!(deep.map_readable().unwrap()[5], 5);
        assert!(
            crate::cudameta::get(&deep).is_none(),
            "a deep copy drops the meta"
        );
        drop(buf);
        drop(shallow);
        assert_eq!(
            released.load(Ordering::SeqCst),
            0,
            "a share still holds the frame"
        );
        drop(sub);
        assert_eq!(
            released.load(Ordering::SeqCst),
            1,
            "the last share let the frame go"
        );
        drop(deep);
    }
}
