// SPDX-License-Identifier: MPL-2.0
//! From a frame of the ring to a GstBuffer: the caps' stream, buffers and metas made ahead,
//! zero-copy memories or copies past the budget, layout checks, flags and timecodes.

use super::*;

/// The buffer made ahead for the next frame of `stream`, with the memory of the slot that
/// frame is expected in (`slot`) when there is one.
pub(super) struct Ahead {
    stream: Arc<Stream>,
    buffer: gst::Buffer,
    slot: Option<AheadSlot>,
    metas: AheadMetas,
}

/// The metas of the buffer made ahead, filled in through these pointers when its frame comes
/// (looking them up after the wake-up costs ~1 µs each on the frame's way, 2-core VM).
#[derive(Clone, Copy)]
pub(super) struct AheadMetas {
    /// Raw video: its VideoMeta.
    video: Option<std::ptr::NonNull<gst_video::ffi::GstVideoMeta>>,
    /// The publish-time ReferenceTimestampMeta.
    publish: std::ptr::NonNull<gst::ffi::GstReferenceTimestampMeta>,
}

// SAFETY: the metas belong to the buffer made ahead, which only the Worker holding it (its
// only reference) reads or writes.
unsafe impl Send for AheadMetas {}

/// A spare memory ([`SpareMemory`]) put in the buffer made ahead: that buffer holds its only
/// reference, and the Worker the buffer's.
pub(super) struct AheadSlot {
    ptr: usize,
    size: usize,
    notify: *mut NotifyOnRelease,
}

// SAFETY: see SpareMemory: `notify` points into the Box owned by the memory in the buffer made
// ahead, written only by the Worker, which holds that buffer's only reference.
unsafe impl Send for AheadSlot {}

/// Spare memories kept at most (more than any ring has slots in practice).
pub(super) const MAX_SPARES: usize = 64;

/// A GstMemory over `size` bytes at `ptr`, with no lease yet: [`SpareMemory::fill`] puts in
/// the lease of the frame that comes there, before the memory goes anywhere (until then nothing
/// maps it, and nothing keeps that address mapped). A raw pointer rather than a shared cell:
/// the fill is on the frame's way, and a plain store costs least there.
pub(super) struct SpareMemory {
    ptr: usize,
    size: usize,
    mem: gst::Memory,
    notify: *mut NotifyOnRelease,
}

// SAFETY: `notify` points into the Box that `mem` owns (freed only with `mem`); only the
// holder of this SpareMemory, which holds `mem`'s only reference, writes through it.
unsafe impl Send for SpareMemory {}

impl SpareMemory {
    /// Puts `lease` in and hands the memory out (once: it consumes the spare).
    fn fill(self, lease: gpushm::subscriber::SlotLease) -> gst::Memory {
        // SAFETY: `self.mem` holds its only reference (made ahead, never handed out), so the
        // NotifyOnRelease it owns is alive and nothing else reads or writes it; the lease
        // keeps `ptr` mapped from here on.
        unsafe { (*self.notify).lease = Some(lease) };
        self.mem
    }
}

