// SPDX-License-Identifier: MPL-2.0
//! The low-latency mode of a consumer ([`ConnectOptions::spin`](crate::subscriber::ConnectOptions::spin)):
//! when the next frame is due, learnt from the publish times of the last frames.
//!
//! A consumer that sleeps on its wake-up descriptor pays for the sleeping core to wake up when
//! the frame lands (60–80 µs after a few ms idle on a server, most of a hop's latency). In
//! low-latency mode it sleeps (wake-up descriptor armed, so an early frame wakes it as before)
//! until a little before the next frame is due, then polls the ring for at most its budget,
//! and only then goes back to the wake-up descriptor. A wrong guess costs at most one budget
//! of CPU per frame and never delays a frame: the descriptor is armed whenever we are not
//! polling. A stream that pauses or stops costs one budget, then nothing: the budget is spent
//! once per frame taken.
//!
//! The producer learns the same from its own publish times to wake sleeping consumers before
//! a frame is due ([`Server::set_wake_ahead`](crate::server::Server::set_wake_ahead)).

/// Intervals between frames kept to guess the next one (their median).
const HISTORY: usize = 8;

/// The producer's cadence as seen in the publish times of the frames taken.
#[derive(Debug, Default, Clone)]
pub(crate) struct Cadence {
    /// Publish time (CLOCK_MONOTONIC ns) of the newest frame taken (0: none yet).
    last: u64,
    /// The last intervals between publish times, ns (ring buffer of `n` entries).
    intervals: [u64; HISTORY],
    n: usize,
    at: usize,
    /// A poll may be spent on the frame after `last` (set by each frame taken, cleared when
    /// spent).
    armed: bool,
}

impl Cadence {
    /// A frame published at `publish_ns` was taken.
    pub fn record(&mut self, publish_ns: u64) {
        if publish_ns == 0 || publish_ns == crate::ring::layout::NONE_U64 {
            return;
        }
        if publish_ns < self.last {
            // Time went back (only a broken or lying producer does that on CLOCK_MONOTONIC):
            // what was learnt is worth nothing; start again from this frame.
            *self = Self {
                last: publish_ns,
                ..Self::default()
            };
            return;
        }
        if self.last != 0 && publish_ns > self.last {
            self.intervals[self.at] = publish_ns - self.last;
            self.at = (self.at + 1) % HISTORY;
            self.n = (self.n + 1).min(HISTORY);
        }
        self.last = publish_ns;
        self.armed = true;
    }

    /// The publish time of the newest frame recorded (0: none yet).
    pub fn last(&self) -> u64 {
        self.last
    }

    /// The usual interval between frames (the median of the last ones), once known.
    pub fn interval(&self) -> Option<u64> {
        if self.n == 0 {
            return None;
        }
        let mut v = self.intervals;
        let v = &mut v[..self.n];
        v.sort_unstable();
        Some(v[v.len() / 2])
    }

    /// When the next frame is due (CLOCK_MONOTONIC ns), if a poll may still be spent on it:
    /// at most once per frame taken.
    pub fn take_due(&mut self) -> Option<u64> {
        if !std::mem::take(&mut self.armed) {
            return None;
        }
        Some(self.last.saturating_add(self.interval()?))
    }
}

/// This thread's timer slack (how late the kernel may end a timed sleep to group wake-ups,
/// 50 µs by default), ns: the early wake-up allows for it.
pub(crate) fn timer_slack_ns() -> u64 {
    nix::sys::prctl::get_timerslack()
        .ok()
        .and_then(|s| u64::try_from(s).ok())
        .unwrap_or(50_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_the_cadence_and_spends_one_poll_per_frame() {
        let mut c = Cadence::default();
        assert_eq!(c.take_due(), None, "nothing known yet");
        c.record(1_000_000);
        assert_eq!(c.take_due(), None, "one frame gives no interval");
        c.record(34_333_333);
        assert_eq!(c.take_due(), Some(34_333_333 + 33_333_333));
        assert_eq!(c.take_due(), None, "spent until the next frame");
        c.record(67_666_666);
        assert_eq!(c.interval(), Some(33_333_333));
        assert!(c.take_due().is_some());
    }

    #[test]
    fn a_new_cadence_wins_the_median_and_a_pause_does_not() {
        let mut c = Cadence::default();
        let mut t = 1_000_000;
        for _ in 0..9 {
            t += 33_000_000;
            c.record(t);
        }
        // One long pause: the median stays at the old cadence.
        t += 3_000_000_000;
        c.record(t);
        assert_eq!(c.interval(), Some(33_000_000));
        // 5 fps from now on: after a few frames the median follows.
        for _ in 0..5 {
            t += 200_000_000;
            c.record(t);
        }
        assert_eq!(c.interval(), Some(200_000_000));
        // Frames without a publish time change nothing.
        c.record(0);
        c.record(crate::ring::layout::NONE_U64);
        assert_eq!(c.interval(), Some(200_000_000));
        // Time going back starts the learning again from that frame.
        c.record(t - 1);
        assert_eq!(c.interval(), None);
        assert_eq!(c.take_due(), None);
        c.record(t + 10_000_000);
        assert_eq!(c.interval(), Some(10_000_001));
    }
}
