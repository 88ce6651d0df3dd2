// SPDX-License-Identifier: MPL-2.0
/**
 * SECTION:element-gpushmsrc
 * @see_also: gpushmsink, shmsrc, unixfdsrc
 *
 * Receives raw video from a gpushmsink in another process. The producer's ring is mapped once,
 * read-only, and every buffer points straight into it: no frame byte is copied. A slot goes
 * back to the producer when downstream drops the buffer.
 *
 * Caps come from the producer: no caps are needed on the command line, and the source
 * renegotiates when the producer's caps change. Timestamps are mapped from the producer's
 * running time to this pipeline's (both on the system monotonic clock), so the latency tracer
 * shows the real cross-process latency. Each buffer also carries a GstReferenceTimestampMeta
 * with caps `timestamp/x-gpushm-publish`: the CLOCK_MONOTONIC time the producer published it.
 *
 * ## Example launch line
 * |[
 * gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink
 * ]|
 */
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::base_src::CreateSuccess;
use gst_base::subclass::prelude::*;
use nix::sys::eventfd::EventFd;
use once_cell::sync::Lazy;

use crate::memory::wrap_slot_memory;
use crate::ring::client::{ConnectOptions, Connection, Frame, Wait, WaitFds};
use crate::ring::layout::NONE_U64;
use crate::ring::{shm, Error};

static CAT: Lazy<gst::DebugCategory> = Lazy::new(|| {
    gst::DebugCategory::new(
        "gpushmsrc",
        gst::DebugColorFlags::empty(),
        Some("GPU shared-memory video source"),
    )
});

/// Caps of the GstReferenceTimestampMeta holding the producer's publish time.
pub const PUBLISH_TIMESTAMP_CAPS: &str = "timestamp/x-gpushm-publish";

const DEFAULT_TIMEOUT: u64 = 5_000_000_000;
const DEFAULT_LOSSLESS: bool = false;
const DEFAULT_CUDA_DEVICE: i32 = -1;
const DEFAULT_RECONNECT: bool = true;
const DEFAULT_RECONNECT_INTERVAL: u64 = 100_000_000;

#[derive(Debug, Clone)]
struct Settings {
    socket_path: Option<PathBuf>,
    timeout: u64,
    lossless: bool,
    cuda_device: i32,
    reconnect: bool,
    reconnect_interval: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            socket_path: None,
            timeout: DEFAULT_TIMEOUT,
            lossless: DEFAULT_LOSSLESS,
            cuda_device: DEFAULT_CUDA_DEVICE,
            reconnect: DEFAULT_RECONNECT,
            reconnect_interval: DEFAULT_RECONNECT_INTERVAL,
        }
    }
}

struct Started {
    conn: Connection,
    /// Caps string last set on the pad.
    pad_caps: Option<std::sync::Arc<str>>,
    info: Option<gst_video::VideoInfo>,
    discont: bool,
    dropped_seen: u64,
    received: u64,
    /// Added to the producer's clock times, fixed at the first frame.
    shift: Option<u64>,
    /// The GPU rings are registered with, if any.
    cuda: Option<std::sync::Arc<crate::cuda::Device>>,
    /// For reconnecting.
    path: PathBuf,
    /// Frames dropped on earlier connections.
    dropped_base: u64,
    opts: ConnectOptions,
}

pub struct GpuShmSrc {
    settings: Mutex<Settings>,
    state: Mutex<Option<Started>>,
    /// Written by unlock() to get create() out of poll().
    wake: once_cell::sync::OnceCell<EventFd>,
    publish_caps: gst::Caps,
}

