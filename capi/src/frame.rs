// SPDX-License-Identifier: MPL-2.0
//! Frames: `gpushm_frame_*`, each holding its slot until released.

use super::*;
use gpushm_core::ring::frame::LayoutKey;

pub(crate) struct FrameObj {
    /// The frame (its lease keeps the slot and the ring's mapping), until released.
    pub(crate) frame: Mutex<Option<Frame>>,
    /// Its caps and plane layout, shared by every frame of that caps and layout.
    pub(crate) shape: Arc<Shape>,
}

/// A frame's or slot's description (plain data, with pointers into a mapping).
pub(crate) struct InfoCell(pub(crate) gpushm_frame_info);
// SAFETY: plain data; its pointers are into a mapping, only handed to the caller.
unsafe impl Send for InfoCell {}
unsafe impl Sync for InfoCell {}

/// What frames of one caps and layout share: the caps as a C string and the checked plane
/// layout, made once per caps and layout, not per frame (parsing the caps costs more than the
/// rest of a frame's way through this API).
pub(crate) struct Shape {
    pub(crate) caps: CString,
    /// Format, width, height and planes (their `data` NULL) of raw video; all 0 otherwise.
    pub(crate) template: InfoCell,
}

/// What decides a frame's [`Shape`]: its caps and the layout of its bytes.
pub(crate) struct ShapeKey {
    pub(crate) caps: Arc<str>,
    pub(crate) layout: LayoutKey,
}

/// The [`Shape`] of `f`: `last`'s when the caps and layout are the last frame's (the
/// subscriber's own cache, under the lock its frames are taken with).
#[inline(always)]
pub(crate) fn shape(f: &Frame, last: &mut Option<(ShapeKey, Arc<Shape>)>) -> Arc<Shape> {
    let layout = LayoutKey::of(&f.meta);
    if let Some((k, s)) = last.as_ref() {
        if k.layout == layout && (Arc::ptr_eq(&k.caps, &f.caps) || k.caps == f.caps) {
            return s.clone();
        }
    }
    new_shape(f, layout, last)
}

/// Makes the [`Shape`] of `f` (new caps or layout), keeps it in `last`.
#[cold]
#[inline(never)]
pub(crate) fn new_shape(
    f: &Frame,
    layout: LayoutKey,
    last: &mut Option<(ShapeKey, Arc<Shape>)>,
) -> Arc<Shape> {
    let m = &f.meta;
    let mut template = empty_info();
    if let Ok(g) = FrameGeometry::of_frame(m, &f.caps) {
        describe(
            &mut template,
            &g.format,
            g.width,
            g.height,
            &g.planes,
            std::ptr::null_mut(),
        );
    }
    let s = Arc::new(Shape {
        caps: CString::new(f.caps.replace('\0', " ")).unwrap_or_default(),
        template: InfoCell(template),
    });
    let key = ShapeKey {
        caps: f.caps.clone(),
        layout,
    };
    *last = Some((key, s.clone()));
    s
}

pub(crate) fn empty_info() -> gpushm_frame_info {
    gpushm_frame_info {
        format: [0; 16],
        width: 0,
        height: 0,
        n_planes: 0,
        planes: [gpushm_plane {
            data: std::ptr::null_mut(),
            stride: 0,
            rows: 0,
            row_bytes: 0,
            offset: 0,
        }; GPUSHM_MAX_PLANES],
        data: std::ptr::null_mut(),
        size: 0,
        pts: GPUSHM_TIME_NONE,
        dts: GPUSHM_TIME_NONE,
        duration: GPUSHM_TIME_NONE,
        offset: 0,
        flags: 0,
        publish_ns: 0,
        on_device: 0,
    }
}

pub(crate) fn set_format(info: &mut gpushm_frame_info, name: &str) {
    for (d, s) in info.format.iter_mut().zip(name.bytes().take(15)) {
        *d = s as c_char;
    }
}

