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
    wrap_slot_memory_keeping(ptr, maxsize, len, readonly, keep).0
}

/// [`wrap_slot_memory`], also returning where `keep` now lives. It stays there until the
/// memory is freed; whoever holds the memory's only reference may change it through that
/// pointer (before handing the memory on): the consumer makes memories ahead of their frames
/// and puts the frame's lease in when the frame comes.
pub fn wrap_slot_memory_keeping<K: Send + 'static>(
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
    // SAFETY: `ptr..ptr+maxsize` stays mapped while `keep` lives, which GStreamer guarantees
    // until `destroy` runs.
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
