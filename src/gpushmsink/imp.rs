// SPDX-License-Identifier: MPL-2.0
/**
 * SECTION:element-gpushmsink
 * @see_also: gpushmsrc, shmsink, unixfdsink
 *
 * Shares raw video with any number of gpushmsrc elements in other processes through a
 * shared-memory ring. Upstream renders straight into the ring through the buffer pool this
 * sink proposes, and consumers map the same memory: no frame byte is copied on either side.
 * Buffers that do not come from the pool are copied once into a free slot (counted in
 * `stats` as frames-copied). Raw video in CUDA memory goes into a ring in GPU memory on a
 * discrete GPU (`ring`): on GStreamer 1.24+ CUDA elements upstream render into its slots
 * through the CUDA buffer pool this sink proposes, otherwise each frame is copied on the GPU.
 *
 * Any caps travel, like with shmsink: encoded video (H.264, H.265, JPEG), audio, RTP, data.
 * Raw video gets frame-sized slots; other caps get slots of `max-buffer-size`, and a larger
 * buffer gets a new ring with larger slots (never cut or refused). Timestamps, offsets, every
 * buffer flag and the caps (streamheader, codec_data) reach the consumers. Caps in device
 * memory (memory:NVMM, DMABuf, GL) are refused: convert to system memory first.
 *
 * The ring is a sealed memfd handed to consumers over the unix socket at `socket-path`, so
 * nothing is ever left in /dev/shm, even after kill -9. A consumer that goes away gives back
 * every slot it held at once; slow consumers are leaky unless they ask to be lossless.
 *
 * For the lowest latency, a live source goes with `sync=false` (buffers then go straight to
 * the ring, around GstBaseSink's chain function), and `cpu-latency-us=0` keeps the CPUs out
 * of the deep idle states after which a frame's way runs on cold caches (the kernel's CPU
 * latency QoS; needs write access to /dev/cpu_dma_latency).
 *
 * ## Example launch line
 * |[
 * gst-launch-1.0 videotestsrc is-live=true ! video/x-raw,format=NV12,width=1920,height=1080 ! gpushmsink socket-path=/tmp/cam
 * ]|
 * and in another terminal
 * |[
 * gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink
 * ]|
 */
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex, MutexGuard};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;
use gst_video::prelude::*;
use once_cell::sync::Lazy;

use super::caps::{acceptable_caps, cuda_memory, system_memory};
use super::direct::Direct;
use super::metas::Timing;
use super::pool::{Server, SlotPool};
use super::properties::{
    self, DEFAULT_ALLOW_WRITABLE_RING, DEFAULT_CLIENT_BUDGET, DEFAULT_CUDA_DEVICE,
    DEFAULT_MAX_BUFFER_SIZE, DEFAULT_MAX_CLIENTS, DEFAULT_MAX_WAIT, DEFAULT_PERMS, DEFAULT_SLOTS,
    DEFAULT_WAIT_FOR_CLIENTS, DEFAULT_WAIT_FOR_CONNECTION, DEFAULT_WAKE_AHEAD_US,
    DEFAULT_WAKE_EARLY,
};
use super::publish::FramePath;
use crate::cuda::Selected;
use crate::cudameta::{CudaRegister, RingPlacement};
use gpushm::server::{Config, Event};

pub(super) static CAT: Lazy<gst::DebugCategory> = Lazy::new(|| {
    gst::DebugCategory::new(
        "gpushmsink",
        gst::DebugColorFlags::empty(),
        Some("GPU shared-memory video sink"),
    )
});