impl Worker {
    pub(super) fn stream(&mut self, caps: &Arc<str>) -> Result<Arc<Stream>, gst::ErrorMessage> {
        if let Some((c, stream)) = &self.info {
            if c == caps {
                return Ok(stream.clone());
            }
        }
        let parsed = gst::Caps::from_str(caps).map_err(|_| {
            gst::error_msg!(
                gst::StreamError::Format,
                ("The producer sent unparsable caps {}", caps)
            )
        })?;
        if parsed.is_any() {
            // A stream without caps (the producer got none): bytes, pushed without caps.
            let stream = Arc::new(Stream {
                video: None,
                headers: Vec::new(),
            });
            self.info = Some((caps.clone(), stream.clone()));
            return Ok(stream);
        }
        let st = parsed.structure(0).ok_or_else(|| {
            gst::error_msg!(
                gst::StreamError::Format,
                ("The producer sent empty caps {}", caps)
            )
        })?;
        let video = if st.name() == "video/x-raw" {
            // The producer sends planes for what GstVideo knows, and opaque bytes otherwise.
            gst_video::VideoInfo::from_caps(&parsed).ok()
        } else {
            None
        };
        let headers = st
            .get::<gst::Array>("streamheader")
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.get::<gst::Buffer>().ok())
                    .map(|mut b| {
                        b.make_mut().set_flags(gst::BufferFlags::HEADER);
                        b
                    })
                    .collect()
            })
            .unwrap_or_default();
        let stream = Arc::new(Stream { video, headers });
        self.info = Some((caps.clone(), stream.clone()));
        Ok(stream)
    }

    /// Makes the next frame's buffer and metas now, while no frame waits: after a wake-up
    /// they cost several times more (cold caches), on the way of the frame.
    pub(super) fn make_ahead(&mut self) {
        let Some((_, stream)) = &self.info else {
            return;
        };
        if !self
            .ahead
            .as_ref()
            .is_some_and(|a| Arc::ptr_eq(&a.stream, stream))
        {
            self.ahead = Self::new_ahead(stream);
        }
        self.put_expected_slot();
    }

    /// Low-latency mode: reads what the next frame's way reads (the buffer made ahead and its
    /// metas, the queue, and, where the streaming thread itself polls, the element's and its
    /// pads' fields), as the poll for the frame starts (see
    /// `Subscriber::next_frame_warming`): after a sleep, each of those reads is a cache and
    /// TLB miss on the frame's way. Waits for no lock but object locks.
    pub(super) fn warm_up(&self) {
        if let Some(a) = &self.ahead {
            let b: &gst::BufferRef = &a.buffer;
            std::hint::black_box((b.n_memory(), b.flags(), b.size()));
            if let Some(vm) = a.metas.video {
                // SAFETY: the VideoMeta of the buffer made ahead, which we hold.
                std::hint::black_box(unsafe { (*vm.as_ptr()).offset[0] });
            }
            // SAFETY: the publish meta of the buffer made ahead, which we hold.
            std::hint::black_box(unsafe { (*a.metas.publish.as_ptr()).timestamp });
        }
        let sh = &self.shared;
        std::hint::black_box((
            sh.q.try_lock().is_ok(),
            sh.received.load(Ordering::Relaxed),
            sh.producer_dropped.load(Ordering::Relaxed),
            sh.latency.load(Ordering::Relaxed),
            sh.spin_caught.load(Ordering::Relaxed),
        ));
        // The receiver thread (the streaming thread away pushing) would warm another core's
        // caches, and contend with the streaming thread for the element's locks.
        if !sh.streaming_reads.load(Ordering::Relaxed) {
            return;
        }
        if let Some(e) = self.element.upgrade() {
            gst::subclass::prelude::ObjectSubclassIsExt::imp(&e).warm_up();
        }
    }

    /// An empty buffer with the metas every frame of `stream` gets.
    pub(super) fn new_ahead(stream: &Arc<Stream>) -> Option<Ahead> {
        let mut buffer = gst::Buffer::new();
        let b = buffer.get_mut()?;
        let video = match &stream.video {
            Some(info) => {
                let n = info.n_planes() as usize;
                let mut vm = gst_video::VideoMeta::add_full(
                    b,
                    gst_video::VideoFrameFlags::empty(),
                    info.format(),
                    info.width(),
                    info.height(),
                    &info.offset()[..n],
                    &info.stride()[..n],
                )
                .ok()?;
                Some(std::ptr::NonNull::new(vm.as_mut_ptr())?)
            }
            None => None,
        };
        let mut publish =
            gst::ReferenceTimestampMeta::add(b, &publish_caps(), gst::ClockTime::ZERO, None);
        let publish = std::ptr::NonNull::new(publish.as_mut_ptr())?;
        Some(Ahead {
            stream: stream.clone(),
            buffer,
            slot: None,
            metas: AheadMetas { video, publish },
        })
    }

    /// Puts the spare memory of the slot the next frame is expected in (the one that followed
    /// the last frame's slot last time) in the buffer made ahead: appending a memory after
    /// the wake-up costs ~3 µs on the frame's way (2-core VM).
    pub(super) fn put_expected_slot(&mut self) {
        let Some(ahead) = self.ahead.as_mut() else {
            return;
        };
        if ahead.slot.is_some() || ahead.stream.video.is_none() {
            return;
        }
        let Some((prev, _)) = self.prev_slot else {
            return;
        };
        let Some(&(_, next)) = self.next_slot.iter().find(|(from, _)| *from == prev) else {
            return;
        };
        let Some(i) = self.spares.iter().position(|s| s.ptr == next) else {
            return;
        };
        let Some(b) = ahead.buffer.get_mut() else {
            return;
        };
        let spare = self.spares.swap_remove(i);
        ahead.slot = Some(AheadSlot {
            ptr: spare.ptr,
            size: spare.size,
            notify: spare.notify,
        });
        b.append_memory(spare.mem);
    }

    /// A zero-copy raw-video frame came at `ptr`: learns which slot follows which.
    pub(super) fn note_slot(&mut self, ptr: usize, size: usize) {
        if let Some((prev, _)) = self.prev_slot.replace((ptr, size)) {
            match self.next_slot.iter_mut().find(|(from, _)| *from == prev) {
                Some(e) => e.1 = ptr,
                None => {
                    if self.next_slot.len() >= MAX_SPARES {
                        self.next_slot.remove(0);
                    }
                    self.next_slot.push((prev, ptr));
                }
            }
        }
    }

    /// Makes a memory ahead over the slot of the last zero-copy frame, for the next frame
    /// that comes in it.
    pub(super) fn make_spare(&mut self) {
        let Some((ptr, size)) = self.prev_slot else {
            return;
        };
        if self.spares.iter().any(|s| s.ptr == ptr && s.size == size) {
            return;
        }
        if self.spares.len() >= MAX_SPARES {
            self.spares.remove(0);
        }
        // SAFETY: `notify` is written only by SpareMemory::fill, while the spare holds the
        // memory's only reference.
        let (mem, notify) = unsafe {
            wrap_slot_memory_keeping(
                ptr as *mut u8,
                size,
                size,
                true,
                Box::new(NotifyOnRelease {
                    lease: None,
                    shared: Arc::downgrade(&self.shared),
                }),
            )
        };
        self.spares.push(SpareMemory {
            ptr,
            size,
            mem,
            notify,
        });
    }

    /// Wraps a frame in a buffer: zero-copy while we are within our budget, otherwise a copy
    /// in system memory whose slot goes back at once.
    pub(super) fn build(
        &mut self,
        conn: &Subscriber,
        frame: Frame,
        arrival_ns: u64,
    ) -> Result<Option<Received>, gst::ErrorMessage> {
        let stream = self.stream(&frame.caps)?;
        if let Some(info) = &stream.video {
            let key = LayoutKey::of(&frame.meta);
            let known = self
                .checked
                .as_ref()
                .is_some_and(|(s, k)| Arc::ptr_eq(s, &stream) && *k == key);
            if !known {
                check_layout(&frame, info).map_err(|msg| {
                    gst::error_msg!(
                        gst::StreamError::Decode,
                        ("The producer sent an invalid frame: {}", msg)
                    )
                })?;
                self.checked = Some((stream.clone(), key));
            }
        }
        let m = frame.meta;
        let lossless = self
            .link
            .options()
            .delivery()
            .lossless_for(m.live, &frame.caps);
        if stream.video.is_none() {
            let dropped = conn.dropped();
            if self.shared.regate.swap(false, Ordering::Relaxed) || dropped != self.dropped_seen {
                // Frames were missed: what follows may refer to them.
                self.need_keyframe = true;
            }
            let flags = gst::BufferFlags::from_bits_truncate(m.buffer_flags);
            if self.need_keyframe
                && flags.contains(gst::BufferFlags::DELTA_UNIT)
                && !flags.contains(gst::BufferFlags::HEADER)
            {
                // A decoder cannot start here: wait for the next keyframe, and ask the
                // producer's encoder for one (once; its rate limit bounds the rest).
                if !std::mem::replace(&mut self.asked_keyframe, true) {
                    if let Err(e) = conn.send_upstream(&crate::events::force_key_unit()) {
                        gst::debug!(CAT, "asking the producer for a keyframe: {e}");
                    }
                }
                self.dropped_seen = dropped;
                self.discont = true;
                self.shared.skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            self.need_keyframe = false;
            self.asked_keyframe = false;
        }
        // The first buffer of a connection that joined mid-way: the caps' stream headers go
        // first (a buffer flagged HEADER means we joined at the start, where they are).
        let headers = if std::mem::take(&mut self.fresh)
            && !gst::BufferFlags::from_bits_truncate(m.buffer_flags)
                .contains(gst::BufferFlags::HEADER)
        {
            stream.headers.clone()
        } else {
            Vec::new()
        };
        let size = m.payload_size as usize;
        let mut copy = conn.should_copy();
        if copy.is_some() && lossless && !m.live {
            // A producer that is not live loses nothing by waiting. While frames wait in our
            // own queue, downstream is only slow to take them: wait until it takes one (the
            // producer waits meanwhile) and keep this frame zero-copy.
            let mut q = self.shared.queue();
            while copy.is_some() && !q.items.is_empty() && !q.stopping && !q.paused {
                // Woken as soon as downstream drops a frame (NotifyOnRelease) or takes one.
                q = self.shared.wait_release(q, Duration::from_millis(5));
                copy = conn.should_copy();
            }
        }
        let may_wait = self
            .no_wait_until
            .is_none_or(|t| std::time::Instant::now() >= t);
        if copy.is_some() && lossless && !m.live && may_wait {
            // Our queue is empty: downstream holds the frames. Give it a moment to hand one
            // back.
            let deadline = std::time::Instant::now() + NON_LIVE_WAIT;
            let mut q = self.shared.queue();
            while copy.is_some() && !q.stopping {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                // Woken as soon as downstream drops a frame (NotifyOnRelease).
                q = self.shared.wait_release(q, left);
                copy = conn.should_copy();
            }
            drop(q);
            if copy.is_some() {
                // Downstream keeps frames until it gets more: not waited for again for a
                // while, longer each time waiting does not help.
                self.futile_waits = (self.futile_waits + 1).min(6);
                let pause = NON_LIVE_WAIT_BACKOFF * (1 << (self.futile_waits - 1));
                self.no_wait_until = Some(std::time::Instant::now() + pause);
                gst::debug!(
                    CAT,
                    "downstream handed no frame back in {NON_LIVE_WAIT:?}: copying without waiting for {pause:?}"
                );
            } else {
                self.futile_waits = 0;
                self.no_wait_until = None;
            }
        }
        // The buffer made ahead, unless the stream changed or the frame has no publish time.
        let publish_ts = clock_time(m.publish_ns);
        let mut ahead = self
            .ahead
            .take()
            .filter(|a| Arc::ptr_eq(&a.stream, &stream) && publish_ts.is_some());
        let mut slot = None;
        let on_device = frame.is_on_device();
        let device = frame.device_ptr().filter(|_| on_device).map(|(_, d)| d);
        // Downstream takes this stream in CUDA memory: a device frame goes there on the GPU.
        let cuda_out = on_device
            .then(|| self.shared.cuda_out_for(&frame.caps))
            .flatten()
            .filter(|_| size > 0 && stream.video.is_some());
        let mut cuda_buffer = None;
        let frame_caps = frame.caps.clone();
        let producer_metas = frame.metas.clone();
        // Some(None): the frame's memory is in the buffer made ahead already.
        let mem = if let Some(out) = cuda_out {
            // In CUDA memory: the ring's GPU memory wrapped in place where GStreamer can
            // (1.24+) and the layout lets its CUDA elements read it; otherwise one
            // device-to-device copy into a buffer of the CUDA pool downstream takes.
            self.prev_slot = None;
            let info = stream.video.as_ref().ok_or_else(|| {
                gst::error_msg!(
                    gst::StreamError::Format,
                    ("A device frame without video caps")
                )
            })?;
            let held = copy;
            cuda_buffer = Some(self.cuda_buffer_of(&out, info, frame, held, conn).map_err(
                |e| {
                    gst::error_msg!(
                        gst::ResourceError::Read,
                        ("Cannot hand a frame out in CUDA memory: {}", e)
                    )
                },
            )?);
            None
        } else if size == 0 {
            // An empty buffer (caps other than raw video): nothing to map or keep.
            drop(frame.lease);
            None
        } else if on_device && copy.is_none() {
            // Zero-copy in GPU memory: CUDA elements read the frame in place (its
            // GpuShmCudaMeta, or a GST_MAP_CUDA map), the CPU through a copy made when it
            // first maps it.
            self.prev_slot = None;
            let ring = frame.lease.ring().clone();
            let (dptr, _) = frame.device_ptr().ok_or_else(|| {
                gst::error_msg!(
                    gst::StreamError::Decode,
                    ("The producer sent a frame outside its ring's GPU memory")
                )
            })?;
            slot = Some((ring.clone(), frame.ptr as usize));
            let copy: crate::memory::CopyToHost = Box::new(move |dst: &mut [u8]| {
                crate::cuda::vmm::of(ring.attachment())
                    .ok_or("the ring has no GPU memory")?
                    .copy_to_host(dptr, dst)
                    .map_err(|e| e.to_string())
            });
            Some(Some(crate::memory::wrap_device_slot_memory(
                dptr,
                size,
                copy,
                Box::new(NotifyOnRelease {
                    lease: Some(frame.lease),
                    shared: Arc::downgrade(&self.shared),
                }),
            )))
        } else if on_device || copy.is_some() {
            // Copied into a buffer of our own: downstream keeps more than our budget allows
            // zero-copy. The slot order learnt goes from zero-copy frame to zero-copy frame.
            self.prev_slot = None;
            let mut mem = gst::Memory::with_size(size);
            {
                let mem = mem.get_mut().ok_or_else(|| {
                    gst::error_msg!(gst::ResourceError::NoSpaceLeft, ("Cannot allocate a frame"))
                })?;
                let mut map = mem.map_writable().map_err(|_| {
                    gst::error_msg!(gst::ResourceError::NoSpaceLeft, ("Cannot map a frame"))
                })?;
                frame.copy_to(&mut map).map_err(|e| {
                    gst::error_msg!(gst::ResourceError::Read, ("Cannot copy a frame out: {}", e))
                })?;
            }
            self.shared.copied.fetch_add(1, Ordering::Relaxed);
            // Copies for downstream's sake are the producer's to count, and said once.
            if let Some(held) = copy {
                let n = conn.count_copy();
                if !self.copy_warned {
                    self.copy_warned = true;
                    self.warn_copy(conn, held, n);
                }
            }
            drop(frame.lease);
            Some(Some(mem))
        } else {
            slot = Some((frame.lease.ring().clone(), frame.ptr as usize));
            if self.link.options().writable_ring
                && !frame.lease.ring().is_writable()
                && !std::mem::replace(&mut self.writable_refusal_warned, true)
            {
                if let Some(el) = self.element.upgrade() {
                    gst::element_warning!(
                        el,
                        gst::ResourceError::Settings,
                        ("The GPU cannot register read-only memory and the producer does not hand out writable rings: CUDA elements copy each frame"),
                        ["Set allow-writable-ring=true on the gpushmsink to let them read frames in place"]
                    );
                }
            }
            let ptr = frame.ptr as usize;
            if stream.video.is_some() {
                self.note_slot(ptr, size);
            }
            let expected = ahead
                .as_mut()
                .and_then(|a| a.slot.take_if(|s| s.ptr == ptr && s.size == size));
            if let Some(e) = expected {
                // SAFETY: the buffer made ahead holds the memory's only reference and we hold
                // the buffer's (it is handed out below, after this), so the NotifyOnRelease is
                // alive and nothing else reads it.
                unsafe { (*e.notify).lease = Some(frame.lease) };
                Some(None)
            } else if let Some(i) = stream.video.as_ref().and_then(|_| {
                self.spares
                    .iter()
                    .position(|s| s.ptr == ptr && s.size == size)
            }) {
                Some(Some(self.spares.swap_remove(i).fill(frame.lease)))
            } else {
                Some(Some(wrap_slot_memory(
                    frame.ptr as *mut u8,
                    size,
                    size,
                    true,
                    Box::new(NotifyOnRelease {
                        lease: Some(frame.lease),
                        shared: Arc::downgrade(&self.shared),
                    }),
                )))
            }
        };
        let metas = ahead.as_ref().map(|a| a.metas);
        // A memory put in ahead for another slot goes (the frame came elsewhere).
        let unused = ahead.as_mut().and_then(|a| a.slot.take());
        let in_pool = cuda_buffer.is_some();
        let (mut buffer, metas) = match cuda_buffer {
            // The pool's buffer, with its own VideoMeta (its pitched layout); the one made
            // ahead is not used.
            Some(b) => (b, None),
            None => (ahead.map(|a| a.buffer).unwrap_or_default(), metas),
        };
        {
            let b = buffer.get_mut().ok_or_else(|| {
                gst::error_msg!(gst::CoreError::Failed, ("A new buffer is not writable"))
            })?;
            if let Some(u) = unused.filter(|_| !in_pool) {
                // Back among the spares, for the next frame in that slot.
                let mem = b.memory(0);
                b.remove_all_memory();
                if let Some(mem) = mem.filter(|_| self.spares.len() < MAX_SPARES) {
                    // `mem` is now the memory's only reference, as SpareMemory requires.
                    self.spares.push(SpareMemory {
                        ptr: u.ptr,
                        size: u.size,
                        mem,
                        notify: u.notify,
                    });
                }
            }
            if let Some(Some(mem)) = mem {
                b.append_memory(mem);
            }
            b.set_duration(clock_time(m.duration));
            b.set_offset(m.offset);
            b.set_offset_end(m.offset_end);
            // Every flag the producer set (interlacing, field order, keyframes, ...), except
            // the one that describes its memory.
            // Bits below GST_MINI_OBJECT_FLAG_LAST belong to the mini object (locking), not
            // to the buffer: never taken from a peer.
            let mut flags = gst::BufferFlags::from_bits_retain(
                m.buffer_flags & !(gst::ffi::GST_MINI_OBJECT_FLAG_LAST - 1),
            ) - gst::BufferFlags::TAG_MEMORY;
            let dropped = conn.dropped();
            if self.discont || dropped != self.dropped_seen {
                flags |= gst::BufferFlags::DISCONT;
                self.discont = false;
                self.dropped_seen = dropped;
            }
            b.set_flags(flags);
            if let Some(info) = stream.video.as_ref().filter(|_| !in_pool) {
                // check_layout() bounded n_planes by the caps' (at most MAX_PLANES).
                let n = (m.n_planes as usize).min(MAX_PLANES);
                let offsets = m.plane_offset.map(|o| o as usize);
                let strides = m.plane_stride.map(|s| s as i32);
                let flags = frame_flags(m.buffer_flags);
                if let Some(vm) = metas.and_then(|m| m.video) {
                    // SAFETY: the VideoMeta of the buffer made ahead (`b`), which we hold
                    // writable.
                    unsafe { fill_video_meta(vm.as_ptr(), flags, &offsets[..n], &strides[..n]) };
                } else {
                    gst_video::VideoMeta::add_full(
                        b,
                        flags,
                        info.format(),
                        info.width(),
                        info.height(),
                        &offsets[..n],
                        &strides[..n],
                    )
                    .map_err(|_| {
                        gst::error_msg!(
                            gst::StreamError::Decode,
                            ("The producer's plane layout does not fit the frame")
                        )
                    })?;
                }
            }
            if let Some(ts) = publish_ts {
                match metas {
                    // SAFETY: a meta of the buffer made ahead (`b`), which we hold writable.
                    Some(m) => unsafe { (*m.publish.as_ptr()).timestamp = ts.into_glib() },
                    None => {
                        gst::ReferenceTimestampMeta::add(b, &publish_caps(), ts, None);
                    }
                }
            }
            if let Some(p) = producer_metas.as_deref() {
                for why in crate::frame_metas::apply(p, b) {
                    gst::debug!(CAT, "a meta of the producer left out: {why}");
                }
            }
            if let Some(tc) = m.timecode {
                let fps =
                    (tc.fps_d > 0 && tc.fps_d <= i32::MAX as u32 && tc.fps_n <= i32::MAX as u32)
                        .then(|| gst::Fraction::new(tc.fps_n as i32, tc.fps_d as i32));
                let valid = fps.and_then(|fps| {
                    gst_video::ValidVideoTimeCode::new(
                        fps,
                        None,
                        gst_video::VideoTimeCodeFlags::from_bits_truncate(tc.flags),
                        tc.hours,
                        tc.minutes,
                        tc.seconds,
                        tc.frames,
                        tc.field_count,
                    )
                    .ok()
                });
                if let Some(v) = valid {
                    gst_video::VideoTimeCodeMeta::add(b, &v);
                }
            }
        }
        self.shared.received.fetch_add(1, Ordering::Relaxed);
        if m.latency != NONE_U64 {
            self.shared.latency.store(m.latency, Ordering::Relaxed);
        }
        self.shared.producer_live.store(m.live, Ordering::Relaxed);
        Ok(Some(Received {
            buffer,
            details: Details {
                meta: m,
                caps: frame_caps,
                arrival_ns,
                conn_serial: self.serial,
                slot,
                on_device: device,
                #[cfg(feature = "stages")]
                built_ns: gpushm::monotonic_ns(),
            },
            headers,
            events: std::mem::take(&mut self.events),
        }))
    }

    pub(super) fn warn_copy(&self, conn: &Subscriber, held: usize, n: u64) {
        let Some(el) = self.element.upgrade() else {
            return;
        };
        gst::element_warning!(
            el,
            gst::ResourceError::Busy,
            (
                "This consumer holds {} frames of the producer's ring (downstream and in its own queue), as many as it keeps zero-copy with client-budget {}: further frames are copied into system memory (one copy each, counted in frames-copied) until downstream gives frames back",
                held.saturating_sub(1),
                conn.budget()
            ),
            [
                "Copied {} frame so far. Elements such as encoders, queues with thresholds or sinks keeping their last buffer hold frames; to keep them zero-copy, raise slots (or client-budget) on the gpushmsink",
                n
            ]
        );
    }
}

