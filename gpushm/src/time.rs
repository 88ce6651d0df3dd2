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
//! - **Live producers never run ahead of real time**: a frame of a live producer that maps
//!   after its own publish moment (the producer waited, e.g. for its first consumer, and its
//!   source jumped ahead) lowers `J` so that it maps at its publish moment, never before the
//!   frame mapped last (decode order): the gap shows, flagged DISCONT, timestamps keep
//!   increasing. (Known limit: a live producer that delivers a backlog in a burst, a queue
//!   before a `wait-for-connection` gpushmsink, has that burst stamped at its publish moments,
//!   1 ns apart at worst, rather than with its spacing.)
//! - **Non-live producers keep their timestamps**, ahead of real time included (a file read
//!   flat out with sync=false): a syncing consumer plays them at their pace (and holds a
//!   lossless producer to it), a consumer with sync=false gets them strictly increasing with
//!   the producer's spacing. Beyond [`MAX_LEAD`] ahead they are lowered like live ones.
//! - PTS order is the producer's (B-frames); DTS travel as set. Decode order never goes
//!   back: the producer's latency is fixed per connection, and a new connection (or a new
//!   producer) maps after the last frame of the previous one ([`TimeMap::continuing`]).
//!
//! Examples (L = 40 ms, consumer started at monotonic 100 s):
//! - live camera, frame stamped 100.010 s, published 100.050 s: running 0.050 s.
//! - wait-for-connection producer, first frames stamped 90.000, 90.033 s: J = 9.96 s, they map
//!   to 0 and 0.033 s; its next frame, stamped 100.100 s after the wait, maps 5 ms before its publish
//!   moment (J lowered), DISCONT.
//! - x264enc with B-frames: first DTS 66.7 ms before the first PTS: the DTS maps at 0 (or
//!   later), the PTS 66.7 ms after it, as in the producer's pipeline.
//! - producer pipeline on CLOCK_REALTIME: `clock_offset` ≈ 56 years, the times map as if it
//!   ran on CLOCK_MONOTONIC.

use crate::ring::frame::FrameMeta;
use crate::ring::layout::NONE_U64;

/// Producer pipeline latencies above this are taken as 0 (a broken or hostile value).
pub const MAX_PRODUCER_LATENCY: u64 = 10_000_000_000;
/// A live producer's frame may map this far after its publish moment (a system clock wakes
/// up to 0.5 ms early) before the mapping is lowered.
pub const FUTURE_TOLERANCE: i128 = 1_000_000;
/// A lowered mapping places the frame this long before its publish moment, so that the
/// jitter of a producer that publishes before its timestamps plus latency (a live source
/// into a gpushmsink with sync=false) does not lower it again at every frame.
pub const LOWER_MARGIN: i128 = 5_000_000;
/// A producer clock offset that moves more than this (the clock was stepped or slewed) is
/// adopted; smaller moves are the jitter of reading two clocks.
pub const OFFSET_SLACK: i64 = 1_000_000;
/// Lowering the mapping by more than this is a gap in the stream (the producer waited):
/// the frame is flagged DISCONT.
pub const GAP: i128 = 1_000_000_000;
/// A producer that is not live may run this far ahead of real time (a file read flat out):
/// further ahead (nobody holds it to a consumer's pace, or its timestamps are bogus), the
/// mapping is lowered to the publish moment, DISCONT, so that a syncing sink never waits
/// longer than this.
pub const MAX_LEAD: i128 = 5_000_000_000;

/// A frame's times in the consumer's running time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub pts: Option<u64>,
    pub dts: Option<u64>,
    /// The mapping moved (a gap in the stream): flag the buffer DISCONT.
    pub discont: bool,
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
        if (m.live && ahead > FUTURE_TOLERANCE) || ahead > MAX_LEAD {
            // Ahead of real time: lowered to the publish moment, never back past the last.
            let target = self
                .last
                .map_or(now - LOWER_MARGIN, |l| (now - LOWER_MARGIN).max(l + 1));
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
        let clamp = |t: i128| Some(t.clamp(0, (u64::MAX - 1) as i128) as u64);
        Mapped {
            pts: pts.and_then(|p| clamp(run(p))),
            dts: dts.and_then(|d| clamp(run(d))),
            discont,
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
        // A live producer publishing before its timestamps plus latency (sync=false): lowered
        // once, then kept, with no DISCONT for it.
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