#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) socket_path: Option<PathBuf>,
    pub(super) stream: Option<String>,
    pub(super) wait_for_connection: bool,
    /// How many consumers wait_for_connection waits for.
    pub(super) wait_for_clients: u32,
    pub(super) perms: u32,
    pub(super) slots: u32,
    pub(super) cuda_device: i32,
    pub(super) cuda_register: CudaRegister,
    pub(super) ring: RingPlacement,
    pub(super) max_wait: i64,
    pub(super) client_budget: u32,
    pub(super) max_clients: u32,
    pub(super) upstream_event_rate: u32,
    pub(super) allow_writable_ring: bool,
    pub(super) max_buffer_size: u32,
    pub(super) spin_us: u32,
    pub(super) cpu_latency_us: i32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            socket_path: None,
            stream: None,
            wait_for_connection: DEFAULT_WAIT_FOR_CONNECTION,
            wait_for_clients: DEFAULT_WAIT_FOR_CLIENTS,
            perms: DEFAULT_PERMS,
            slots: DEFAULT_SLOTS,
            cuda_device: DEFAULT_CUDA_DEVICE,
            cuda_register: CudaRegister::Auto,
            ring: RingPlacement::Auto,
            max_wait: DEFAULT_MAX_WAIT,
            client_budget: DEFAULT_CLIENT_BUDGET,
            max_clients: DEFAULT_MAX_CLIENTS,
            upstream_event_rate: gpushm::policy::UPSTREAM_EVENTS_PER_S,
            allow_writable_ring: DEFAULT_ALLOW_WRITABLE_RING,
            max_buffer_size: DEFAULT_MAX_BUFFER_SIZE,
            spin_us: 0,
            cpu_latency_us: crate::cpu_latency::DEFAULT,
        }
    }
}

// One per element, held behind a mutex: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum State {
    Stopped,
    Started {
        server: Arc<Server>,
        /// The GPU every ring is registered with (cuda-register=always), if any.
        cuda: Option<Arc<crate::cuda::Device>>,
        /// The device to register a ring with when upstream asks (cuda-register=auto).
        cuda_on_request: Option<i32>,
        /// The raw video layout of `caps`; `None` for other caps (their buffers are opaque
        /// bytes of any size up to the slot size).
        info: Option<Arc<gst_video::VideoInfo>>,
        caps: Option<gst::Caps>,
        pool: Option<SlotPool>,
        /// Whether upstream is live, asked once per caps.
        live: Option<bool>,
        /// What render() needs for each frame of `caps`, found once per ring.
        frames: Option<Arc<FramePath>>,
        /// cpu-latency-us, held until stop.
        _cpu_latency: Option<gpushm::cpu_latency::CpuLatency>,
    },
}

pub struct GpuShmSink {
    pub(super) settings: Mutex<Settings>,
    pub(super) state: Mutex<State>,
    /// The pipeline clock and latency, for frames' times (metas.rs).
    pub(super) timing: Timing,
    /// The direct chain (direct.rs).
    pub(super) direct: Direct,
    /// wake-early, read on the way of each frame without the settings' lock.
    pub(super) wake_early: AtomicBool,
    /// wake-ahead-us (applied with wake-early, see `apply_wake_ahead`).
    pub(super) wake_ahead_us: AtomicU32,
    /// Metas already warned about as too large to travel (publish.rs): once per name.
    pub(super) warned_metas: Mutex<std::collections::BTreeSet<String>>,
}

impl Default for GpuShmSink {
    fn default() -> Self {
        Self {
            settings: Mutex::new(Settings::default()),
            state: Mutex::new(State::Stopped),
            timing: Timing::default(),
            direct: Direct::default(),
            wake_early: AtomicBool::new(DEFAULT_WAKE_EARLY),
            wake_ahead_us: AtomicU32::new(DEFAULT_WAKE_AHEAD_US),
            warned_metas: Mutex::new(Default::default()),
        }
    }
}

impl GpuShmSink {
    pub(super) fn settings(&self) -> MutexGuard<'_, Settings> {
        self.settings.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn server(&self) -> Option<Arc<Server>> {
        match &*self.state() {
            State::Started { server, .. } => Some(server.clone()),
            State::Stopped => None,
        }
    }
}

#[glib::object_subclass]
impl ObjectSubclass for GpuShmSink {
    const NAME: &'static str = "GstGpuShmSink";
    type Type = super::GpuShmSink;
    type ParentType = gst_base::BaseSink;
}

impl ObjectImpl for GpuShmSink {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: Lazy<Vec<glib::ParamSpec>> = Lazy::new(properties::specs);
        PROPERTIES.as_ref()
    }

    fn signals() -> &'static [glib::subclass::Signal] {
        static SIGNALS: Lazy<Vec<glib::subclass::Signal>> = Lazy::new(|| {
            vec![
                glib::subclass::Signal::builder("client-connected")
                    .param_types([i32::static_type()])
                    .build(),
                glib::subclass::Signal::builder("client-disconnected")
                    .param_types([i32::static_type()])
                    .build(),
            ]
        });
        SIGNALS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        self.set_property_value(value, pspec)
    }

    fn constructed(&self) {
        self.parent_constructed();
        // The last buffer is a ring slot: keeping it would take a slot from upstream.
        self.obj().set_enable_last_sample(false);
        self.install_direct_chain();
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        self.property_value(pspec)
    }
}