/// Sets the flags and plane layout of a VideoMeta made ahead (its format and size are the
/// stream's, as check_layout() checked the frame's).
///
/// # Safety
/// `vm` is the VideoMeta of a buffer the caller holds writable, and nothing else reads or
/// writes it meanwhile.
unsafe fn fill_video_meta(
    vm: *mut gst_video::ffi::GstVideoMeta,
    flags: gst_video::VideoFrameFlags,
    offsets: &[usize],
    strides: &[i32],
) {
    let n = offsets.len().min(strides.len()).min(MAX_PLANES);
    // SAFETY: see above; n is at most MAX_PLANES (GST_VIDEO_MAX_PLANES), the arrays' length.
    let p = unsafe { &mut *vm };
    p.flags = flags.into_glib();
    p.n_planes = n as u32;
    p.offset[..n].copy_from_slice(&offsets[..n]);
    p.stride[..n].copy_from_slice(&strides[..n]);
}

fn clock_time(v: u64) -> Option<gst::ClockTime> {
    // ClockTime cannot hold u64::MAX (GST_CLOCK_TIME_NONE): that value means "none".
    (v != NONE_U64).then(|| gst::ClockTime::from_nseconds(v))
}

fn publish_caps() -> gst::Caps {
    static CAPS: once_cell::sync::Lazy<gst::Caps> = once_cell::sync::Lazy::new(|| {
        gst::Caps::new_empty_simple(super::super::PUBLISH_TIMESTAMP_CAPS)
    });
    CAPS.clone()
}