/// Writes `f`'s description (of `shape`, its caps and layout) to `out`, in place: a frame
/// arrives to cold caches after a sleep, and each line of the stack a copy of the 300-byte
/// description goes through is a miss (see the README's "What the C layer costs").
///
/// # Safety
/// `out` is writable.
#[inline(always)]
pub(crate) unsafe fn describe_frame(shape: &Shape, f: &Frame, out: *mut gpushm_frame_info) {
    // SAFETY: the caller's pointer; the template is plain data.
    let info = unsafe {
        out.write(shape.template.0);
        &mut *out
    };
    let on_device = f.is_on_device();
    let (ptr, size) = f.as_ptr();
    let base = if on_device {
        std::ptr::null_mut()
    } else {
        ptr as *mut u8
    };
    info.data = base;
    info.size = size as u64;
    info.pts = f.meta.pts;
    info.dts = f.meta.dts;
    info.duration = f.meta.duration;
    info.offset = f.meta.offset;
    // Bits below GST_MINI_OBJECT_FLAG_LAST (1 << 4) are the mini object's, not the buffer's.
    info.flags = f.meta.buffer_flags & !0xf;
    info.publish_ns = f.meta.publish_ns;
    info.on_device = on_device as c_int;
    if !base.is_null() {
        let n = (info.n_planes as usize).min(GPUSHM_MAX_PLANES);
        for p in &mut info.planes[..n] {
            p.data = base.wrapping_add(p.offset as usize);
        }
    }
}

pub(crate) fn describe(
    info: &mut gpushm_frame_info,
    format: &str,
    width: u32,
    height: u32,
    planes: &[gpushm_core::format::Plane],
    base: *mut u8,
) {
    set_format(info, format);
    info.width = width;
    info.height = height;
    info.n_planes = planes.len().min(GPUSHM_MAX_PLANES) as u32;
    for (d, p) in info.planes.iter_mut().zip(planes) {
        *d = gpushm_plane {
            data: if base.is_null() {
                std::ptr::null_mut()
            } else {
                base.wrapping_add(p.offset as usize)
            },
            stride: p.stride,
            rows: p.rows,
            row_bytes: p.row_bytes,
            offset: p.offset,
        };
    }
}

/// Why `held` (a frame object's content) cannot be used, if it cannot.
pub(crate) fn unusable(held: Option<&Frame>) -> Option<Fail> {
    match held {
        None => Some(Fail(GPUSHM_ERROR_RELEASED, "the frame was released".into())),
        Some(h) if !h.lease.is_valid() => Some(Fail(
            GPUSHM_ERROR_REVOKED,
            format!(
                "the producer took the frame back: {}",
                h.lease.revoked().unwrap_or_default()
            ),
        )),
        Some(_) => None,
    }
}

pub(crate) fn live_frame(frame: *const gpushm_frame) -> Result<Arc<FrameObj>, Fail> {
    let f = get(&FRAMES, frame as _, "frame")?;
    let why = unusable(lock(&f.frame).as_ref());
    why.map_or(Ok(f), Err)
}

/// `*valid` is 1 while the frame is still this consumer's, 0 once the producer took it back
/// (see gpushm_frame): check it after reading a frame you kept for long, and drop what you
/// read if it is 0. GPUSHM_ERROR_RELEASED after release.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_is_valid(
    frame: *const gpushm_frame,
    valid: *mut c_int,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(valid, "valid")?;
        let v = match live_frame(frame) {
            Ok(_) => 1,
            Err(Fail(GPUSHM_ERROR_REVOKED, _)) => 0,
            Err(e) => return Err(e),
        };
        // SAFETY: checked non-NULL.
        unsafe { out.write(v) };
        Ok(GPUSHM_OK)
    })
}

/// Describes the frame: format, size, planes (pointers into the ring, valid until the frame
/// is released), time stamps, flags.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_get_info(
    frame: *const gpushm_frame,
    info: *mut gpushm_frame_info,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(info, "info")?;
        let f = get(&FRAMES, frame as _, "frame")?;
        let held = lock(&f.frame);
        if let Some(why) = unusable(held.as_ref()) {
            return Err(why);
        }
        // SAFETY: checked non-NULL.
        unsafe { describe_frame(&f.shape, held.as_ref().expect("checked"), out) };
        Ok(GPUSHM_OK)
    })
}

/// The frame's caps (a GStreamer caps string); the pointer stays valid until the frame is
/// destroyed.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_get_caps(
    frame: *const gpushm_frame,
    caps: *mut *const c_char,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(caps, "caps")?;
        let f = get(&FRAMES, frame as _, "frame")?;
        // SAFETY: checked non-NULL; the string lives in the frame's shape, which the frame
        // object keeps until its destroy call (a reused object takes another frame's shape
        // only after that).
        unsafe { out.write(f.shape.caps.as_ptr()) };
        Ok(GPUSHM_OK)
    })
}

