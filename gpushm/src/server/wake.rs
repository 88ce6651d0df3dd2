// SPDX-License-Identifier: MPL-2.0
//! Waking sleeping consumers before a frame, so that their wake-up (tens of µs on a core that
//! idled) runs while the frame is on its way instead of after it:
//!
//! - **wake-early**: as a frame starts its last steps to the publish
//!   ([`super::Server::wake_early`]), after a gap of [`WAKE_EARLY_GAP`] since the last one;
//! - **wake-ahead**: a set time before each frame is due, as learnt from the last frames'
//!   publish times, rung by the connection thread ([`super::Server::set_wake_ahead`]).
//!
//! [`WakeUps`] keeps what both need (the stream's cadence, what was rung for which frame,
//! how late the connection thread's timed polls end) and decides when; the engine rings.

use crate::cadence::Cadence;
use crate::policy::{EARLY_WAKE_POLL, WAKE_AHEAD_MIN_INTERVAL, WAKE_EARLY_GAP};

/// How late the connection thread's timed wake-ups came (the last few, ns): it asks to be
/// woken that much earlier. Bounded: a machine too busy to keep time gets no more.
const AHEAD_LATE_HISTORY: usize = 8;
const AHEAD_LATE_MAX_NS: u64 = 300_000;

/// What the connection thread does about the next wake-up ahead of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ahead {
    /// Nothing to do (off, no clients, a stream too fast).
    Off,
    /// Nothing until the next frame is published: its cadence is not known yet, or the
    /// frame is later than it should be (a pause). The publish wakes the thread.
    Park,
    /// Ring at this time (CLOCK_MONOTONIC ns; now, if it passed).
    At(u64),
}

/// What [`WakeUps::ahead_step`] tells the connection thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AheadStep {
    /// Ring the clients asleep off `cpu` now (`now`: the time, CLOCK_MONOTONIC ns).
    Ring { cpu: u32, now: u64 },
    /// Look again at this time (CLOCK_MONOTONIC ns), or after the next publish (`None`).
    Later(Option<u64>),
}

#[derive(Default)]
pub(super) struct WakeUps {
    /// The frame (its seq) that wake-early woke clients for last.
    woken_early_for: u64,
    /// The publish times of the last frames (the last one's, 0 before the first frame of a
    /// stream): when the next one is due.
    cadence: Cadence,
    /// The CPU (1 + it, see [`crate::ring::layout::this_cpu`]) the last frame after a gap was
    /// published from.
    publish_cpu: u32,
    /// How long before a frame is due wake-ahead rings, ns (0: off).
    ahead_ns: u64,
    /// The time the connection thread asked its poll to end at for a wake-up ahead (0: none).
    asked_ns: u64,
    /// How late those polls ended (the last [`AHEAD_LATE_HISTORY`], ns): `late_n` of them,
    /// the next going at `late_at`.
    late: [u64; AHEAD_LATE_HISTORY],
    late_n: usize,
    late_at: usize,
    /// The frame (its seq) the connection thread rang ahead of last.
    ahead_for: u64,
    /// The frame that ring woke clients for (its seq), and when (CLOCK_MONOTONIC ns).
    ahead_woke: (u64, u64),
    /// The connection thread waits for the next publish to plan a wake-up ahead: that
    /// publish wakes it.
    parked: bool,
}

impl WakeUps {
    /// Whether wake-early rings for frame `next_seq` now: once per frame, after a gap of
    /// [`WAKE_EARLY_GAP`] since the last frame, and not within two polls of a wake-up ahead
    /// of the same frame.
    pub fn early_due(&mut self, next_seq: u64, now: u64) -> bool {
        if self.woken_early_for == next_seq {
            return false;
        }
        self.woken_early_for = next_seq;
        let last = self.cadence.last();
        if last != 0 && now.saturating_sub(last) < WAKE_EARLY_GAP.as_nanos() as u64 {
            return false;
        }
        // Clients woken ahead of this frame moments ago are waking up or polling for it:
        // ringing them again is a system call on the frame's way for nothing. Rung longer
        // ago (the frame is late), they have slept again.
        let (seq, at) = self.ahead_woke;
        !(seq == next_seq && now.saturating_sub(at) < 2 * EARLY_WAKE_POLL.as_nanos() as u64)
    }

    /// A frame was published at `publish_ns` from the CPU we run on. True if the connection
    /// thread waits for it to plan the next wake-up ahead (the caller wakes it).
    pub fn published(&mut self, publish_ns: u64) -> bool {
        // The CPU the frame's way runs on, for wake-ups ahead of the next frame: only after a
        // gap (they are rung for streams with one), not on every frame of a fast one.
        if publish_ns.saturating_sub(self.cadence.last()) >= WAKE_EARLY_GAP.as_nanos() as u64 {
            self.publish_cpu = crate::ring::layout::this_cpu();
        }
        self.cadence.record(publish_ns);
        std::mem::take(&mut self.parked)
    }

    /// A new stream starts: its cadence is learnt afresh.
    pub fn new_stream(&mut self) {
        self.cadence = Default::default();
    }

    /// Sets wake-ahead's lead (ns, 0: off). True if it changed (the connection thread plans
    /// again).
    pub fn set_ahead(&mut self, ns: u64) -> bool {
        std::mem::replace(&mut self.ahead_ns, ns) != ns
    }

