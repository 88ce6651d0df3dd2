// SPDX-License-Identifier: MPL-2.0
//! The pad's caps: the producer's, set as its frames come (in CUDA memory where downstream
//! asks for it, see cuda.rs), and the error when downstream refuses them.

use std::str::FromStr;
use std::sync::Arc;

use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;

use super::imp::GpuShmSrc;
use super::CAT;

impl GpuShmSrc {
    /// Sets the caps for frames of `caps_str` on the pad: in CUDA memory when they come from a
    /// device ring on GPU `device` and downstream asks for CUDA memory, otherwise the
    /// producer's. Returns whether they are in CUDA memory.
    /// Called without the state lock held (downstream sees a caps event and may call back
    /// into us).
    pub(super) fn set_pad_caps(
        &self,
        caps_str: &Arc<str>,
        device: Option<i32>,
    ) -> Result<bool, gst::FlowError> {
        let caps = gst::Caps::from_str(caps_str).map_err(|_| {
            gst::element_imp_error!(
                self,
                gst::StreamError::Format,
                ("The producer sent unparsable caps {}", caps_str)
            );
            gst::FlowError::NotNegotiated
        })?;
        gst::info!(CAT, imp = self, "caps from the producer: {caps}");
        if caps.is_any() {
            // The producer's stream has no caps: its bytes go out without any, as shmsrc
            // pushes them (a capsfilter downstream gives them caps).
            return Ok(false);
        }
        let shared = self.shared();
        if let Some(d) = device.filter(|_| gpushm::format::is_raw_video(caps_str)) {
            if let Some((out, cuda_caps)) = self.cuda_output(&caps, caps_str, d) {
                let how = match &out.wrap {
                    Ok(()) => "wrapped in place, without a copy".to_owned(),
                    Err(why) => format!("copied on the GPU: {why}"),
                };
                if let Some(sh) = &shared {
                    sh.set_cuda_out(Some(out));
                }
                if self.obj().set_caps(&cuda_caps).is_ok() {
                    gst::info!(
                        CAT,
                        imp = self,
                        "device-ring frames go out in CUDA memory ({how}): {cuda_caps}"
                    );
                    return Ok(true);
                }
                gst::debug!(
                    CAT,
                    imp = self,
                    "downstream refused {cuda_caps}: system memory"
                );
            }
        }
        if let Some(sh) = &shared {
            sh.set_cuda_out(None);
        }
        // A refused caps event is only seen at the next push, as not-negotiated: ask first.
        if !self.obj().src_pad().peer_query_accept_caps(&caps) {
            self.refused(&caps);
            return Err(gst::FlowError::NotNegotiated);
        }
        self.obj().set_caps(&caps).map_err(|_| {
            self.refused(&caps);
            gst::FlowError::NotNegotiated
        })?;
        Ok(false)
    }

    /// Posts the error for downstream refusing the producer's `caps`, with a hint when they
    /// are not raw video.
    fn refused(&self, caps: &gst::Caps) {
        let name = caps.structure(0).map_or("", |s| s.name().as_str());
        if name.starts_with("video/x-raw") {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Downstream refused the producer's caps {}", caps)
            );
        } else {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Downstream refused the producer's caps {}", caps),
                ["The producer shares {} buffers, not raw video: elements that need raw video (cudasum, videoconvert, ...) need a parser and decoder before them", name]
            );
        }
    }
}
