// SPDX-License-Identifier: MPL-2.0
/**
 * SECTION:element-gpushmsrc
 * @see_also: gpushmsink, shmsrc, unixfdsrc
 *
 * Receives a stream (raw or encoded video, audio, RTP, any caps) from a gpushmsink in another
 * process, with the producer's caps. The producer's ring is mapped once,
 * read-only, and buffers point straight into it: no frame byte is copied. A slot goes back to
 * the producer when downstream drops the buffer, also after the source went to NULL: buffers an
 * app keeps (a sink's last sample, an app's queue) keep their slots, and the producer, told
 * that this source takes no more frames, never waits for it. The one exception is a consumer
 * the producer cuts for holding more than its share of the ring for 0.5 s while every slot is
 * held: the error says so, and buffers it still holds may then show newer frames (see "Held
 * frames" in the gpushm crate's `client` module).
 *
 * The source connects when it goes to PLAYING. Its streaming thread takes each frame from the
 * ring itself while it waits for one; when downstream holds that thread for more than 50 ms,
 * a thread of its own takes frames as they arrive and queues them. While downstream keeps as many zero-copy
 * frames as the producer's client-budget allows (an encoder's lookahead, a queue with a
 * threshold, a sink keeping its last buffer), further frames are copied into system memory
 * (one copy each, `frames-copied`, one warning), so nothing downstream does can stall the
 * stream or other consumers. A blocked downstream delays only this source's own queue
 * (`max-size-buffers`, `max-size-bytes`, `max-size-time`).
 *
 * Low-latency mode (`spin-us`, 0 = off): most of a hop's latency is the sleeping core waking
 * up when the frame lands. With a budget set, the source learns the producer's cadence from
 * the frames' publish times, sleeps until a little before the next frame is due, and polls
 * the ring for at most `spin-us` µs a frame before going back to sleep on its wake-up
 * descriptor. A frame earlier or later than expected wakes it as without the mode; a paused
 * or stopped producer costs one budget, then nothing.
 * `cpu-latency-us=0` also keeps the CPUs out of deep idle states while the source runs (the
 * kernel's CPU latency QoS, /dev/cpu_dma_latency): after a deep sleep a core runs the frame's
 * way on cold caches.
 *
 * Caps come from the producer: no caps are needed on the command line, and the source
 * renegotiates when the producer's caps change. Timestamps are the producer's, mapped onto
 * this pipeline's running time by the gpushm crate's one mapping (its `time` module): shifted
 * by the producer pipeline's latency, so that a live producer's frames are stamped about when
 * they were published (5 ms of latency answered) and streams of one producer pipeline (audio
 * and video through two gpushmsinks) keep its relative offset exactly in one consumer
 * pipeline; a connection whose first frame is older than this pipeline (a wait-for-connection
 * producer, a stream that is not live) is delayed just enough to start at 0 with the
 * producer's spacing; a producer on another clock (an audio device's, a realtime system clock)
 * says how its clock relates to CLOCK_MONOTONIC; DTS travel (B-frames' DTS before their first
 * PTS included). A live producer's frames are never stamped in the future; one that is not
 * live keeps its timestamps, ahead of real time included. Every buffer flag (interlacing included) and GstVideoTimeCodeMeta travel. Each
 * buffer also carries a GstReferenceTimestampMeta with caps `timestamp/x-gpushm-publish`: the
 * CLOCK_MONOTONIC time the producer published it.
 *
 * ## Example launch line
 * |[
 * gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink
 * ]|
 */
use std::path::PathBuf;

use gpushm::names::Endpoint;
use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::base_src::CreateSuccess;
use gst_base::subclass::prelude::*;
use once_cell::sync::Lazy;

use super::receiver::{Config, Details, Item, Reader, Received, Receiver, Shared};
use super::{DeliveryMode, CAT};
use crate::cuda::gstcuda;
use crate::cuda::register::{device_ptr_in, register_mapping, NotRegistered};
use crate::cuda::Selected;
use crate::cudameta::{CudaMetaApi, CudaRegister};
use gpushm::ring::layout::NONE_U64;
use gpushm::subscriber::ConnectOptions;
use gpushm::time::TimeMap;

/// Caps of the GstReferenceTimestampMeta holding the producer's publish time.
pub const PUBLISH_TIMESTAMP_CAPS: &str = "timestamp/x-gpushm-publish";

const DEFAULT_TIMEOUT: u64 = 5_000_000_000;
const DEFAULT_MODE: DeliveryMode = DeliveryMode::Auto;
const DEFAULT_CUDA_DEVICE: i32 = -1;
const DEFAULT_RECONNECT: bool = true;
const DEFAULT_RECONNECT_INTERVAL: u64 = 100_000_000;
const DEFAULT_MAX_SIZE_BUFFERS: u32 = 0;
const DEFAULT_PRODUCER_UID: i64 = -1;
const DEFAULT_MAX_SIZE_BYTES: u64 = 256 << 20;
const DEFAULT_MAX_SIZE_TIME: u64 = 2_000_000_000;
/// The latency this source answers for its timestamps (see [`gpushm::time`]): a frame is
/// stamped about when its producer published it, so it needs only the time to reach us and
/// be pushed.
const ANSWERED_LATENCY: u64 = 5_000_000;

/// The largest `spin-us` (the core's bound).
const MAX_SPIN_US: u32 = gpushm::policy::MAX_SPIN.as_micros() as u32;

#[derive(Debug, Clone)]
struct Settings {
    socket_path: Option<PathBuf>,
    stream: Option<String>,
    timeout: u64,
    mode: DeliveryMode,
    cuda_device: i32,
    cuda_register: CudaRegister,
    reconnect: bool,
    reconnect_interval: u64,
    max_size_buffers: u32,
    max_size_bytes: u64,
    max_size_time: u64,
    producer_uid: i64,
    spin_us: u32,
    cpu_latency_us: i32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            socket_path: None,
            stream: None,
            timeout: DEFAULT_TIMEOUT,
            mode: DEFAULT_MODE,
            cuda_device: DEFAULT_CUDA_DEVICE,
            cuda_register: CudaRegister::Auto,
            reconnect: DEFAULT_RECONNECT,
            reconnect_interval: DEFAULT_RECONNECT_INTERVAL,
            max_size_buffers: DEFAULT_MAX_SIZE_BUFFERS,
            max_size_bytes: DEFAULT_MAX_SIZE_BYTES,
            max_size_time: DEFAULT_MAX_SIZE_TIME,
            producer_uid: DEFAULT_PRODUCER_UID,
            spin_us: 0,
            cpu_latency_us: crate::cpu_latency::DEFAULT,
        }
    }
}