/// The VideoMeta flags that match a buffer's video flags.
pub(super) fn frame_flags(buffer_flags: u32) -> gst_video::VideoFrameFlags {
    let b = gst_video::VideoBufferFlags::from_bits_truncate(buffer_flags);
    let mut f = gst_video::VideoFrameFlags::empty();
    for (bf, ff) in [
        (
            gst_video::VideoBufferFlags::INTERLACED,
            gst_video::VideoFrameFlags::INTERLACED,
        ),
        (
            gst_video::VideoBufferFlags::TFF,
            gst_video::VideoFrameFlags::TFF,
        ),
        (
            gst_video::VideoBufferFlags::RFF,
            gst_video::VideoFrameFlags::RFF,
        ),
        (
            gst_video::VideoBufferFlags::ONEFIELD,
            gst_video::VideoFrameFlags::ONEFIELD,
        ),
        (
            gst_video::VideoBufferFlags::MULTIPLE_VIEW,
            gst_video::VideoFrameFlags::MULTIPLE_VIEW,
        ),
        (
            gst_video::VideoBufferFlags::FIRST_IN_BUNDLE,
            gst_video::VideoFrameFlags::FIRST_IN_BUNDLE,
        ),
    ] {
        if b.contains(bf) {
            f |= ff;
        }
    }
    f
}

