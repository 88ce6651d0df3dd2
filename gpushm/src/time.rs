// SPDX-License-Identifier: MPL-2.0
//! One timestamp mapping for every consumer and every kind of stream: how a frame's times on
//! the producer's pipeline clock become running times of the consumer's pipeline.
//!
//! The producer publishes, with each frame, its PTS and DTS as clock times of its pipeline
//! (base time + running time; DTS may lie before the first PTS, as with B-frames), how those
//! times relate to CLOCK_MONOTONIC (`clock_offset`; gpushmsink converts them to
//! CLOCK_MONOTONIC itself, measuring an audio device's clock or a realtime system clock
//! against it, and publishes 0), its pipeline latency `L` and whether it is live. Then, on
//! CLOCK_MONOTONIC:
//!
//! ```text
//! running(t) = t - clock_offset + L - consumer_base + J
//! ```
//!
//! - **`+ L`**: a live producer publishes a frame about `L` after its timestamp; shifted by
//!   `L`, every frame published after the consumer started maps at or after 0, at about the
//!   moment it was published. All streams of one producer pipeline share its clock and `L`,
//!   so two consumers in one pipeline (audio and video from two gpushmsinks of one producer)
//!   keep the producer's relative offset exactly, as long as neither needed a join delay
//!   (each connection fixes its own: after a `wait-for-connection` start, to within the
//!   producers' publish jitter).
//! - **`J`, the join delay**, fixed at the first frame of each connection: 0 unless that
//!   frame's earliest time (its DTS, with B-frames) would map before 0, then just enough to
//!   place it at 0. A consumer started after a `wait-for-connection` producer stamped its first
//!   frames, or one joining a non-live stream, gets the producer's spacing from its first
//!   frame: no clamping, nothing piled at 0.
//! - **The spacing is the producer's, to the nanosecond**, live or not, whatever the publish
//!   moments were: `J` stays as fixed. Frames that arrive late (a backlog delivered in a
//!   burst) keep their spacing and map before their arrival: what gives is latency, which the
//!   consumer answers for ([`Mapped::late`]), not spacing. Frames that arrive early (the
//!   backlog of a `wait-for-connection` producer, for a consumer that started after its first
//!   frame) map after their arrival: a syncing sink plays them at their pace, the consumer
//!   runs behind by the backlog.
//! - **`J` moves only where the producer's times leave real time**, flagged DISCONT when it
//!   moves by more than [`GAP`]: a live frame whose time jumped more than [`GAP`] further ahead
//!   of its publish moment than the frame before (a source stamping on a clock that ran on
//!   while the producer waited), or any frame more than [`MAX_LEAD`] ahead of its publish moment
//!   (a file read flat out that nobody holds to a consumer's pace, bogus timestamps, a
//!   backlog that long), is lowered to its publish moment, never back past the frame mapped
//!   last. A syncing sink never waits more than [`MAX_LEAD`] for a frame.
//! - PTS order is the producer's (B-frames); DTS travel as set. Decode order never goes
//!   back: the producer's latency is fixed per connection, and a new connection (or a new
//!   producer) maps after the last frame of the previous one ([`TimeMap::continuing`]).
//!
//! Examples (L = 40 ms, consumer started at monotonic 100 s):
//! - live camera, frame stamped 100.010 s, published 100.050 s: running 0.050 s.
//! - wait-for-connection producer, first frames stamped 90.000, 90.033 s: J = 9.96 s, they map
//!   to 0 and 0.033 s; if its next frame is stamped 100.100 s after the wait (a source that stamps
//!   on the clock), it maps 5 ms before its publish moment (J lowered), DISCONT; if it is
//!   stamped 90.067 s (a source that catches up), it maps at 0.067 s.
//! - live audio, 1024 samples a buffer: every PTS differs from the one before by exactly the
//!   producer's, at any load (publish jitter never reaches them).
//! - x264enc with B-frames: first DTS 66.7 ms before the first PTS: the DTS maps at 0 (or
//!   later), the PTS 66.7 ms after it, as in the producer's pipeline.
//! - producer pipeline on CLOCK_REALTIME: `clock_offset` ≈ 56 years, the times map as if it
//!   ran on CLOCK_MONOTONIC.

use crate::ring::frame::FrameMeta;
use crate::ring::layout::NONE_U64;