impl Default for GpuShmSrc {
    fn default() -> Self {
        Self {
            settings: Mutex::new(Settings::default()),
            state: Mutex::new(None),
            wake: once_cell::sync::OnceCell::new(),
            publish_caps: gst::Caps::new_empty_simple(PUBLISH_TIMESTAMP_CAPS),
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

    /// Checks that the frame's layout matches its caps and lies inside its slot.
    fn check_layout(frame: &Frame, info: &gst_video::VideoInfo) -> Result<(), String> {
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
        let finfo = info.format_info();
        for p in 0..info.n_planes() as usize {
            // Rows of plane p: the tallest component stored in it.
            let rows = (0..finfo.n_components())
                .filter(|&c| finfo.plane()[c as usize] as usize == p)
                .map(|c| info.comp_height(c as u8))
                .max()
                .unwrap_or(info.height()) as u64;
            let end =
                m.plane_offset[p].checked_add((m.plane_stride[p] as u64).saturating_mul(rows));
            if end.is_none_or(|e| e > m.payload_size) {
                return Err(format!(
                    "frame {} plane {p} (offset {}, stride {}, {rows} rows) overruns its {} bytes",
                    frame.seq, m.plane_offset[p], m.plane_stride[p], m.payload_size
                ));
            }
        }
        Ok(())
    }

    /// Written by unlock() to get create() and connect() out of poll(); made in start().
    fn wake_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.wake.get().map(std::os::fd::AsFd::as_fd)
    }

    /// Waits for a producer on the same path and switches to it (reconnect=true). Buffers of
    /// the old producer stay valid downstream: they keep their mapping alive.
    fn reconnect(
        &self,
        path: &std::path::Path,
        opts: &ConnectOptions,
        why: &str,
    ) -> Result<Connection, gst::FlowError> {
        gst::element_imp_warning!(
            self,
            gst::ResourceError::Read,
            (
                "{}; waiting for a producer on {} (reconnect=true)",
                why,
                path.display()
            )
        );
        let opts = ConnectOptions {
            timeout: Duration::MAX,
            ..opts.clone()
        };
        match Connection::connect(path, &opts, self.wake_fd()) {
            Ok(conn) => {
                gst::info!(
                    CAT,
                    imp = self,
                    "reconnected to {} as client {}",
                    path.display(),
                    conn.client_id()
                );
                Ok(conn)
            }
            Err(Error::Interrupted) => Err(gst::FlowError::Flushing),
            Err(e) => {
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::OpenRead,
                    ("Reconnecting failed: {}", e)
                );
                Err(gst::FlowError::Error)
            }
        }
    }

