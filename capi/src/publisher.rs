// SPDX-License-Identifier: MPL-2.0
//! Publishers and their slots: `gpushm_publisher_*`, `gpushm_slot_*`.

use super::*;

pub(crate) struct PubObj {
    pub(crate) p: Publisher,
}

pub(crate) struct SlotObj {
    pub(crate) lease: Mutex<Option<HeldSlot>>,
    pub(crate) publisher: u64,
    pub(crate) info: InfoCell,
}

pub(crate) struct HeldSlot(pub(crate) Slot);
// SAFETY: a lease of a slot of the publisher's ring; nothing in it is tied to a thread.
unsafe impl Send for HeldSlot {}

/// Fills `opts` with the defaults: GRAY8 (set format, width and height), 30/1 fps, 8 slots,
/// socket permissions 0600, host memory.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_options_init(
    opts: *mut gpushm_publisher_options,
) -> gpushm_status {
    guard(|| {
        let o = out_ptr(opts, "opts")?;
        // SAFETY: checked non-NULL; the caller's struct.
        unsafe {
            o.write(gpushm_publisher_options {
                format: std::ptr::null(),
                width: 0,
                height: 0,
                fps_n: 30,
                fps_d: 1,
                slots: 8,
                perms: 0o600,
                cuda_device: -1,
                spin_us: 0,
            })
        };
        Ok(GPUSHM_OK)
    })
}

/// Serves raw video at `path` (a unix socket it creates, removed on destroy; gpushmsrc and
/// subscribers connect there). `*out` is a publisher to destroy with
/// `gpushm_publisher_destroy`.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_open(
    path: *const c_char,
    opts: *const gpushm_publisher_options,
    out: *mut *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let path = PathBuf::from(unsafe { string(path, "path") }?);
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_publisher(path, opts, out) }
    })
}

/// Serves raw video like `gpushm_publisher_open`, as stream `name`: the socket is made in
/// $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or
/// /tmp/gpushm-UID, created mode 0700). Consumers give the same name (gpushmsrc stream=NAME,
/// `gpushm_subscriber_open_stream`). GPUSHM_ERROR_INVALID for a bad name or a directory that
/// cannot be trusted (another user's), saying why.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_open_stream(
    name: *const c_char,
    opts: *const gpushm_publisher_options,
    out: *mut *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let name = unsafe { string(name, "name") }?;
        let path = gpushm_core::names::producer_path(&name)?;
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_publisher(path, opts, out) }
    })
}

/// # Safety
/// `opts` is NULL or the caller's initialised struct; `out` is NULL or writable.
pub(crate) unsafe fn open_publisher(
    path: PathBuf,
    opts: *const gpushm_publisher_options,
    out: *mut *mut gpushm_publisher,
) -> Result<gpushm_status, Fail> {
    {
        let out = out_ptr(out, "out")?;
        if opts.is_null() {
            return Err(invalid(
                "opts is NULL (format, width and height are needed)",
            ));
        }
        // SAFETY: non-NULL, the caller's initialised struct.
        let o = unsafe { &*opts };
        // SAFETY: the caller's string.
        let name = unsafe { string(o.format, "opts->format") }?;
        let format = VideoFormat::from_name(&name)
            .ok_or_else(|| invalid(format!("format {name:?} is not one gpushm publishes")))?;
        let layout = FrameLayout::new(format, o.width, o.height)
            .ok_or_else(|| invalid(format!("{}x{} is not a frame size", o.width, o.height)))?;
        if o.fps_n == 0 || o.fps_d == 0 {
            return Err(invalid(format!("frame rate {}/{}", o.fps_n, o.fps_d)));
        }
        if !(2..=64).contains(&o.slots) {
            return Err(invalid(format!("{} slots: 2 to 64", o.slots)));
        }
        // Checked before the stream is served.
        let spin = Duration::from_micros(o.spin_us.into());
        gpushm_core::policy::check_spin(spin)?;
        let config = Config {
            perms: o.perms & 0o777,
            ..Config::default()
        };
        let p = if o.cuda_device >= 0 {
            let dev = gpushm_core::cuda::device(o.cuda_device)
                .map_err(|e| Fail(GPUSHM_ERROR_NO_GPU, e.to_string()))?;
            Publisher::new_on_device(&path, layout, (o.fps_n, o.fps_d), o.slots, config, dev)?
        } else {
            Publisher::new(&path, layout, (o.fps_n, o.fps_d), o.slots, config)?
        };
        p.set_spin(spin)?;
        let id = insert(&PUBLISHERS, Arc::new(PubObj { p }))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(id as *mut gpushm_publisher) };
        Ok(GPUSHM_OK)
    }
}

