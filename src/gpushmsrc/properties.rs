// SPDX-License-Identifier: MPL-2.0
//! The element's properties: their defaults, their specs with the docs gst-inspect-1.0 shows
//! (docs/elements.md tells the same story, and tests compare the two), and how they are set
//! and read (the read-only counters from the receiver's shared state).

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use gst::glib;
use gst::prelude::*;

use super::imp::GpuShmSrc;
use super::DeliveryMode;
use crate::cudameta::CudaRegister;

pub(super) const DEFAULT_TIMEOUT: u64 = 5_000_000_000;
pub(super) const DEFAULT_MODE: DeliveryMode = DeliveryMode::Auto;
pub(super) const DEFAULT_CUDA_DEVICE: i32 = -1;
pub(super) const DEFAULT_RECONNECT: bool = true;
pub(super) const DEFAULT_RECONNECT_INTERVAL: u64 = 100_000_000;
pub(super) const DEFAULT_MAX_SIZE_BUFFERS: u32 = 0;
pub(super) const DEFAULT_PRODUCER_UID: i64 = -1;
pub(super) const DEFAULT_MAX_SIZE_BYTES: u64 = 256 << 20;
pub(super) const DEFAULT_MAX_SIZE_TIME: u64 = 2_000_000_000;
/// The largest `spin-us` (the core's bound).
const MAX_SPIN_US: u32 = gpushm::policy::MAX_SPIN.as_micros() as u32;

/// The property specs, in the order gst-inspect-1.0 lists them.
pub(super) fn specs() -> Vec<glib::ParamSpec> {
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
        glib::ParamSpecUInt64::builder("frames-cuda-wrapped")
            .nick("Frames wrapped as CUDA memory")
            .blurb("Device-ring frames handed to a downstream that asks for memory:CUDAMemory as CUDA memory over the ring's GPU memory itself: no copy (GStreamer 1.24 or newer)")
            .read_only()
            .build(),
        glib::ParamSpecUInt64::builder("frames-cuda-copied")
            .nick("Frames copied into CUDA memory")
            .blurb("Device-ring frames copied on the GPU into a CUDA buffer pool for a downstream that asks for memory:CUDAMemory: always before GStreamer 1.24, which cannot wrap memory it did not allocate; on newer runtimes only for frames whose planes are not aligned for CUDA textures or whose rows are padded (a warning says why, once), and frames downstream would hold past the budget")
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
            .blurb("Whether the producer's pipeline is live, as its newest frame says. A live producer's frames are stamped about when it published them (its backlog, after a wait-for-connection start or a stall, keeps its spacing: earlier frames come late, and the latency this source answers grows to cover them); a producer that is not live keeps its own timestamps, ahead of real time included (a file read flat out), so a syncing consumer plays them at their pace. Either way the spacing of the timestamps is the producer's, to the nanosecond")
            .read_only()
            .build(),
    ]
}

impl GpuShmSrc {
    pub(super) fn set_property_value(&self, value: &glib::Value, pspec: &glib::ParamSpec) {
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

    pub(super) fn property_value(&self, pspec: &glib::ParamSpec) -> glib::Value {
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
            "frames-cuda-wrapped" => self
                .shared()
                .map_or(0u64, |s| s.cuda_wrapped.load(Ordering::Relaxed))
                .to_value(),
            "frames-cuda-copied" => self
                .shared()
                .map_or(0u64, |s| s.cuda_copied.load(Ordering::Relaxed))
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
}
