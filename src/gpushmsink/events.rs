// SPDX-License-Identifier: MPL-2.0
//! The events gpushmsink passes on to its consumers: tags and serialized custom events, in
//! order with the buffers (see `crate::events` for which and how).

use gst::prelude::*;
use gst::subclass::prelude::*;

use super::imp::{GpuShmSink, CAT};

impl GpuShmSink {
    /// Sends `event` to every consumer if it is one that travels. Called from `event()`, in the
    /// streaming thread, so it goes out before the buffers that follow it.
    pub(super) fn forward_event(&self, event: &gst::Event) {
        let Some(enc) = crate::events::encode(event) else {
            return;
        };
        let Some(server) = self.server() else {
            return;
        };
        match enc {
            Ok(e) => {
                server.send_event(&e.payload, e.sticky_key.as_deref());
                gst::trace!(CAT, imp = self, "event sent to consumers: {event:?}");
            }
            Err(why) => gst::element_imp_warning!(
                self,
                gst::StreamError::Encode,
                ("Not sent to consumers: {}", why)
            ),
        }
    }
}

/// Passes consumer `id`'s upstream event (within the rate `upstream-event-rate` allows) to
/// the producer's pipeline, through the sink pad. Called from the server's threads.
pub(super) fn pass_upstream(obj: &super::GpuShmSink, id: u32, payload: &str) {
    match crate::events::decode_upstream(payload) {
        Ok(e) => {
            gst::debug!(CAT, obj = obj, "client {id}'s upstream event: {e:?}");
            let pad = obj.static_pad("sink").expect("the sink pad");
            if !pad.push_event(e) {
                gst::debug!(CAT, obj = obj, "upstream took no client {id}'s event");
            }
        }
        Err(why) => gst::warning!(CAT, obj = obj, "client {id}: {why}: left out"),
    }
}