/// The frame's address for CUDA kernels on `cuda_device` (an ordinal; -1: the first GPU), in
/// `*device_ptr` (a CUdeviceptr). A frame of a device ring is read there in place; a frame of a
/// host ring is read in place over the bus (or at memory speed on Jetson) once its ring is
/// registered with CUDA, which the first call for a ring does (once per ring, never per frame;
/// it creates this process's CUDA context). GPUSHM_ERROR_NO_GPU without a usable GPU.
#[no_mangle]
pub unsafe extern "C" fn gpushm_frame_cuda_ptr(
    frame: *const gpushm_frame,
    cuda_device: c_int,
    device_ptr: *mut u64,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(device_ptr, "device_ptr")?;
        let f = live_frame(frame)?;
        let guard = lock(&f.frame);
        let held = guard
            .as_ref()
            .ok_or_else(|| Fail(GPUSHM_ERROR_RELEASED, "the frame was released".into()))?;
        let frame = held;
        if frame.device_ptr().is_none() && !frame.is_on_device() {
            let dev = gpushm_core::cuda::device(cuda_device)
                .map_err(|e| Fail(GPUSHM_ERROR_NO_GPU, e.to_string()))?;
            let ring = frame.lease.ring();
            // One registration per ring, whichever threads ask at once.
            static REGISTERING: Mutex<()> = Mutex::new(());
            let _one = lock(&REGISTERING);
            if ring.attachment().is_none() {
                let (base, len) = ring.mapping();
                // SAFETY: the registration is attached to the ring and dropped with it,
                // before its mapping.
                let att = unsafe {
                    gpushm_core::cuda::register::register_mapping(
                        &dev,
                        base,
                        len,
                        !ring.is_writable(),
                    )
                };
                ring.attach(att);
            }
            if let Some(why) = ring
                .attachment()
                .and_then(|a| a.downcast_ref::<gpushm_core::cuda::register::NotRegistered>())
            {
                return Err(Fail(
                    GPUSHM_ERROR_NO_GPU,
                    format!("the ring cannot be registered with {}: {}", dev.name, why.0),
                ));
            }
        }
        let (ptr, dev) = frame.device_ptr().ok_or_else(|| {
            Fail(
                GPUSHM_ERROR_NO_GPU,
                "the frame has no device address".into(),
            )
        })?;
        if cuda_device >= 0 && dev != cuda_device {
            return Err(Fail(
                GPUSHM_ERROR_NO_GPU,
                format!("the frame is on GPU {dev}, not {cuda_device}"),
            ));
        }
        // SAFETY: checked non-NULL.
        unsafe { out.write(ptr) };
        Ok(GPUSHM_OK)
    })
}

/// Gives the frame back to the producer: its pointers are invalid from now on, and further
/// calls on it (but `gpushm_frame_destroy`) return GPUSHM_ERROR_RELEASED.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_frame_release(frame: *mut gpushm_frame) -> gpushm_status {
    guard(|| {
        let f = get(&FRAMES, frame as _, "frame")?;
        let held = lock(&f.frame).take();
        match held {
            Some(h) => {
                drop(h);
                Ok(GPUSHM_OK)
            }
            None => Err(Fail(
                GPUSHM_ERROR_RELEASED,
                "the frame was released already".into(),
            )),
        }
    })
}

/// Frees the frame handle, releasing the frame first if it was not.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_frame_destroy(frame: *mut gpushm_frame) -> gpushm_status {
    guard(|| {
        let mut f = lock(&FRAMES)
            .remove(frame as u64)
            .ok_or_else(|| bad_handle("frame"))?;
        // The last holder (no other thread is in a call on it): its frame goes back now,
        // outside the table's lock (a release may ring the producer), and the object is kept
        // for the next frame.
        if let Some(o) = Arc::get_mut(&mut f) {
            drop(o.frame.get_mut().unwrap_or_else(|e| e.into_inner()).take());
            let mut frames = lock(&FRAMES);
            if frames.spare.len() < SPARE_FRAMES {
                frames.spare.push(f);
                return Ok(GPUSHM_OK);
            }
        }
        drop(f);
        Ok(GPUSHM_OK)
    })
}
