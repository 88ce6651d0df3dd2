// SPDX-License-Identifier: MPL-2.0
/**
 * SECTION:element-cudasum
 * @see_also: gpushmsrc
 *
 * Sums every plane of each raw video frame with a CUDA kernel (kernels/sum.cu), per plane and
 * per colour component, and posts the result as an element message named `cudasum`. Buffers
 * pass through unchanged.
 *
 * Frames from gpushmsrc carry a `GpuShmCudaMeta`: the kernel reads them in place from the
 * shared ring, which was registered with CUDA once per mapping (zero-copy). Other buffers are
 * copied to the GPU through a pinned staging buffer (counted as frames-staged). The results
 * are bit-exact with the CPU reference, which is also available as `backend=cpu`.
 *
 * The message structure `cudasum` holds: `offset` (guint64), `pts` (guint64, or
 * GST_CLOCK_TIME_NONE), `backend` ("cuda" or "cpu"), `path` ("zero-copy", "staged" or "cpu"),
 * `plane-sums` (array of guint64: every byte of each plane), `component-sums` (array of
 * guint64 in the format's component order, e.g. Y, U, V or R, G, B[, A]), `bytes` (guint64
 * read) and `kernel-time-ns` (guint64, 0 on the CPU).
 *
 * ## Example launch line
 * |[
 * gst-launch-1.0 -m gpushmsrc socket-path=/tmp/cam ! cudasum ! fakesink
 * ]|
 */
use std::sync::{Mutex, MutexGuard};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;
use once_cell::sync::Lazy;

use super::planes::{self, Plane};
use super::Backend;
use crate::cuda::kernels::{GpuSummer, PlaneJob};

static CAT: Lazy<gst::DebugCategory> = Lazy::new(|| {
    gst::DebugCategory::new(
        "cudasum",
        gst::DebugColorFlags::empty(),
        Some("CUDA plane sums"),
    )
});

const DEFAULT_BACKEND: Backend = Backend::Auto;
const DEFAULT_DEVICE: i32 = -1;

#[derive(Debug, Clone)]
struct Settings {
    backend: Backend,
    device: i32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            backend: DEFAULT_BACKEND,
            device: DEFAULT_DEVICE,
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Stats {
    frames: u64,
    zero_copy: u64,
    staged: u64,
    cpu: u64,
    bytes: u64,
    kernel_ns: u64,
}

#[derive(Default)]
struct State {
    gpu: Option<GpuSummer>,
    info: Option<gst_video::VideoInfo>,
    stats: Stats,
}

#[derive(Default)]
pub struct CudaSum {
    settings: Mutex<Settings>,
    state: Mutex<State>,
}

impl CudaSum {
    fn settings(&self) -> MutexGuard<'_, Settings> {
        self.settings.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens the GPU for backend=cuda/auto.
    fn open_backend(&self) -> Result<(), gst::ErrorMessage> {
        let s = self.settings().clone();
        if s.backend == Backend::Cpu {
            self.state().gpu = None;
            return Ok(());
        }
        let gpu = crate::cuda::select(s.device).and_then(|sel| match sel {
            crate::cuda::Selected::Device(d) => {
                gst::info!(CAT, imp = self, "{d:?}");
                GpuSummer::new(&d)
            }
            crate::cuda::Selected::Unavailable(e) => Err(e),
        });
        match gpu {
            Ok(g) => {
                gst::info!(CAT, imp = self, "kernels from {}", g.kernel_origin());
                self.state().gpu = Some(g);
                Ok(())
            }
            Err(e) if s.backend == Backend::Cuda => Err(gst::error_msg!(
                gst::LibraryError::Init,
                ("cudasum backend=cuda cannot run: {}. Use backend=cpu (or auto) on machines without a GPU.", e)
            )),
            Err(e) => {
                gst::element_imp_warning!(
                    self,
                    gst::LibraryError::Init,
                    ("No usable GPU ({}); cudasum computes the sums on the CPU", e)
                );
                self.state().gpu = None;
                Ok(())
            }
        }
    }

