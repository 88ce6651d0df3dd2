// SPDX-License-Identifier: MPL-2.0
/**
 * SECTION:element-gpushmsink
 * @see_also: gpushmsrc, shmsink, unixfdsink
 *
 * Shares raw video with any number of gpushmsrc elements in other processes through a
 * shared-memory ring. Upstream renders straight into the ring through the buffer pool this
 * sink proposes, and consumers map the same memory: no frame byte is copied on either side.
 * Buffers that do not come from the pool are copied once into a free slot (counted in
 * `stats` as frames-copied).
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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;
use gst_video::prelude::*;
use once_cell::sync::Lazy;

use super::pool::Server;
use super::pool::SlotPool;
use crate::cuda::gstcuda::CUDA_MEMORY;
use crate::cuda::Selected;
use crate::cudameta::{CudaRegister, RingPlacement};
use gpushm::policy::Policy;
use gpushm::ring::layout::{MAX_PLANES, MAX_SLOTS, NONE_U64};
use gpushm::ring::producer_end::{FrameMeta, TimeCode};
use gpushm::server::{Config, Event, Published};

static CAT: Lazy<gst::DebugCategory> = Lazy::new(|| {
    gst::DebugCategory::new(
        "gpushmsink",
        gst::DebugColorFlags::empty(),
        Some("GPU shared-memory video sink"),
    )
});

const DEFAULT_WAIT_FOR_CONNECTION: bool = false;
const DEFAULT_PERMS: u32 = 0o600;
const DEFAULT_SLOTS: u32 = 8;
const DEFAULT_CUDA_DEVICE: i32 = -1;
/// -1: one frame duration (40 to 200 ms) for a live stream, one second otherwise.
const DEFAULT_MAX_WAIT: i64 = -1;
/// What max-wait=-1 waits for a stream that is not live.
const MAX_WAIT_NOT_LIVE: std::time::Duration = std::time::Duration::from_secs(1);
const DEFAULT_CLIENT_BUDGET: u32 = 0;
const DEFAULT_MAX_CLIENTS: u32 = 64;
const DEFAULT_ALLOW_WRITABLE_RING: bool = false;
/// Slot size for caps other than raw video (encoded video, audio, RTP, data).
const DEFAULT_MAX_BUFFER_SIZE: u32 = 1 << 20;
const DEFAULT_WAKE_EARLY: bool = true;
/// wake-ahead-us: a consumer's wake-up after a few ms asleep takes 60-80 µs on the H100
/// machine; woken this long before the frame it is up and polling (for at most 100 µs) when
/// the frame lands.
const DEFAULT_WAKE_AHEAD_US: u32 = 120;
const MAX_WAKE_AHEAD_US: u32 = gpushm::policy::MAX_WAKE_AHEAD.as_micros() as u32;

/// Caps travel in one control message.
const MAX_CAPS_LEN: usize = gpushm::wire::MAX_PAYLOAD as usize - 64;

#[derive(Debug, Clone)]
struct Settings {
    socket_path: Option<PathBuf>,
    stream: Option<String>,
    wait_for_connection: bool,
    perms: u32,
    slots: u32,
    cuda_device: i32,
    cuda_register: CudaRegister,
    ring: RingPlacement,
    max_wait: i64,
    client_budget: u32,
    max_clients: u32,
    allow_writable_ring: bool,
    max_buffer_size: u32,
    spin_us: u32,
    cpu_latency_us: i32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            socket_path: None,
            stream: None,
            wait_for_connection: DEFAULT_WAIT_FOR_CONNECTION,
            perms: DEFAULT_PERMS,
            slots: DEFAULT_SLOTS,
            cuda_device: DEFAULT_CUDA_DEVICE,
            cuda_register: CudaRegister::Auto,
            ring: RingPlacement::Auto,
            max_wait: DEFAULT_MAX_WAIT,
            client_budget: DEFAULT_CLIENT_BUDGET,
            max_clients: DEFAULT_MAX_CLIENTS,
            allow_writable_ring: DEFAULT_ALLOW_WRITABLE_RING,
            max_buffer_size: DEFAULT_MAX_BUFFER_SIZE,
            spin_us: 0,
            cpu_latency_us: crate::cpu_latency::DEFAULT,
        }
    }
}

// One per element, held behind a mutex: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum State {
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

/// What render() needs for each frame of the current caps, found once per ring and taken with
/// one reference: after the producer slept, every lock, caps lookup, plane computation or
/// reference count on the way of a frame costs cold cache and TLB misses.
struct FramePath {
    server: Arc<Server>,
    /// The caps' raw video layout (`None`: opaque buffers), as in the state.
    info: Option<Arc<gst_video::VideoInfo>>,
    pool: SlotPool,
    /// The pool's ring (the pool itself is behind its own lock).
    ring: Arc<gpushm::ring::producer_end::ProducerRing>,
    /// Raw video in CUDA memory, as the caps say (nvcodec's elements also hand GstCudaMemory,
    /// mapped for the CPU, under system-memory caps: those are copied as system memory).
    cuda_input: bool,
    /// Format, size and planes of the caps' own layout, for a frame laid out that way.
    template: Option<FrameMeta>,
}

pub struct GpuShmSink {
    settings: Mutex<Settings>,
    state: Mutex<State>,
    /// The pipeline clock last seen, whether it is CLOCK_MONOTONIC itself (GstSystemClock's
    /// default: offset exactly 0), and the offset in use for another clock (kept while a
    /// fresh reading stays within 1 ms of it, so reading two clocks adds no jitter).
    clock_kind: Mutex<Option<(gst::Clock, bool, i64)>>,
    /// The pipeline latency of the last LATENCY event (what GstBaseSink keeps, read here
    /// without its object lock).
    latency: AtomicU64,
    /// See `chain`.
    direct: Direct,
    /// wake-early, read on the way of each frame without the settings' lock.
    wake_early: AtomicBool,
    /// wake-ahead-us (applied with wake-early, see `apply_wake_ahead`).
    wake_ahead_us: AtomicU32,
}

/// The direct way of a buffer from the sink pad to render(), around GstBaseSink's chain
/// function, where that does nothing for the buffer but cost time (8 µs of a 33 µs way from
/// upstream to the consumers on the dev VM): not synchronised to the clock (sync=false),
/// prerolled, playing, no last sample kept, no QoS, throttling or stepping. Anything else
/// goes GstBaseSink's way, as does every buffer list.
#[derive(Default)]
struct Direct {
    /// GstBaseSink's chain function, found when the element was made.
    base_chain: std::sync::OnceLock<BaseChain>,
    /// A STEP event came: GstBaseSink's way from then on.
    stepped: AtomicBool,
    /// EOS came (cleared by FLUSH_STOP and STREAM_START, as GstBaseSink does).
    eos: AtomicBool,
    /// The start and stop of the last buffer rendered (either way) or GAP event, clipped to the
    /// segment: without sync, position queries are answered with their stream time, as
    /// GstBaseSink does from the times it keeps (which buffers of the direct way do not reach).
    /// NONE_U64 for none; both NONE_U64 until the first buffer after a start or flush. (Two
    /// loads: a query racing a frame may see one of each, told apart only playing backwards.)
    position: [AtomicU64; 2],
}

type BaseChainFn = unsafe extern "C" fn(
    *mut gst::ffi::GstPad,
    *mut gst::ffi::GstObject,
    *mut gst::ffi::GstBuffer,
) -> gst::ffi::GstFlowReturn;

struct BaseChain(BaseChainFn);

impl Default for GpuShmSink {
    fn default() -> Self {
        Self {
            settings: Mutex::new(Settings::default()),
            state: Mutex::new(State::Stopped),
            clock_kind: Mutex::new(None),
            latency: AtomicU64::new(0),
            direct: Direct::default(),
            wake_early: AtomicBool::new(DEFAULT_WAKE_EARLY),
            wake_ahead_us: AtomicU32::new(DEFAULT_WAKE_AHEAD_US),
        }
    }
}

impl GpuShmSink {
    fn settings(&self) -> MutexGuard<'_, Settings> {
        self.settings.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// wake-ahead-us, as it applies with wake-early, to the server if started. Read and
    /// applied under the state lock: of two properties set at once, the last read is applied
    /// last.
    fn apply_wake_ahead(&self) {
        let state = self.state();
        if let State::Started { server, .. } = &*state {
            let us = match self.wake_early.load(Ordering::Relaxed) {
                true => self.wake_ahead_us.load(Ordering::Relaxed),
                false => 0,
            };
            // Within the property's range, never over the core's most.
            let _ = server.set_wake_ahead(std::time::Duration::from_micros(us.into()));
        }
    }

    fn server(&self) -> Option<Arc<Server>> {
        match &*self.state() {
            State::Started { server, .. } => Some(server.clone()),
            State::Stopped => None,
        }
    }

    /// The publishing policy for a frame of `frame_duration` in a stream that is `live` or not.
    fn policy(s: &Settings, live: bool, frame_duration: Option<gst::ClockTime>) -> Policy {
        let max_wait = match s.max_wait {
            // A live source drops frames for everyone while the producer waits: wait about
            // one frame for a stuck lossless consumer, not more.
            -1 if live => frame_duration
                .map(|d| std::time::Duration::from_nanos(d.nseconds()))
                .unwrap_or(std::time::Duration::from_millis(40))
                .clamp(
                    std::time::Duration::from_millis(40),
                    std::time::Duration::from_millis(200),
                ),
            -1 => MAX_WAIT_NOT_LIVE,
            n if n >= 0 => std::time::Duration::from_nanos(n as u64),
            _ => MAX_WAIT_NOT_LIVE,
        };
        Policy {
            budget: if s.client_budget == 0 {
                (s.slots / 2).max(1)
            } else {
                s.client_budget.min(s.slots)
            } as usize,
            max_wait,
            spin: std::time::Duration::from_micros(s.spin_us as u64),
        }
    }

    fn stats_structure(&self) -> gst::Structure {
        let Some(server) = self.server() else {
            return gst::Structure::builder("application/x-gpushmsink-stats")
                .field("frames-sent", 0u64)
                .field("frames-copied", 0u64)
                .field("frames-dropped", 0u64)
                .field("times-lagged", 0u64)
                .field("spin-caught", 0u64)
                .field("spin-missed", 0u64)
                .field("woken-early", 0u64)
                .field("woken-ahead", 0u64)
                .field("clients", gst::Array::new(Vec::<gst::Structure>::new()))
                .build();
        };
        let (s, clients) = server.stats();
        let clients: Vec<gst::Structure> = clients
            .into_iter()
            .map(|c| {
                gst::Structure::builder("client")
                    .field("id", c.id)
                    .field("pid", c.pid)
                    .field("mode", c.mode.name())
                    .field("lossless", c.lossless)
                    .field("frames-sent", c.sent)
                    .field("frames-dropped", c.dropped)
                    .field("held-slots", c.held as u32)
                    .field("frames-copied", c.copied)
                    .field("lagging", c.lagging)
                    .field("times-lagged", c.times_lagged)
                    .field("closed", c.closed)
                    .field("uid", c.uid)
                    .field("name", &c.name)
                    .field("frames-taken", c.taken)
                    .field("frames-skipped", c.skipped)
                    .field(
                        "latency-p50",
                        c.latency_p50_ns().map_or(-1i64, |n| n as i64),
                    )
                    .field(
                        "latency-p99",
                        c.latency_p99_ns().map_or(-1i64, |n| n as i64),
                    )
                    .build()
            })
            .collect();
        gst::Structure::builder("application/x-gpushmsink-stats")
            .field("frames-sent", s.frames_sent)
            .field("frames-copied", s.frames_copied)
            .field("frames-dropped", s.frames_dropped)
            .field("times-lagged", s.times_lagged)
            .field("spin-caught", s.spin_caught)
            .field("spin-missed", s.spin_missed)
            .field("woken-early", s.woken_early)
            .field("woken-ahead", s.woken_ahead)
            .field("clients", gst::Array::new(clients))
            .build()
    }

    /// Whether raw video in CUDA memory is taken: into a device ring, with ring=device, or
    /// with ring=auto on a discrete GPU (on Jetson the host ring is the GPU's memory).
    fn takes_cuda_memory(&self) -> bool {
        let (ring, id) = {
            let s = self.settings();
            (s.ring, s.cuda_device)
        };
        match ring {
            RingPlacement::Host => false,
            RingPlacement::Device => true,
            RingPlacement::Auto => crate::cuda::device(id).is_ok_and(|d| !d.integrated),
        }
    }

    /// Copies a frame in CUDA memory (`buffer`, mapped for CUDA) into a free slot of the
    /// device ring, plane by plane on the GPU; returns the pool buffer of that slot.
    fn copy_cuda_into_slot(
        &self,
        pool: &SlotPool,
        info: &gst_video::VideoInfo,
        caps: &gst::Caps,
        buffer: &gst::Buffer,
    ) -> Result<gst::Buffer, gst::FlowError> {
        self.activate(pool, Some(info), caps)?;
        let out = pool.acquire_buffer(None)?;
        let ring = pool.ring().ok_or(gst::FlowError::Error)?;
        let slot = pool.slot_of(&out).ok_or(gst::FlowError::Error)?;
        let fail = |msg: String| {
            gst::element_imp_error!(self, gst::ResourceError::Write, ("{}", msg));
            gst::FlowError::Error
        };
        let (mem, dst) = crate::cuda::vmm::of(ring.attachment())
            .zip(crate::cuda::vmm::device_ptr_of_slot(&ring, slot))
            .ok_or_else(|| fail("CUDA memory input needs a device ring".into()))?;
        // The source planes where the buffer's VideoMeta (or the caps) put them.
        let (offsets, strides): (Vec<usize>, Vec<i32>) = match buffer.meta::<gst_video::VideoMeta>()
        {
            Some(m) => (m.offset().to_vec(), m.stride().to_vec()),
            None => (info.offset().to_vec(), info.stride().to_vec()),
        };
        let mut planes = Vec::new();
        for p in 0..info.n_planes() as usize {
            let rows = info.comp_height(p as u8) as usize;
            let row_bytes = info.comp_width(p as u8) as usize * info.comp_pstride(p as u8) as usize;
            let (so, ss) = (
                *offsets.get(p).ok_or(gst::FlowError::Error)?,
                *strides.get(p).ok_or(gst::FlowError::Error)?,
            );
            planes.push(crate::cuda::vmm::Plane2d {
                src_offset: so as u64,
                src_pitch: ss.max(0) as u64,
                dst_offset: info.offset()[p] as u64,
                dst_pitch: info.stride()[p].max(0) as u64,
                row_bytes: row_bytes as u64,
                rows: rows as u64,
            });
        }
        crate::cuda::gstcuda::with_device_map(buffer, false, |src, len| {
            mem.copy_planes_from_device(dst, src, len, &planes)
        })
        .ok_or_else(|| fail("Could not map a buffer in CUDA memory".into()))?
        .map_err(|e| fail(format!("Copying a frame from CUDA memory failed: {e}")))?;
        Ok(out)
    }

    /// Activates the ring's pool for `caps` if it is not yet (it is when upstream renders
    /// into it).
    fn activate(
        &self,
        pool: &SlotPool,
        info: Option<&gst_video::VideoInfo>,
        caps: &gst::Caps,
    ) -> Result<(), gst::FlowError> {
        if pool.is_active() {
            return Ok(());
        }
        let size = match info {
            Some(info) => info.size() as u32,
            None => pool.ring().map_or(0, |r| r.slot_size() as u32),
        };
        let mut config = pool.config();
        config.set_params(Some(caps), size, 0, 0);
        if info.is_some() {
            config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
        }
        if pool.set_config(config).is_err() || pool.set_active(true).is_err() {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Failed,
                ("Could not activate the ring's buffer pool")
            );
            return Err(gst::FlowError::Error);
        }
        Ok(())
    }

    /// Copies `buffer` into a free slot of the pool; returns the pool buffer. Raw video
    /// (`info`) laid out as the caps say is copied in one piece, other layouts plane by plane
    /// into the pool's layout; anything else byte for byte.
    fn copy_into_slot(
        &self,
        pool: &SlotPool,
        info: Option<&gst_video::VideoInfo>,
        caps: &gst::Caps,
        buffer: &gst::Buffer,
    ) -> Result<gst::Buffer, gst::FlowError> {
        self.activate(pool, info, caps)?;
        let mut out = pool.acquire_buffer(None)?;
        let map_failed = |_| {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Failed,
                ("Could not map a ring slot")
            );
            gst::FlowError::Error
        };
        let Some(info) = info else {
            if buffer.size() == 0 {
                // An empty buffer: the slot is only its place in the stream (payload 0).
                return Ok(out);
            }
            let outref = out.get_mut().ok_or(gst::FlowError::Error)?;
            outref.set_size(buffer.size());
            let mut map = outref.map_writable().map_err(map_failed)?;
            buffer.copy_to_slice(0, &mut map).map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Read,
                    ("Could not read a buffer of {} bytes", buffer.size())
                );
                gst::FlowError::Error
            })?;
            drop(map);
            return Ok(out);
        };
        // The frame laid out as the caps say (no VideoMeta, or one that agrees): one memcpy of
        // the whole frame. GstVideoFrame copies line by line, which cost ~60 µs more per
        // 1080p NV12 frame at 30 fps (bench, 2-core VM).
        if buffer.size() >= info.size() && laid_out_as(buffer, info) {
            let outref = out.get_mut().ok_or(gst::FlowError::Error)?;
            let mut map = outref.map_writable().map_err(map_failed)?;
            if let Some(dst) = map.get_mut(..info.size()) {
                buffer.copy_to_slice(0, dst).map_err(|_| {
                    gst::element_imp_error!(
                        self,
                        gst::ResourceError::Read,
                        ("Could not read a frame of {} bytes", info.size())
                    );
                    gst::FlowError::Error
                })?;
                drop(map);
                return Ok(out);
            }
        }
        let src = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), info)
            .map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::StreamError::Format,
                    ("Input buffer does not match the caps")
                );
                gst::FlowError::Error
            })?;
        {
            let outref = out.get_mut().ok_or(gst::FlowError::Error)?;
            let mut dst = gst_video::VideoFrameRef::from_buffer_ref_writable(outref, info)
                .map_err(map_failed)?;
            src.copy(&mut dst).map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Failed,
                    ("Copying the frame failed")
                );
                gst::FlowError::Error
            })?;
        }
        Ok(out)
    }

    /// Makes the ring match `caps`: a new ring (announced to every client) when they change.
    fn configure(&self, caps: &gst::Caps) -> Result<(), gst::LoggableError> {
        self.make_ring(caps, 0)
    }

    /// Makes the ring match `caps`, with slots of at least `min_slot` bytes: a new ring
    /// (announced to every client like a caps change) when the caps change or a buffer does
    /// not fit the current slots.
    fn make_ring(&self, caps: &gst::Caps, min_slot: u64) -> Result<(), gst::LoggableError> {
        let cuda_caps = caps.features(0).is_some_and(cuda_memory);
        // (Looked at only for caps in CUDA memory: a process that does not use the GPU loads
        // no CUDA library.)
        let info = match stream_kind(caps, cuda_caps && self.takes_cuda_memory()) {
            Ok(info) => info,
            Err(msg) => {
                gst::element_imp_error!(self, gst::CoreError::Negotiation, ("{}", msg));
                return Err(gst::loggable_error!(CAT, "{}", msg));
            }
        };
        // Consumers get the frames from the ring, whatever memory upstream's were in: caps in
        // CUDA memory are announced as plain video/x-raw (the ring says where the pixels are).
        let caps_str = if caps.features(0).is_some_and(cuda_memory) {
            let mut plain = caps.clone();
            plain.make_mut().set_features(0, None);
            plain.to_string()
        } else {
            caps.to_string()
        };
        if caps_str.len() > MAX_CAPS_LEN {
            let msg = format!(
                "The caps are {} bytes long (their stream headers), more than the {} bytes consumers accept",
                caps_str.len(),
                MAX_CAPS_LEN
            );
            gst::element_imp_error!(self, gst::CoreError::Negotiation, ("{}", msg));
            return Err(gst::loggable_error!(CAT, "{}", msg));
        }
        let (slots, max_buffer, placement, cuda_device) = {
            let s = self.settings();
            (s.slots, s.max_buffer_size as u64, s.ring, s.cuda_device)
        };
        // A device ring: its GPU, found before anything changes.
        let ring_device = match placement {
            RingPlacement::Device => match crate::cuda::device(cuda_device) {
                Ok(d) => Some(d),
                Err(e) => {
                    let msg = format!("ring=device needs a CUDA GPU: {e}");
                    gst::element_imp_error!(self, gst::ResourceError::Settings, ("{}", msg));
                    return Err(gst::loggable_error!(CAT, "{}", msg));
                }
            },
            RingPlacement::Auto if cuda_caps => match crate::cuda::device(cuda_device) {
                Ok(d) => Some(d),
                Err(e) => {
                    let msg = format!("CUDA memory input needs a CUDA GPU: {e}");
                    gst::element_imp_error!(self, gst::ResourceError::Settings, ("{}", msg));
                    return Err(gst::loggable_error!(CAT, "{}", msg));
                }
            },
            RingPlacement::Host | RingPlacement::Auto => None,
        };
        let slot_size = match &info {
            Some(info) => info.size() as u64,
            None if min_slot <= max_buffer => max_buffer,
            // Room for bursts up to twice this one: consumers keep only the two newest rings,
            // so growing in small steps could drop a ring a slow consumer still reads.
            None => match min_slot.saturating_mul(2).checked_next_power_of_two() {
                Some(n) if n <= gpushm::ring::layout::MAX_SLOT_SIZE => n,
                _ if min_slot <= gpushm::ring::layout::MAX_SLOT_SIZE => {
                    gpushm::ring::layout::MAX_SLOT_SIZE
                }
                _ => {
                    let msg = format!(
                        "A buffer of {min_slot} bytes is larger than the largest slot ({} bytes)",
                        gpushm::ring::layout::MAX_SLOT_SIZE
                    );
                    gst::element_imp_error!(self, gst::ResourceError::NoSpaceLeft, ("{}", msg));
                    return Err(gst::loggable_error!(CAT, "{}", msg));
                }
            },
        };
        let mut state = self.state();
        let State::Started {
            server,
            info: cur_info,
            caps: cur_caps,
            pool,
            cuda,
            cuda_on_request,
            live,
            frames,
            ..
        } = &mut *state
        else {
            return Err(gst::loggable_error!(CAT, "Not started"));
        };
        let fits = pool
            .as_ref()
            .and_then(|p| p.ring())
            .is_some_and(|r| r.slot_size() >= min_slot);
        if fits && cur_caps.as_ref().is_some_and(|c| c == caps) {
            return Ok(());
        }
        // Slots come back to the ring's pool once no consumer references them.
        let cell: Arc<std::sync::OnceLock<SlotPool>> = Arc::default();
        let requeue = {
            let cell = cell.clone();
            Arc::new(move |b: gst::Buffer| {
                if let Some(p) = cell.get() {
                    p.requeue(b);
                }
            })
        };
        // Slots grown for a burst stay grown across caps changes of the same kind.
        let slot_size = match (&info, &cur_info, pool.as_ref().and_then(|p| p.ring())) {
            (None, None, Some(r)) if cur_caps.is_some() => slot_size.max(r.slot_size()),
            _ => slot_size,
        };
        let place = |r: &gpushm::ring::producer_end::ProducerRing| match &ring_device {
            Some(dev) => crate::cuda::vmm::place_ring(r, dev)
                .map_err(|e| gpushm::Error::Invalid(format!("GPU memory: {e}"))),
            None => Ok(()),
        };
        let ring = match server.new_ring(slots, slot_size, &caps_str, requeue, &place) {
            Ok(r) => r,
            Err(e) => {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::NoSpaceLeft,
                    (
                        "Cannot create a ring of {} slots of {} bytes: {}",
                        slots,
                        slot_size,
                        e
                    )
                );
                return Err(gst::loggable_error!(CAT, "Cannot create the ring: {}", e));
            }
        };
        let new_pool = SlotPool::new(ring, Arc::downgrade(server), *cuda_on_request);
        let _ = cell.set(new_pool.clone());
        gst::info!(
            CAT,
            imp = self,
            "new ring of {slots} slots of {slot_size} bytes for {caps}"
        );
        if let (Some(dev), Some(ring)) = (
            cuda.as_ref(),
            new_pool.ring().filter(|r| r.device().is_none()),
        ) {
            if let Err(why) = super::pool::register_ring(dev, &ring) {
                gst::warning!(CAT, imp = self, "{why}");
            }
        }
        let info = info.map(Arc::new);
        *frames = new_pool.ring().map(|ring| {
            Arc::new(FramePath {
                server: server.clone(),
                info: info.clone(),
                pool: new_pool.clone(),
                ring,
                cuda_input: info.is_some() && cuda_caps,
                template: info.as_deref().map(frame_template),
            })
        });
        if let Some(old) = pool.replace(new_pool) {
            let _ = old.set_active(false);
        }
        *cur_info = info;
        *cur_caps = Some(caps.clone());
        *live = None;
        Ok(())
    }

    /// The pipeline clock's time less CLOCK_MONOTONIC, published with every frame so that
    /// consumers map its timestamps (gpushm's `time` module): exactly 0 for the system clock
    /// on CLOCK_MONOTONIC (GStreamer's default), measured for any other.
    fn clock_offset(&self) -> i64 {
        let Some(clock) = self.obj().clock() else {
            return 0;
        };
        let mut kind = self.clock_kind.lock().unwrap_or_else(|e| e.into_inner());
        let (monotonic, kept) = match &*kind {
            Some((c, mono, o)) if *c == clock => (*mono, Some(*o)),
            _ => (crate::clock::is_monotonic(&clock), None),
        };
        let offset = if monotonic {
            0
        } else {
            let now = (clock.time().nseconds() as i128 - gpushm::monotonic_ns() as i128)
                .clamp(i64::MIN as i128, i64::MAX as i128) as i64;
            match kept {
                Some(o) if o.abs_diff(now) <= gpushm::time::OFFSET_SLACK as u64 => o,
                _ => now,
            }
        };
        *kind = Some((clock, monotonic, offset));
        offset
    }

    /// The element's base time and the clock offset (see `clock_offset`), under one object
    /// lock: each lock is a cold cache line on the way of a frame.
    fn timing(&self) -> (Option<gst::ClockTime>, i64) {
        let obj = self.obj();
        let (base, clock) = {
            let _lock = obj.object_lock();
            // SAFETY: GstElement's base_time and clock are read under its object lock, as
            // gst_element_get_base_time and gst_element_get_clock do.
            unsafe {
                let e = obj.as_ptr() as *const gst::ffi::GstElement;
                ((*e).base_time, (*e).clock)
            }
        };
        let base = (base as u64 != gst::ffi::GST_CLOCK_TIME_NONE)
            .then(|| gst::ClockTime::from_nseconds(base as u64));
        if clock.is_null() {
            return (base, 0);
        }
        // The clock last seen, monotonic: nothing to read (its pointer is compared, never
        // followed, before a reference is taken).
        {
            let kind = self.clock_kind.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((c, true, _)) = &*kind {
                if c.as_ptr() == clock {
                    return (base, 0);
                }
            }
        }
        (base, self.clock_offset())
    }

    fn frame_meta(
        &self,
        buffer: &gst::BufferRef,
        info: Option<&gst_video::VideoInfo>,
        template: Option<&FrameMeta>,
    ) -> FrameMeta {
        let obj = self.obj();
        let (base, offset) = self.timing();
        let (vm, tc) = metas(buffer);
        // SAFETY: only render() calls this, with the sink pad's stream lock held, and basesink
        // changes its segment only under that lock. Read in place: `segment()` copies it, an
        // allocation and a free per frame on the way of every frame.
        let segment = unsafe {
            gst::Segment::from_glib_ptr_borrow(
                &(*(obj.as_ptr() as *const gst_base::ffi::GstBaseSink)).segment,
            )
        };
        let segment = segment.downcast_ref::<gst::format::Time>();
        // Signed running time: a DTS before the segment's start (x264enc's B-frames, whose
        // first DTS come before the first PTS) still has its clock time.
        // Published on CLOCK_MONOTONIC (clock_offset 0), signed running time included: a DTS
        // before the segment's start (x264enc's B-frames) keeps its time even on a clock that
        // started near 0 (an audio device's).
        let offset = offset as i128;
        let clock = |t: Option<gst::ClockTime>| -> u64 {
            let rt = match (t, segment) {
                (Some(t), Some(seg)) => match seg.to_running_time_full(t) {
                    Some(gst::Signed::Positive(rt)) => rt.nseconds() as i128,
                    Some(gst::Signed::Negative(rt)) => -(rt.nseconds() as i128),
                    None => return NONE_U64,
                },
                _ => return NONE_U64,
            };
            match base {
                Some(base) => u64::try_from(base.nseconds() as i128 + rt - offset)
                    .ok()
                    .filter(|&v| v != NONE_U64)
                    .unwrap_or(NONE_U64),
                None => NONE_U64,
            }
        };
        let mut m = FrameMeta {
            payload_size: buffer.size() as u64,
            pts: buffer.pts().map_or(NONE_U64, |t| t.nseconds()),
            dts: buffer.dts().map_or(NONE_U64, |t| t.nseconds()),
            duration: buffer.duration().map_or(NONE_U64, |t| t.nseconds()),
            offset: buffer.offset(),
            offset_end: buffer.offset_end(),
            pts_clock: clock(buffer.pts()),
            dts_clock: clock(buffer.dts()),
            // Every flag, the media-specific ones too (interlacing, field order): flags()
            // keeps only the core ones.
            // SAFETY: reading a field of a valid buffer we hold a reference to.
            buffer_flags: unsafe { (*buffer.as_ptr()).mini_object.flags },
            latency: self.latency.load(Ordering::Relaxed),
            timecode: tc,
            // The times above are on CLOCK_MONOTONIC already.
            clock_offset: 0,
            // Format, size and planes of the caps' layout (described again below where the
            // buffer's VideoMeta says otherwise).
            ..template.copied().unwrap_or_default()
        };
        // Other caps: opaque bytes, no planes.
        let Some(info) = info else {
            return m;
        };
        // Laid out as the caps say: the template's planes are the frame's.
        if template.is_some() && vm.is_none_or(|vm| same_layout(vm, info)) {
            return m;
        }
        let (offsets, strides) = match vm {
            Some(vm) => (vm.offset(), vm.stride()),
            None => (info.offset(), info.stride()),
        };
        describe_layout(info, offsets, strides, &mut m);
        m
    }
}

impl Direct {
    fn forget_position(&self) {
        for p in &self.position {
            p.store(NONE_U64, Ordering::Relaxed);
        }
    }
}

impl GpuShmSink {
    /// Puts `chain` in front of GstBaseSink's chain function on the sink pad.
    fn install_direct_chain(&self) {
        let obj = self.obj();
        let Some(pad) = obj.static_pad("sink") else {
            return;
        };
        // SAFETY: GstBaseSink set its chain function when the instance was made; it reads
        // neither the pad's chain data nor anything we replace.
        let base = unsafe { (*(pad.as_ptr())).chainfunc };
        let Some(base) = base else {
            return;
        };
        let _ = self.direct.base_chain.set(BaseChain(base));
        // SAFETY: the function keeps the pad's contract (takes the buffer, returns a flow);
        // the pad is the sink's own and outlives nothing it refers to.
        unsafe {
            pad.set_chain_function(|pad, parent, buffer| {
                match parent.and_then(|p| p.downcast_ref::<super::GpuShmSink>()) {
                    // A panic is an element error, as in GstBaseSink's way (the pad's
                    // trampoline catches none).
                    Some(sink) => gst::panic_to_error!(sink.imp(), Err(gst::FlowError::Error), {
                        sink.imp().chain(pad, buffer)
                    }),
                    None => Err(gst::FlowError::Error),
                }
            });
        }
    }

    /// Whether GstBaseSink's settings allow the direct way (see [`Direct`]). Read for every
    /// buffer: its setters notify nobody (gst_base_sink_set_sync, ...). The getters that lock
    /// take the object lock that `timing` takes next, a cache line already in cache.
    fn direct_allowed(&self) -> bool {
        let bs = self.obj().as_ptr() as *mut gst_base::ffi::GstBaseSink;
        // SAFETY: GstBaseSink's own getters on our instance.
        unsafe {
            gst_base::ffi::gst_base_sink_get_sync(bs) == 0
                && gst_base::ffi::gst_base_sink_is_last_sample_enabled(bs) == 0
                && gst_base::ffi::gst_base_sink_is_qos_enabled(bs) == 0
                && gst_base::ffi::gst_base_sink_get_max_bitrate(bs) == 0
                && gst_base::ffi::gst_base_sink_get_throttle_time(bs) == 0
                && gst_base::ffi::gst_base_sink_get_drop_out_of_segment(bs) != 0
        }
    }

    /// The sink pad's chain function: the direct way to render() where GstBaseSink would do
    /// nothing but call it (see [`Direct`]), GstBaseSink's chain function otherwise. The
    /// direct way takes GstBaseSink's preroll lock for the whole buffer, as its chain function
    /// does, so that flushing and state changes meet it the same way.
    fn chain(
        &self,
        pad: &gst::Pad,
        buffer: gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        #[cfg(feature = "stages")]
        crate::stages::CHAIN_NS.with(|c| c.set(gpushm::monotonic_ns()));
        let obj = self.obj();
        let bs = obj.as_ptr() as *mut gst_base::ffi::GstBaseSink;
        if !self.direct.stepped.load(Ordering::Relaxed)
            && !self.direct.eos.load(Ordering::Relaxed)
            && self.direct_allowed()
        {
            // SAFETY: the preroll lock is GstBaseSink's own mutex, taken and released here
            // as its chain function does; the fields read under it are the ones it guards.
            unsafe {
                glib::ffi::g_mutex_lock(&mut (*bs).preroll_lock);
                let ready = (*bs).pad_mode == gst::ffi::GST_PAD_MODE_PUSH
                    && (*bs).flushing == 0
                    && (*bs).eos == 0
                    && (*bs).need_preroll == 0
                    && (*bs).have_newsegment != 0
                    && (*bs).segment.format == gst::ffi::GST_FORMAT_TIME;
                if ready {
                    // wake-early: no clock wait on this way, the frame is on its way to
                    // consumers now (see Server::wake_early; render() asks again, a no-op).
                    if self.wake_early.load(Ordering::Relaxed) {
                        if let Some(server) = self.server() {
                            server.wake_early();
                        }
                    }
                    let r = match self.clip_direct(&mut (*bs).segment, &buffer) {
                        true => self.render(&buffer),
                        // Out of the segment: dropped, as GstBaseSink does.
                        false => Ok(gst::FlowSuccess::Ok),
                    };
                    let flushing = (*bs).flushing != 0;
                    glib::ffi::g_mutex_unlock(&mut (*bs).preroll_lock);
                    drop(buffer);
                    return if flushing {
                        Err(gst::FlowError::Flushing)
                    } else {
                        r
                    };
                }
                glib::ffi::g_mutex_unlock(&mut (*bs).preroll_lock);
            }
        }
        let Some(BaseChain(base)) = self.direct.base_chain.get() else {
            return Err(gst::FlowError::Error);
        };
        // SAFETY: GstBaseSink's chain function, with its pad, parent and a buffer it takes.
        let ret = unsafe {
            base(
                pad.as_ptr(),
                obj.upcast_ref::<gst::Object>().as_ptr(),
                glib::translate::IntoGlibPtr::into_glib_ptr(buffer),
            )
        };
        // SAFETY: a GstFlowReturn from the chain function.
        unsafe { <gst::FlowReturn as glib::translate::FromGlib<_>>::from_glib(ret) }.into_result()
    }

    /// GstBaseSink's segment handling for a buffer of the direct way: whether it is in the
    /// segment (clipped on its PTS and duration), and the segment's position moved as
    /// GstBaseSink moves it.
    fn clip_direct(&self, segment: &mut gst::ffi::GstSegment, buffer: &gst::BufferRef) -> bool {
        // GstBaseSink's default get_times: DTS, or PTS; the end after the duration.
        let Some(start) = buffer.dts().or(buffer.pts()) else {
            return true;
        };
        let end = buffer.duration().map(|d| start.saturating_add(d));
        let pts = buffer.pts().unwrap_or(start);
        if !open_from(segment, start.min(pts)) {
            // SAFETY: a time segment (checked by the caller), borrowed for this call.
            let seg = unsafe { gst::Segment::from_glib_ptr_borrow(segment) };
            let Some(seg) = seg.downcast_ref::<gst::format::Time>() else {
                return true;
            };
            if seg
                .clip(pts, end.map(|e| pts.saturating_add(e - start)))
                .is_none()
            {
                return false;
            }
        }
        if let Some((cstart, cstop)) = clipped(segment, start, end) {
            let position = match (end, cstop) {
                (Some(_), Some(c)) => Some(c),
                _ => cstart,
            };
            segment.position = position.map_or(gst::ffi::GST_CLOCK_TIME_NONE, |t| t.nseconds());
        }
        true
    }

    /// Keeps the times of what was rendered (a buffer, or a GAP event's span) for position
    /// queries: `start` to `end`, clipped to the segment (called with the stream lock held).
    fn note_position(&self, start: Option<gst::ClockTime>, end: Option<gst::ClockTime>) {
        let obj = self.obj();
        // SAFETY: GstBaseSink changes its segment only with the stream lock held, as here.
        let segment = unsafe { &(*(obj.as_ptr() as *const gst_base::ffi::GstBaseSink)).segment };
        let Some(start) = start else {
            return;
        };
        if segment.format != gst::ffi::GST_FORMAT_TIME {
            return;
        }
        if let Some((cstart, cstop)) = clipped(segment, start, end) {
            let ns = |t: Option<gst::ClockTime>| t.map_or(NONE_U64, |t| t.nseconds());
            self.direct.position[0].store(ns(cstart), Ordering::Relaxed);
            self.direct.position[1].store(ns(cstop), Ordering::Relaxed);
        }
    }

    /// The position GstBaseSink reports without sync: the stream time of the last buffer's
    /// start (of its stop when playing backwards, or after EOS). `None` before any buffer,
    /// without a time segment, or with sync (GstBaseSink answers then).
    fn direct_position(&self) -> Option<gst::ClockTime> {
        let start = self.direct.position[0].load(Ordering::Relaxed);
        let stop = self.direct.position[1].load(Ordering::Relaxed);
        if start == NONE_U64 && stop == NONE_U64 {
            return None;
        }
        let eos = self.direct.eos.load(Ordering::SeqCst);
        let obj = self.obj();
        let bs = obj.as_ptr() as *mut gst_base::ffi::GstBaseSink;
        // SAFETY: GstBaseSink's getter on our instance (it takes the object lock).
        if unsafe { gst_base::ffi::gst_base_sink_get_sync(bs) } != 0 {
            return None;
        }
        let _lock = obj.object_lock();
        // SAFETY: read under the object lock, as GstBaseSink's position query does.
        if unsafe { (*bs).have_newsegment } == 0 {
            return None;
        }
        // SAFETY: the segment, read under the object lock as GstBaseSink's position query
        // does.
        let seg = unsafe { gst::Segment::from_glib_ptr_borrow(&(*bs).segment) };
        let seg = seg.downcast_ref::<gst::format::Time>()?;
        let stream = |t: u64| {
            (t != NONE_U64)
                .then(|| seg.to_stream_time(gst::ClockTime::from_nseconds(t)))
                .flatten()
        };
        let sstart = stream(start);
        let sstop = stream(stop).or(sstart);
        if !eos && (sstop.is_none() || seg.rate() > 0.0) {
            sstart
        } else {
            sstop
        }
    }
}

/// Whether `segment` is an open time segment that started by `t`: every buffer from `t` on
/// is in it, and clipping changes nothing (gst_segment_clip's rules). Every live stream's.
fn open_from(segment: &gst::ffi::GstSegment, t: gst::ClockTime) -> bool {
    segment.stop == u64::MAX && segment.rate > 0.0 && t.nseconds() >= segment.start
}

/// `start`..`end` clipped to the time `segment` (`None`: outside it), as GstBaseSink clips a
/// buffer's times.
fn clipped(
    segment: &gst::ffi::GstSegment,
    start: gst::ClockTime,
    end: Option<gst::ClockTime>,
) -> Option<(Option<gst::ClockTime>, Option<gst::ClockTime>)> {
    if open_from(segment, start) {
        return Some((Some(start), end));
    }
    // SAFETY: a segment read in place for this call.
    let seg = unsafe { gst::Segment::from_glib_ptr_borrow(segment) };
    seg.downcast_ref::<gst::format::Time>()?.clip(start, end)
}

/// The frame description of `info`'s own layout: format, size and planes (what every frame
/// laid out that way publishes).
fn frame_template(info: &gst_video::VideoInfo) -> FrameMeta {
    let mut m = FrameMeta::default();
    describe_layout(info, info.offset(), info.stride(), &mut m);
    m
}

/// Describes in `m` a frame of `info` whose planes sit at `offsets` with `strides`: format,
/// size, planes (no allocation).
fn describe_layout(
    info: &gst_video::VideoInfo,
    offsets: &[usize],
    strides: &[i32],
    m: &mut FrameMeta,
) {
    m.video_format = info.format().into_glib() as u32;
    m.width = info.width();
    m.height = info.height();
    let n = offsets.len().min(strides.len()).min(MAX_PLANES);
    m.n_planes = n as u32;
    for i in 0..n {
        m.plane_offset[i] = offsets[i] as u64;
        m.plane_stride[i] = strides[i].max(0) as u32;
    }
    crate::geometry::describe_planes(info, m);
}

/// Whether a VideoMeta puts the planes where `info` does (same format and size too).
fn same_layout(vm: &gst_video::VideoMeta, info: &gst_video::VideoInfo) -> bool {
    let n = info.n_planes() as usize;
    vm.format() == info.format()
        && vm.width() == info.width()
        && vm.height() == info.height()
        && vm.n_planes() as usize == n
        && vm.offset().get(..n) == info.offset().get(..n)
        && vm.stride().get(..n) == info.stride().get(..n)
}

/// How the ring carries `caps`: raw video in system memory gets frame-sized slots and its
/// layout (`Some`); anything else (encoded video, audio, RTP, data) travels as opaque buffers
/// of any size (`None`). Buffers in device memory (NVMM, DMABuf, GL) cannot be shared by
/// mapping them: an error that says what to do.
fn stream_kind(caps: &gst::CapsRef, cuda: bool) -> Result<Option<gst_video::VideoInfo>, String> {
    let (Some(st), Some(features)) = (caps.structure(0), caps.features(0)) else {
        return Err(format!("Caps {caps} describe no stream"));
    };
    if cuda_memory(features) && !cuda {
        return Err(format!(
            "gpushmsink ring=host shares buffers in system memory; caps with {CUDA_MEMORY} are GPU memory: use ring=device (or auto) on a discrete GPU, or download first (cudadownload)"
        ));
    }
    if cuda_memory(features) && st.name() != "video/x-raw" {
        return Err(format!(
            "{CUDA_MEMORY} is taken for raw video only, not {}",
            st.name()
        ));
    }
    if !system_memory(features) && !cuda_memory(features) {
        if let Some(f) = features.iter().find(|f| f.starts_with("memory:")) {
            return Err(format!(
                "gpushmsink shares buffers in system memory; caps with {f} are device memory: convert or download first (nvvidconv on Jetson, cudadownload, gldownload)"
            ));
        }
    }
    if st.name() != "video/x-raw" {
        return Ok(None);
    }
    match gst_video::VideoInfo::from_caps(caps) {
        Ok(info) if info.n_planes() as usize > MAX_PLANES => Err(format!(
            "{} planes are more than {}",
            info.n_planes(),
            MAX_PLANES
        )),
        Ok(info) => Ok(Some(info)),
        // Raw video GstVideo does not know: its bytes travel as they are.
        Err(_) => Ok(None),
    }
}

/// Whether caps `features` are CUDA device memory (`memory:CUDAMemory`, nothing else that is
/// memory).
fn cuda_memory(features: &gst::CapsFeaturesRef) -> bool {
    !features.is_any()
        && features.contains(CUDA_MEMORY)
        && features.iter().filter(|f| f.starts_with("memory:")).count() == 1
}

/// Whether caps `features` are memory gpushmsink takes: system memory (no memory feature,
/// or memory:SystemMemory), whatever else they name (meta features).
fn system_memory(features: &gst::CapsFeaturesRef) -> bool {
    features.is_any()
        || !features.iter().any(|f| {
            f.starts_with("memory:")
                && f.as_str() != gst::CAPS_FEATURE_MEMORY_SYSTEM_MEMORY.as_str()
        })
}

/// What gpushmsink answers a caps query with `filter`: any media type, in system memory only.
/// Caps cannot say "anything but device memory" on their own, so the answer is the filter
/// without its device-memory structures (`ANY` features become system memory): an element
/// before the sink that can give either (cudadownload, gldownload, nvvidconv) then picks
/// system memory without a capsfilter, and no query offers what `set_caps` would refuse.
/// With `cuda` (a device ring takes them), raw video in CUDA memory is kept too.
fn acceptable_caps(filter: Option<&gst::Caps>, cuda: bool) -> gst::Caps {
    let Some(filter) = filter else {
        return gst::Caps::new_any();
    };
    if filter.is_any() {
        return filter.clone();
    }
    let mut out = gst::Caps::new_empty();
    {
        let out = out.get_mut().expect("new caps");
        for (st, features) in filter.iter_with_features() {
            if features.is_any() {
                out.append_structure_full(st.to_owned(), None);
            } else if system_memory(features)
                || (cuda && cuda_memory(features) && st.name() == "video/x-raw")
            {
                out.append_structure_full(st.to_owned(), Some(features.to_owned()));
            }
        }
    }
    out
}

/// The metas gpushmsink carries: the VideoMeta and the timecode, in one pass over the
/// buffer's metas, against API types looked up once (a lookup per frame costs ~1 µs cold).
fn metas(buffer: &gst::BufferRef) -> (Option<&gst_video::VideoMeta>, Option<TimeCode>) {
    static APIS: Lazy<(glib::Type, glib::Type)> = Lazy::new(|| {
        (
            gst_video::VideoMeta::meta_api(),
            gst_video::VideoTimeCodeMeta::meta_api(),
        )
    });
    let (video_api, tc_api) = *APIS;
    let (mut vm, mut tc) = (None, None);
    for m in buffer.iter_meta::<gst::Meta>() {
        let api = m.api();
        if api == video_api && vm.is_none() {
            // SAFETY: a meta of this API is a GstVideoMeta, which VideoMeta wraps
            // transparently; it lives as long as the buffer borrow.
            vm = Some(unsafe { &*(m.as_ptr() as *const gst_video::VideoMeta) });
        } else if api == tc_api && tc.is_none() {
            // SAFETY: as above, for GstVideoTimeCodeMeta.
            tc = Some(timecode_of(unsafe {
                &*(m.as_ptr() as *const gst_video::VideoTimeCodeMeta)
            }));
        }
    }
    (vm, tc)
}

/// The frame's GstVideoTimeCodeMeta, if it has one.
fn timecode(buffer: &gst::BufferRef) -> Option<TimeCode> {
    metas(buffer).1
}

fn timecode_of(m: &gst_video::VideoTimeCodeMeta) -> TimeCode {
    let tc = m.tc();
    let fps = tc.fps();
    TimeCode {
        fps_n: fps.numer().max(0) as u32,
        fps_d: fps.denom().max(0) as u32,
        flags: tc.flags().bits(),
        hours: tc.hours(),
        minutes: tc.minutes(),
        seconds: tc.seconds(),
        frames: tc.frames(),
        field_count: tc.field_count(),
    }
}

use gst::glib::translate::IntoGlib;

#[glib::object_subclass]
impl ObjectSubclass for GpuShmSink {
    const NAME: &'static str = "GstGpuShmSink";
    type Type = super::GpuShmSink;
    type ParentType = gst_base::BaseSink;
}

impl ObjectImpl for GpuShmSink {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: Lazy<Vec<glib::ParamSpec>> = Lazy::new(|| {
            vec![
                glib::ParamSpecString::builder("socket-path")
                    .nick("Socket path")
                    .blurb("Path of the unix socket consumers connect to (this or stream is required). A stale socket file left by a dead producer is replaced; a live producer on the path is an error.")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("stream")
                    .nick("Stream name")
                    .blurb("Name of the stream, instead of socket-path: consumers connect with gpushmsrc stream=NAME. The socket is made in $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID, created 0700); a service publishes to /run/gpushm by setting GPUSHM_RUNTIME_DIR=/run/gpushm. Letters, digits and . _ - @ + :, at most 64. `gpushm list` shows the streams")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("wait-for-connection")
                    .nick("Wait for connection")
                    .blurb("Block the stream until at least one consumer is connected")
                    .default_value(DEFAULT_WAIT_FOR_CONNECTION)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("perms")
                    .nick("Permissions")
                    .blurb("Permissions of the socket file (octal mode bits, e.g. 0600 = owner only, 0660 = group too)")
                    .maximum(0o777)
                    .default_value(DEFAULT_PERMS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("slots")
                    .nick("Slots")
                    .blurb("Frames in the shared ring: upstream, the sink and every consumer share them. Memory: frame size x slots per producer (1080p NV12: 3 MiB a slot, 8 slots = 24 MiB), shared by every consumer. Any count works with any downstream: a consumer whose downstream keeps more frames than its client-budget gets copies of the rest")
                    .minimum(2)
                    .maximum(MAX_SLOTS)
                    .default_value(DEFAULT_SLOTS)
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
                    .blurb("When to register the rings with CUDA (once per ring) so that pool buffers carry GpuShmCudaMeta and CUDA elements upstream render into the slots. auto: only when an upstream element sets the pool option GstBufferPoolOptionGpuShmCudaMeta, so a process that does not use the GPU creates no CUDA context; always: whenever a GPU is found; never")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("ring", RingPlacement::Auto)
                    .nick("Ring placement")
                    .blurb("Where the ring's pixels live. host: a shared-memory ring every consumer maps; device: GPU memory of cuda-device-id (CUDA virtual memory, exported once per ring), read in place on the GPU by gpushmsrc (cudasum after it; CUDA memory for nvcodec elements; a copy for CPU elements that map frames), the Python Subscriber with device_memory=True, the gpushm crate and the C API; input in CUDA memory is copied there on the GPU, input in system memory with one host-to-device copy; auto: device for input in CUDA memory (memory:CUDAMemory) on a discrete GPU, host otherwise")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt64::builder("max-wait")
                    .nick("Max wait")
                    .blurb("How long a lossless consumer that takes no frames may hold the producer up, in nanoseconds. Past it the consumer is marked lagging (a warning is posted the first time): the frames it did not take go back, and it is served like a leaky one, never waited for, until it takes frames again. A consumer that is merely slow holds the producer to its pace. -1 = one frame duration (40 to 200 ms) for a live stream, so the other consumers see frames at most that late, 1 s otherwise; 0 = never wait (a lossless consumer at its budget is marked lagging at once). Consumers that keep frames downstream never hold the producer up: gpushmsrc copies what they keep beyond their budget")
                    .minimum(-1)
                    .default_value(DEFAULT_MAX_WAIT)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("spin-us")
                    .nick("Low-latency poll budget")
                    .blurb("Low-latency mode of the wait for a lossless consumer at its budget: poll its releases for up to this many microseconds before sleeping (a wake-up through the connection thread costs two thread hops), at most once per frame and never past max-wait. 0 = off. Counted in stats as spin-caught and spin-missed")
                    .maximum(gpushm::policy::MAX_SPIN.as_micros() as u32)
                    .default_value(0)
                    .mutable_playing()
                    .build(),
                crate::cpu_latency::param_spec(),
                glib::ParamSpecBoolean::builder("wake-early")
                    .nick("Wake consumers early")
                    .blurb("Wake consumers that sleep waiting for a frame as it reaches the sink (after the clock wait with sync), rather than once it is published, so that their wake-up (tens of µs on a core that idled) runs while the sink publishes it: up to 14 µs less latency per hop on the H100 machine. Only after 0.5 ms or more without a frame (streams up to 2000 fps), and never a consumer that went to sleep on the sink's CPU (the woken thread would take that CPU from the frame): a consumer woken before the frame is published polls for it (at most 100 µs), one not yet awake is woken twice. Counted in stats as woken-early")
                    .default_value(DEFAULT_WAKE_EARLY)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("wake-ahead-us")
                    .nick("Wake consumers ahead")
                    .blurb("With wake-early: also wake consumers that sleep waiting for a frame this many microseconds before the frame is due, from the stream's cadence (the median interval of the last frames' publish times), so that they are awake and polling when it lands, without a poll of their own (gpushmsrc spin-us): about 80 µs less latency per hop on the H100 machine (p50 52-59 µs against 128-137), for at most 100 µs of a consumer's polling per frame. Only for streams of at most 500 fps (a thread of the sink wakes once per frame to ring them), never for a frame already half an interval late (a stream that stops costs one wake-up), once per frame (wake-early rings again only for a frame that comes over 200 µs after it), and by wake-early's rules. 0 = off. Counted in stats as woken-ahead (and woken-early)")
                    .maximum(MAX_WAKE_AHEAD_US)
                    .default_value(DEFAULT_WAKE_AHEAD_US)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("client-budget")
                    .nick("Client budget")
                    .blurb("Slots one consumer may reference at once (0 = half the slots). gpushmsrc keeps fewer than this zero-copy and copies further frames into system memory (counted as frames-copied), so downstream elements that keep frames (encoders, queues, sinks keeping their last buffer) never stall the stream. The other consumers always keep slots to run on")
                    .maximum(MAX_SLOTS)
                    .default_value(DEFAULT_CLIENT_BUDGET)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("max-clients")
                    .nick("Max clients")
                    .blurb("Consumers served at once, at most. A new consumer beyond them takes the place of one that has had frames waiting and taken none for 1 s or more; otherwise it is told the producer is busy and retries until its timeout. Each costs the producer 4 file descriptors")
                    .minimum(1)
                    .maximum(4096)
                    .default_value(DEFAULT_MAX_CLIENTS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("allow-writable-ring")
                    .nick("Allow writable ring")
                    .blurb("Give a writable ring descriptor to consumers that ask for one (their GPU cannot register read-only host memory). Off: every consumer gets the read-only ring, sealed so that no consumer can ever write to it, and such consumers' CUDA elements copy frames instead")
                    .default_value(DEFAULT_ALLOW_WRITABLE_RING)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("max-buffer-size")
                    .nick("Max buffer size")
                    .blurb("Slot size in bytes for caps other than raw video (encoded video, audio, RTP, any data): the largest buffer expected. A larger buffer (an I-frame burst) is never cut or refused: it gets a new ring with slots of twice its size rounded up to a power of two (at most 256 MiB), announced to consumers like a caps change; slots stay that large. Raw video slots are always one frame")
                    .minimum(4096)
                    .maximum(gpushm::ring::layout::MAX_SLOT_SIZE as u32)
                    .default_value(DEFAULT_MAX_BUFFER_SIZE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("num-clients")
                    .nick("Number of clients")
                    .blurb("Consumers connected and taking frames now (one that closed while its app still holds frames is listed in stats, closed=true, until it lets them go)")
                    .read_only()
                    .build(),
                glib::ParamSpecBoxed::builder::<gst::Structure>("stats")
                    .nick("Statistics")
                    .blurb("frames-sent, frames-copied (buffers not from the ring's pool), frames-dropped (frames a consumer did not get: taken back because it fell behind, or skipped while it held its whole client-budget or was lagging), times-lagged (times a lossless consumer was marked lagging), spin-caught and spin-missed (waits for a lossless consumer that spin-us polling ended, and that ended asleep all the same), and per client: id, pid, mode (leaky, lossless or auto, as the consumer asked), lossless (whether it is waited for: its mode applied to this stream), frames-sent, frames-dropped, held-slots, frames-copied (frames that consumer copied out of the ring because its downstream kept its zero-copy ones), lagging, times-lagged, closed (the consumer stopped taking frames and keeps those its app still holds), uid, name (as the consumer gave it), frames-taken, frames-skipped (of frames-dropped, those never handed over because it held its whole budget), latency-p50 and latency-p99 (ns from publish to the consumer taking the frame, its own figures; -1 before its first frame). `gpushm top` shows the same figures from outside the pipeline")
                    .read_only()
                    .build(),
            ]
        });
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
        let mut s = self.settings();
        match pspec.name() {
            "socket-path" => {
                s.socket_path = value
                    .get::<Option<String>>()
                    .expect("type checked")
                    .map(PathBuf::from)
            }
            "stream" => s.stream = value.get::<Option<String>>().expect("type checked"),
            "wait-for-connection" => s.wait_for_connection = value.get().expect("type checked"),
            "perms" => s.perms = value.get().expect("type checked"),
            "slots" => s.slots = value.get().expect("type checked"),
            "cuda-device-id" => s.cuda_device = value.get().expect("type checked"),
            "ring" => s.ring = value.get().expect("type checked"),
            "cuda-register" => s.cuda_register = value.get().expect("type checked"),
            "max-wait" => s.max_wait = value.get().expect("type checked"),
            "client-budget" => s.client_budget = value.get().expect("type checked"),
            "spin-us" => s.spin_us = value.get().expect("type checked"),
            "cpu-latency-us" => s.cpu_latency_us = value.get().expect("type checked"),
            "wake-early" | "wake-ahead-us" => {
                if pspec.name() == "wake-early" {
                    self.wake_early
                        .store(value.get().expect("type checked"), Ordering::Relaxed);
                } else {
                    self.wake_ahead_us
                        .store(value.get().expect("type checked"), Ordering::Relaxed);
                }
                drop(s);
                self.apply_wake_ahead();
            }
            "max-clients" => s.max_clients = value.get().expect("type checked"),
            "allow-writable-ring" => s.allow_writable_ring = value.get().expect("type checked"),
            "max-buffer-size" => s.max_buffer_size = value.get().expect("type checked"),
            _ => unimplemented!(),
        }
    }

    fn constructed(&self) {
        self.parent_constructed();
        // The last buffer is a ring slot: keeping it would take a slot from upstream.
        self.obj().set_enable_last_sample(false);
        self.install_direct_chain();
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
            "wait-for-connection" => self.settings().wait_for_connection.to_value(),
            "perms" => self.settings().perms.to_value(),
            "slots" => self.settings().slots.to_value(),
            "cuda-device-id" => self.settings().cuda_device.to_value(),
            "ring" => self.settings().ring.to_value(),
            "cuda-register" => self.settings().cuda_register.to_value(),
            "max-wait" => self.settings().max_wait.to_value(),
            "client-budget" => self.settings().client_budget.to_value(),
            "spin-us" => self.settings().spin_us.to_value(),
            "cpu-latency-us" => self.settings().cpu_latency_us.to_value(),
            "wake-early" => self.wake_early.load(Ordering::Relaxed).to_value(),
            "wake-ahead-us" => self.wake_ahead_us.load(Ordering::Relaxed).to_value(),
            "max-clients" => self.settings().max_clients.to_value(),
            "allow-writable-ring" => self.settings().allow_writable_ring.to_value(),
            "max-buffer-size" => self.settings().max_buffer_size.to_value(),
            "num-clients" => (self.server().map_or(0, |s| s.num_clients()) as u32).to_value(),
            "stats" => self.stats_structure().to_value(),
            _ => unimplemented!(),
        }
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
            self.latency.store(0, Ordering::Relaxed);
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
                self.latency
                    .store(l.latency().nseconds(), Ordering::Relaxed);
            }
            gst::EventView::Step(_) => self.direct.stepped.store(true, Ordering::SeqCst),
            _ => {}
        }
        self.parent_send_event(event)
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        // Buffers that went the direct way did not tell GstBaseSink their times: without sync,
        // the position it reports (the last buffer's stream time) is answered here.
        if let gst::QueryViewMut::Position(q) = query.view_mut() {
            if q.format() == gst::Format::Time {
                if let Some(pos) = self.direct_position() {
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
        self.direct.eos.store(false, Ordering::SeqCst);
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
                let _ = pool.set_active(false);
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
        let state = self.state();
        if let (
            Some(caps),
            State::Started {
                caps: Some(cur),
                info: Some(info),
                pool: Some(pool),
                ..
            },
        ) = (caps, &*state)
        {
            // (Not for CUDA memory: upstream allocates that itself.)
            if &caps == cur && !pool.is_active() && !caps.features(0).is_some_and(cuda_memory) {
                let n = pool.ring().map_or(0, |r| r.slot_count());
                query.add_allocation_pool(Some(pool), info.size() as u32, 0, n);
            }
        }
        Ok(())
    }

    fn event(&self, event: gst::Event) -> bool {
        match event.view() {
            gst::EventView::Eos(_) => {
                self.direct.eos.store(true, Ordering::SeqCst);
                if let Some(s) = self.server() {
                    s.send_eos();
                }
            }
            gst::EventView::Gap(g) => {
                // GstBaseSink counts a gap's span as position, as a buffer's.
                let (ts, dur) = g.get();
                self.note_position(Some(ts), dur.map(|d| ts.saturating_add(d)));
            }
            gst::EventView::FlushStop(_) | gst::EventView::StreamStart(_) => {
                self.direct.eos.store(false, Ordering::SeqCst);
                self.direct.forget_position();
                if let Some(s) = self.server() {
                    s.clear_eos();
                }
            }
            _ => {}
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
        #[cfg(feature = "stages")]
        let render_ns = gpushm::monotonic_ns();
        let start = buffer.dts().or(buffer.pts());
        self.note_position(
            start,
            buffer
                .duration()
                .and_then(|d| Some(start?.saturating_add(d))),
        );
        // The caps are cloned only where they are needed (a new ring, a copy): off the way of a
        // frame rendered into our pool.
        let caps_of = || match &*self.state() {
            State::Started {
                caps: Some(caps), ..
            } => Ok(caps.clone()),
            _ => Err(gst::FlowError::Flushing),
        };
        // One look at the state for everything a frame of our pool needs (see FramePath).
        let (path, live) = match &*self.state() {
            State::Started {
                caps: Some(_),
                pool: Some(_),
                live,
                frames: Some(f),
                ..
            } => (f.clone(), *live),
            _ => {
                gst::element_imp_error!(
                    self,
                    gst::CoreError::Negotiation,
                    ("Got a buffer before caps")
                );
                return Err(gst::FlowError::NotNegotiated);
            }
        };
        let FramePath {
            server,
            info,
            pool,
            ring,
            cuda_input,
            template,
        } = &*path;
        let cuda_input = *cuda_input;
        // wake-early on GstBaseSink's way: the clock wait is behind us (once per frame: on the
        // direct way, chain() woke them already).
        if self.wake_early.load(Ordering::Relaxed) {
            server.wake_early();
        }
        if info.is_none() && buffer.size() as u64 > ring.slot_size() {
            // Never cut or refuse a large buffer: a new ring with larger slots, announced to
            // consumers like a caps change. Then render again into it.
            gst::info!(
                CAT,
                imp = self,
                "a buffer of {} bytes does not fit slots of {}: new ring",
                buffer.size(),
                ring.slot_size()
            );
            self.make_ring(&caps_of()?, buffer.size() as u64)
                .map_err(|e| {
                    e.log_with_imp(self);
                    gst::FlowError::Error
                })?;
            return self.render(buffer);
        }
        let live = live.unwrap_or_else(|| {
            let live = self
                .obj()
                .query_latency()
                .map(|(_, upstream_live, _, _)| upstream_live)
                .unwrap_or(false);
            if let State::Started { live: l, .. } = &mut *self.state() {
                *l = Some(live);
            }
            live
        });
        let duration = buffer.duration().or_else(|| {
            let fps = info.as_ref()?.fps();
            (fps.numer() > 0).then(|| {
                gst::ClockTime::SECOND
                    .mul_div_floor(fps.denom() as u64, fps.numer() as u64)
                    .unwrap_or(gst::ClockTime::ZERO)
            })
        });
        let (wait, policy) = {
            let s = self.settings();
            (s.wait_for_connection, Self::policy(&s, live, duration))
        };
        let gen = ring.ring_gen();
        let publish = |slot: u32, mut meta: FrameMeta| {
            if info.is_none() {
                meta.payload_size = buffer.size() as u64;
            }
            meta.live = live;
            if cuda_input {
                // Copied on the GPU already (copy_cuda_into_slot).
            } else if let Some(mem) = crate::cuda::vmm::of(ring.attachment()) {
                // A device ring: the frame, in the slot's host bytes, goes to the GPU.
                let n = (meta.payload_size as usize).min(ring.slot_size() as usize);
                // SAFETY: the slot is ours until published, and n bytes long at most.
                let src = unsafe { std::slice::from_raw_parts(ring.slot_ptr(slot), n) };
                let copied = crate::cuda::vmm::device_ptr_of_slot(ring, slot)
                    .ok_or_else(|| "the slot is outside the ring's GPU memory".to_string())
                    .and_then(|dst| mem.copy_from_host(dst, src).map_err(|e| e.0));
                if let Err(e) = copied {
                    gst::element_imp_error!(
                        self,
                        gst::ResourceError::Write,
                        ("Copying a frame to GPU memory failed: {}", e)
                    );
                    return Err(gst::FlowError::Error);
                }
            }
            server
                .publish_frame(gen, slot, meta, policy, wait)
                .map_err(|e| {
                    gst::element_imp_error!(
                        self,
                        gst::ResourceError::Write,
                        ("Publishing a frame failed: {}", e)
                    );
                    gst::FlowError::Error
                })
        };
        // Upstream rendered into one of our slots: published as it is, unless consumers
        // still hold that slot (upstream pushed the same buffer again) or it is of an
        // earlier ring.
        if let Some(slot) = super::pool::slot_of_buffer(ring, buffer) {
            let meta = self.frame_meta(buffer, info.as_deref(), template.as_ref());
            #[cfg(feature = "stages")]
            if meta.payload_size >= 32 && ring.slot_size() >= 32 {
                let t = [
                    crate::stages::CHAIN_NS.with(|c| c.get()),
                    render_ns,
                    gpushm::monotonic_ns(),
                ];
                // SAFETY: the slot is ours until published, and at least 32 bytes long.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        t.as_ptr() as *const u8,
                        ring.slot_ptr(slot).add(crate::stages::PRODUCER_OFFSET),
                        24,
                    )
                };
            }
            match publish(slot, meta)? {
                Published::Sent => {
                    super::pool::lock_published(buffer);
                    return Ok(gst::FlowSuccess::Ok);
                }
                Published::Stopped => return Err(gst::FlowError::Flushing),
                Published::SlotBusy(why) => {
                    gst::trace!(CAT, imp = self, "copying a frame of our pool: {why}");
                }
            }
        }
        let mut out = match (&info, cuda_input) {
            (Some(i), true) => self.copy_cuda_into_slot(pool, i, &caps_of()?, buffer)?,
            _ => self.copy_into_slot(pool, info.as_deref(), &caps_of()?, buffer)?,
        };
        server.count_copy();
        let slot = pool.slot_of(&out).ok_or(gst::FlowError::Error)?;
        gst::trace!(CAT, imp = self, "copied a foreign buffer into slot {slot}");
        // Keep timestamps and flags of the original.
        {
            let o = out.make_mut();
            let _ = buffer.copy_into(
                o,
                gst::BufferCopyFlags::FLAGS | gst::BufferCopyFlags::TIMESTAMPS,
                ..,
            );
        }
        let mut meta = self.frame_meta(&out, info.as_deref(), template.as_ref());
        // Metas stay on the original.
        meta.timecode = timecode(buffer);
        // The copy has the pool's default layout.
        if let Some(info) = &info {
            describe_layout(info, info.offset(), info.stride(), &mut meta);
        }
        match publish(slot, meta)? {
            Published::Sent => {}
            Published::Stopped => return Err(gst::FlowError::Flushing),
            Published::SlotBusy(why) => {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Write,
                    ("Publishing a frame failed: {}", why)
                );
                return Err(gst::FlowError::Error);
            }
        }
        drop(out);
        Ok(gst::FlowSuccess::Ok)
    }
}

/// Whether `buffer`'s planes sit where `info` puts them: no VideoMeta, or one that agrees.
fn laid_out_as(buffer: &gst::BufferRef, info: &gst_video::VideoInfo) -> bool {
    buffer
        .meta::<gst_video::VideoMeta>()
        .is_none_or(|m| same_layout(&m, info))
}