impl GstObjectImpl for GpuShmSink {}

impl ElementImpl for GpuShmSink {
    fn change_state(
        &self,
        transition: gst::StateChange,
    ) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        if transition == gst::StateChange::ReadyToPaused {
            // GstBaseSink starts each stream with a latency of 0.
            self.timing.set_latency(0);
        }
        let r = self.parent_change_state(transition);
        if transition == gst::StateChange::PausedToReady {
            self.direct.forget_position();
        }
        r
    }

    fn send_event(&self, event: gst::Event) -> bool {
        match event.view() {
            // Kept here too, for frames' latency field without GstBaseSink's object lock.
            gst::EventView::Latency(l) => {
                self.timing.set_latency(l.latency().nseconds());
            }
            gst::EventView::Step(_) => self.direct.set_stepped(),
            _ => {}
        }
        self.parent_send_event(event)
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        // Buffers that went the direct way did not tell GstBaseSink their times: without sync,
        // the position it reports (the last buffer's stream time) is answered here.
        if let gst::QueryViewMut::Position(q) = query.view_mut() {
            if q.format() == gst::Format::Time {
                if let Some(pos) = self.direct.reported_position(&self.obj()) {
                    q.set(pos);
                    return true;
                }
            }
        }
        ElementImplExt::parent_query(self, query)
    }

    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: Lazy<gst::subclass::ElementMetadata> = Lazy::new(|| {
            gst::subclass::ElementMetadata::new(
                "GPU shared-memory video sink",
                "Sink/Video",
                "Shares video (raw or encoded), audio or any stream with gpushmsrc in other processes through a shared-memory ring; raw video is zero-copy and CUDA reads it in place. Example: gst-launch-1.0 videotestsrc is-live=true ! video/x-raw,format=NV12,width=1920,height=1080 ! gpushmsink socket-path=/tmp/cam",
                "gpushm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: Lazy<Vec<gst::PadTemplate>> = Lazy::new(|| {
            let caps = gst::Caps::new_any();
            vec![gst::PadTemplate::new(
                "sink",
                gst::PadDirection::Sink,
                gst::PadPresence::Always,
                &caps,
            )
            .expect("valid template")]
        });
        TEMPLATES.as_ref()
    }
}

