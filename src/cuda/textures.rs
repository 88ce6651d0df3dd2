// SPDX-License-Identifier: MPL-2.0
//! Which device-ring frames gpushmsrc may hand to GStreamer's CUDA elements in place, as a
//! GstCudaMemory wrapping the ring's GPU memory ([`wrappable`]); the others are copied into
//! CUDA memory of GStreamer's own.
//!
//! Two things decide it:
//! - GStreamer's CUDA elements (cudaconvert, cudascale, the encoders' converters) read planes
//!   as CUDA textures, whose addresses and strides must be aligned;
//! - a wrapped GstCudaMemory describes its bytes by one pitch (its first plane's stride), one
//!   row width (its first plane's visible bytes) and `size / pitch` rows. GStreamer copies it
//!   that way: to the host when the CPU maps it, and into a new allocation of that row width
//!   (`gst_memory_copy`, or a writable map of the read-only memory). Only a frame whose first
//!   plane's rows have no padding (stride = visible bytes) and whose size is whole rows is
//!   then one contiguous block that those copies take exactly, whatever the other planes'
//!   strides; with padding they would skip bytes of other planes, or write past the copy.

use gpushm::format::FrameGeometry;

/// Whether a frame of `geometry` at device address `src` can go out wrapped on `dev`; why
/// not, otherwise.
pub fn wrappable(
    geometry: &FrameGeometry,
    src: u64,
    dev: &gpushm::cuda::Device,
) -> Result<(), String> {
    wrappable_with(
        geometry,
        src,
        dev.texture_alignment,
        dev.texture_pitch_alignment,
    )
}

/// [`wrappable`], for a GPU whose plane addresses must be multiples of `align` bytes and
/// strides of `pitch_align`.
fn wrappable_with(
    geometry: &FrameGeometry,
    src: u64,
    align: u64,
    pitch_align: u64,
) -> Result<(), String> {
    let Some(first) = geometry.planes.first() else {
        return Err("the frame has no planes".into());
    };
    let stride0 = first.stride as u64;
    if stride0 == 0 || stride0 != first.row_bytes as u64 {
        return Err(format!(
            "its rows are padded (stride {stride0} for {} visible bytes)",
            first.row_bytes
        ));
    }
    if !geometry.size.is_multiple_of(stride0) {
        return Err(format!(
            "its {} bytes are not whole rows of {stride0}",
            geometry.size
        ));
    }
    for (i, p) in geometry.planes.iter().enumerate() {
        let at = src + p.offset;
        if !at.is_multiple_of(align.max(1)) || !(p.stride as u64).is_multiple_of(pitch_align.max(1))
        {
            return Err(format!(
                "plane {i} (offset {}, stride {}) is not aligned for CUDA textures ({align} and {pitch_align} bytes)",
                p.offset, p.stride
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The geometry gpushmsink publishes for frames laid out as `info` (as a consumer reads
    /// it).
    fn geometry(info: &gst_video::VideoInfo) -> FrameGeometry {
        let mut meta = crate::gpushmsink::frame_template_for_tests(info);
        meta.payload_size = info.size() as _;
        let caps = info.to_caps().unwrap().to_string();
        FrameGeometry::of_frame(&meta, &caps).unwrap()
    }

    fn info(format: gst_video::VideoFormat, w: u32, h: u32) -> gst_video::VideoInfo {
        gst_video::VideoInfo::builder(format, w, h).build().unwrap()
    }

    #[test]
    fn common_frames_go_out_wrapped_and_padded_or_unaligned_ones_are_copied() {
        gst::init().unwrap();
        // A slot's device address (slots are page-aligned).
        let slot = 0x7f12_3456_0000u64;
        use gst_video::VideoFormat::*;
        // GStreamer's own layouts of the usual sizes: planes aligned, rows unpadded.
        for (format, w, h) in [
            (Nv12, 320, 240),
            (Nv12, 1920, 1080),
            (Nv12, 3840, 2160),
            (I420, 1280, 720),
            (Bgrx, 1920, 1080),
            (P01010le, 3840, 2160),
        ] {
            let g = geometry(&info(format, w, h));
            assert_eq!(
                wrappable_with(&g, slot, 512, 32),
                Ok(()),
                "{format:?} {w}x{h}"
            );
        }
        // A stride that is no multiple of the pitch alignment (200), a plane off the texture
        // alignment (I420 1080p's V plane at 2592000), a slot off it.
        let err = wrappable_with(&geometry(&info(Nv12, 200, 120)), slot, 512, 32).unwrap_err();
        assert!(err.contains("plane 0 (offset 0, stride 200)"), "{err}");
        let err = wrappable_with(&geometry(&info(I420, 1920, 1080)), slot, 512, 32).unwrap_err();
        assert!(err.contains("plane 2"), "{err}");
        assert!(wrappable_with(&geometry(&info(Nv12, 320, 240)), slot + 256, 512, 32).is_err());
        // Padded rows (a pool's 512-byte strides): GStreamer would copy them wrongly.
        let mut padded = info(Nv12, 1280, 720);
        let mut a = gst_video::VideoAlignment::new(0, 0, 0, 0, &[511; gst_video::VIDEO_MAX_PLANES]);
        padded.align(&mut a).unwrap();
        assert_eq!(padded.stride()[0], 1536);
        let err = wrappable_with(&geometry(&padded), slot, 512, 32).unwrap_err();
        assert!(err.contains("rows are padded"), "{err}");
    }
}
