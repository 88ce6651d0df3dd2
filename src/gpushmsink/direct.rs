// SPDX-License-Identifier: MPL-2.0
//! The direct chain: GstBaseSink's chain function on the sink pad is put behind our own (FFI),
//! which takes a buffer straight to render() when GstBaseSink would do nothing but call it,
//! with GstBaseSink's segment clipping and the positions it would report.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;

use super::imp::GpuShmSink;
use gpushm::ring::layout::NONE_U64;

/// The direct way of a buffer from the sink pad to render(), around GstBaseSink's chain
/// function, where that does nothing for the buffer but cost time (8 µs of a 33 µs way from
/// upstream to the consumers on the dev VM): not synchronised to the clock (sync=false),
/// prerolled, playing, no last sample kept, no QoS, throttling or stepping. Anything else
/// goes GstBaseSink's way, as does every buffer list.
#[derive(Default)]
pub(super) struct Direct {
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

impl Direct {
    pub(super) fn forget_position(&self) {
        for p in &self.position {
            p.store(NONE_U64, Ordering::Relaxed);
        }
    }

    /// EOS came (`true`), or FLUSH_STOP, STREAM_START or a start cleared it (`false`).
    pub(super) fn set_eos(&self, eos: bool) {
        self.eos.store(eos, Ordering::SeqCst);
    }

    /// A STEP event came: GstBaseSink's way from then on.
    pub(super) fn set_stepped(&self) {
        self.stepped.store(true, Ordering::SeqCst);
    }

    /// Keeps the times of what was rendered (a buffer, or a GAP event's span) for position
    /// queries: `start` to `end`, clipped to the segment (called with the stream lock held).
    pub(super) fn note_position(
        &self,
        obj: &super::GpuShmSink,
        start: Option<gst::ClockTime>,
        end: Option<gst::ClockTime>,
    ) {
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
            self.position[0].store(ns(cstart), Ordering::Relaxed);
            self.position[1].store(ns(cstop), Ordering::Relaxed);
        }
    }

    /// The position GstBaseSink reports without sync: the stream time of the last buffer's
    /// start (of its stop when playing backwards, or after EOS). `None` before any buffer,
    /// without a time segment, or with sync (GstBaseSink answers then).
    pub(super) fn reported_position(&self, obj: &super::GpuShmSink) -> Option<gst::ClockTime> {
        let start = self.position[0].load(Ordering::Relaxed);
        let stop = self.position[1].load(Ordering::Relaxed);
        if start == NONE_U64 && stop == NONE_U64 {
            return None;
        }
        let eos = self.eos.load(Ordering::SeqCst);
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

impl GpuShmSink {
    /// Puts `chain` in front of GstBaseSink's chain function on the sink pad.
    pub(super) fn install_direct_chain(&self) {
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
    /// take the object lock that `Timing::base_and_offset` takes next, a cache line already in cache.
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
                    let r = match clip(&mut (*bs).segment, &buffer) {
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
}

/// GstBaseSink's segment handling for a buffer of the direct way: whether it is in the
/// segment (clipped on its PTS and duration), and the segment's position moved as
/// GstBaseSink moves it.
fn clip(segment: &mut gst::ffi::GstSegment, buffer: &gst::BufferRef) -> bool {
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
