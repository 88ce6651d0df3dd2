// SPDX-License-Identifier: MPL-2.0
//! The element's properties: their defaults, their specs with the docs gst-inspect-1.0 shows
//! (docs/elements.md tells the same story, and tests compare the two), and how they are set
//! and read.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;

use super::imp::{GpuShmSink, State, CAT};
use super::stats;
use crate::cudameta::{CudaRegister, RingPlacement};
use gpushm::ring::layout::MAX_SLOTS;

pub(super) const DEFAULT_WAIT_FOR_CONNECTION: bool = false;
pub(super) const DEFAULT_WAIT_FOR_CLIENTS: u32 = 1;
pub(super) const DEFAULT_PERMS: u32 = 0o600;
/// `slots` 0: as many as [`auto_slots`] gives the ring.
pub(super) const DEFAULT_SLOTS: u32 = 0;

/// The slot count of a ring with `slots` set to `slots` (0: auto), in GPU memory or not.
/// Auto gives a ring in GPU memory 16 slots, a ring in host memory 8. Each consumer may hold
/// a share of the ring (client-budget: half the slots, split among the consumers): with 8
/// slots and 3 consumers whose downstream keeps its last frame (most sinks do), every other
/// frame is copied (a 4K decode shared that way on an H200: 150 of 300 frames copied on the
/// GPU for CUDA-memory consumers, 144 to system memory for in-place ones), with 16 none is,
/// for 12 MiB of GPU memory a 4K slot. Host rings stay at 8: they live in /dev/shm, which
/// containers keep small (64 MiB by default in Docker).
pub(super) fn auto_slots(slots: u32, device_ring: bool) -> u32 {
    match (slots, device_ring) {
        (0, true) => 16,
        (0, false) => 8,
        (n, _) => n.max(2),
    }
}
pub(super) const DEFAULT_CUDA_DEVICE: i32 = -1;
/// -1: one frame duration (40 to 200 ms) for a live stream, one second otherwise.
pub(super) const DEFAULT_MAX_WAIT: i64 = -1;
/// What max-wait=-1 waits for a stream that is not live.
pub(super) const MAX_WAIT_NOT_LIVE: std::time::Duration = std::time::Duration::from_secs(1);
pub(super) const DEFAULT_CLIENT_BUDGET: u32 = 0;
pub(super) const DEFAULT_MAX_CLIENTS: u32 = 64;
pub(super) const DEFAULT_ALLOW_WRITABLE_RING: bool = false;
/// Slot size for caps other than raw video (encoded video, audio, RTP, data).
pub(super) const DEFAULT_MAX_BUFFER_SIZE: u32 = 1 << 20;
pub(super) const DEFAULT_WAKE_EARLY: bool = true;
/// wake-ahead-us: a consumer's wake-up after a few ms asleep takes 60-80 µs on the H100
/// machine; woken this long before the frame it is up and polling (for at most 100 µs) when
/// the frame lands.
pub(super) const DEFAULT_WAKE_AHEAD_US: u32 = 120;
const MAX_WAKE_AHEAD_US: u32 = gpushm::policy::MAX_WAKE_AHEAD.as_micros() as u32;

/// Properties read when the element starts serving: GstBaseSink starts in the NULL to READY
/// change. They carry no GST_PARAM_MUTABLE_* flag (changeable in NULL only), and a change while
/// the element serves is refused with a warning rather than silently kept for the next start.
const SET_IN_NULL: [&str; 6] = [
    "socket-path",
    "stream",
    "perms",
    "max-clients",
    "allow-writable-ring",
    "cuda-register",
];