    /// The connection thread's wake-up ahead of frame `next_seq`: ring now, or when to look
    /// again. `active`: a stream runs (not at EOS) with an open client. `timed_out`: the
    /// poll that asked for it ended by its timeout (how late it ended is learnt).
    pub fn ahead_step(&mut self, next_seq: u64, active: bool, timed_out: bool) -> AheadStep {
        if self.ahead_ns == 0 {
            self.parked = false;
            return AheadStep::Later(None);
        }
        let now = crate::monotonic_ns();
        let plan = if active {
            plan_ahead(
                self.ahead_ns + self.late_ns(),
                self.cadence.interval(),
                self.cadence.last(),
                self.ahead_for == next_seq,
                now,
            )
        } else {
            Ahead::Off
        };
        self.parked = plan == Ahead::Park;
        match plan {
            Ahead::At(at) if at <= now => {
                if timed_out && self.asked_ns != 0 && now >= self.asked_ns {
                    let i = self.late_at;
                    self.late[i] = (now - self.asked_ns).min(AHEAD_LATE_MAX_NS);
                    self.late_at = (i + 1) % AHEAD_LATE_HISTORY;
                    self.late_n = (self.late_n + 1).min(AHEAD_LATE_HISTORY);
                }
                self.asked_ns = 0;
                self.ahead_for = next_seq;
                AheadStep::Ring {
                    cpu: self.publish_cpu,
                    now,
                }
            }
            Ahead::At(at) => {
                self.asked_ns = at;
                AheadStep::Later(Some(at))
            }
            Ahead::Off | Ahead::Park => {
                self.asked_ns = 0;
                AheadStep::Later(None)
            }
        }
    }

    /// The ring of [`AheadStep::Ring`] for frame `next_seq` at `now` woke `woken` clients.
    pub fn rang_ahead(&mut self, next_seq: u64, now: u64, woken: usize) {
        if woken > 0 {
            self.ahead_woke = (next_seq, now);
        }
    }

    /// How late the connection thread's timed polls end (the median of the last ones).
    fn late_ns(&self) -> u64 {
        let n = self.late_n;
        if n == 0 {
            return 0;
        }
        let mut v = self.late;
        let v = &mut v[..n];
        v.sort_unstable();
        v[n / 2]
    }
}

/// When to ring clients ahead of the frame after the one published at `last` (CLOCK_MONOTONIC
/// ns, like `now`): `lead` before it is due, frames coming every `interval` (once known), and
/// `rung` if that frame was rung for already.
pub(super) fn plan_ahead(
    lead: u64,
    interval: Option<u64>,
    last: u64,
    rung: bool,
    now: u64,
) -> Ahead {
    let Some(iv) = interval else {
        return Ahead::Park;
    };
    if iv < WAKE_AHEAD_MIN_INTERVAL.as_nanos() as u64 {
        return Ahead::Off;
    }
    let due = last.saturating_add(iv);
    // Rung for the coming frame already: plan for the one after.
    let at = due
        .saturating_add(if rung { iv } else { 0 })
        .saturating_sub(lead);
    if at > now {
        Ahead::At(at)
    } else if rung || now > due.saturating_add(iv / 2) {
        // The coming frame is late (rung for, or half an interval past due): a pause.
        Ahead::Park
    } else {
        Ahead::At(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When the connection thread rings ahead of a frame: `lead` before it is due, the frame
    /// after if the coming one was rung for, never for a frame half an interval late (a
    /// pause) or a stream too fast, and not before its cadence is known.
    #[test]
    fn plans_wake_ups_ahead_of_frames_due_and_none_in_a_pause() {
        const MS: u64 = 1_000_000;
        let (lead, iv, last) = (MS / 10, 33 * MS, 1_000 * MS);
        let plan = |rung, now| plan_ahead(lead, Some(iv), last, rung, now);
        // The coming frame is due at last + iv.
        assert_eq!(plan(false, last + MS), Ahead::At(last + iv - lead));
        // Its time passed, the frame has not come: ring now, until it is half an interval late.
        assert_eq!(plan(false, last + iv), Ahead::At(last + iv - lead));
        assert_eq!(plan(false, last + iv + iv / 2), Ahead::At(last + iv - lead));
        assert_eq!(plan(false, last + iv + iv / 2 + 1), Ahead::Park);
        // Rung for it: the one after, once the coming one is published (a pause until then).
        assert_eq!(plan(true, last + iv), Ahead::At(last + 2 * iv - lead));
        assert_eq!(plan(true, last + 2 * iv - lead), Ahead::Park);
        // Cadence not known yet: wait for the next frame.
        assert_eq!(plan_ahead(lead, None, last, false, last), Ahead::Park);
        // Faster than one frame every WAKE_AHEAD_MIN_INTERVAL: never.
        let fast = WAKE_AHEAD_MIN_INTERVAL.as_nanos() as u64 - 1;
        assert_eq!(plan_ahead(lead, Some(fast), last, false, last), Ahead::Off);
        // A lead longer than the interval rings at once (it is due now), never in the past.
        assert_eq!(
            plan_ahead(2 * iv, Some(iv), last, false, last + 1),
            Ahead::At(last.saturating_sub(iv))
        );
    }

    /// Wake-early rings once per frame, only after a gap, and not right after a wake-up ahead
    /// of the same frame.
    #[test]
    fn wake_early_rings_once_a_frame_after_a_gap() {
        let gap = WAKE_EARLY_GAP.as_nanos() as u64;
        let mut w = WakeUps::default();
        let t = 10 * gap;
        // No frame yet: due, once.
        assert!(w.early_due(1, t));
        assert!(!w.early_due(1, t));
        w.published(t);
        // Too soon after the last frame.
        assert!(!w.early_due(2, t + gap / 2));
        // After a gap, the next frame.
        assert!(w.early_due(3, t + 2 * gap));
        // Rung ahead of frame 4 a moment ago: not again; long ago: yes.
        w.rang_ahead(4, t + 4 * gap, 1);
        assert!(!w.early_due(4, t + 4 * gap + 1000));
        w.rang_ahead(5, t + 4 * gap, 1);
        assert!(w.early_due(5, t + 6 * gap));
    }
}