struct Started {
    receiver: Receiver,
    /// Caps string last set on the pad, and the device of the ring its frames came from
    /// (`None`: a host ring).
    pad_caps: Option<(Arc<str>, Option<i32>)>,
    /// The pad's caps are the producer's in CUDA memory (memory:CUDAMemory): device-ring
    /// frames go to downstream in a CUDA buffer pool's memory.
    pad_cuda: bool,
    /// The producer's times into our running time, per connection (the gpushm crate's one
    /// mapping for every binding).
    map: TimeMap,
    /// Our clock, and whether it is CLOCK_MONOTONIC itself (GstSystemClock's default): then
    /// its offset is exactly 0, so the producer's spacing is kept to the nanosecond.
    clock_is_monotonic: Option<(gst::Clock, bool)>,
    /// Our clock's offset to CLOCK_MONOTONIC in use, when it is another clock.
    clock_offset: Option<i128>,
    /// The last raw-video PTS pushed (running time): never gone back past. After a pause, a
    /// frame stamped just before this pipeline played again would map before it.
    last_pts: Option<gst::ClockTime>,
    serial: u64,
    /// The latency this source last answered (ns).
    answered_latency: Option<u64>,
    /// The latency changed since the pipeline last asked: post a Latency message.
    latency_changed: bool,
    /// The GPU frames are registered with (cuda-register=always, or downstream asked).
    cuda: Option<Arc<crate::cuda::Device>>,
    /// Downstream asked for GpuShmCudaMeta (auto): the device was looked for.
    cuda_asked: bool,
    /// cpu-latency-us, held until stop.
    _cpu_latency: Option<gpushm::cpu_latency::CpuLatency>,
}

pub struct GpuShmSrc {
    settings: Mutex<Settings>,
    state: Mutex<Option<Started>>,
    /// The CUDA context GStreamer's CUDA elements of the pipeline share (GstCudaContext),
    /// once device-ring frames go out in CUDA memory or a neighbour handed it.
    cuda_ctx: Mutex<Option<gstcuda::Context>>,
}

impl Default for GpuShmSrc {
    fn default() -> Self {
        Self {
            settings: Mutex::new(Settings::default()),
            state: Mutex::new(None),
            cuda_ctx: Mutex::new(None),
        }
    }
}