    /// The device address of a frame, registering its ring with CUDA the first time one of its
    /// frames is seen (once per mapping, never per frame).
    fn cuda_ptr(&self, st: &Started, frame: &Frame) -> Option<crate::cudameta::CudaPtr> {
        let dev = st.cuda.as_ref()?;
        let ring = frame.lease.ring();
        if ring.attachment().is_none() {
            let (base, len) = ring.mapping();
            // SAFETY: the registration is attached to the mapping and dropped before it.
            let att = unsafe { crate::cuda::register::register_mapping(dev, base, len, true) };
            match att.downcast_ref::<crate::cuda::register::NotRegistered>() {
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
                    "ring {} ({} MiB) registered read-only with {}",
                    ring.ring_gen(),
                    len >> 20,
                    dev.name
                ),
            }
            ring.attach(att);
        }
        let (device_ptr, device) =
            crate::cuda::register::device_ptr_in(ring.attachment(), frame.ptr)?;
        Some(crate::cudameta::CudaPtr {
            device,
            device_ptr,
            size: frame.meta.payload_size,
            read_only: true,
        })
    }

    fn build_buffer(&self, st: &mut Started, frame: Frame) -> Result<gst::Buffer, gst::FlowError> {
        let Some(info) = st.info.clone() else {
            return Err(gst::FlowError::NotNegotiated);
        };
        if let Err(msg) = Self::check_layout(&frame, &info) {
            gst::element_imp_error!(
                self,
                gst::StreamError::Decode,
                ("The producer sent an invalid frame: {}", msg)
            );
            return Err(gst::FlowError::Error);
        }
        let m = frame.meta;
        let size = m.payload_size as usize;
        let cuda = self.cuda_ptr(st, &frame);
        let mem = wrap_slot_memory(
            frame.ptr as *mut u8,
            size,
            size,
            true,
            Box::new(frame.lease),
        );
        let mut buffer = gst::Buffer::new();
        let obj = self.obj();
        {
            let b = buffer.get_mut().expect("new buffer is writable");
            b.append_memory(mem);
            let t = |v: u64| (v != NONE_U64).then(|| gst::ClockTime::from_nseconds(v));
            if !obj.does_timestamp() {
                // Map the producer's clock time to our running time; fall back to its PTS.
                let base = obj.base_time().map(|b| b.nseconds());
                if st.shift.is_none() && m.pts_clock != NONE_U64 {
                    // A live producer's frames are stamped about now: no shift, so the real
                    // latency shows. Frames stamped before our pipeline started (a producer
                    // running ahead, or started long before us) are shifted to arrive now.
                    let now = obj.clock().map_or(0, |c| c.time().nseconds());
                    st.shift = Some(match base {
                        Some(b) if m.pts_clock < b => now.saturating_sub(m.pts_clock),
                        _ => 0,
                    });
                }
                let shift = st.shift.unwrap_or(0);
                let map = |clock: u64, raw: u64| match (clock != NONE_U64, base) {
                    (true, Some(base)) => Some(gst::ClockTime::from_nseconds(
                        (clock + shift).saturating_sub(base),
                    )),
                    _ => t(raw),
                };
                b.set_pts(map(m.pts_clock, m.pts));
                b.set_dts(map(m.dts_clock, m.dts));
            }
            b.set_duration(t(m.duration));
            b.set_offset(m.offset);
            b.set_offset_end(m.offset_end);
            let keep = gst::BufferFlags::DELTA_UNIT
                | gst::BufferFlags::GAP
                | gst::BufferFlags::DROPPABLE
                | gst::BufferFlags::HEADER
                | gst::BufferFlags::MARKER
                | gst::BufferFlags::CORRUPTED;
            let mut flags = gst::BufferFlags::from_bits_truncate(m.buffer_flags) & keep;
            let dropped = st.conn.dropped();
            if st.discont || dropped != st.dropped_seen {
                flags |= gst::BufferFlags::DISCONT;
                st.discont = false;
                st.dropped_seen = dropped;
            }
            b.set_flags(flags);
            let offsets: Vec<usize> = m.plane_offset[..m.n_planes as usize]
                .iter()
                .map(|&o| o as usize)
                .collect();
            let strides: Vec<i32> = m.plane_stride[..m.n_planes as usize]
                .iter()
                .map(|&s| s as i32)
                .collect();
            gst_video::VideoMeta::add_full(
                b,
                gst_video::VideoFrameFlags::empty(),
                info.format(),
                info.width(),
                info.height(),
                &offsets,
                &strides,
            )
            .map_err(|_| gst::FlowError::Error)?;
            gst::ReferenceTimestampMeta::add(
                b,
                &self.publish_caps,
                gst::ClockTime::from_nseconds(m.publish_ns),
                None,
            );
            if let Some(c) = cuda {
                crate::cudameta::add(b, c);
            }
        }
        st.received += 1;
        Ok(buffer)
    }

    /// Sets new caps on the pad when the frame's caps differ from the current ones.
    fn update_caps(
        &self,
        st: &mut Started,
        caps_str: &std::sync::Arc<str>,
    ) -> Result<(), gst::FlowError> {
        if st.pad_caps.as_ref() == Some(caps_str) {
            return Ok(());
        }
        let caps = gst::Caps::from_str(caps_str).map_err(|_| {
            gst::element_imp_error!(
                self,
                gst::StreamError::Format,
                ("The producer sent unparsable caps {}", caps_str)
            );
            gst::FlowError::NotNegotiated
        })?;
        let info = gst_video::VideoInfo::from_caps(&caps).map_err(|_| {
            gst::element_imp_error!(
                self,
                gst::StreamError::Format,
                ("The producer sent unsupported caps {}", caps)
            );
            gst::FlowError::NotNegotiated
        })?;
        gst::info!(CAT, imp = self, "caps from the producer: {caps}");
        self.obj().set_caps(&caps).map_err(|_| {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Downstream refused the producer's caps {}", caps)
            );
            gst::FlowError::NotNegotiated
        })?;
        st.pad_caps = Some(caps_str.clone());
        st.info = Some(info);
        Ok(())
    }
}

