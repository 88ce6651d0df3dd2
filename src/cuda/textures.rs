// SPDX-License-Identifier: MPL-2.0
//! What GStreamer's CUDA elements need to read a frame in place: they read planes as CUDA
//! textures (cudaconvert, cudascale, the encoders' converters), whose addresses and strides
//! must be aligned. gpushmsink lays device rings out so ([`device_ring_layout`]); gpushmsrc
//! hands a device-ring frame to them without a copy only where its layout allows
//! ([`wrappable`]), since a producer of the core API chooses its own.

use gpushm::format::FrameGeometry;

/// The stride alignment of frames in a device ring, as in GStreamer's own CUDA memory: a
/// multiple of every NVIDIA GPU's texture alignment (512 bytes) and pitch alignment (32).
pub const DEVICE_RING_STRIDE_ALIGN: u32 = 512;

/// The layout of raw video frames in a device ring: every plane's stride a multiple of
/// [`DEVICE_RING_STRIDE_ALIGN`], so that each plane starts at a multiple of it too. A frame
/// takes a little more memory (a 1920-pixel NV12 row: 2048 bytes). `info` as it is where
/// GStreamer cannot align it.
pub fn device_ring_layout(info: &gst_video::VideoInfo) -> gst_video::VideoInfo {
    let mut aligned = info.clone();
    let mut a = gst_video::VideoAlignment::new(
        0,
        0,
        0,
        0,
        &[DEVICE_RING_STRIDE_ALIGN - 1; gst_video::VIDEO_MAX_PLANES],
    );
    match aligned.align(&mut a) {
        Ok(()) => aligned,
        Err(_) => info.clone(),
    }
}

/// Whether a frame of `geometry` at device address `src` can be read in place as textures on
/// `dev`: each plane's address a multiple of its texture alignment and each stride of its
/// pitch alignment, and the frame whole rows of the first stride (a wrapped GstCudaMemory
/// copies `size / stride` rows when the CPU maps it). Why not, otherwise.
pub fn wrappable(
    geometry: &FrameGeometry,
    src: u64,
    dev: &gpushm::cuda::Device,
) -> Result<(), String> {
    aligned_for_textures(
        geometry,
        src,
        dev.texture_alignment,
        dev.texture_pitch_alignment,
    )
}

fn aligned_for_textures(
    geometry: &FrameGeometry,
    src: u64,
    align: u64,
    pitch_align: u64,
) -> Result<(), String> {
    let stride0 = geometry.planes.first().map_or(0, |p| p.stride as u64);
    if stride0 == 0 || !geometry.size.is_multiple_of(stride0) {
        return Err(format!(
            "the frame's {} bytes are not whole rows of {stride0}",
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

    /// The geometry gpushmsink publishes for frames of `info` (as a consumer reads it).
    fn geometry(info: &gst_video::VideoInfo) -> FrameGeometry {
        let mut meta = crate::gpushmsink::frame_template_for_tests(info);
        meta.payload_size = info.size() as _;
        let caps = info.to_caps().unwrap().to_string();
        FrameGeometry::of_frame(&meta, &caps).unwrap()
    }

    #[test]
    fn device_ring_frames_are_laid_out_for_textures_and_others_are_refused() {
        gst::init().unwrap();
        // A slot's device address (slots are page-aligned).
        let slot = 0x7f12_3456_0000u64;
        for (format, w, h) in [
            (gst_video::VideoFormat::Nv12, 200, 120),
            (gst_video::VideoFormat::Nv12, 1920, 1080),
            (gst_video::VideoFormat::I420, 1280, 720),
            (gst_video::VideoFormat::I420, 202, 100),
            (gst_video::VideoFormat::Bgrx, 100, 50),
            (gst_video::VideoFormat::P01010le, 3840, 2160),
        ] {
            let info = gst_video::VideoInfo::builder(format, w, h).build().unwrap();
            let laid_out = device_ring_layout(&info);
            let g = geometry(&laid_out);
            assert_eq!(
                aligned_for_textures(&g, slot, 512, 32),
                Ok(()),
                "{format:?} {w}x{h}: {g:?}"
            );
            assert!(laid_out.size() >= info.size());
            for p in 0..info.n_planes() as usize {
                assert_eq!(
                    laid_out.stride()[p] % 512,
                    0,
                    "{format:?} {w}x{h} plane {p}"
                );
            }
        }
        // GStreamer's default layout of 200x120 NV12 (stride 200) is not; nor a slot address
        // off the texture alignment.
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, 200, 120)
            .build()
            .unwrap();
        let err = aligned_for_textures(&geometry(&info), slot, 512, 32).unwrap_err();
        assert!(err.contains("plane 0 (offset 0, stride 200)"), "{err}");
        let g = geometry(&device_ring_layout(&info));
        assert!(aligned_for_textures(&g, slot + 256, 512, 32).is_err());
    }
}