/// Lends a free slot to fill, waiting up to `timeout_ns` (negative: as long as it takes) while
/// consumers hold them all (GPUSHM_TIMEOUT). Fill it through `gpushm_slot_get_info`, then
/// `gpushm_publisher_publish` it (or `gpushm_slot_discard` it).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_acquire(
    publisher: *mut gpushm_publisher,
    timeout_ns: i64,
    slot: *mut *mut gpushm_slot,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(slot, "slot")?;
        let p = get(&PUBLISHERS, publisher as _, "publisher")?;
        let t = timeout(timeout_ns).unwrap_or(Duration::MAX);
        let mut lease = p.p.acquire(t)?;
        let mut info = empty_info();
        let on_device = lease.is_on_device();
        let layout = lease.layout().clone();
        let bytes = lease.bytes_mut();
        let base = if on_device {
            std::ptr::null_mut()
        } else {
            bytes.as_mut_ptr()
        };
        info.data = base;
        info.size = layout.size;
        info.on_device = on_device as c_int;
        describe(
            &mut info,
            layout.format.name(),
            layout.width,
            layout.height,
            &layout.planes,
            base,
        );
        let obj = SlotObj {
            lease: Mutex::new(Some(HeldSlot(lease))),
            publisher: publisher as u64,
            info: InfoCell(info),
        };
        let id = insert(&SLOTS, Arc::new(obj))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(id as *mut gpushm_slot) };
        Ok(GPUSHM_OK)
    })
}

/// Where to write the frame: the slot's planes (`data` NULL for a device ring's slot: write it
/// with `gpushm_slot_cuda_ptr`).
#[no_mangle]
pub unsafe extern "C" fn gpushm_slot_get_info(
    slot: *const gpushm_slot,
    info: *mut gpushm_frame_info,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(info, "info")?;
        let s = get(&SLOTS, slot as _, "slot")?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(s.info.0) };
        Ok(GPUSHM_OK)
    })
}

/// The device address of a device ring's slot (write the frame there with CUDA, and finish
/// before publishing); GPUSHM_ERROR_NO_GPU for a slot in host memory.
#[no_mangle]
pub unsafe extern "C" fn gpushm_slot_cuda_ptr(
    slot: *const gpushm_slot,
    device_ptr: *mut u64,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(device_ptr, "device_ptr")?;
        let s = get(&SLOTS, slot as _, "slot")?;
        let l = lock(&s.lease);
        let ptr = l
            .as_ref()
            .ok_or_else(|| Fail(GPUSHM_ERROR_RELEASED, "the slot was published".into()))?
            .0
            .device_ptr()
            .ok_or_else(|| Fail(GPUSHM_ERROR_NO_GPU, "the slot is in host memory".into()))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(ptr) };
        Ok(GPUSHM_OK)
    })
}

/// Publishes a filled slot to every consumer; `capture_ns` is when it was captured
/// (CLOCK_MONOTONIC ns; 0: now). The slot handle is gone after this call, whatever it returns.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_publish(
    publisher: *mut gpushm_publisher,
    slot: *mut gpushm_slot,
    capture_ns: u64,
) -> gpushm_status {
    guard(|| {
        let s = lock(&SLOTS)
            .remove(slot as u64)
            .ok_or_else(|| bad_handle("slot"))?;
        let p = get(&PUBLISHERS, publisher as _, "publisher")?;
        if s.publisher != publisher as u64 {
            return Err(invalid("the slot was lent by another publisher"));
        }
        let lease = lock(&s.lease)
            .take()
            .ok_or_else(|| Fail(GPUSHM_ERROR_RELEASED, "the slot was published".into()))?;
        p.p.publish(lease.0, (capture_ns != 0).then_some(capture_ns))?;
        Ok(GPUSHM_OK)
    })
}