impl GpuShmSrc {
    fn settings(&self) -> MutexGuard<'_, Settings> {
        self.settings.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn state(&self) -> MutexGuard<'_, Option<Started>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        self.state()
            .as_ref()
            .map(|s| s.receiver.reader.shared.clone())
    }
    fn reader(&self) -> Option<Arc<Reader>> {
        self.state().as_ref().map(|s| s.receiver.reader.clone())
    }

    /// The latency to answer: none when buffers are stamped on arrival (do-timestamp=true),
    /// otherwise [`ANSWERED_LATENCY`]: frames are stamped about when they were published (the
    /// producer's latency is in their timestamps, see the gpushm crate's `time` module).
    fn latency(&self, _st: &Started, does_timestamp: bool) -> u64 {
        if does_timestamp {
            0
        } else {
            ANSWERED_LATENCY
        }
    }

    /// Sets PTS and DTS: the producer's clock times mapped into this pipeline's running time
    /// by the gpushm crate's one mapping ([`gpushm::time`]).
    fn timestamp(&self, st: &mut Started, t: &Timing, b: &mut gst::BufferRef, f: &Details) {
        if t.does_timestamp {
            return;
        }
        let m = &f.meta;
        let (Some(clock), Some(base)) = (&t.clock, t.base) else {
            b.set_pts(clock_time(m.pts));
            b.set_dts(clock_time(m.dts));
            return;
        };
        if st.serial != f.conn_serial {
            // A new connection (or producer) goes on after what was pushed: never back.
            st.serial = f.conn_serial;
            st.map = st.map.continuing();
        }
        // Our clock's time less CLOCK_MONOTONIC: exactly 0 for the system clock on it.
        let monotonic = match &st.clock_is_monotonic {
            Some((c, mono)) if c == clock => *mono,
            _ => {
                let mono = crate::clock::is_monotonic(clock);
                st.clock_is_monotonic = Some((clock.clone(), mono));
                st.clock_offset = None;
                mono
            }
        };
        // Another clock: its offset read at each frame, kept while within 1 ms (reading two
        // clocks a little apart must not reach the spacing; a step or a slew is followed).
        let offset = if monotonic {
            0
        } else {
            let o = match st.clock_offset {
                Some(o) if o.abs_diff(t.offset) <= gpushm::time::OFFSET_SLACK as u128 => o,
                _ => t.offset,
            };
            st.clock_offset = Some(o);
            o
        };
        // A bogus publish time (after the frame arrived) falls back to our arrival stamp.
        let published = m.publish_ns.min(f.arrival_ns) as i128;
        let mapped = st.map.map(m, base.nseconds() as i128 - offset, published);
        let mut pts = mapped.pts.map(gst::ClockTime::from_nseconds);
        if gpushm::format::is_raw_video(&f.caps) {
            // Raw video has no reordering: its PTS never goes back (after a pause, a frame
            // stamped just before this pipeline played again would map before the last).
            if let (Some(p), Some(last)) = (pts, st.last_pts) {
                if p < last {
                    pts = Some(last);
                }
            }
            if pts.is_some() {
                st.last_pts = pts;
            }
        }
        b.set_pts(pts);
        b.set_dts(mapped.dts.map(gst::ClockTime::from_nseconds));
        if mapped.discont {
            b.set_flags(gst::BufferFlags::DISCONT);
        }
    }

    /// Low-latency mode: reads what create() and GstBaseSrc read of the element and its pads
    /// on a frame's way, while the streaming thread polls for the frame (see
    /// `Worker::warm_up`). Takes only object locks (held by anyone for a few reads), and our
    /// state's lock only if it is free.
    pub(super) fn warm_up(&self) {
        if let Ok(g) = self.state.try_lock() {
            std::hint::black_box(g.as_ref().map(|s| {
                (
                    s.pad_caps.is_some(),
                    s.serial,
                    s.map.clone(),
                    s.last_pts,
                    s.clock_offset,
                    s.answered_latency,
                    s.clock_is_monotonic.as_ref().map(|c| c.1),
                )
            }));
        }
        let obj = self.obj();
        std::hint::black_box((obj.is_live(), obj.does_timestamp()));
        let bs = obj.upcast_ref::<gst_base::BaseSrc>().as_ptr();
        {
            let _lock = obj.object_lock();
            // SAFETY: GstBaseSrc's segment, read under the object lock as GstBaseSrc reads it.
            std::hint::black_box(unsafe { (*bs).segment.format });
        }
        let pad = obj.src_pad();
        std::hint::black_box((
            pad.is_active(),
            pad.needs_reconfigure(),
            pad.has_current_caps(),
        ));
        if let Some(peer) = pad.peer() {
            std::hint::black_box((peer.is_active(), peer.needs_reconfigure()));
        }
    }

    /// What timestamp() reads from the element, read at once.
    fn timing(&self) -> Timing {
        let obj = self.obj();
        let clock = obj.clock();
        let offset = clock.as_ref().map_or(0, |c| {
            c.time().nseconds() as i128 - gpushm::monotonic_ns() as i128
        });
        Timing {
            does_timestamp: obj.does_timestamp(),
            clock,
            base: obj.base_time(),
            offset,
        }
    }

    /// Notes that the pipeline must ask for our latency again, when it changed since it last
    /// asked (posted by create(), without the state lock).
    fn post_latency_if_changed(&self, st: &mut Started, t: &Timing) {
        let now = self.latency(st, t.does_timestamp);
        if st.answered_latency.is_some_and(|a| a != now) {
            st.answered_latency = Some(now);
            st.latency_changed = true;
        }
    }

    /// Sets the producer's caps on the pad, without the state lock held (downstream sees a
    /// caps event and may call back into us).
    /// Opens the GPU of cuda-device-id (see crate::cuda::select): `None` without one.
    fn open_cuda(&self, id: i32) -> Result<Option<Arc<crate::cuda::Device>>, gst::ErrorMessage> {
        match crate::cuda::select(id) {
            Ok(Selected::Device(d)) => {
                gst::info!(CAT, imp = self, "{d:?}");
                Ok(Some(d))
            }
            Ok(Selected::Unavailable(e)) => {
                gst::info!(CAT, imp = self, "frames are not registered with CUDA: {e}");
                Ok(None)
            }
            Err(e) => Err(gst::error_msg!(gst::LibraryError::Init, ("{}", e))),
        }
    }

    /// Downstream asked for GpuShmCudaMeta: with cuda-register=auto, open the GPU the first
    /// time (frames get the meta from then on).
    fn cuda_requested(&self) -> Result<(), gst::LoggableError> {
        let (mode, id) = {
            let s = self.settings();
            (s.cuda_register, s.cuda_device)
        };
        if mode != CudaRegister::Auto {
            return Ok(());
        }
        {
            let mut guard = self.state();
            match guard.as_mut() {
                Some(st) if !st.cuda_asked => st.cuda_asked = true,
                _ => return Ok(()),
            }
        }
        let dev = self.open_cuda(id).map_err(|e| {
            let msg = e.to_string();
            self.post_error_message(e);
            gst::loggable_error!(CAT, "{}", msg)
        })?;
        let mut guard = self.state();
        if let (Some(st), Some(d)) = (guard.as_mut(), dev) {
            if self.needs_writable_ring(&d) {
                st.receiver.reader.request_writable_ring();
            }
            st.cuda = Some(d);
        }
        Ok(())
    }

    /// Whether `d` needs a writable ring to read frames in place (it cannot register
    /// read-only host memory); warns once.
    fn needs_writable_ring(&self, d: &crate::cuda::Device) -> bool {
        let needs = d.host_register && !d.host_register_read_only;
        if needs {
            gst::warning!(
                CAT,
                imp = self,
                "{} cannot register read-only host memory: asking the producer for a writable mapping (it must allow it: allow-writable-ring=true)",
                d.name
            );
        }
        needs
    }

    /// Puts a GpuShmCudaMeta on a zero-copy frame's buffer, registering its ring the first
    /// time one of its frames goes out (once per mapping, never per frame).
    fn add_cuda_meta(&self, dev: &Arc<crate::cuda::Device>, b: &mut gst::BufferRef, f: &Details) {
        let Some((ring, ptr)) = &f.slot else {
            return;
        };
        if ring.attachment().is_none() {
            let (base, len) = ring.mapping();
            let read_only = !ring.is_writable();
            if read_only && dev.host_register && !dev.host_register_read_only {
                // The receiver reconnects for a writable ring: frames of this one are copied
                // by CUDA elements meanwhile.
                return;
            }
            // SAFETY: the registration is attached to the mapping and dropped before it.
            let att = unsafe { register_mapping(dev, base, len, read_only) };
            match att.downcast_ref::<NotRegistered>() {
                Some(why) => gst::element_imp_warning!(
                    self,
                    gst::ResourceError::Settings,
                    (
                        "Cannot register the ring with {} ({}); CUDA elements will copy each frame",
                        dev.name,
                        why.0
                    )
                ),
                None => gst::info!(
                    CAT,
                    imp = self,
                    "ring {} ({} MiB) registered {} with {}",
                    ring.ring_gen(),
                    len >> 20,
                    if read_only {
                        "read-only"
                    } else {
                        "writable (the GPU cannot register read-only memory)"
                    },
                    dev.name
                ),
            }
            ring.attach(att);
        }
        if let Some((device_ptr, device)) = device_ptr_in(ring.attachment(), *ptr as *const u8) {
            crate::cudameta::add(
                b,
                crate::cudameta::CudaPtr {
                    device,
                    device_ptr,
                    size: f.meta.payload_size,
                    read_only: !ring.is_writable(),
                },
            );
        }
    }

    /// Sets the caps for frames of `caps_str` on the pad: in CUDA memory when they come from a
    /// device ring on GPU `device` and downstream asks for CUDA memory, otherwise the
    /// producer's. Returns whether they are in CUDA memory.
    fn set_pad_caps(
        &self,
        caps_str: &Arc<str>,
        device: Option<i32>,
    ) -> Result<bool, gst::FlowError> {
        let caps = gst::Caps::from_str(caps_str).map_err(|_| {
            gst::element_imp_error!(
                self,
                gst::StreamError::Format,
                ("The producer sent unparsable caps {}", caps_str)
            );
            gst::FlowError::NotNegotiated
        })?;
        gst::info!(CAT, imp = self, "caps from the producer: {caps}");
        let shared = self.shared();
        if let Some(d) = device.filter(|_| gpushm::format::is_raw_video(caps_str)) {
            if let Some((pool, cuda_caps)) = self.cuda_output(&caps, d) {
                if let Some(sh) = &shared {
                    sh.set_cuda_out(Some((pool, caps_str.clone())));
                }
                if self.obj().set_caps(&cuda_caps).is_ok() {
                    gst::info!(
                        CAT,
                        imp = self,
                        "device-ring frames go out in CUDA memory: {cuda_caps}"
                    );
                    return Ok(true);
                }
                gst::debug!(
                    CAT,
                    imp = self,
                    "downstream refused {cuda_caps}: system memory"
                );
            }
        }
        if let Some(sh) = &shared {
            sh.set_cuda_out(None);
        }
        // A refused caps event is only seen at the next push, as not-negotiated: ask first.
        if !self.obj().src_pad().peer_query_accept_caps(&caps) {
            self.refused(&caps);
            return Err(gst::FlowError::NotNegotiated);
        }
        self.obj().set_caps(&caps).map_err(|_| {
            self.refused(&caps);
            gst::FlowError::NotNegotiated
        })?;
        Ok(false)
    }

    /// Whether downstream takes device-ring frames of `caps` (GPU `device`) in CUDA memory:
    /// it names memory:CUDAMemory in its caps (an element taking ANY gets system memory, as
    /// from nvcodec's decoders) and GStreamer's CUDA library is here. Then the pipeline's
    /// CUDA context for that GPU, an active CUDA buffer pool for the caps, and the caps in
    /// CUDA memory.
    fn cuda_output(&self, caps: &gst::Caps, device: i32) -> Option<(gst::BufferPool, gst::Caps)> {
        let obj = self.obj();
        let pad = obj.src_pad();
        let cuda_caps = gstcuda::with_cuda_feature(caps);
        // Unfiltered: an element taking ANY would otherwise answer the filter itself.
        let peer = pad.peer_query_caps(None);
        let asks = !peer.is_any()
            && peer
                .iter_with_features()
                .any(|(_, f)| !f.is_any() && f.contains(gstcuda::CUDA_MEMORY))
            && peer.can_intersect(&cuda_caps);
        if !asks {
            return None;
        }
        if let Err(why) = gstcuda::available() {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Init,
                (
                    "Downstream asks for CUDA memory but {}: frames go out in system memory",
                    why
                )
            );
            return None;
        }
        if !pad.peer_query_accept_caps(&cuda_caps) {
            return None;
        }
        let info = gst_video::VideoInfo::from_caps(caps).ok()?;
        // Outside our lock: finding the context may call set_context() on us.
        let mut ctx = self
            .cuda_ctx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .filter(|c| c.device_id() == device);
        let element = obj.upcast_ref::<gst::Element>();
        if !gstcuda::ensure_element_context(element, device, &mut ctx) {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Init,
                (
                    "No CUDA context for GPU {}: frames go out in system memory",
                    device
                )
            );
            return None;
        }
        let ctx = ctx.filter(|c| c.device_id() == device)?;
        *self.cuda_ctx.lock().unwrap_or_else(|e| e.into_inner()) = Some(ctx.clone());
        let pool = gstcuda::buffer_pool(&ctx)?;
        let mut config = pool.config();
        config.set_params(Some(&cuda_caps), info.size() as u32, 0, 0);
        config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
        if pool.set_config(config).is_err() || pool.set_active(true).is_err() {
            gst::element_imp_warning!(
                self,
                gst::ResourceError::NoSpaceLeft,
                (
                    "Cannot allocate CUDA memory for {}: frames go out in system memory",
                    caps
                )
            );
            return None;
        }
        Some((pool, cuda_caps))
    }

    /// A frame queued before the pad's memory changed (CUDA memory negotiated, or given up)
    /// is copied into the memory the caps now say.
    fn to_pad_memory(
        &self,
        buffer: gst::Buffer,
        f: &Details,
        cuda: bool,
    ) -> Result<gst::Buffer, gst::FlowError> {
        let is_cuda = buffer.n_memory() > 0 && gstcuda::is_cuda_memory(buffer.peek_memory(0));
        if is_cuda == cuda || !gpushm::format::is_raw_video(&f.caps) {
            return Ok(buffer);
        }
        let fail = |what: &str| {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Failed,
                ("Cannot copy a frame into {}", what)
            );
            gst::FlowError::Error
        };
        let caps = gst::Caps::from_str(&f.caps).map_err(|_| fail("the caps' memory"))?;
        let info = gst_video::VideoInfo::from_caps(&caps).map_err(|_| fail("the caps' memory"))?;
        let mut out = if cuda {
            let pool = self
                .shared()
                .and_then(|s| s.cuda_pool_for(&f.caps))
                .ok_or_else(|| fail("CUDA memory"))?;
            pool.acquire_buffer(None).map_err(|_| fail("CUDA memory"))?
        } else {
            let mut b = gst::Buffer::with_size(info.size()).map_err(|_| fail("system memory"))?;
            let bm = b.get_mut().ok_or_else(|| fail("system memory"))?;
            gst_video::VideoMeta::add_full(
                bm,
                gst_video::VideoFrameFlags::empty(),
                info.format(),
                info.width(),
                info.height(),
                info.offset(),
                info.stride(),
            )
            .map_err(|_| fail("system memory"))?;
            b
        };
        {
            let src = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), &info)
                .map_err(|_| fail("a frame of the new memory"))?;
            let om = out.make_mut();
            let mut dst = gst_video::VideoFrameRef::from_buffer_ref_writable(om, &info)
                .map_err(|_| fail("a frame of the new memory"))?;
            src.copy(&mut dst)
                .map_err(|_| fail("a frame of the new memory"))?;
        }
        let om = out.make_mut();
        om.set_flags(buffer.flags());
        om.set_duration(buffer.duration());
        om.set_offset(buffer.offset());
        om.set_offset_end(buffer.offset_end());
        for m in buffer.iter_meta::<gst::ReferenceTimestampMeta>() {
            gst::ReferenceTimestampMeta::add(
                om,
                &m.reference().to_owned(),
                m.timestamp(),
                m.duration(),
            );
        }
        if let Some(tc) = buffer.meta::<gst_video::VideoTimeCodeMeta>() {
            gst_video::VideoTimeCodeMeta::add(om, &tc.tc());
        }
        Ok(out)
    }

    /// Posts the error for downstream refusing the producer's `caps`, with a hint when they
    /// are not raw video.
    fn refused(&self, caps: &gst::Caps) {
        let name = caps.structure(0).map_or("", |s| s.name().as_str());
        if name.starts_with("video/x-raw") {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Downstream refused the producer's caps {}", caps)
            );
        } else {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Downstream refused the producer's caps {}", caps),
                ["The producer shares {} buffers, not raw video: elements that need raw video (cudasum, videoconvert, ...) need a parser and decoder before them", name]
            );
        }
    }
}

