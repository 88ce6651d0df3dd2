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