    fn stats_structure(&self) -> gst::Structure {
        let st = self.state();
        let s = st.stats;
        let mut b = gst::Structure::builder("application/x-cudasum-stats")
            .field("frames", s.frames)
            .field("frames-zero-copy", s.zero_copy)
            .field("frames-staged", s.staged)
            .field("frames-cpu", s.cpu)
            .field("bytes", s.bytes)
            .field("kernel-time-ns", s.kernel_ns)
            .field(
                "host-registrations",
                if crate::cuda::driver().is_ok() {
                    crate::cuda::register::registrations()
                } else {
                    0
                },
            );
        if let Some(g) = &st.gpu {
            let d = g.device();
            b = b
                .field("device", d.name.as_str())
                .field("integrated", d.integrated)
                .field("host-register", d.host_register)
                .field("kernels", g.kernel_origin());
        }
        b.build()
    }
}

#[glib::object_subclass]
impl ObjectSubclass for CudaSum {
    const NAME: &'static str = "GstGpuShmCudaSum";
    type Type = super::CudaSum;
    type ParentType = gst_base::BaseTransform;
}

impl ObjectImpl for CudaSum {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: Lazy<Vec<glib::ParamSpec>> = Lazy::new(|| {
            vec![
                glib::ParamSpecEnum::builder_with_default("backend", DEFAULT_BACKEND)
                    .nick("Backend")
                    .blurb("Where to compute: auto (CUDA when a GPU is present, else the CPU with a warning), cuda (an error at NULL->READY without a GPU), cpu (the reference)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt::builder("cuda-device-id")
                    .nick("CUDA device")
                    .blurb("GPU to run on (-1 = the first one)")
                    .minimum(-1)
                    .default_value(DEFAULT_DEVICE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoxed::builder::<gst::Structure>("stats")
                    .nick("Statistics")
                    .blurb("frames, frames-zero-copy (read in place from a registered ring), frames-staged (copied to the GPU through a pinned buffer), frames-cpu, bytes, kernel-time-ns, host-registrations (cuMemHostRegister calls in this process: one per ring mapping, never one per frame), and the GPU's name, integrated and host-register support")
                    .read_only()
                    .build(),
            ]
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings();
        match pspec.name() {
            "backend" => s.backend = value.get().expect("type checked"),
            "cuda-device-id" => s.device = value.get().expect("type checked"),
            _ => unimplemented!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        match pspec.name() {
            "backend" => self.settings().backend.to_value(),
            "cuda-device-id" => self.settings().device.to_value(),
            "stats" => self.stats_structure().to_value(),
            _ => unimplemented!(),
        }
    }
}

impl GstObjectImpl for CudaSum {}

impl ElementImpl for CudaSum {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: Lazy<gst::subclass::ElementMetadata> = Lazy::new(|| {
            gst::subclass::ElementMetadata::new(
                "CUDA plane sums",
                "Filter/Analyzer/Video",
                "Sums every plane of raw video frames with CUDA, reading gpushm rings in place, and posts the sums as element messages named cudasum. Example: gst-launch-1.0 -m gpushmsrc socket-path=/tmp/cam ! cudasum ! fakesink",
                "gpushm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: Lazy<Vec<gst::PadTemplate>> = Lazy::new(|| {
            let caps = gst_video::VideoCapsBuilder::new()
                .format_list(planes::FORMATS.iter().copied())
                .build();
            vec![
                gst::PadTemplate::new(
                    "src",
                    gst::PadDirection::Src,
                    gst::PadPresence::Always,
                    &caps,
                )
                .expect("template"),
                gst::PadTemplate::new(
                    "sink",
                    gst::PadDirection::Sink,
                    gst::PadPresence::Always,
                    &caps,
                )
                .expect("template"),
            ]
        });
        TEMPLATES.as_ref()
    }

    fn change_state(
        &self,
        transition: gst::StateChange,
    ) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        if transition == gst::StateChange::NullToReady {
            if let Err(e) = self.open_backend() {
                self.post_error_message(e);
                return Err(gst::StateChangeError);
            }
        }
        let r = self.parent_change_state(transition)?;
        if transition == gst::StateChange::ReadyToNull {
            self.state().gpu = None;
        }
        Ok(r)
    }
}

impl BaseTransformImpl for CudaSum {
    const MODE: gst_base::subclass::BaseTransformMode =
        gst_base::subclass::BaseTransformMode::AlwaysInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = true;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = true;

    fn set_caps(&self, incaps: &gst::Caps, _outcaps: &gst::Caps) -> Result<(), gst::LoggableError> {
        let info = gst_video::VideoInfo::from_caps(incaps)
            .map_err(|_| gst::loggable_error!(CAT, "bad caps {}", incaps))?;
        self.state().info = Some(info);
        Ok(())
    }

    /// Asks upstream (gpushmsrc, cuda-register=auto) for GpuShmCudaMeta when a GPU is in use,
    /// so frames arrive registered and kernels read them in place.
    fn propose_allocation(
        &self,
        decide_query: Option<&gst::query::Allocation>,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        // Downstream may not answer (a sink that proposes nothing): we still ask upstream.
        if let Err(e) = self.parent_propose_allocation(decide_query, query) {
            gst::debug!(CAT, imp = self, "downstream's allocation answer: {e}");
        }
        if self.state().gpu.is_none() {
            return Ok(());
        }
        query.add_allocation_meta::<crate::cudameta::CudaMetaApi>(None);
        // Downstream's pool (gpushmsink's) gives device pointers to whoever sets its option:
        // set it, so that upstream renders into registered slots we read in place.
        let option = crate::cudameta::POOL_OPTION_CUDA_META;
        let caps = query.get_owned().0;
        for (pool, size, min, max) in query.allocation_pools() {
            let Some(pool) = pool.filter(|p| !p.is_active()) else {
                continue;
            };
            if pool.options().iter().any(|o| o == option) {
                let mut config = pool.config();
                if !config.has_option(option) {
                    if config.params().is_none_or(|p| p.1 == 0) {
                        config.set_params(caps.as_ref(), size, min, max);
                    }
                    config.add_option(option);
                    if pool.set_config(config).is_err() {
                        gst::debug!(CAT, imp = self, "downstream's pool refused {option}");
                    }
                }
            }
        }
        Ok(())
    }

    fn transform_ip_passthrough(
        &self,
        buf: &gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let mut st = self.state();
        let info = st.info.clone().ok_or(gst::FlowError::NotNegotiated)?;
        // The frame's device address, where it has one on our GPU: read in place, unmapped
        // (a frame in GPU memory would otherwise be copied to the host to be mapped).
        let in_place = st.gpu.as_ref().and_then(|gpu| {
            let ordinal = gpu.device().ordinal as i32;
            crate::cudameta::get(buf).filter(|m| {
                m.device == ordinal && m.size >= buf.size() as u64 && buf.n_memory() == 1
            })
        });
        let map = match in_place {
            Some(_) => None,
            None => Some(buf.map_readable().map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::StreamError::Failed,
                    ("Could not map the frame")
                );
                gst::FlowError::Error
            })?),
        };
        let planes = planes::buffer_planes(&info, buf).map_err(|e| {
            gst::element_imp_error!(
                self,
                gst::StreamError::Format,
                ("Frame layout not usable: {}", e)
            );
            gst::FlowError::Error
        })?;
        let bytes: u64 = planes.iter().map(|p| (p.row_bytes * p.rows) as u64).sum();
        let (sums, path, kernel_ns) = match (st.gpu.as_mut(), &map) {
            (None, Some(map)) => (planes::cpu_sums(map, &planes), "cpu", 0),
            (None, None) => return Err(gst::FlowError::Error),
            (Some(gpu), map) => {
                let (base, path) = match (in_place, map) {
                    (Some(m), _) => (m.device_ptr, "zero-copy"),
                    (None, None) => return Err(gst::FlowError::Error),
                    (None, Some(map)) => {
                        let p = gpu.stage(map).map_err(|e| {
                            gst::element_imp_error!(
                                self,
                                gst::ResourceError::Failed,
                                ("Copying the frame to the GPU failed: {}", e)
                            );
                            gst::FlowError::Error
                        })?;
                        (p, "staged")
                    }
                };
                let jobs: Vec<PlaneJob> = planes
                    .iter()
                    .map(|p: &Plane| PlaneJob {
                        dev_ptr: base + p.offset as u64,
                        stride: p.stride as u64,
                        row_bytes: p.row_bytes as u32,
                        rows: p.rows as u32,
                        channels: p.channels as u32,
                    })
                    .collect();
                let (sums, ns) = gpu.sum(&jobs).map_err(|e| {
                    gst::element_imp_error!(
                        self,
                        gst::ResourceError::Failed,
                        ("The CUDA kernel failed: {}", e)
                    );
                    gst::FlowError::Error
                })?;
                (sums, path, ns)
            }
        };
        drop(map);
        st.stats.frames += 1;
        st.stats.bytes += bytes;
        st.stats.kernel_ns += kernel_ns;
        match path {
            "zero-copy" => st.stats.zero_copy += 1,
            "staged" => st.stats.staged += 1,
            _ => st.stats.cpu += 1,
        }
        let backend = if st.gpu.is_some() { "cuda" } else { "cpu" };
        drop(st);
        let s = gst::Structure::builder("cudasum")
            .field("offset", buf.offset())
            .field("pts", buf.pts().map_or(u64::MAX, |t| t.nseconds()))
            .field("backend", backend)
            .field("path", path)
            .field("plane-sums", gst::Array::new(planes::plane_totals(&sums)))
            .field(
                "component-sums",
                gst::Array::new(planes::component_sums(&info, &sums)),
            )
            .field("bytes", bytes)
            .field("kernel-time-ns", kernel_ns)
            .build();
        let _ = self
            .obj()
            .post_message(gst::message::Element::builder(s).src(&*self.obj()).build());
        Ok(gst::FlowSuccess::Ok)
    }
}
