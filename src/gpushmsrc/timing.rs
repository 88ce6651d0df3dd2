// SPDX-License-Identifier: MPL-2.0
//! Timestamps and latency: the producer's times mapped onto this pipeline's running time (the
//! gpushm crate's one mapping, its `time` module), what that mapping reads of the element, and
//! the latency this source answers for them.

use gpushm::ring::layout::NONE_U64;
use gpushm::time::TimeMap;
use gst::prelude::*;
use gst_base::prelude::*;

use super::receiver::Details;

/// Caps of the GstReferenceTimestampMeta holding the producer's publish time.
pub const PUBLISH_TIMESTAMP_CAPS: &str = "timestamp/x-gpushm-publish";

/// The latency this source answers for its timestamps (see [`gpushm::time`]): a frame is
/// stamped about when its producer published it, so it needs only the time to reach us and
/// be pushed.
const ANSWERED_LATENCY: u64 = 5_000_000;
/// Frames of a backlog keep their spacing and map before their publish moment
/// ([`gpushm::time::Mapped::late`]): the latency answered grows to cover the latest seen, in
/// steps of this (one Latency message a step)...
const LATENCY_STEP: u64 = 10_000_000;
/// ... up to this: later still is a stall, not the stream's pace (syncing sinks play such
/// frames late, or drop them as they would in one process).
const MAX_ANSWERED_LATENCY: u64 = 1_000_000_000;

/// create() reads [`Timing`] again when a frame came more than this after it asked.
pub(super) const TIMING_STALE_NS: u64 = 100_000_000;

/// The latency to answer: none when buffers are stamped on arrival (do-timestamp=true),
/// otherwise [`ANSWERED_LATENCY`]: frames are stamped about when they were published (the
/// producer's latency is in their timestamps, see the gpushm crate's `time` module), more if
/// frames came `late` (a backlog, see [`LATENCY_STEP`]).
fn latency(does_timestamp: bool, late: u64) -> u64 {
    match (does_timestamp, late) {
        (true, _) => 0,
        (false, l) if l <= ANSWERED_LATENCY => ANSWERED_LATENCY,
        (false, l) => {
            (l.min(MAX_ANSWERED_LATENCY) + ANSWERED_LATENCY).next_multiple_of(LATENCY_STEP)
        }
    }
}

/// What timestamp() needs from the element, read before waiting for a frame.
pub(super) struct Timing {
    does_timestamp: bool,
    clock: Option<gst::Clock>,
    base: Option<gst::ClockTime>,
    /// The clock's time less CLOCK_MONOTONIC, read with them: a frame's publish moment on
    /// our clock is its publish_ns plus this. (A clock that drifts against CLOCK_MONOTONIC
    /// drifts by parts per million over the at most TIMING_STALE_NS this is used for.)
    offset: i128,
}

impl Timing {
    /// What timestamp() reads from the element, read at once.
    pub(super) fn read(obj: &super::GpuShmSrc) -> Timing {
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
}

/// The timestamp and latency bookkeeping of a started source.
pub(super) struct Timestamps {
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
    /// The most a frame mapped before its publish moment (ns): the latency needed to play
    /// every frame on time.
    late: u64,
    /// The segment starting at the first buffer went out (see `first_segment`).
    segment_started: bool,
    /// The latency changed since the pipeline last asked: post a Latency message.
    latency_changed: bool,
}

impl Timestamps {
    pub(super) fn new() -> Self {
        Self {
            map: TimeMap::new(),
            clock_is_monotonic: None,
            clock_offset: None,
            last_pts: None,
            serial: 0,
            answered_latency: None,
            late: 0,
            segment_started: false,
            latency_changed: false,
        }
    }

