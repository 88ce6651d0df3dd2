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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::base_src::CreateSuccess;
use gst_base::subclass::prelude::*;
use once_cell::sync::Lazy;

use super::properties::{
    self, DEFAULT_CUDA_DEVICE, DEFAULT_MAX_SIZE_BUFFERS, DEFAULT_MAX_SIZE_BYTES,
    DEFAULT_MAX_SIZE_TIME, DEFAULT_MODE, DEFAULT_PRODUCER_UID, DEFAULT_RECONNECT,
    DEFAULT_RECONNECT_INTERVAL, DEFAULT_TIMEOUT,
};
use super::receiver::{Config, Reader, Receiver, Shared};
use super::timing::Timestamps;
use super::{DeliveryMode, CAT};
use crate::cuda::gstcuda;
use crate::cudameta::{CudaMetaApi, CudaRegister};
use gpushm::subscriber::ConnectOptions;

#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) socket_path: Option<PathBuf>,
    pub(super) stream: Option<String>,
    pub(super) timeout: u64,
    pub(super) mode: DeliveryMode,
    pub(super) cuda_device: i32,
    pub(super) cuda_register: CudaRegister,
    pub(super) reconnect: bool,
    pub(super) reconnect_interval: u64,
    pub(super) max_size_buffers: u32,
    pub(super) max_size_bytes: u64,
    pub(super) max_size_time: u64,
    pub(super) producer_uid: i64,
    pub(super) spin_us: u32,
    pub(super) cpu_latency_us: i32,
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

pub(super) struct Started {
    pub(super) receiver: Receiver,
    /// Caps string last set on the pad, and the device of the ring its frames came from
    /// (`None`: a host ring).
    pub(super) pad_caps: Option<(Arc<str>, Option<i32>)>,
    /// The pad's caps are the producer's in CUDA memory (memory:CUDAMemory): device-ring
    /// frames go to downstream in a CUDA buffer pool's memory.
    pub(super) pad_cuda: bool,
    /// The producer's times into our running time, and the latency answered (timing.rs).
    pub(super) timestamps: Timestamps,
    /// The GPU frames are registered with (cuda-register=always, or downstream asked).
    pub(super) cuda: Option<Arc<crate::cuda::Device>>,
    /// Downstream asked for GpuShmCudaMeta (auto): the device was looked for.
    pub(super) cuda_asked: bool,
    /// cpu-latency-us, held until stop.
    _cpu_latency: Option<gpushm::cpu_latency::CpuLatency>,
}

pub struct GpuShmSrc {
    settings: Mutex<Settings>,
    pub(super) state: Mutex<Option<Started>>,
    /// The CUDA context GStreamer's CUDA elements of the pipeline share (GstCudaContext),
    /// once device-ring frames go out in CUDA memory or a neighbour handed it.
    pub(super) cuda_ctx: Mutex<Option<gstcuda::Context>>,
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
    pub(super) fn settings(&self) -> MutexGuard<'_, Settings> {
        self.settings.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn state(&self) -> MutexGuard<'_, Option<Started>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn shared(&self) -> Option<Arc<Shared>> {
        self.state()
            .as_ref()
            .map(|s| s.receiver.reader.shared.clone())
    }
    pub(super) fn reader(&self) -> Option<Arc<Reader>> {
        self.state().as_ref().map(|s| s.receiver.reader.clone())
    }
}

#[glib::object_subclass]
impl ObjectSubclass for GpuShmSrc {
    const NAME: &'static str = "GstGpuShmSrc";
    type Type = super::GpuShmSrc;
    type ParentType = gst_base::PushSrc;
}

impl ObjectImpl for GpuShmSrc {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: Lazy<Vec<glib::ParamSpec>> = Lazy::new(properties::specs);
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        self.set_property_value(value, pspec)
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        self.property_value(pspec)
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
                "Receives raw or encoded video, audio or any stream from a gpushmsink in another process without copying its bytes; caps come from the producer. Joining an encoded stream, it starts at a keyframe, after the caps' stream headers. A producer's device ring (GPU memory) is read in place (cudasum, GpuShmCudaMeta; CPU elements get a copy when they map a frame) and goes out as memory:CUDAMemory where downstream asks for it: the ring's GPU memory itself on GStreamer 1.24 and newer, a copy on the GPU before (frames-cuda-wrapped, frames-cuda-copied). Example: gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink",
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
            // A producer's device ring (frames in GPU memory) is mapped; its frames go out
            // in place (CUDA elements, GpuShmCudaMeta) or copied where downstream needs.
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
            timestamps: Timestamps::new(),
            cuda,
            cuda_asked: false,
            _cpu_latency: crate::cpu_latency::hold(&*self.obj(), s.cpu_latency_us),
        });
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        // What happened to the frames, for a log (GST_DEBUG=gpushmsrc:4) of a run that ended.
        if let Some(s) = self.shared() {
            let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
            gst::info!(
                CAT,
                imp = self,
                "stopping: frames-dropped {}, frames-copied {}, frames-cuda-wrapped {}, frames-cuda-copied {}",
                s.dropped(),
                n(&s.copied),
                n(&s.cuda_wrapped),
                n(&s.cuda_copied)
            );
        }
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

    fn event(&self, event: &gst::Event) -> bool {
        // Custom upstream events (force-key-unit included) are for the producer's pipeline.
        match crate::events::encode_upstream(event) {
            Some(Ok(p)) => match self.reader() {
                Some(r) => {
                    r.send_upstream(p);
                    true
                }
                None => false,
            },
            Some(Err(why)) => {
                gst::warning!(CAT, imp = self, "not sent to the producer: {why}");
                false
            }
            None => self.parent_event(event),
        }
    }

    fn negotiate(&self) -> Result<(), gst::LoggableError> {
        // Caps are set from create() with each frame's caps; nothing to pick here.
        Ok(())
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        if let gst::QueryViewMut::Context(q) = query.view_mut() {
            if q.context_type() == gstcuda::CONTEXT_TYPE {
                // A CUDA element downstream looks for the pipeline's context: ours, or this
                // process's, which frames are imported in (see gstcuda::process_context).
                let cached = self
                    .cuda_ctx
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                let ctx = cached.or_else(|| self.process_cuda_context(self.settings().cuda_device));
                let obj = self.obj();
                if gstcuda::handle_context_query(obj.upcast_ref(), query, ctx.as_ref()) {
                    return true;
                }
            }
        }
        if let gst::QueryViewMut::Latency(q) = query.view_mut() {
            let mut guard = self.state();
            let latency = match guard.as_mut() {
                Some(st) => st.timestamps.answer_latency(self.obj().does_timestamp()),
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