/// What timestamp() needs from the element, read before waiting for a frame.
struct Timing {
    does_timestamp: bool,
    clock: Option<gst::Clock>,
    base: Option<gst::ClockTime>,
    /// The clock's time less CLOCK_MONOTONIC, read with them: a frame's publish moment on
    /// our clock is its publish_ns plus this. (A clock that drifts against CLOCK_MONOTONIC
    /// drifts by parts per million over the at most TIMING_STALE_NS this is used for.)
    offset: i128,
}

/// create() reads [`Timing`] again when a frame came more than this after it asked.
const TIMING_STALE_NS: u64 = 100_000_000;

fn clock_time(v: u64) -> Option<gst::ClockTime> {
    (v != NONE_U64).then(|| gst::ClockTime::from_nseconds(v))
}

#[glib::object_subclass]
impl ObjectSubclass for GpuShmSrc {
    const NAME: &'static str = "GstGpuShmSrc";
    type Type = super::GpuShmSrc;
    type ParentType = gst_base::PushSrc;
}

impl ObjectImpl for GpuShmSrc {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: Lazy<Vec<glib::ParamSpec>> = Lazy::new(|| {
            vec![
                glib::ParamSpecString::builder("socket-path")
                    .nick("Socket path")
                    .blurb("Path of the unix socket of the gpushmsink to receive from (this or stream is required)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("stream")
                    .nick("Stream name")
                    .blurb("Name of the stream to receive, instead of socket-path: the gpushmsink with the same stream name, found in $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID) and then in /run/gpushm. Letters, digits and . _ - @ + :, at most 64. `gpushm list` shows the streams there")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("timeout")
                    .nick("Timeout")
                    .blurb("How long to wait for a producer to appear on socket-path, in nanoseconds, before posting an error (0 = try once; 18446744073709551615 = forever). The wait happens in the streaming thread: setting the pipeline to PLAYING returns at once. Errors that waiting cannot fix (no permission, not a socket, a path too long) are posted at once")
                    .default_value(DEFAULT_TIMEOUT)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("mode", DEFAULT_MODE)
                    .nick("Delivery mode")
                    .blurb("Whether the producer may skip frames for this consumer. lossless: receive every frame: when this consumer's queue is full (max-size-*), the producer waits for it, up to the gpushmsink's max-wait. leaky: a consumer that falls behind drops its oldest frames and never holds the producer up. auto (the default): lossless, except for live raw video (a camera), which is leaky: audio, encoded video, any stream that is not live, and the start of a wait-for-connection producer lose nothing")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("lossless")
                    .nick("Lossless")
                    .blurb("Kept for older pipelines: true sets mode=lossless, false sets mode=leaky; reads true only when mode is lossless")
                    .default_value(false)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt::builder("cuda-device-id")
                    .nick("CUDA device")
                    .blurb("GPU the rings are registered with when cuda-register says so (see there). -1 = the first GPU if there is one, none otherwise; an id that does not exist is an error")
                    .minimum(-1)
                    .default_value(DEFAULT_CUDA_DEVICE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("cuda-register", CudaRegister::Auto)
                    .nick("CUDA registration")
                    .blurb("When to register the producer's rings with CUDA (once per ring) so that frames carry GpuShmCudaMeta and CUDA elements read them in place. auto: only when a downstream element asks for the meta in the ALLOCATION query (cudasum does), so a process that does not use the GPU creates no CUDA context; always: whenever a GPU is found; never")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("reconnect")
                    .nick("Reconnect")
                    .blurb("When the producer goes away, stay PLAYING and wait for a new producer on socket-path, then remap its ring, renegotiate caps and go on (a warning is posted). When false, that is an error")
                    .default_value(DEFAULT_RECONNECT)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("reconnect-interval")
                    .nick("Reconnect interval")
                    .blurb("How often to try connecting while waiting for a producer (at start and after it went away), in nanoseconds")
                    .minimum(1_000_000)
                    .default_value(DEFAULT_RECONNECT_INTERVAL)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("max-size-buffers")
                    .nick("Max queued buffers")
                    .blurb("Frames received but not yet pushed downstream (downstream blocked, e.g. a sink waiting on its clock) that this source keeps at most (0 = no limit). Past any max-size-* limit a leaky consumer drops its oldest queued frames; a lossless one stops taking frames, so the producer waits (max-wait)")
                    .default_value(DEFAULT_MAX_SIZE_BUFFERS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("max-size-bytes")
                    .nick("Max queued bytes")
                    .blurb("Bytes of frames received but not yet pushed downstream that this source keeps at most (0 = no limit)")
                    .default_value(DEFAULT_MAX_SIZE_BYTES)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("max-size-time")
                    .nick("Max queued time")
                    .blurb("Span of arrival times of frames received but not yet pushed downstream that this source keeps at most, in nanoseconds (0 = no limit)")
                    .default_value(DEFAULT_MAX_SIZE_TIME)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt64::builder("producer-uid")
                    .nick("Producer uid")
                    .blurb("User the producer must run as (checked with SO_PEERCRED on every connection): -1 = this process's user or root. A socket served by anyone else is refused, so that another user binding the path cannot feed frames; set it for a camera service running as its own user")
                    .minimum(-1)
                    .maximum(u32::MAX as i64)
                    .default_value(DEFAULT_PRODUCER_UID)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("spin-us")
                    .nick("Low-latency poll budget")
                    .blurb("Low-latency mode (0 = off): CPU time in microseconds this source may spend per frame polling the ring around the time the next frame is due (learnt from the producer's cadence), instead of sleeping until the frame wakes it. Saves the wake-up of a sleeping core (tens of µs) for a little CPU (the budget at most per frame); a frame earlier or later than expected still wakes the source as with 0, and a paused stream costs nothing. 100-500 suits most machines")
                    .maximum(MAX_SPIN_US)
                    .default_value(0)
                    .mutable_ready()
                    .build(),
                crate::cpu_latency::param_spec(),
                glib::ParamSpecUInt64::builder("frames-dropped")
                    .nick("Frames dropped")
                    .blurb("Frames this consumer did not get: taken back by the producer because it fell behind (leaky), skipped while it was lagging (lossless, past max-wait), or dropped from its own queue past max-size-* (leaky)")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("frames-copied")
                    .nick("Frames copied")
                    .blurb("Frames copied into system memory instead of pointing into the ring, because downstream kept as many zero-copy frames as the producer's client-budget allows")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("frames-skipped")
                    .nick("Frames skipped")
                    .blurb("Buffers of an encoded stream skipped while waiting for a keyframe (DELTA_UNIT buffers after joining mid-stream or after frames were dropped), so that decoders start clean")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("spin-caught")
                    .nick("Frames caught polling")
                    .blurb("Low-latency mode (spin-us): frames that came while the ring was polled, each saving a wake-up")
                    .read_only()
                    .build(),
                glib::ParamSpecUInt64::builder("spin-missed")
                    .nick("Polls missed")
                    .blurb("Low-latency mode (spin-us): polls that ended without a frame, each costing its whole budget (the producer paused, changed its pace, or jitters more than spin-us covers: raise it if this grows with every frame)")
                    .read_only()
                    .build(),
                glib::ParamSpecBoolean::builder("producer-live")
                    .nick("Producer is live")
                    .blurb("Whether the producer's pipeline is live, as its newest frame says. A live producer's frames are stamped about when it published them, never later; a producer that is not live keeps its own timestamps, ahead of real time included (a file read flat out), so a syncing consumer plays them at their pace")
                    .read_only()
                    .build(),
            ]
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings();
        match pspec.name() {
            "socket-path" => {
                s.socket_path = value
                    .get::<Option<String>>()
                    .expect("type checked")
                    .map(PathBuf::from)
            }
            "stream" => s.stream = value.get::<Option<String>>().expect("type checked"),
            "timeout" => s.timeout = value.get().expect("type checked"),
            "mode" => s.mode = value.get().expect("type checked"),
            "lossless" => {
                s.mode = if value.get().expect("type checked") {
                    DeliveryMode::Lossless
                } else {
                    DeliveryMode::Leaky
                }
            }
            "cuda-device-id" => s.cuda_device = value.get().expect("type checked"),
            "cuda-register" => s.cuda_register = value.get().expect("type checked"),
            "reconnect" => s.reconnect = value.get().expect("type checked"),
            "reconnect-interval" => s.reconnect_interval = value.get().expect("type checked"),
            "max-size-buffers" => s.max_size_buffers = value.get().expect("type checked"),
            "max-size-bytes" => s.max_size_bytes = value.get().expect("type checked"),
            "max-size-time" => s.max_size_time = value.get().expect("type checked"),
            "producer-uid" => s.producer_uid = value.get().expect("type checked"),
            "spin-us" => s.spin_us = value.get().expect("type checked"),
            "cpu-latency-us" => s.cpu_latency_us = value.get().expect("type checked"),
            _ => unimplemented!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        match pspec.name() {
            "socket-path" => self
                .settings()
                .socket_path
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned())
                .to_value(),
            "stream" => self.settings().stream.to_value(),
            "timeout" => self.settings().timeout.to_value(),
            "mode" => self.settings().mode.to_value(),
            "lossless" => (self.settings().mode == DeliveryMode::Lossless).to_value(),
            "cuda-device-id" => self.settings().cuda_device.to_value(),
            "cuda-register" => self.settings().cuda_register.to_value(),
            "reconnect" => self.settings().reconnect.to_value(),
            "reconnect-interval" => self.settings().reconnect_interval.to_value(),
            "max-size-buffers" => self.settings().max_size_buffers.to_value(),
            "max-size-bytes" => self.settings().max_size_bytes.to_value(),
            "max-size-time" => self.settings().max_size_time.to_value(),
            "producer-uid" => self.settings().producer_uid.to_value(),
            "spin-us" => self.settings().spin_us.to_value(),
            "cpu-latency-us" => self.settings().cpu_latency_us.to_value(),
            "frames-dropped" => self.shared().map_or(0u64, |s| s.dropped()).to_value(),
            "spin-caught" => self
                .shared()
                .map_or(0u64, |s| s.spin_caught.load(Ordering::Relaxed))
                .to_value(),
            "spin-missed" => self
                .shared()
                .map_or(0u64, |s| s.spin_missed.load(Ordering::Relaxed))
                .to_value(),
            "frames-copied" => self
                .shared()
                .map_or(0u64, |s| s.copied.load(Ordering::Relaxed))
                .to_value(),
            "frames-skipped" => self
                .shared()
                .map_or(0u64, |s| s.skipped.load(Ordering::Relaxed))
                .to_value(),
            "producer-live" => self
                .shared()
                .is_some_and(|s| s.producer_live.load(Ordering::Relaxed))
                .to_value(),
            _ => unimplemented!(),
        }
    }

    fn constructed(&self) {
        self.parent_constructed();
        let obj = self.obj();
        obj.set_live(true);
        obj.set_format(gst::Format::Time);
    }
}

impl GstObjectImpl for GpuShmSrc {}

impl ElementImpl for GpuShmSrc {
    fn set_context(&self, context: &gst::Context) {
        if context.context_type() == gstcuda::CONTEXT_TYPE {
            let device = self.settings().cuda_device;
            let mut ctx = self
                .cuda_ctx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let obj = self.obj();
            gstcuda::handle_set_context(obj.upcast_ref(), context, device, &mut ctx);
            *self.cuda_ctx.lock().unwrap_or_else(|e| e.into_inner()) = ctx;
        }
        self.parent_set_context(context)
    }

    fn change_state(
        &self,
        transition: gst::StateChange,
    ) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        match transition {
            // The base time is set: connect now (see the receiver).
            gst::StateChange::PausedToPlaying => {
                if let Some(s) = self.shared() {
                    s.go();
                }
            }
            gst::StateChange::PlayingToPaused => {
                if let Some(s) = self.shared() {
                    s.pause();
                }
            }
            _ => {}
        }
        self.parent_change_state(transition)
    }

    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: Lazy<gst::subclass::ElementMetadata> = Lazy::new(|| {
            gst::subclass::ElementMetadata::new(
                "GPU shared-memory video source",
                "Source/Video",
                "Receives raw or encoded video, audio or any stream from a gpushmsink in another process without copying its bytes; caps come from the producer. Joining an encoded stream, it starts at a keyframe, after the caps' stream headers. A producer's device ring (GPU memory) is read in place (cudasum, GpuShmCudaMeta; CPU elements get a copy when they map a frame) or, where downstream asks for memory:CUDAMemory, copied on the GPU into a CUDA buffer pool. Example: gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink",
                "gpushm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: Lazy<Vec<gst::PadTemplate>> = Lazy::new(|| {
            let caps = gst::Caps::new_any();
            vec![gst::PadTemplate::new(
                "src",
                gst::PadDirection::Src,
                gst::PadPresence::Always,
                &caps,
            )
            .expect("valid template")]
        });
        TEMPLATES.as_ref()
    }
}

impl BaseSrcImpl for GpuShmSrc {
    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let s = self.settings().clone();
        let endpoint =
            Endpoint::from_settings(s.socket_path.clone(), s.stream.clone(), "socket-path")
                .map_err(|e| gst::error_msg!(gst::ResourceError::Settings, ("{}", e)))?;
        // A CUDA context costs ≈100 MiB: only for cuda-register=always here, otherwise when
        // downstream asks (decide_allocation).
        let cuda = match s.cuda_register {
            CudaRegister::Always => self.open_cuda(s.cuda_device)?,
            _ => None,
        };
        // A GPU that cannot register read-only memory needs a writable mapping to read frames
        // in place: zero-copy GPU access beats the protection there.
        let writable_ring = cuda.as_ref().is_some_and(|d| self.needs_writable_ring(d));
        let opts = ConnectOptions {
            mode: s.mode.into(),
            lossless: false,
            writable_ring,
            name: self.obj().name().to_string(),
            timeout: Duration::from_nanos(s.timeout),
            retry: Duration::from_nanos(s.reconnect_interval).max(Duration::from_millis(1)),
            producer_uid: u32::try_from(s.producer_uid).ok(),
            // A producer's device ring (frames in GPU memory) is mapped, and each frame copied
            // to system memory for downstream.
            device_memory: true,
            spin: Duration::from_micros(s.spin_us.into()),
        };
        // Connecting (and waiting for a producer) happens in the receiver thread: a pipeline
        // can be stopped while it waits.
        let receiver = Receiver::start(
            &self.obj(),
            Config {
                endpoint,
                opts,
                reconnect: s.reconnect,
                max_buffers: s.max_size_buffers,
                max_bytes: s.max_size_bytes,
                max_time: s.max_size_time,
            },
        )
        .map_err(|e| {
            gst::error_msg!(
                gst::ResourceError::Failed,
                ("Cannot start receiving: {}", e)
            )
        })?;
        *self.state() = Some(Started {
            receiver,
            pad_caps: None,
            pad_cuda: false,
            map: TimeMap::new(),
            clock_is_monotonic: None,
            clock_offset: None,
            last_pts: None,
            serial: 0,
            answered_latency: None,
            latency_changed: false,
            cuda,
            cuda_asked: false,
            _cpu_latency: crate::cpu_latency::hold(&*self.obj(), s.cpu_latency_us),
        });
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        // Dropped outside the lock: stopping joins the receiver thread.
        let old = self.state().take();
        drop(old);
        self.cuda_ctx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        Ok(())
    }

    /// Frames are pushed the moment they arrive: never wait on the clock for them. (The
    /// default makes a live source sync on each timestamp, and a live producer can stamp a
    /// frame up to 0.5 ms ahead, since GstSystemClock does not sleep for shorter waits.)
    fn times(&self, _buffer: &gst::BufferRef) -> (Option<gst::ClockTime>, Option<gst::ClockTime>) {
        (None, None)
    }

    fn is_seekable(&self) -> bool {
        false
    }

    fn caps(&self, filter: Option<&gst::Caps>) -> Option<gst::Caps> {
        let known = self
            .shared()
            .and_then(|s| s.caps.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .and_then(|c| gst::Caps::from_str(&c).ok());
        let on_device = self
            .state()
            .as_ref()
            .is_some_and(|st| st.pad_caps.as_ref().is_some_and(|(_, d)| d.is_some()));
        let caps = match known {
            // Frames of a device ring go out in CUDA memory too, where downstream asks.
            Some(c)
                if on_device
                    && c.structure(0).is_some_and(|s| s.name() == "video/x-raw")
                    && gstcuda::available().is_ok() =>
            {
                let mut both = gstcuda::with_cuda_feature(&c);
                both.get_mut().expect("new caps").append(c);
                both
            }
            Some(c) => c,
            None => self.obj().src_pad().pad_template_caps(),
        };
        Some(match filter {
            Some(f) => f.intersect_with_mode(&caps, gst::CapsIntersectMode::First),
            None => caps,
        })
    }

    fn decide_allocation(
        &self,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        let asks = query.find_allocation_meta::<CudaMetaApi>().is_some();
        gst::debug!(
            CAT,
            imp = self,
            "ALLOCATION query: downstream asks for GpuShmCudaMeta: {asks}"
        );
        if asks {
            self.cuda_requested()?;
        }
        self.parent_decide_allocation(query)
    }

    fn negotiate(&self) -> Result<(), gst::LoggableError> {
        // Caps are set from create() with each frame's caps; nothing to pick here.
        Ok(())
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        if let gst::QueryViewMut::Context(q) = query.view_mut() {
            if q.context_type() == gstcuda::CONTEXT_TYPE {
                let ctx = self
                    .cuda_ctx
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                let obj = self.obj();
                if gstcuda::handle_context_query(obj.upcast_ref(), query, ctx.as_ref()) {
                    return true;
                }
            }
        }
        if let gst::QueryViewMut::Latency(q) = query.view_mut() {
            let mut guard = self.state();
            let latency = match guard.as_mut() {
                Some(st) => {
                    let l = self.latency(st, self.obj().does_timestamp());
                    st.answered_latency = Some(l);
                    l
                }
                None => 0,
            };
            q.set(
                true,
                gst::ClockTime::from_nseconds(latency),
                gst::ClockTime::NONE,
            );
            return true;
        }
        BaseSrcImplExt::parent_query(self, query)
    }

    fn unlock(&self) -> Result<(), gst::ErrorMessage> {
        if let Some(s) = self.reader() {
            s.set_flushing(true);
        }
        Ok(())
    }

    fn unlock_stop(&self) -> Result<(), gst::ErrorMessage> {
        if let Some(s) = self.reader() {
            s.set_flushing(false);
        }
        Ok(())
    }

    /// GstBaseSrc's create, answered here rather than through GstPushSrc's (one C function
    /// and one binding trampoline less on the way of every frame, each cold after a wait).
    /// GstBaseSrc passes no buffer in push mode, the only mode of a live source.
    fn create(
        &self,
        _offset: u64,
        _buffer: Option<&mut gst::BufferRef>,
        _length: u32,
    ) -> Result<CreateSuccess, gst::FlowError> {
        self.next_buffer()
    }
}

/// GstPushSrc's create() is not used: GstBaseSrc calls ours directly (see
/// `BaseSrcImpl::create`).
impl PushSrcImpl for GpuShmSrc {}

impl GpuShmSrc {
    /// The next buffer (or list: stream headers first) to push: waits for a frame.
    fn next_buffer(&self) -> Result<CreateSuccess, gst::FlowError> {
        // Wait without the state lock: property reads and queries never wait for frames.
        let reader = self.reader().ok_or(gst::FlowError::Flushing)?;
        // Read before waiting: after a wake-up each read costs several times more, on the
        // frame's way. Base time and clock change only while create() is not running (a live
        // source is unlocked before it pauses); read again after a long wait all the same.
        let mut timing = self.timing();
        let asked = gpushm::monotonic_ns();
        let (item, discont) = reader.next_item().ok_or(gst::FlowError::Flushing)?;
        #[cfg(feature = "stages")]
        let t_next = gpushm::monotonic_ns();
        match item {
            Item::Frame(Received {
                mut buffer,
                details: mut f,
                headers,
            }) => {
                if f.arrival_ns.saturating_sub(asked) > TIMING_STALE_NS {
                    timing = self.timing();
                }
                // The state lock is held only for bookkeeping: caps events, warnings and
                // messages go out without it (a bus sync handler may read our properties).
                let mut guard = self.state();
                let new_caps = {
                    let st = guard.as_ref().ok_or(gst::FlowError::Flushing)?;
                    let now = (f.caps.clone(), f.on_device);
                    (st.pad_caps.as_ref() != Some(&now)).then_some(now)
                };
                if let Some(c) = new_caps {
                    drop(guard);
                    let cuda = self.set_pad_caps(&c.0, c.1)?;
                    // The ALLOCATION query for these caps, now: downstream may ask for
                    // GpuShmCudaMeta, and this frame already gets it.
                    if !self.obj().negotiate() {
                        gst::debug!(CAT, imp = self, "allocation after new caps failed");
                    }
                    guard = self.state();
                    if let Some(st) = guard.as_mut() {
                        st.pad_caps = Some(c);
                        st.pad_cuda = cuda;
                    }
                }
                if f.on_device.is_some() {
                    let cuda = guard.as_ref().is_some_and(|st| st.pad_cuda);
                    drop(guard);
                    let before = buffer.as_ptr();
                    buffer = self.to_pad_memory(buffer, &f, cuda)?;
                    if buffer.as_ptr() != before {
                        // A copy: it does not hold the frame's slot, so no device pointer to it.
                        f.slot = None;
                    }
                    guard = self.state();
                }
                #[cfg(feature = "stages")]
                let t_caps = gpushm::monotonic_ns();
                #[cfg(feature = "stages")]
                let mut stage_times;
                let latency_changed = {
                    let st = guard.as_mut().ok_or(gst::FlowError::Flushing)?;
                    let b = buffer.make_mut();
                    if let Some(dev) = &st.cuda {
                        self.add_cuda_meta(dev, b, &f);
                    }
                    self.timestamp(st, &timing, b, &f);
                    if discont {
                        b.set_flags(gst::BufferFlags::DISCONT);
                    }
                    self.post_latency_if_changed(st, &timing);
                    #[cfg(feature = "stages")]
                    {
                        stage_times = [
                            f.arrival_ns,
                            f.built_ns,
                            t_next,
                            t_caps,
                            gpushm::monotonic_ns(),
                            0,
                        ];
                    }
                    std::mem::take(&mut st.latency_changed)
                };
                drop(guard);
                if latency_changed {
                    let _ = self
                        .obj()
                        .post_message(gst::message::Latency::builder().src(&*self.obj()).build());
                }
                drop(f);
                if headers.is_empty() {
                    #[cfg(feature = "stages")]
                    if let Some(b) = buffer.get_mut() {
                        stage_times[5] = gpushm::monotonic_ns();
                        crate::stages::add_all(b, stage_times);
                    }
                    return Ok(CreateSuccess::NewBuffer(buffer));
                }
                // Joined mid-stream: the caps' stream headers first, as multifdsink sends
                // them to a new client.
                gst::debug!(
                    CAT,
                    imp = self,
                    "joined mid-stream: {} stream headers first",
                    headers.len()
                );
                let mut list = gst::BufferList::new_sized(headers.len() + 1);
                {
                    let l = list.get_mut().ok_or(gst::FlowError::Error)?;
                    let discont = buffer.flags().contains(gst::BufferFlags::DISCONT);
                    for (i, mut h) in headers.into_iter().enumerate() {
                        let hb = h.make_mut();
                        hb.set_pts(buffer.pts());
                        hb.set_dts(buffer.dts());
                        if i == 0 && discont {
                            hb.set_flags(gst::BufferFlags::DISCONT);
                        }
                        l.add(h);
                    }
                    l.add(buffer);
                }
                Ok(CreateSuccess::NewBufferList(list))
            }
            Item::Eos => Err(gst::FlowError::Eos),
            Item::Error(msg) => {
                self.post_error_message(msg);
                Err(gst::FlowError::Error)
            }
        }
    }
}