    /// Sets PTS and DTS: the producer's clock times mapped into this pipeline's running time
    /// by the gpushm crate's one mapping ([`gpushm::time`]).
    pub(super) fn timestamp(&mut self, t: &Timing, b: &mut gst::BufferRef, f: &Details) {
        if t.does_timestamp {
            return;
        }
        let m = &f.meta;
        let (Some(clock), Some(base)) = (&t.clock, t.base) else {
            b.set_pts(clock_time(m.pts));
            b.set_dts(clock_time(m.dts));
            return;
        };
        if self.serial != f.conn_serial {
            // A new connection (or producer) goes on after what was pushed: never back.
            self.serial = f.conn_serial;
            self.map = self.map.continuing();
        }
        // Our clock's time less CLOCK_MONOTONIC: exactly 0 for the system clock on it.
        let monotonic = match &self.clock_is_monotonic {
            Some((c, mono)) if c == clock => *mono,
            _ => {
                let mono = crate::clock::is_monotonic(clock);
                self.clock_is_monotonic = Some((clock.clone(), mono));
                self.clock_offset = None;
                mono
            }
        };
        // Another clock: its offset read at each frame, kept while within 1 ms (reading two
        // clocks a little apart must not reach the spacing; a step or a slew is followed).
        let offset = if monotonic {
            0
        } else {
            let o = match self.clock_offset {
                Some(o) if o.abs_diff(t.offset) <= gpushm::time::OFFSET_SLACK as u128 => o,
                _ => t.offset,
            };
            self.clock_offset = Some(o);
            o
        };
        // A bogus publish time (after the frame arrived) falls back to our arrival stamp.
        let published = m.publish_ns.min(f.arrival_ns) as i128;
        let mapped = self.map.map(m, base.nseconds() as i128 - offset, published);
        let mut pts = mapped.pts.map(gst::ClockTime::from_nseconds);
        if gpushm::format::is_raw_video(&f.caps) {
            // Raw video has no reordering: its PTS never goes back (after a pause, a frame
            // stamped just before this pipeline played again would map before the last).
            if let (Some(p), Some(last)) = (pts, self.last_pts) {
                if p < last {
                    pts = Some(last);
                }
            }
            if pts.is_some() {
                self.last_pts = pts;
            }
        }
        b.set_pts(pts);
        b.set_dts(mapped.dts.map(gst::ClockTime::from_nseconds));
        self.late = self.late.max(mapped.late);
        if mapped.discont {
            b.set_flags(gst::BufferFlags::DISCONT);
        }
    }

    /// The segment to push before the first buffer `b`, stamped by [`Self::timestamp`]: it
    /// starts at that buffer (its DTS, if earlier), with running time equal to the PTS as
    /// before. The stream of this consumer starts there: elements that fill from the
    /// segment's start to the first buffer (audiorate, videorate) add nothing that the
    /// producer did not make, whenever the consumer joined.
    pub(super) fn first_segment(
        &mut self,
        t: &Timing,
        b: &gst::BufferRef,
    ) -> Option<gst::FormattedSegment<gst::ClockTime>> {
        if std::mem::replace(&mut self.segment_started, true)
            || t.does_timestamp
            || t.clock.is_none()
            || t.base.is_none()
        {
            return None;
        }
        let start = match (b.pts(), b.dts()) {
            (Some(p), Some(d)) => p.min(d),
            (p, d) => p.or(d)?,
        };
        let mut segment = gst::FormattedSegment::<gst::ClockTime>::new();
        segment.set_start(start);
        segment.set_time(start);
        segment.set_base(start);
        segment.set_position(start);
        Some(segment)
    }

    /// The latency to answer the pipeline's LATENCY query with, kept to see it change.
    pub(super) fn answer_latency(&mut self, does_timestamp: bool) -> u64 {
        let l = latency(does_timestamp, self.late);
        self.answered_latency = Some(l);
        l
    }

    /// Notes that the pipeline must ask for our latency again, when it changed since it last
    /// asked (posted by create(), without the state lock).
    pub(super) fn post_latency_if_changed(&mut self, t: &Timing) {
        let now = latency(t.does_timestamp, self.late);
        if self.answered_latency.is_some_and(|a| a != now) {
            self.answered_latency = Some(now);
            self.latency_changed = true;
        }
    }

    /// Whether a Latency message is to be posted (once per change).
    pub(super) fn take_latency_changed(&mut self) -> bool {
        std::mem::take(&mut self.latency_changed)
    }

    /// Low-latency mode: reads what timestamp() reads, while the streaming thread polls for
    /// the frame (see `GpuShmSrc::warm_up`).
    pub(super) fn warm_up(&self) {
        std::hint::black_box((
            self.serial,
            self.map.clone(),
            self.last_pts,
            self.clock_offset,
            self.answered_latency,
            self.late,
            self.clock_is_monotonic.as_ref().map(|c| c.1),
        ));
    }
}

fn clock_time(v: u64) -> Option<gst::ClockTime> {
    (v != NONE_U64).then(|| gst::ClockTime::from_nseconds(v))
}