impl BaseSinkImpl for GpuShmSink {
    fn caps(&self, filter: Option<&gst::Caps>) -> Option<gst::Caps> {
        // CUDA memory is worth a look (and a CUDA context) only when upstream offers it.
        let offered = filter.is_some_and(|f| {
            !f.is_any() && f.iter_with_features().any(|(_, feat)| cuda_memory(feat))
        });
        Some(acceptable_caps(filter, offered && self.takes_cuda_memory()))
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        // GstBaseSink checks accept-caps against its unfiltered caps (ANY here): device
        // memory is refused here as in set_caps.
        if let gst::QueryViewMut::AcceptCaps(q) = query.view_mut() {
            let cuda = q.caps().iter_with_features().any(|(_, f)| cuda_memory(f))
                && self.takes_cuda_memory();
            if !q.caps().iter_with_features().all(|(st, f)| {
                system_memory(f) || (cuda && cuda_memory(f) && st.name() == "video/x-raw")
            }) {
                q.set_result(false);
                return true;
            }
        }
        // A CUDA element upstream (nvh264dec, cudaupload) looks for the pipeline's CUDA
        // context: it gets this process's, the one a device ring is made in, so that the
        // process runs one CUDA context, not two (see gstcuda::process_context).
        if let gst::QueryViewMut::Context(q) = query.view_mut() {
            if q.context_type() == crate::cuda::gstcuda::CONTEXT_TYPE {
                let id = self.settings().cuda_device;
                let ctx = crate::cuda::gstcuda::available()
                    .ok()
                    .and_then(|()| crate::cuda::device(id).ok())
                    .and_then(|d| crate::cuda::gstcuda::process_context(&d));
                let obj = self.obj();
                if crate::cuda::gstcuda::handle_context_query(obj.upcast_ref(), query, ctx.as_ref())
                {
                    return true;
                }
            }
        }
        BaseSinkImplExt::parent_query(self, query)
    }

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let s = self.settings().clone();
        let settings_error =
            |e: gpushm::Error| gst::error_msg!(gst::ResourceError::Settings, ("{}", e));
        let path = match gpushm::names::Endpoint::from_settings(
            s.socket_path.clone(),
            s.stream.clone(),
            "socket-path",
        )
        .map_err(settings_error)?
        {
            gpushm::names::Endpoint::Path(p) => p,
            gpushm::names::Endpoint::Stream(n) => gpushm::names::producer_path(&n)
                .map_err(|e| gst::error_msg!(gst::ResourceError::OpenWrite, ("{}", e)))?,
        };
        let weak = self.obj().downgrade();
        let on_event = Box::new(move |e: Event| {
            let Some(obj) = weak.upgrade() else { return };
            match e {
                Event::Connected { id, pid, uid, name } => {
                    gst::info!(
                        CAT,
                        obj = obj,
                        "client {id} connected: pid {pid}, uid {uid}, name {:?}",
                        // A client's own words: quoted and cut short in the log.
                        name.chars().take(64).collect::<String>()
                    );
                    obj.emit_by_name::<()>("client-connected", &[&(id as i32)]);
                    obj.notify("num-clients");
                }
                Event::Info(m) => gst::info!(CAT, obj = obj, "{m}"),
                Event::Upstream { id, payload } => super::events::pass_upstream(&obj, id, &payload),
                Event::Lagging { id, waited, first } => {
                    if first {
                        gst::element_warning!(
                            obj,
                            gst::ResourceError::Busy,
                            ("Lossless client {} took no frame for {:?} (max-wait): it is served like a leaky one (frames skip it, nobody waits for it) until it takes frames again", id, waited)
                        );
                    } else {
                        gst::info!(CAT, obj = obj, "lossless client {id} lagging again");
                    }
                }
                Event::CaughtUp { id } => {
                    gst::info!(CAT, obj = obj, "lossless client {id} caught up")
                }
                Event::Closed { id, held } => {
                    gst::info!(
                        CAT,
                        obj = obj,
                        "client {id} closed: it takes no more frames and keeps the {held} it holds until it lets them go"
                    );
                    obj.notify("num-clients");
                }
                Event::Disconnected { id, reason } => {
                    if id == 0 {
                        gst::warning!(CAT, obj = obj, "rejected a connection: {reason}");
                    } else {
                        gst::info!(CAT, obj = obj, "client {id} disconnected: {reason}");
                        obj.emit_by_name::<()>("client-disconnected", &[&(id as i32)]);
                        obj.notify("num-clients");
                    }
                }
            }
        });
        if s.allow_writable_ring {
            gst::info!(
                CAT,
                imp = self,
                "allow-writable-ring: rings are not sealed against writes; consumers that ask get a writable descriptor"
            );
        }
        let config = Config {
            perms: s.perms,
            allow_writable: s.allow_writable_ring,
            max_clients: s.max_clients as usize,
        };
        let server = Server::start(&path, config, on_event).map_err(|e| {
            gst::error_msg!(
                gst::ResourceError::OpenWrite,
                ("Cannot serve {}: {}", path.display(), e)
            )
        })?;
        server.set_upstream_rate(s.upstream_event_rate);
        gst::debug!(CAT, imp = self, "listening on {}", path.display());
        // A CUDA context costs ≈100 MiB: only for cuda-register=always here, otherwise when
        // upstream asks (the pool option).
        let cuda = match s.cuda_register {
            CudaRegister::Always => match crate::cuda::select(s.cuda_device) {
                Ok(Selected::Device(d)) => Some(d),
                Ok(Selected::Unavailable(e)) => {
                    gst::info!(CAT, imp = self, "rings are not registered with CUDA: {e}");
                    None
                }
                Err(e) => {
                    server.stop();
                    return Err(gst::error_msg!(gst::LibraryError::Init, ("{}", e)));
                }
            },
            _ => None,
        };
        let cuda_on_request = (s.cuda_register == CudaRegister::Auto).then_some(s.cuda_device);
        self.direct.set_eos(false);
        self.direct.forget_position();
        *self.state() = State::Started {
            server,
            cuda,
            cuda_on_request,
            info: None,
            caps: None,
            pool: None,
            live: None,
            frames: None,
            _cpu_latency: crate::cpu_latency::hold(&*self.obj(), s.cpu_latency_us),
        };
        // Once started: a property set meanwhile is applied by one side or the other.
        self.apply_wake_ahead();
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        let old = std::mem::replace(&mut *self.state(), State::Stopped);
        if let State::Started { server, pool, .. } = old {
            server.stop();
            if let Some(pool) = pool {
                pool.retire();
            }
        }
        Ok(())
    }

    fn set_caps(&self, caps: &gst::Caps) -> Result<(), gst::LoggableError> {
        self.configure(caps)
    }

    fn propose_allocation(
        &self,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        let caps = query.get().0.map(|c| c.to_owned());
        query.add_allocation_meta::<gst_video::VideoMeta>(None);
        if self.settings().cuda_register != CudaRegister::Never {
            // Upstream that wants device pointers sets POOL_OPTION_CUDA_META on our pool.
            query.add_allocation_meta::<crate::cudameta::CudaMetaApi>(None);
        }
        // Upstream asks before its first buffer: have the ring for these caps ready so that
        // it renders into shared memory from the very first frame.
        if let Some(c) = caps.as_ref().filter(|c| c.is_fixed()) {
            self.configure(c)?;
        }
        // (Taken out of the state: the CUDA pool asks upstream for its context.)
        let current = match (caps, &*self.state()) {
            (
                Some(caps),
                State::Started {
                    caps: Some(cur),
                    info: Some(info),
                    pool: Some(pool),
                    ..
                },
            ) if &caps == cur => Some((caps, info.size() as u32, pool.clone())),
            _ => None,
        };
        if let Some((caps, size, pool)) = current {
            let n = pool.ring().map_or(0, |r| r.slot_count());
            if caps.features(0).is_some_and(cuda_memory) {
                // CUDA memory: a CUDA element upstream renders into the device ring's slots
                // through a GstCudaBufferPool of its context (GStreamer 1.24+); otherwise it
                // allocates its own and each frame is copied on the GPU.
                let pad = self.obj().static_pad("sink");
                match pad
                    .ok_or_else(|| "no sink pad".to_string())
                    .and_then(|pad| super::cuda_pool::for_upstream(&pad, &pool))
                {
                    Ok(p) => query.add_allocation_pool(Some(&p), size, 0, n),
                    Err(why) => gst::debug!(CAT, imp = self, "no CUDA pool proposed: {why}"),
                }
            } else if !pool.is_active() {
                query.add_allocation_pool(Some(&pool), size, 0, n);
            }
        }
        Ok(())
    }

    fn event(&self, event: gst::Event) -> bool {
        match event.view() {
            gst::EventView::Eos(_) => {
                self.direct.set_eos(true);
                if let Some(s) = self.server() {
                    s.send_eos();
                }
            }
            gst::EventView::Gap(g) => {
                // GstBaseSink counts a gap's span as position, as a buffer's.
                let (ts, dur) = g.get();
                self.direct
                    .note_position(&self.obj(), Some(ts), dur.map(|d| ts.saturating_add(d)));
            }
            gst::EventView::FlushStop(_) | gst::EventView::StreamStart(_) => {
                self.direct.set_eos(false);
                self.direct.forget_position();
                if let Some(s) = self.server() {
                    s.clear_eos();
                    if event.type_() == gst::EventType::StreamStart {
                        s.forget_sticky_events();
                    }
                }
            }
            _ => self.forward_event(&event),
        }
        self.parent_event(event)
    }

    fn unlock(&self) -> Result<(), gst::ErrorMessage> {
        if let State::Started { server, pool, .. } = &*self.state() {
            server.set_unlocked(true);
            if let Some(p) = pool {
                p.set_flushing(true);
            }
        }
        Ok(())
    }

    fn unlock_stop(&self) -> Result<(), gst::ErrorMessage> {
        if let State::Started { server, pool, .. } = &*self.state() {
            server.set_unlocked(false);
            if let Some(p) = pool {
                p.set_flushing(false);
            }
        }
        Ok(())
    }

    fn render(&self, buffer: &gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        self.publish(buffer)
    }
}
