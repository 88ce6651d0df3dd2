// SPDX-License-Identifier: MPL-2.0
//! Which pipeline clocks are CLOCK_MONOTONIC itself, for both elements: a frame's clock times
//! are then published (gpushmsink) and mapped (gpushmsrc) with an offset of exactly 0, so the
//! producer's spacing is kept to the nanosecond (see the gpushm crate's `time` module).

use gst::prelude::*;

/// A plain GstSystemClock on CLOCK_MONOTONIC (GStreamer's default), uncalibrated. Its
/// subclasses (network, NTP and PTP clocks) keep the clock type but run on another time, and
/// a calibrated clock is another time too: those are measured instead.
pub fn is_monotonic(clock: &gst::Clock) -> bool {
    clock.type_() == gst::SystemClock::static_type()
        && clock.property::<gst::ClockType>("clock-type") == gst::ClockType::Monotonic
        && {
            let (internal, external, num, den) = clock.calibration();
            internal == external && num == den
        }
}