/// The property specs, in the order gst-inspect-1.0 lists them.
pub(super) fn specs() -> Vec<glib::ParamSpec> {
    vec![
        glib::ParamSpecString::builder("socket-path")
            .nick("Socket path")
            .blurb("Path of the unix socket consumers connect to (this or stream is required). A stale socket file left by a dead producer is replaced; a live producer on the path is an error.")
            .build(),
        glib::ParamSpecString::builder("stream")
            .nick("Stream name")
            .blurb("Name of the stream, instead of socket-path: consumers connect with gpushmsrc stream=NAME. The socket is made in $GPUSHM_RUNTIME_DIR if set, else in this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID, created 0700); a service publishes to /run/gpushm by setting GPUSHM_RUNTIME_DIR=/run/gpushm. Letters, digits and . _ - @ + :, at most 64. `gpushm list` shows the streams")
            .build(),
        glib::ParamSpecBoolean::builder("wait-for-connection")
            .nick("Wait for connection")
            .blurb("Block the stream until at least one consumer is connected. The consumers connected then get every buffer from the first, whatever their mode, the backlog a live source made meanwhile included (waited for up to 1 s a frame, until each has kept up with frames on time for 1.5 s; one that takes them slower than they come is served as its mode says); consumers that join later get the stream from where it is")
            .default_value(DEFAULT_WAIT_FOR_CONNECTION)
            .mutable_playing()
            .build(),
        glib::ParamSpecUInt::builder("wait-for-clients")
            .nick("Consumers to wait for")
            .blurb("How many consumers wait-for-connection waits for before the first buffer: a recorder, a viewer and an inference process started with the producer then all get the stream from its first frame. After it, wait-for-connection waits for one, as with 1")
            .minimum(1)
            .maximum(1024)
            .default_value(DEFAULT_WAIT_FOR_CLIENTS)
            .mutable_playing()
            .build(),
        glib::ParamSpecUInt::builder("perms")
            .nick("Permissions")
            .blurb("Permissions of the socket file (octal mode bits, e.g. 0600 = owner only, 0660 = group too)")
            .maximum(0o777)
            .default_value(DEFAULT_PERMS)
            .build(),
        glib::ParamSpecUInt::builder("slots")
            .nick("Slots")
            .blurb("Frames in the shared ring (2-64): upstream, the sink and every consumer share them. 0 = auto: 16 for a ring in GPU memory (ring=device), 8 for one in host memory. Memory: frame size x slots per producer (1080p NV12: 3 MiB a slot, 8 slots = 24 MiB), shared by every consumer. Any count works with any downstream: a consumer whose downstream keeps more frames than its client-budget gets copies of the rest")
            .minimum(0)
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
            .build(),
        glib::ParamSpecEnum::builder_with_default("ring", RingPlacement::Auto)
            .nick("Ring placement")
            .blurb("Where the ring's pixels live. host: a shared-memory ring every consumer maps; device: GPU memory of cuda-device-id (CUDA virtual memory, exported once per ring), read in place on the GPU by gpushmsrc (cudasum after it; CUDA memory for nvcodec elements; a copy for CPU elements that map frames), the Python Subscriber with device_memory=True, the gpushm crate and the C API; CUDA elements upstream (nvh264dec, cudaupload, cudaconvert) render into its slots through the CUDA buffer pool this sink proposes (GStreamer 1.24+), other input in CUDA memory is copied there on the GPU, input in system memory with one host-to-device copy; auto: device for input in CUDA memory (memory:CUDAMemory) on a discrete GPU, host otherwise")
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
            .build(),
        glib::ParamSpecUInt::builder("upstream-event-rate")
            .nick("Upstream event rate")
            .blurb("Custom upstream events (force-key-unit included: a consumer that joins an encoded stream asks for a keyframe) taken from each consumer a second at most, with a burst of as many; the rest are dropped, so a consumer cannot flood the encoder. Taken events go upstream from the sink pad. 0 = refuse every consumer's upstream events")
            .maximum(1000)
            .default_value(gpushm::policy::UPSTREAM_EVENTS_PER_S)
            .mutable_playing()
            .build(),
        glib::ParamSpecBoolean::builder("allow-writable-ring")
            .nick("Allow writable ring")
            .blurb("Give a writable ring descriptor to consumers that ask for one (their GPU cannot register read-only host memory). Then the ring is not sealed against writes, and any consumer that asks can write every frame and slot descriptor the others read: a buggy or hostile one can break every consumer's stream. Turn it on only where every consumer is trusted. Off: every consumer gets the read-only ring, sealed so that no consumer can ever write to it, and such consumers' CUDA elements copy frames instead")
            .default_value(DEFAULT_ALLOW_WRITABLE_RING)
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
            .blurb("frames-sent, frames-copied (buffers not from the ring's pool), frames-dropped (frames a consumer did not get: taken back because it fell behind, or skipped while it held its whole client-budget or was lagging), times-lagged (times a lossless consumer was marked lagging), spin-caught and spin-missed (waits for a lossless consumer that spin-us polling ended, and that ended asleep all the same), woken (wake-ups rung for frames delivered: to consumers asleep, and every frame to one whose event loop polls its doorbell), woken-early and woken-ahead (see wake-early and wake-ahead-us), connections-accepted, reports-built, and per client: id, pid, mode (leaky, lossless or auto, as the consumer asked), lossless (whether it is waited for: its mode applied to this stream), frames-sent, frames-dropped, held-slots, frames-copied (frames that consumer copied out of the ring because its downstream kept its zero-copy ones), lagging, times-lagged, closed (the consumer stopped taking frames and keeps those its app still holds), uid, name (as the consumer gave it), frames-taken, frames-skipped (of frames-dropped, those never handed over because it held its whole budget), latency-p50 and latency-p99 (ns from publish to the consumer taking the frame, its own figures; -1 before its first frame). `gpushm top` shows the same figures from outside the pipeline")
            .read_only()
            .build(),
    ]
}

