// SPDX-License-Identifier: MPL-2.0
//! The receiver's connection to its producer: reading the ring one step at a time, and what a
//! lost producer means for the element (a warning, a discontinuity, an error without
//! reconnect). Connecting and reconnecting themselves are the core's
//! [`gpushm::subscriber::Link`].

use super::*;

impl Worker {
    /// One read from the ring (connecting or reconnecting first when needed). Blocks until
    /// something comes or the wake-up descriptor fires.
    pub(super) fn step(&mut self) -> Step {
        if self.done {
            return Step::Done;
        }
        let mut conn = match self.link.take() {
            Some(c) => c,
            None => match self.open() {
                Ok(c) => c,
                Err(step) => return step,
            },
        };
        // Upstream events downstream sent meanwhile (they woke us).
        let upstream: Vec<String> = self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for p in upstream {
            if let Err(e) = conn.send_upstream(&p) {
                gst::debug!(CAT, "an upstream event not sent to the producer: {e}");
            }
        }
        // The spare of the last frame's slot first: the next frame may come in it again.
        self.make_spare();
        self.make_ahead();
        let step = match conn.next_frame_warming(None, &mut || self.warm_up()) {
            Ok(Some(frame)) => {
                self.note_events(&frame.events);
                let (dropped, spin) = self.link.counts_with(&conn);
                self.shared
                    .producer_dropped
                    .store(dropped, Ordering::Relaxed);
                if !self.link.options().spin.is_zero() {
                    self.shared
                        .spin_caught
                        .store(spin.caught, Ordering::Relaxed);
                    self.shared
                        .spin_missed
                        .store(spin.missed, Ordering::Relaxed);
                }
                if let Some(c) = conn.caps() {
                    // Our copy first: the shared one's lock only when the caps changed.
                    if self
                        .caps_seen
                        .as_ref()
                        .is_none_or(|cur| !Arc::ptr_eq(cur, &c))
                    {
                        self.caps_seen = Some(c.clone());
                        *self.shared.caps.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
                    }
                }
                let arrival_ns = gpushm::monotonic_ns();
                match self.build(&conn, frame, arrival_ns) {
                    Ok(Some(r)) => Step::Item(Item::Frame(r)),
                    // Skipped (waiting for a keyframe): read on.
                    Ok(None) => Step::Interrupted,
                    Err(e) => {
                        self.done = true;
                        Step::Item(Item::Error(e))
                    }
                }
            }
            Ok(None) => {
                gst::debug!(CAT, "producer sent EOS");
                self.done = true;
                let last = conn.take_events();
                self.note_events(&last);
                Step::Item(Item::Eos(std::mem::take(&mut self.events)))
            }
            Err(Error::Interrupted) => {
                if self.shared.want_writable.load(Ordering::Acquire)
                    && !self.link.options().writable_ring
                {
                    self.link.options_mut().writable_ring = true;
                    self.lost(
                        conn,
                        "Downstream reads frames with CUDA and this GPU cannot register read-only memory: reconnecting to ask the producer for a writable ring (frames published meanwhile are missed)",
                    );
                    return Step::Interrupted;
                }
                Step::Interrupted
            }
            Err(e) => {
                let received = self.shared.received.load(Ordering::Relaxed);
                let why = match e {
                    Error::Disconnected => format!(
                        "The producer went away (gpushmsink stopped or crashed) after {received} frames"
                    ),
                    e => format!("Receiving from the producer failed: {e}"),
                };
                if !self.cfg.reconnect {
                    self.done = true;
                    return Step::Item(Item::Error(gst::error_msg!(
                        gst::ResourceError::Read,
                        ("{}", why)
                    )));
                }
                self.lost(conn, &why);
                return Step::Interrupted;
            }
        };
        self.link.restore(conn);
        step
    }

    /// Decodes the producer's events that come before the next frame (or the end) and keeps
    /// them for it. One that does not decode is left out with a warning: it came from another
    /// process.
    fn note_events(&mut self, payloads: &[Arc<str>]) {
        for p in payloads {
            match crate::events::decode(p) {
                Ok(e) => self.events.push(e),
                Err(why) => {
                    if let Some(el) = self.element.upgrade() {
                        gst::element_warning!(
                            el,
                            gst::StreamError::Decode,
                            ("The producer sent an event that was left out: {}", why)
                        );
                    }
                }
            }
        }
    }

    /// Whether more frames wait in the ring than the one just read.
    pub(super) fn behind(&self) -> bool {
        self.link.current().is_some_and(|c| c.has_frame())
    }

    /// The connection ended (or is given up for a writable one): the next step waits for a
    /// producer on the same path. Buffers of the old producer stay valid downstream: they
    /// keep their mapping alive.
    pub(super) fn lost(&mut self, conn: Box<Subscriber>, why: &str) {
        self.shared.connected.store(false, Ordering::Release);
        // The old producer's events for frames that never came: its stream is over.
        self.events.clear();
        // Memories made ahead over the old rings' slots.
        self.spares.clear();
        self.ahead = None;
        self.next_slot.clear();
        self.prev_slot = None;
        self.link.lost(Some(conn));
        if let Some(el) = self.element.upgrade() {
            gst::element_warning!(
                el,
                gst::ResourceError::Read,
                (
                    "{}; waiting for a producer on {} (reconnect=true)",
                    why,
                    self.link.endpoint()
                )
            );
        }
    }

    /// Connects (the first time with the configured timeout, later waiting as long as it
    /// takes). A wake is a stop, a flush, or a request for a writable ring: the caller looks
    /// at the flags and calls again.
    #[allow(clippy::result_large_err)]
    pub(super) fn open(&mut self) -> Result<Box<Subscriber>, Step> {
        if self.shared.want_writable.load(Ordering::Acquire) {
            self.link.options_mut().writable_ring = true;
        }
        let again = self.link.connections() > 0;
        match self.link.connect(None) {
            Ok(()) => {
                let Some(conn) = self.link.take() else {
                    return Err(Step::Interrupted);
                };
                gst::info!(
                    CAT,
                    "{} {} as client {}",
                    if again {
                        "reconnected to"
                    } else {
                        "connected to"
                    },
                    self.link.endpoint(),
                    conn.client_id()
                );
                if again {
                    self.serial += 1;
                    self.discont = true;
                    self.dropped_seen = 0;
                }
                self.need_keyframe = true;
                self.fresh = true;
                self.shared.connected.store(true, Ordering::Release);
                Ok(conn)
            }
            Err(Error::Interrupted) => {
                self.stop.clear();
                Err(Step::Interrupted)
            }
            Err(e) => {
                self.done = true;
                Err(Step::Item(Item::Error(if again {
                    gst::error_msg!(gst::ResourceError::OpenRead, ("Reconnecting failed: {}", e))
                } else {
                    gst::error_msg!(
                        gst::ResourceError::OpenRead,
                        (
                            "Could not connect to a gpushmsink at {}: {}",
                            self.link.endpoint(),
                            e
                        )
                    )
                })))
            }
        }
    }
}