/// Gives a slot back unpublished; the handle is gone after this call.
#[no_mangle]
pub unsafe extern "C" fn gpushm_slot_discard(slot: *mut gpushm_slot) -> gpushm_status {
    guard(|| {
        let s = lock(&SLOTS)
            .remove(slot as u64)
            .ok_or_else(|| bad_handle("slot"))?;
        drop(s);
        Ok(GPUSHM_OK)
    })
}

/// Tells every consumer the stream ended (they get GPUSHM_EOS after the frames before).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_send_eos(
    publisher: *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        get(&PUBLISHERS, publisher as _, "publisher")?.p.send_eos();
        Ok(GPUSHM_OK)
    })
}

/// Wakes the consumers that sleep waiting for a frame, ahead of the next one: call it a few
/// µs before `gpushm_publisher_publish` (as the frame's last step starts), so that their
/// wake-up (tens of µs on a core that idled) runs meanwhile. Once per frame; it wakes nobody
/// less than 0.5 ms after the last frame, nor a consumer that went to sleep on this thread's
/// CPU, nor one whose event loop polls `gpushm_subscriber_fd`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_wake_early(
    publisher: *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        get(&PUBLISHERS, publisher as _, "publisher")?
            .p
            .wake_early();
        Ok(GPUSHM_OK)
    })
}

/// Consumers woken ahead of a frame by `gpushm_publisher_wake_early` so far, one per consumer
/// and frame.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_woken_early(
    publisher: *mut gpushm_publisher,
    count: *mut u64,
) -> gpushm_status {
    publisher_count(publisher, count, |s| s.woken_early)
}

/// Writes one of `publisher`'s counts (picked from its stats) into `*count`.
pub(crate) fn publisher_count(
    publisher: *mut gpushm_publisher,
    count: *mut u64,
    pick: fn(&gpushm_core::publisher::Stats) -> u64,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(count, "count")?;
        let n = pick(&get(&PUBLISHERS, publisher as _, "publisher")?.p.stats().0);
        // SAFETY: checked non-NULL.
        unsafe { out.write(n) };
        Ok(GPUSHM_OK)
    })
}

/// Wakes the consumers that sleep waiting for a frame `us` microseconds before each frame is
/// due, as learnt from the intervals between the last frames published, from a thread of the
/// publisher (0, the default: never; at most 1000). A consumer woken from a sleep of a few ms
/// takes tens of µs to run (60-80 on the H100 machine): woken ahead, it is up and polling
/// (at most 100 µs, once per frame) when the frame lands. For streams of at most 500 frames
/// a second, never for a frame already half an interval late (a stream that stops costs
/// one wake-up), once per frame (`gpushm_publisher_wake_early` rings again only for a frame
/// that came more than 200 µs after it), by the same rules as `gpushm_publisher_wake_early`
/// (its CPU is the one the last frame was published from).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_set_wake_ahead(
    publisher: *mut gpushm_publisher,
    us: u32,
) -> gpushm_status {
    guard(|| {
        get(&PUBLISHERS, publisher as _, "publisher")?
            .p
            .set_wake_ahead(std::time::Duration::from_micros(us.into()))?;
        Ok(GPUSHM_OK)
    })
}

/// Consumers woken before a frame was due (`gpushm_publisher_set_wake_ahead`) so far, one per
/// consumer and frame (counted in `gpushm_publisher_woken_early` too).
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_woken_ahead(
    publisher: *mut gpushm_publisher,
    count: *mut u64,
) -> gpushm_status {
    publisher_count(publisher, count, |s| s.woken_ahead)
}

/// Consumers connected now.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_num_clients(
    publisher: *mut gpushm_publisher,
    count: *mut u32,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(count, "count")?;
        let n = get(&PUBLISHERS, publisher as _, "publisher")?
            .p
            .num_clients();
        // SAFETY: checked non-NULL.
        unsafe { out.write(n.min(u32::MAX as usize) as u32) };
        Ok(GPUSHM_OK)
    })
}

/// Stops serving (the socket file goes) and frees the publisher. Frames consumers hold stay
/// valid for them; slots it lent and not published are given back.
#[no_mangle]
pub unsafe extern "C" fn gpushm_publisher_destroy(
    publisher: *mut gpushm_publisher,
) -> gpushm_status {
    guard(|| {
        let p = lock(&PUBLISHERS)
            .remove(publisher as u64)
            .ok_or_else(|| bad_handle("publisher"))?;
        drop(p);
        Ok(GPUSHM_OK)
    })
}