impl GpuShmSink {
    pub(super) fn set_property_value(&self, value: &glib::Value, pspec: &glib::ParamSpec) {
        if SET_IN_NULL.contains(&pspec.name()) && matches!(*self.state(), State::Started { .. }) {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Settings,
                (
                    "{} can only be changed in the NULL state: the element serves consumers from READY on, and this change would not reach them (set the pipeline to NULL first)",
                    pspec.name()
                )
            );
            return;
        }
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
            "wait-for-clients" => s.wait_for_clients = value.get().expect("type checked"),
            "perms" => s.perms = value.get().expect("type checked"),
            "slots" => {
                s.slots = value.get().expect("type checked");
                if s.slots == 1 {
                    gst::warning!(
                        CAT,
                        imp = self,
                        "slots=1: a ring needs 2 slots at least, it gets 2"
                    );
                }
            }
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
            "upstream-event-rate" => {
                s.upstream_event_rate = value.get().expect("type checked");
                let rate = s.upstream_event_rate;
                drop(s);
                if let Some(server) = self.server() {
                    server.set_upstream_rate(rate);
                }
            }
            "allow-writable-ring" => s.allow_writable_ring = value.get().expect("type checked"),
            "max-buffer-size" => s.max_buffer_size = value.get().expect("type checked"),
            _ => unimplemented!(),
        }
    }

    pub(super) fn property_value(&self, pspec: &glib::ParamSpec) -> glib::Value {
        match pspec.name() {
            "socket-path" => self
                .settings()
                .socket_path
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned())
                .to_value(),
            "stream" => self.settings().stream.to_value(),
            "wait-for-connection" => self.settings().wait_for_connection.to_value(),
            "wait-for-clients" => self.settings().wait_for_clients.to_value(),
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
            "upstream-event-rate" => self.settings().upstream_event_rate.to_value(),
            "allow-writable-ring" => self.settings().allow_writable_ring.to_value(),
            "max-buffer-size" => self.settings().max_buffer_size.to_value(),
            "num-clients" => (self.server().map_or(0, |s| s.num_clients()) as u32).to_value(),
            "stats" => stats::structure(self.server().as_deref()).to_value(),
            _ => unimplemented!(),
        }
    }

    /// wake-ahead-us, as it applies with wake-early, to the server if started. Read and
    /// applied under the state lock: of two properties set at once, the last read is applied
    /// last.
    pub(super) fn apply_wake_ahead(&self) {
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
}
