// SPDX-License-Identifier: MPL-2.0
//! The FrameMeta of a buffer: its times on CLOCK_MONOTONIC (base time, segment and the
//! pipeline clock's offset), the pipeline latency, its planes (from the caps or its VideoMeta)
//! and its time code.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use gst::glib;
use gst::glib::translate::IntoGlib;
use gst::prelude::*;
use once_cell::sync::Lazy;

use gpushm::ring::layout::{MAX_PLANES, NONE_U64};
use gpushm::ring::producer_end::{FrameMeta, TimeCode};

/// What a frame's times need besides the buffer and the element's base time and segment.
#[derive(Default)]
pub(super) struct Timing {
    /// The pipeline clock last seen, whether it is CLOCK_MONOTONIC itself (GstSystemClock's
    /// default: offset exactly 0), and the offset in use for another clock (kept while a
    /// fresh reading stays within 1 ms of it, so reading two clocks adds no jitter).
    clock_kind: Mutex<Option<(gst::Clock, bool, i64)>>,
    /// The pipeline latency of the last LATENCY event (what GstBaseSink keeps, read here
    /// without its object lock).
    latency: AtomicU64,
}

impl Timing {
    /// Keeps the pipeline latency published with every frame, in nanoseconds.
    pub(super) fn set_latency(&self, ns: u64) {
        self.latency.store(ns, Ordering::Relaxed);
    }

    /// The pipeline clock's time less CLOCK_MONOTONIC, published with every frame so that
    /// consumers map its timestamps (gpushm's `time` module): exactly 0 for the system clock
    /// on CLOCK_MONOTONIC (GStreamer's default), measured for any other.
    fn clock_offset(&self, obj: &super::GpuShmSink) -> i64 {
        let Some(clock) = obj.clock() else {
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
    fn base_and_offset(&self, obj: &super::GpuShmSink) -> (Option<gst::ClockTime>, i64) {
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
        (base, self.clock_offset(obj))
    }

    /// The FrameMeta of `buffer`, a frame of `info` (`None`: opaque bytes) whose caps' own
    /// layout is `template`, rendered by `obj`.
    pub(super) fn frame_meta(
        &self,
        obj: &super::GpuShmSink,
        buffer: &gst::BufferRef,
        info: Option<&gst_video::VideoInfo>,
        template: Option<&FrameMeta>,
    ) -> FrameMeta {
        let (base, offset) = self.base_and_offset(obj);
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

/// The frame description of `info`'s own layout: format, size and planes (what every frame
/// laid out that way publishes).
pub(super) fn frame_template(info: &gst_video::VideoInfo) -> FrameMeta {
    let mut m = FrameMeta::default();
    describe_layout(info, info.offset(), info.stride(), &mut m);
    m
}

/// Describes in `m` a frame of `info` whose planes sit at `offsets` with `strides`: format,
/// size, planes (no allocation).
pub(super) fn describe_layout(
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
pub(super) fn same_layout(vm: &gst_video::VideoMeta, info: &gst_video::VideoInfo) -> bool {
    let n = info.n_planes() as usize;
    vm.format() == info.format()
        && vm.width() == info.width()
        && vm.height() == info.height()
        && vm.n_planes() as usize == n
        && vm.offset().get(..n) == info.offset().get(..n)
        && vm.stride().get(..n) == info.stride().get(..n)
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
pub(super) fn timecode(buffer: &gst::BufferRef) -> Option<TimeCode> {
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
