// SPDX-License-Identifier: MPL-2.0
//! Registering a ring with CUDA for `__cuda_array_interface__` and DLPack: once per ring
//! mapping, on the first GPU use of one of its frames, through the core crate's CUDA layer
//! (`gpushm::cuda`, the one the GStreamer elements use). Until then this process loads no
//! CUDA library and creates no context.

use std::sync::Mutex;

use gpushm::cuda::register::{device_ptr_in, register_mapping, HostRegistration, NotRegistered};

use crate::held::FrameData;

/// Registering and attaching happen under one lock: two threads never register one range.
static REGISTER: Mutex<()> = Mutex::new(());

pub fn registrations() -> u64 {
    gpushm::cuda::register::registrations()
}

/// The device address of a frame's first byte and its device, registering its ring first if
/// needed.
pub fn device_ptr(data: &FrameData) -> Result<(u64, i32), String> {
    let ring = data.lease.0.ring();
    if data.on_device {
        // A device ring: mapped from GPU memory when it arrived.
        return device_ptr_in(ring.attachment(), data.ptr as *const u8)
            .ok_or_else(|| "the frame lies outside its ring's GPU memory".to_string());
    }
    if ring.attachment().is_none() {
        let _guard = REGISTER.lock().unwrap_or_else(|e| e.into_inner());
        if ring.attachment().is_none() {
            let read_only = !ring.is_writable();
            let att: Box<dyn std::any::Any + Send + Sync> = match usize::try_from(data.cuda_device)
                .map_err(|_| format!("cuda_device={} is not a device number", data.cuda_device))
                .and_then(|_| gpushm::cuda::device(data.cuda_device).map_err(|e| e.0))
            {
                Ok(dev) => {
                    let (base, len) = ring.mapping();
                    // SAFETY: the ring keeps base..base+len mapped while its attachment (the
                    // registration) lives, and drops the attachment first.
                    unsafe { register_mapping(&dev, base, len, read_only) }
                }
                Err(e) => Box::new(NotRegistered(e)),
            };
            ring.attach(att);
        }
    }
    let att = ring
        .attachment()
        .ok_or("the ring has no CUDA registration")?;
    if let Some(NotRegistered(why)) = att.downcast_ref::<NotRegistered>() {
        return Err(if why.contains("read-only") {
            format!("{why}, and frames are read-only; copy them (numpy) instead")
        } else {
            why.clone()
        });
    }
    let reg = att
        .downcast_ref::<HostRegistration>()
        .ok_or("the ring carries something else than a CUDA registration")?;
    let dev = reg
        .device_ptr_of(data.ptr as *const u8)
        .ok_or("the frame lies outside its ring's registration")?;
    Ok((dev, reg.device().ordinal as i32))
}

/// A copy of a device-ring frame's bytes in host memory.
pub fn copy_to_host(data: &FrameData) -> Result<Vec<u8>, String> {
    let mem = gpushm::cuda::vmm::of(data.lease.0.ring().attachment())
        .ok_or("the frame's ring has no GPU memory")?;
    let (src, _) = device_ptr(data)?;
    let mut v = vec![0u8; data.meta.payload_size as usize];
    mem.copy_to_host(src, &mut v).map_err(|e| e.0)?;
    Ok(v)
}