/// Checks that the frame's layout matches its caps and lies inside its slot.
pub(super) fn check_layout(frame: &Frame, info: &gst_video::VideoInfo) -> Result<(), String> {
    let m = &frame.meta;
    if m.video_format != info.format().into_glib() as u32
        || m.width != info.width()
        || m.height != info.height()
    {
        return Err(format!(
            "frame {} is {}x{} format {}, caps say {}x{} {}",
            frame.seq,
            m.width,
            m.height,
            m.video_format,
            info.width(),
            info.height(),
            info.format()
        ));
    }
    if m.n_planes != info.n_planes() {
        return Err(format!(
            "frame {} has {} planes, caps say {}",
            frame.seq,
            m.n_planes,
            info.n_planes()
        ));
    }
    for p in 0..info.n_planes() as usize {
        // Each row of the plane must hold its visible bytes (a stride narrower than that makes
        // readers run past the plane), and the last row must end inside the payload.
        let rows = crate::geometry::plane_rows(info, p) as u64;
        let stride = m.plane_stride[p] as u64;
        // Formats packed in groups of pixels (v210, UYVP, the 10-bit ...LE32/LE40 ones) have
        // no per-pixel stride, and tiled formats keep tile counts in the stride: for those,
        // nothing but GStreamer's own layout is accepted.
        let packed = info.format_info().pixel_stride()[..]
            .iter()
            .take(info.format_info().n_components() as usize)
            .any(|&ps| ps <= 0);
        if packed || info.format_info().is_tiled() {
            if stride != info.stride()[p] as u64 || m.plane_offset[p] != info.offset()[p] as u64 {
                return Err(format!(
                    "frame {} plane {p}: {} frames must have the standard layout (stride {}, offset {}), not stride {stride}, offset {}",
                    frame.seq,
                    info.format(),
                    info.stride()[p],
                    info.offset()[p],
                    m.plane_offset[p]
                ));
            }
            if (info.size() as u64) > m.payload_size {
                return Err(format!(
                    "frame {} is {} bytes, {} needs {}",
                    frame.seq,
                    m.payload_size,
                    info.format(),
                    info.size()
                ));
            }
            continue;
        }
        let row_bytes = crate::geometry::plane_row_bytes(info, p) as u64;
        if stride < row_bytes {
            return Err(format!(
                "frame {} plane {p}: stride {stride} is narrower than its {row_bytes} visible bytes a row",
                frame.seq
            ));
        }
        let end = stride
            .checked_mul(rows.saturating_sub(1))
            .and_then(|v| v.checked_add(row_bytes))
            .and_then(|v| v.checked_add(m.plane_offset[p]));
        if end.is_none_or(|e| e > m.payload_size) {
            return Err(format!(
                "frame {} plane {p} (offset {}, stride {stride}, {rows} rows of {row_bytes} bytes) overruns its {} bytes",
                frame.seq, m.plane_offset[p], m.payload_size
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VideoMeta made ahead takes each frame's flags and plane layout.
    #[test]
    fn a_video_meta_made_ahead_takes_the_frames_layout() {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, 64, 48)
            .build()
            .unwrap();
        let mut buffer = gst::Buffer::new();
        let b = buffer.get_mut().unwrap();
        crate::geometry::add_caps_layout_meta(b, &info).unwrap();
        let vm = b.meta_mut::<gst_video::VideoMeta>().unwrap().as_mut_ptr();
        for (flags, offsets, strides) in [
            (
                gst_video::VideoFrameFlags::INTERLACED,
                [128, 8192],
                [128, 96],
            ),
            (gst_video::VideoFrameFlags::empty(), [0, 3072], [64, 64]),
        ] {
            // SAFETY: the meta of a buffer we hold writable.
            unsafe { fill_video_meta(vm, flags, &offsets, &strides) };
            let vm = b.meta::<gst_video::VideoMeta>().unwrap();
            assert_eq!(vm.video_frame_flags(), flags);
            assert_eq!(vm.n_planes(), 2);
            assert_eq!(vm.offset(), &offsets[..]);
            assert_eq!(vm.stride(), &strides[..]);
            assert_eq!(
                (vm.format(), vm.width(), vm.height()),
                (info.format(), 64, 48)
            );
        }
    }
}