/// Producer pipeline latencies above this are taken as 0 (a broken or hostile value).
pub const MAX_PRODUCER_LATENCY: u64 = 10_000_000_000;
/// A lowered mapping places the frame this long before its publish moment: with the
/// latency the consumer answers, a syncing sink plays it at once.
pub const LOWER_MARGIN: i128 = 5_000_000;
/// A producer clock offset that moves more than this (the clock was stepped or slewed) is
/// adopted; smaller moves are the jitter of reading two clocks.
pub const OFFSET_SLACK: i64 = 1_000_000;
/// A live frame whose time runs this much further ahead of its publish moment than the frame
/// before jumped (its source stamps on a clock that ran on while the producer waited): the
/// mapping is lowered, and moving it by more than this is a gap, flagged DISCONT.
pub const GAP: i128 = 1_000_000_000;
/// A frame may map this far after its publish moment (a file read flat out, paced by a
/// syncing consumer; the backlog of a `wait-for-connection` producer): further ahead, the
/// mapping is lowered to the publish moment, DISCONT, so that a syncing sink never waits
/// longer than this.
pub const MAX_LEAD: i128 = 5_000_000_000;
/// A live frame published this much later than its time plus the producer's latency is part
/// of a backlog the producer delivers late ([`is_backlog`]).
pub const BACKLOG_SLACK: i128 = 20_000_000;

/// A frame's times in the consumer's running time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub pts: Option<u64>,
    pub dts: Option<u64>,
    /// The mapping moved (a gap in the stream): flag the buffer DISCONT.
    pub discont: bool,
    /// How long before its publish moment the frame maps (ns, 0 if at or after it): a
    /// consumer whose sinks sync needs that much latency to play it on time.
    pub late: u64,
}

/// How long after its time plus the producer's latency live frame `m` is published at
/// `published_mono` (CLOCK_MONOTONIC, ns; negative: before). `None` for a frame that is not
/// live or has no time. Values from anyone: never overflows.
pub fn lateness(m: &FrameMeta, published_mono: u64) -> Option<i128> {
    let t = if m.dts_clock != NONE_U64 {
        m.dts_clock
    } else {
        m.pts_clock
    };
    if !m.live || t == NONE_U64 {
        return None;
    }
    let latency = match m.latency {
        l if l > MAX_PRODUCER_LATENCY => 0,
        l => l as i128,
    };
    Some(published_mono as i128 - (t as i128 - m.clock_offset as i128 + latency))
}

/// Whether `m`, published at `published_mono`, is a live frame published more than
/// [`BACKLOG_SLACK`] late ([`lateness`]): part of a backlog (a producer that waited for its
/// first consumer and delivers what its source made meanwhile, or one that stalled).
pub fn is_backlog(m: &FrameMeta, published_mono: u64) -> bool {
    lateness(m, published_mono).is_some_and(|l| l > BACKLOG_SLACK)
}

/// The mapping of one connection (see the module docs). A new connection, or a new producer,
/// starts a new one.
#[derive(Debug, Clone, Default)]
pub struct TimeMap {
    join: Option<i128>,
    /// The producer's latency, fixed at the first frame (a producer whose latency changes
    /// mid-stream would otherwise move every later frame by the change).
    latency: Option<i128>,
    /// The first decode-order time of this connection may not map before this (the last of
    /// the previous connection): a new producer's frames never go back past the old ones.
    floor: Option<i128>,
    /// The producer's clock offset in use: kept while the published one stays within
    /// [`OFFSET_SLACK`] of it, so that two clocks read a little apart (a realtime clock and
    /// CLOCK_MONOTONIC) do not add their jitter to every frame.
    offset: Option<i64>,
    /// The last decode-order time mapped (running time, ns).
    last: Option<i128>,
    /// How far after its publish moment the last frame mapped (ns): a live frame that maps
    /// more than [`GAP`] further ahead jumped.
    last_ahead: Option<i128>,
}

impl TimeMap {
    pub fn new() -> Self {
        Self::default()
    }

    /// A mapping for a new connection that goes on from `self`'s: its first frame maps after
    /// the last one mapped here.
    pub fn continuing(&self) -> Self {
        Self {
            floor: self.last.map(|l| l + 1),
            ..Self::default()
        }
    }

