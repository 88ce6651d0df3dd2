// SPDX-License-Identifier: MPL-2.0
//! What a stream is from its caps: raw video with a layout or opaque buffers, in which memory;
//! the caps the sink accepts and answers queries with; the caps and slot size of the ring made
//! for them.

use super::imp::GpuShmSink;
use crate::cuda::gstcuda::CUDA_MEMORY;
use crate::cudameta::RingPlacement;
use gpushm::ring::layout::{MAX_PLANES, MAX_SLOT_SIZE};

/// Caps travel in one control message.
const MAX_CAPS_LEN: usize = gpushm::wire::MAX_PAYLOAD as usize - 64;

impl GpuShmSink {
    /// Whether raw video in CUDA memory is taken: into a device ring, with ring=device, or
    /// with ring=auto on a discrete GPU (on Jetson the host ring is the GPU's memory).
    pub(super) fn takes_cuda_memory(&self) -> bool {
        let (ring, id) = {
            let s = self.settings();
            (s.ring, s.cuda_device)
        };
        match ring {
            RingPlacement::Host => false,
            RingPlacement::Device => true,
            RingPlacement::Auto => crate::cuda::device(id).is_ok_and(|d| !d.integrated),
        }
    }
}

/// How the ring carries `caps`: raw video in system memory gets frame-sized slots and its
/// layout (`Some`); anything else (encoded video, audio, RTP, data) travels as opaque buffers
/// of any size (`None`). Buffers in device memory (NVMM, DMABuf, GL) cannot be shared by
/// mapping them: an error that says what to do.
pub(super) fn stream_kind(
    caps: &gst::CapsRef,
    cuda: bool,
) -> Result<Option<gst_video::VideoInfo>, String> {
    if caps.is_any() {
        // A stream without caps (fakesrc, appsrc without caps): bytes, as shmsink takes them.
        return Ok(None);
    }
    let (Some(st), Some(features)) = (caps.structure(0), caps.features(0)) else {
        return Err(format!("Caps {caps} describe no stream"));
    };
    if cuda_memory(features) && !cuda {
        return Err(format!(
            "gpushmsink ring=host shares buffers in system memory; caps with {CUDA_MEMORY} are GPU memory: use ring=device (or auto) on a discrete GPU, or download first (cudadownload)"
        ));
    }
    if cuda_memory(features) && st.name() != "video/x-raw" {
        return Err(format!(
            "{CUDA_MEMORY} is taken for raw video only, not {}",
            st.name()
        ));
    }
    if !system_memory(features) && !cuda_memory(features) {
        if let Some(f) = features.iter().find(|f| f.starts_with("memory:")) {
            return Err(format!(
                "gpushmsink shares buffers in system memory; caps with {f} are device memory: convert or download first (nvvidconv on Jetson, cudadownload, gldownload)"
            ));
        }
    }
    if st.name() != "video/x-raw" {
        return Ok(None);
    }
    match gst_video::VideoInfo::from_caps(caps) {
        Ok(info) if info.n_planes() as usize > MAX_PLANES => Err(format!(
            "{} planes are more than {}",
            info.n_planes(),
            MAX_PLANES
        )),
        Ok(info) => Ok(Some(info)),
        // Raw video GstVideo does not know: its bytes travel as they are.
        Err(_) => Ok(None),
    }
}

/// Whether caps `features` are CUDA device memory (`memory:CUDAMemory`, nothing else that is
/// memory).
pub(super) fn cuda_memory(features: &gst::CapsFeaturesRef) -> bool {
    !features.is_any()
        && features.contains(CUDA_MEMORY)
        && features.iter().filter(|f| f.starts_with("memory:")).count() == 1
}

/// Whether caps `features` are memory gpushmsink takes: system memory (no memory feature,
/// or memory:SystemMemory), whatever else they name (meta features).
pub(super) fn system_memory(features: &gst::CapsFeaturesRef) -> bool {
    features.is_any()
        || !features.iter().any(|f| {
            f.starts_with("memory:")
                && f.as_str() != gst::CAPS_FEATURE_MEMORY_SYSTEM_MEMORY.as_str()
        })
}

/// What gpushmsink answers a caps query with `filter`: any media type, in system memory only.
/// Caps cannot say "anything but device memory" on their own, so the answer is the filter
/// without its device-memory structures (`ANY` features become system memory): an element
/// before the sink that can give either (cudadownload, gldownload, nvvidconv) then picks
/// system memory without a capsfilter, and no query offers what `set_caps` would refuse.
/// With `cuda` (a device ring takes them), raw video in CUDA memory is kept too.
pub(super) fn acceptable_caps(filter: Option<&gst::Caps>, cuda: bool) -> gst::Caps {
    let Some(filter) = filter else {
        return gst::Caps::new_any();
    };
    if filter.is_any() {
        return filter.clone();
    }
    let mut out = gst::Caps::new_empty();
    {
        let out = out.get_mut().expect("new caps");
        for (st, features) in filter.iter_with_features() {
            if features.is_any() {
                out.append_structure_full(st.to_owned(), None);
            } else if system_memory(features)
                || (cuda && cuda_memory(features) && st.name() == "video/x-raw")
            {
                out.append_structure_full(st.to_owned(), Some(features.to_owned()));
            }
        }
    }
    out
}

/// The caps the ring announces to consumers for `caps`, as text; an error when they are too
/// long for the control message.
pub(super) fn announced_caps(caps: &gst::Caps) -> Result<String, String> {
    // Consumers get the frames from the ring, whatever memory upstream's were in: caps in
    // CUDA memory are announced as plain video/x-raw (the ring says where the pixels are).
    let caps_str = if caps.features(0).is_some_and(cuda_memory) {
        let mut plain = caps.clone();
        plain.make_mut().set_features(0, None);
        plain.to_string()
    } else {
        caps.to_string()
    };
    if caps_str.len() > MAX_CAPS_LEN {
        return Err(format!(
            "The caps are {} bytes long (their stream headers), more than the {} bytes consumers accept",
            caps_str.len(),
            MAX_CAPS_LEN
        ));
    }
    Ok(caps_str)
}

/// The slot size of a ring for raw video of `info` (one frame) or, for other caps (`None`),
/// for buffers of `min_slot` bytes with slots of `max_buffer` (max-buffer-size) at least.
pub(super) fn slot_size_for(
    info: Option<&gst_video::VideoInfo>,
    min_slot: u64,
    max_buffer: u64,
) -> Result<u64, String> {
    Ok(match info {
        Some(info) => info.size() as u64,
        None if min_slot <= max_buffer => max_buffer,
        // Room for bursts up to twice this one: consumers keep only the two newest rings,
        // so growing in small steps could drop a ring a slow consumer still reads.
        None => match min_slot.saturating_mul(2).checked_next_power_of_two() {
            Some(n) if n <= MAX_SLOT_SIZE => n,
            _ if min_slot <= MAX_SLOT_SIZE => MAX_SLOT_SIZE,
            _ => {
                return Err(format!(
                    "A buffer of {min_slot} bytes is larger than the largest slot ({} bytes)",
                    MAX_SLOT_SIZE
                ))
            }
        },
    })
}
