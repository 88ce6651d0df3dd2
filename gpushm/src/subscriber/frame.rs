// SPDX-License-Identifier: MPL-2.0
//! A frame taken from the ring: its metadata, where its bytes are (host memory or a device
//! ring's GPU memory) and its lease.

use std::sync::Arc;

use super::lease::SlotLease;
use crate::ring::frame::FrameMeta;
use crate::{Error, Result};

/// A frame taken from the ring.
pub struct Frame {
    pub meta: FrameMeta,
    pub seq: u64,
    /// First byte of the slot; `meta.payload_size` bytes are valid while `lease` lives.
    pub ptr: *const u8,
    pub caps: Arc<str>,
    pub lease: SlotLease,
    /// The stream's events that come before this frame (see [`crate::wire`]), in order: the
    /// producer's encoding (gpushmsink's: `src/events.rs`).
    pub events: Vec<Arc<str>>,
    /// The producer's metas of this frame that the ring has no field for (see
    /// [`crate::wire`], FrameMetas): the producer's encoding (gpushmsink's:
    /// `src/frame_metas.rs`).
    pub metas: Option<Arc<str>>,
}

// SAFETY: `ptr` points into a read-only mapping kept alive by `lease`.
unsafe impl Send for Frame {}

impl Frame {
    /// Whether the frame's bytes are in GPU memory (a device ring): read them through
    /// [`Self::device_ptr`], or copy them with [`Self::to_vec`]; [`Self::as_ptr`] does not
    /// point at them.
    pub fn is_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            crate::cuda::vmm::of(self.lease.ring().attachment()).is_some()
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Where the frame's bytes are for a GPU, and on which device (its ordinal in this
    /// process): in a device ring, or in a host ring registered with CUDA (see
    /// [`crate::cuda::register`]). Valid, and unchanged, while this frame lives.
    #[cfg(feature = "cuda")]
    pub fn device_ptr(&self) -> Option<(u64, i32)> {
        crate::cuda::register::device_ptr_in(self.lease.ring().attachment(), self.ptr)
    }

    /// The frame's layout as its producer published it, checked against its slot (see
    /// [`crate::format::FrameGeometry::of_frame`]): any raw video format; an error for other
    /// streams and layouts that cannot be viewed plane by plane ([`Self::to_vec`] and
    /// [`Self::as_ptr`] still give the bytes).
    pub fn layout(&self) -> std::result::Result<crate::format::FrameGeometry, String> {
        crate::format::FrameGeometry::of_frame(&self.meta, &self.caps)
    }

    /// The frame's bytes (`meta.payload_size`), copied out of the ring (out of GPU memory
    /// for a frame [`Self::is_on_device`]: empty if that copy fails, which only a GPU fault
    /// can make it do).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.meta.payload_size as usize];
        match self.copy_to(&mut v) {
            Ok(()) => v,
            Err(_) => Vec::new(),
        }
    }

    /// Copies the frame's bytes (`meta.payload_size`, which `dst` must be long) into `dst`:
    /// from the ring's host memory, or from GPU memory for a frame [`Self::is_on_device`].
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<()> {
        let n = self.meta.payload_size as usize;
        if dst.len() != n {
            return Err(Error::Invalid(format!(
                "the frame is {n} bytes, the destination {}",
                dst.len()
            )));
        }
        #[cfg(feature = "cuda")]
        if let Some(mem) = crate::cuda::vmm::of(self.lease.ring().attachment()) {
            let src = mem.device_ptr_of(self.ptr).ok_or_else(|| {
                Error::Invalid("the frame lies outside its ring's GPU memory".into())
            })?;
            return mem
                .copy_to_host(src, dst)
                .map_err(|e| Error::Invalid(format!("copying the frame from the GPU: {e}")));
        }
        // SAFETY: the lease keeps `n` bytes at `ptr` mapped (checked against the slot by
        // read_frame); a raw copy forms no reference to shared memory.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst.as_mut_ptr(), n) };
        Ok(())
    }

    /// Where the frame's bytes are, and how many: for handing to a GPU or an array library
    /// without a copy. They stay valid and unchanged while this frame (its lease) lives. For a
    /// frame [`Self::is_on_device`] this is its place in the ring's host memory, which holds
    /// no pixels: use [`Self::device_ptr`].
    pub fn as_ptr(&self) -> (*const u8, usize) {
        (self.ptr, self.meta.payload_size as usize)
    }
}