    /// Maps `m`'s PTS and DTS into the running time of a consumer pipeline whose base time
    /// is `base_mono` on CLOCK_MONOTONIC; `published_mono` is when the frame was published
    /// (CLOCK_MONOTONIC, at most its arrival). Values from shared memory can be anything: the
    /// arithmetic cannot overflow and the results are clamped to what GStreamer holds.
    pub fn map(&mut self, m: &FrameMeta, base_mono: i128, published_mono: i128) -> Mapped {
        let latency = *self.latency.get_or_insert(match m.latency {
            l if l > MAX_PRODUCER_LATENCY => 0,
            l => l as i128,
        });
        let offset = match self.offset {
            Some(o) if o.abs_diff(m.clock_offset) <= OFFSET_SLACK as u64 => o,
            _ => m.clock_offset,
        };
        self.offset = Some(offset);
        let mono = |t: u64| (t != NONE_U64).then(|| t as i128 - offset as i128);
        let (pts, dts) = (mono(m.pts_clock), mono(m.dts_clock));
        // Decode order: the DTS where there is one.
        let Some(order) = dts.or(pts) else {
            return Mapped {
                pts: None,
                dts: None,
                discont: false,
                late: 0,
            };
        };
        let earliest = pts.map_or(order, |p| p.min(order));
        let natural = |t: i128| t + latency - base_mono;
        let floor = self.floor;
        let join = *self.join.get_or_insert_with(|| {
            let at_zero = (-natural(earliest)).max(0);
            // After a previous connection: its first frame after the last one pushed.
            floor.map_or(at_zero, |f| at_zero.max(f - natural(order)))
        });
        let mut join = join;
        let mut discont = false;
        let now = published_mono - base_mono;
        let ahead = natural(order) + join - now;
        let jumped = m.live && self.last_ahead.is_some_and(|a| ahead - a > GAP);
        if jumped || ahead > MAX_LEAD {
            // Left real time: lowered to the publish moment, never before 0 (a frame there
            // would be clamped while the mapping kept the lower value: the next ones would
            // come closer than their spacing) and never back past the last.
            let target = (now - LOWER_MARGIN).max(0);
            let target = self.last.map_or(target, |l| target.max(l + 1));
            let lowered = target - natural(order);
            discont = join - lowered > GAP;
            join = lowered;
            self.join = Some(join);
        }
        // Decode order never goes back (a producer whose timestamps do, or a clock step).
        if let Some(l) = self.last.filter(|&l| natural(order) + join <= l) {
            join = l + 1 - natural(order);
            self.join = Some(join);
        }
        let run = |t: i128| natural(t) + join;
        self.last = Some(run(order));
        self.last_ahead = Some(run(order) - now);
        // Sinks sync on the PTS: how late that is, at its publish moment.
        let late = (now - run(pts.unwrap_or(order))).clamp(0, u64::MAX as i128) as u64;
        let clamp = |t: i128| Some(t.clamp(0, (u64::MAX - 1) as i128) as u64);
        Mapped {
            pts: pts.and_then(|p| clamp(run(p))),
            dts: dts.and_then(|d| clamp(run(d))),
            discont,
            late,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    fn frame(pts: u64, dts: u64, live: bool) -> FrameMeta {
        FrameMeta {
            pts_clock: pts,
            dts_clock: dts,
            latency: 40 * MS,
            live,
            ..Default::default()
        }
    }

    #[test]
    fn a_live_camera_maps_at_its_publish_moment_with_its_spacing() {
        let mut t = TimeMap::new();
        let base = 100 * S as i128;
        let a = t.map(
            &frame(100 * S + 10 * MS, NONE_U64, true),
            base,
            (100 * S + 50 * MS) as i128,
        );
        assert_eq!(a.pts, Some(50 * MS));
        let b = t.map(
            &frame(100 * S + 43 * MS, NONE_U64, true),
            base,
            (100 * S + 84 * MS) as i128,
        );
        assert_eq!(b.pts, Some(83 * MS));
        assert!(!a.discont && !b.discont);
    }

    #[test]
    fn streams_of_one_producer_keep_their_offset() {
        let base = 100 * S as i128;
        let (mut audio, mut video) = (TimeMap::new(), TimeMap::new());
        // Both published after the consumer started; video 7 ms after audio.
        let a = audio.map(
            &frame(100 * S + 10 * MS, NONE_U64, true),
            base,
            (100 * S + 50 * MS) as i128,
        );
        let v = video.map(
            &frame(100 * S + 17 * MS, NONE_U64, true),
            base,
            (100 * S + 60 * MS) as i128,
        );
        assert_eq!(v.pts.unwrap() - a.pts.unwrap(), 7 * MS);
    }

    #[test]
    fn a_late_join_keeps_the_spacing_from_the_first_frame() {
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        let f: Vec<_> = (0..5u64)
            .map(|i| {
                t.map(
                    &frame(90 * S + i * 33 * MS, NONE_U64, false),
                    base,
                    100 * S as i128,
                )
                .pts
                .unwrap()
            })
            .collect();
        assert_eq!(f, vec![0, 33 * MS, 66 * MS, 99 * MS, 132 * MS]);
        // Live: the next frame after the wait maps at its publish moment, DISCONT.
        let mut t = TimeMap::new();
        t.map(&frame(90 * S, NONE_U64, true), base, 100 * S as i128);
        let next = t.map(
            &frame(100 * S + 100 * MS, NONE_U64, true),
            base,
            (100 * S + 140 * MS) as i128,
        );
        assert_eq!(next.pts, Some(135 * MS));
        assert!(next.discont);
        // A live producer publishing before its timestamps plus latency (sync=false): its
        // spacing, no DISCONT.
        let mut t = TimeMap::new();
        let mut discont = 0;
        let mut last = 0;
        for i in 0..30u64 {
            let ts = 100 * S + i * 33 * MS;
            let jitter = (i % 3) * MS;
            let r = t.map(
                &frame(ts, NONE_U64, true),
                base,
                (ts + 2 * MS + jitter) as i128,
            );
            discont += r.discont as u32;
            if i > 0 {
                assert!(r.pts.unwrap() > last);
            }
            last = r.pts.unwrap();
        }
        assert_eq!(discont, 0);
    }

    #[test]
    fn a_live_backlog_keeps_its_spacing_and_says_how_late_it_is() {
        let base = 100 * S as i128;
        // wait-for-connection, consumer started 10 s after the first frame: the backlog comes
        // in a burst, 0.1 ms apart, and keeps its 33.3 ms spacing from 0.
        let mut t = TimeMap::new();
        for k in 0..60u64 {
            let ts = 90 * S + k * 1_000_000_000 / 30;
            let r = t.map(
                &frame(ts, NONE_U64, true),
                base,
                (100 * S + k * 100_000) as i128,
            );
            assert_eq!(r.pts, Some(k * 1_000_000_000 / 30), "frame {k}");
            assert!(!r.discont);
        }
        // Consumer there from the start, producer stalled for 2 s then caught up: the frames
        // keep their spacing, map before their arrival, and say by how much.
        let mut t = TimeMap::new();
        let first = t.map(
            &frame(100 * S, NONE_U64, true),
            base,
            (100 * S + 40 * MS) as i128,
        );
        assert_eq!((first.pts, first.late), (Some(40 * MS), 0));
        let stalled = t.map(
            &frame(100 * S + 33 * MS, NONE_U64, true),
            base,
            (102 * S + 73 * MS) as i128,
        );
        assert_eq!(stalled.pts, Some(73 * MS));
        assert_eq!(stalled.late, 2 * S);
        assert!(!stalled.discont);
    }

    #[test]
    fn live_audio_keeps_its_spacing_at_any_publish_jitter() {
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        let mut last = None;
        // 1024 samples at 48 kHz, published up to 30 ms late or 20 ms early (sync=false).
        for k in 0..2000u64 {
            let ts = 101 * S + k * 1024 * S / 48_000;
            let jitter = (k * 7919 % 50) as i128 * MS as i128 - 20 * MS as i128;
            let published = ts as i128 + 40 * MS as i128 + jitter;
            let r = t.map(&frame(ts, NONE_U64, true), base, published);
            let p = r.pts.unwrap();
            if let Some((lp, lts)) = last {
                assert_eq!(p - lp, ts - lts, "buffer {k}");
            }
            assert!(!r.discont);
            last = Some((p, ts));
        }
    }

    #[test]
    fn a_backlog_is_a_live_frame_published_after_its_time_and_latency() {
        let mut m = frame(100 * S, NONE_U64, true);
        assert!(!is_backlog(&m, 100 * S + 40 * MS));
        assert!(!is_backlog(&m, 100 * S + 55 * MS));
        assert!(is_backlog(&m, 100 * S + 100 * MS));
        // DTS first (B-frames), another clock, not live, no time, hostile latency.
        m.dts_clock = 99 * S;
        assert!(is_backlog(&m, 100 * S + 40 * MS));
        m.clock_offset = -(S as i64);
        assert!(!is_backlog(&m, 100 * S + 40 * MS));
        m.live = false;
        assert!(!is_backlog(&m, 200 * S));
        let mut m = frame(NONE_U64, NONE_U64, true);
        assert!(!is_backlog(&m, 200 * S));
        m.pts_clock = u64::MAX - 1;
        m.latency = u64::MAX;
        m.clock_offset = i64::MIN;
        assert!(!is_backlog(&m, u64::MAX));
    }

    #[test]
    fn b_frames_keep_their_dts_and_pts_order() {
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        // x264enc bframes=2: DTS 66.7 ms before the first PTS.
        let first = t.map(
            &frame(100 * S, 100 * S - 66_666_667, false),
            base,
            100 * S as i128,
        );
        let second = t.map(
            &frame(100 * S + 100 * MS, 100 * S - 33_333_333, false),
            base,
            100 * S as i128,
        );
        let third = t.map(
            &frame(100 * S + 33_333_333, 100 * S, false),
            base,
            100 * S as i128,
        );
        let d = first.dts.unwrap();
        assert_eq!(first.pts.unwrap() - d, 66_666_667);
        assert_eq!(second.dts.unwrap() - d, 33_333_334);
        assert_eq!(second.pts.unwrap() - d, 166_666_667);
        assert_eq!(third.pts.unwrap() - d, 100_000_000);
    }

    #[test]
    fn a_producer_on_another_clock_maps_through_its_offset() {
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        let off = 56 * 365 * 86_400 * S;
        let mut m = frame(off + 100 * S + 10 * MS, NONE_U64, true);
        m.clock_offset = off as i64;
        assert_eq!(
            t.map(&m, base, (100 * S + 50 * MS) as i128).pts,
            Some(50 * MS)
        );
        // Read a little apart at each frame: the spacing stays exact.
        let mut m = frame(off + 100 * S + 43 * MS, NONE_U64, true);
        m.clock_offset = off as i64 + 700;
        assert_eq!(
            t.map(&m, base, (100 * S + 84 * MS) as i128).pts,
            Some(83 * MS)
        );
    }

    #[test]
    fn a_latency_change_or_a_new_connection_never_goes_back() {
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        let a = t.map(&frame(100 * S, NONE_U64, false), base, 100 * S as i128);
        let mut m = frame(100 * S + 33 * MS, NONE_U64, false);
        m.latency = 0;
        let b = t.map(&m, base, 100 * S as i128);
        assert_eq!(
            b.pts.unwrap() - a.pts.unwrap(),
            33 * MS,
            "latency fixed per connection"
        );
        // A new producer whose first frame is older than what was pushed: after it.
        let mut next = t.continuing();
        let c = next.map(&frame(100 * S, NONE_U64, false), base, 100 * S as i128);
        assert!(c.pts.unwrap() > b.pts.unwrap());
        // Timestamps going back: decode order still moves on.
        let d = next.map(&frame(99 * S, NONE_U64, false), base, 100 * S as i128);
        assert!(d.pts.unwrap() > c.pts.unwrap());
    }

    #[test]
    fn a_non_live_producer_far_ahead_is_brought_back() {
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        let a = t.map(&frame(100 * S, NONE_U64, false), base, 100 * S as i128);
        // 2 s ahead: kept (a file read flat out, paced by a syncing consumer).
        let b = t.map(
            &frame(102 * S + 40 * MS, NONE_U64, false),
            base,
            100 * S as i128,
        );
        assert_eq!(b.pts.unwrap() - a.pts.unwrap(), 2 * S + 40 * MS);
        // An hour ahead: lowered to the publish moment, DISCONT.
        let c = t.map(
            &frame(3700 * S, NONE_U64, false),
            base,
            (100 * S + 10 * MS) as i128,
        );
        assert!(c.discont && c.pts.unwrap() > b.pts.unwrap() && c.pts.unwrap() < 3 * S);
    }

    #[test]
    fn a_first_frame_far_ahead_is_lowered_no_further_than_0() {
        // Not live, 30 s ahead (videotestsrc timestamp-offset=30 s), published 1 ms after the
        // consumer started: lowered to 0, not to -4 ms, so that the next frames keep their
        // 33.3 ms spacing from it.
        let base = 100 * S as i128;
        let mut t = TimeMap::new();
        let pts: Vec<u64> = (0..3u64)
            .map(|k| {
                let r = t.map(
                    &frame(130 * S + k * 1_000_000_000 / 30, NONE_U64, false),
                    base,
                    (100 * S + MS + k * 100_000) as i128,
                );
                r.pts.unwrap()
            })
            .collect();
        assert_eq!(pts, vec![0, 33_333_333, 66_666_666]);
    }

    #[test]
    fn hostile_values_never_overflow() {
        let mut t = TimeMap::new();
        let mut m = frame(u64::MAX - 1, u64::MAX - 2, true);
        m.clock_offset = i64::MIN;
        m.latency = u64::MAX;
        let r = t.map(&m, i128::from(i64::MIN), i128::from(i64::MAX));
        assert!(r.pts.is_some());
        let mut m = frame(0, 0, false);
        m.clock_offset = i64::MAX;
        let r = t.map(&m, 0, 0);
        assert!(r.pts.is_some());
    }
}