use gst::glib::translate::IntoGlib;

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
                    .blurb("Path of the unix socket of the gpushmsink to receive from (required)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("timeout")
                    .nick("Timeout")
                    .blurb("How long to wait for a producer to appear on socket-path when starting, in nanoseconds (0 = try once; 18446744073709551615 = forever)")
                    .default_value(DEFAULT_TIMEOUT)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("lossless")
                    .nick("Lossless")
                    .blurb("Receive every frame: the producer waits for this consumer. When false (leaky), a consumer that falls behind skips to the newest frames and never holds the producer up.")
                    .default_value(DEFAULT_LOSSLESS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt::builder("cuda-device-id")
                    .nick("CUDA device")
                    .blurb("GPU to register the ring with, once per mapping, so CUDA elements read frames in place (GpuShmCudaMeta). -1 = the first GPU if there is one, none otherwise")
                    .minimum(-1)
                    .default_value(DEFAULT_CUDA_DEVICE)
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
                glib::ParamSpecUInt64::builder("frames-dropped")
                    .nick("Frames dropped")
                    .blurb("Frames the producer did not hand to this consumer: taken back because it fell behind (leaky), or skipped because it held its whole client-budget (or, lossless, for longer than max-wait)")
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
            "timeout" => s.timeout = value.get().expect("type checked"),
            "lossless" => s.lossless = value.get().expect("type checked"),
            "cuda-device-id" => s.cuda_device = value.get().expect("type checked"),
            "reconnect" => s.reconnect = value.get().expect("type checked"),
            "reconnect-interval" => s.reconnect_interval = value.get().expect("type checked"),
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
            "timeout" => self.settings().timeout.to_value(),
            "lossless" => self.settings().lossless.to_value(),
            "cuda-device-id" => self.settings().cuda_device.to_value(),
            "reconnect" => self.settings().reconnect.to_value(),
            "reconnect-interval" => self.settings().reconnect_interval.to_value(),
            "frames-dropped" => self
                .state()
                .as_ref()
                .map_or(0u64, |s| s.dropped_base + s.conn.dropped())
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
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: Lazy<gst::subclass::ElementMetadata> = Lazy::new(|| {
            gst::subclass::ElementMetadata::new(
                "GPU shared-memory video source",
                "Source/Video",
                "Receives raw video from a gpushmsink in another process without copying frame bytes; caps come from the producer. Example: gst-launch-1.0 gpushmsrc socket-path=/tmp/cam ! videoconvert ! autovideosink",
                "gpushm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: Lazy<Vec<gst::PadTemplate>> = Lazy::new(|| {
            let caps = gst::Caps::builder("video/x-raw").build();
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
        let Some(path) = s.socket_path else {
            return Err(gst::error_msg!(
                gst::ResourceError::NotFound,
                ("socket-path is not set: point gpushmsrc at the socket-path of a gpushmsink")
            ));
        };
        let wake = self.wake.get_or_try_init(shm::new_eventfd).map_err(|e| {
            gst::error_msg!(
                gst::ResourceError::Failed,
                ("Cannot create an eventfd: {}", e)
            )
        })?;
        shm::drain(wake);
        let cuda = match crate::cuda::device(s.cuda_device) {
            Ok(d) => {
                gst::info!(CAT, imp = self, "{d:?}");
                Some(d)
            }
            Err(e) if s.cuda_device < 0 => {
                gst::info!(CAT, imp = self, "frames are not registered with CUDA: {e}");
                None
            }
            Err(e) => {
                return Err(gst::error_msg!(
                    gst::LibraryError::Init,
                    ("cuda-device-id={}: {}", s.cuda_device, e)
                ));
            }
        };
        // A GPU that cannot register read-only memory needs a writable mapping to read frames
        // in place: zero-copy GPU access beats the protection there.
        let writable_ring = cuda
            .as_ref()
            .is_some_and(|d| d.host_register && !d.host_register_read_only);
        if writable_ring {
            gst::warning!(
                CAT,
                imp = self,
                "{} cannot register read-only host memory: asking the producer for a writable mapping",
                cuda.as_ref().map_or("the GPU", |d| d.name.as_str())
            );
        }
        let opts = ConnectOptions {
            lossless: s.lossless,
            writable_ring,
            name: self.obj().name().to_string(),
            timeout: Duration::from_nanos(s.timeout),
            retry: Duration::from_nanos(s.reconnect_interval).max(Duration::from_millis(1)),
        };
        let conn = Connection::connect(&path, &opts, self.wake_fd()).map_err(|e| {
            gst::error_msg!(
                gst::ResourceError::OpenRead,
                (
                    "Could not connect to a gpushmsink at {}: {}",
                    path.display(),
                    e
                )
            )
        })?;
        gst::info!(
            CAT,
            imp = self,
            "connected to {} as client {}",
            path.display(),
            conn.client_id()
        );
        *self.state() = Some(Started {
            conn,
            pad_caps: None,
            info: None,
            discont: true,
            dropped_seen: 0,
            received: 0,
            shift: None,
            cuda,
            path,
            opts,
            dropped_base: 0,
        });
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        *self.state() = None;
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
            .state()
            .as_ref()
            .and_then(|s| s.conn.caps())
            .and_then(|c| gst::Caps::from_str(&c).ok());
        let caps = known.unwrap_or_else(|| self.obj().src_pad().pad_template_caps());
        Some(match filter {
            Some(f) => f.intersect_with_mode(&caps, gst::CapsIntersectMode::First),
            None => caps,
        })
    }

    fn negotiate(&self) -> Result<(), gst::LoggableError> {
        // Caps are set from create() with each producer's caps; nothing to pick here.
        let mut guard = self.state();
        if let Some(st) = guard.as_mut() {
            if let Some(caps) = st.conn.caps() {
                self.update_caps(st, &caps)
                    .map_err(|_| gst::loggable_error!(CAT, "Could not set the producer's caps"))?;
            }
        }
        Ok(())
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        if let gst::QueryViewMut::Latency(q) = query.view_mut() {
            // A frame is available one frame duration after its timestamp at the earliest.
            let frame = self
                .state()
                .as_ref()
                .and_then(|s| s.info.as_ref().map(|i| i.fps()))
                .filter(|f| f.numer() > 0)
                .and_then(|f| {
                    gst::ClockTime::SECOND.mul_div_floor(f.denom() as u64, f.numer() as u64)
                })
                .unwrap_or(gst::ClockTime::ZERO);
            q.set(true, frame, gst::ClockTime::NONE);
            return true;
        }
        BaseSrcImplExt::parent_query(self, query)
    }

    fn unlock(&self) -> Result<(), gst::ErrorMessage> {
        if let Some(w) = self.wake.get() {
            shm::notify(w);
        }
        Ok(())
    }

    fn unlock_stop(&self) -> Result<(), gst::ErrorMessage> {
        if let Some(w) = self.wake.get() {
            shm::drain(w);
        }
        Ok(())
    }
}

impl PushSrcImpl for GpuShmSrc {
    fn create(
        &self,
        _buffer: Option<&mut gst::BufferRef>,
    ) -> Result<CreateSuccess, gst::FlowError> {
        // The state lock is held only between waits: property reads and queries (caps,
        // latency) must never wait for the producer.
        enum Next {
            Wait(WaitFds),
            Reconnect(PathBuf, ConnectOptions, String),
        }
        loop {
            let next = {
                let mut guard = self.state();
                let Some(st) = guard.as_mut() else {
                    return Err(gst::FlowError::Flushing);
                };
                match st.conn.try_next() {
                    Ok(Some(frame)) => {
                        let caps = frame.caps.clone();
                        self.update_caps(st, &caps)?;
                        let buffer = self.build_buffer(st, frame)?;
                        return Ok(CreateSuccess::NewBuffer(buffer));
                    }
                    Ok(None) if st.conn.is_eos() => {
                        gst::debug!(CAT, imp = self, "producer sent EOS");
                        return Err(gst::FlowError::Eos);
                    }
                    Ok(None) => Next::Wait(st.conn.wait_fds()),
                    Err(e) => {
                        let why = match e {
                            Error::Disconnected => format!(
                                "The producer went away (gpushmsink stopped or crashed) after {} frames",
                                st.received
                            ),
                            e => format!("Receiving from the producer failed: {e}"),
                        };
                        if !self.settings().reconnect {
                            gst::element_imp_error!(self, gst::ResourceError::Read, ("{}", why));
                            return Err(gst::FlowError::Error);
                        }
                        Next::Reconnect(st.path.clone(), st.opts.clone(), why)
                    }
                }
            };
            let Some(wake) = self.wake_fd() else {
                return Err(gst::FlowError::Flushing);
            };
            match next {
                Next::Wait(fds) => {
                    // The connection outlives this wait: only this thread replaces it, and
                    // stop() runs after unlock() has ended the wait.
                    let (r, socket) = fds.wait(wake, None).map_err(|e| {
                        gst::element_imp_error!(
                            self,
                            gst::ResourceError::Read,
                            ("Waiting for frames failed: {}", e)
                        );
                        gst::FlowError::Error
                    })?;
                    if r == Wait::Woken {
                        return Err(gst::FlowError::Flushing);
                    }
                    if let Some(st) = self.state().as_mut() {
                        st.conn.woke(r, socket);
                    }
                }
                Next::Reconnect(path, opts, why) => {
                    let conn = self.reconnect(&path, &opts, &why)?;
                    let mut guard = self.state();
                    let Some(st) = guard.as_mut() else {
                        return Err(gst::FlowError::Flushing);
                    };
                    st.dropped_base += st.conn.dropped();
                    st.conn = conn;
                    st.shift = None;
                    st.discont = true;
                    st.dropped_seen = 0;
                }
            }
        }
    }
}
