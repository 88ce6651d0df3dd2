// SPDX-License-Identifier: MPL-2.0
//! A small description of raw video frames, for apps without GStreamer: the formats, plane
//! geometry and caps strings that gpushmsink and gpushmsrc use, and the one check of a
//! received frame's planes against its format.
//!
//! ```
//! use gpushm::format::{FrameLayout, VideoFormat};
//! let l = FrameLayout::new(VideoFormat::I420, 64, 48).unwrap();
//! assert_eq!(l.size, 64 * 48 * 3 / 2);
//! assert_eq!(l.planes[1].offset, 64 * 48);
//! assert_eq!(l.caps(30, 1), "video/x-raw, format=(string)I420, width=(int)64, height=(int)48, framerate=(fraction)30/1");
//! ```

use crate::producer::FrameMeta;

/// Formats this crate can lay out by itself. (Consumers built on GStreamer accept every format
/// GStreamer knows; these are the ones an app can produce or check here.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoFormat {
    /// 8-bit luma only.
    Gray8,
    /// Planar 4:2:0: Y, then U, then V.
    I420,
    /// Y, then interleaved UV at half resolution.
    Nv12,
    /// Packed 8-bit RGBA.
    Rgba,
}

impl VideoFormat {
    /// The GstVideoFormat value (a stable ABI number) stored in each slot descriptor.
    pub fn gst_value(self) -> u32 {
        match self {
            VideoFormat::I420 => 2,
            VideoFormat::Rgba => 11,
            VideoFormat::Nv12 => 23,
            VideoFormat::Gray8 => 25,
        }
    }

    pub fn from_gst_value(v: u32) -> Option<Self> {
        [Self::Gray8, Self::I420, Self::Nv12, Self::Rgba]
            .into_iter()
            .find(|f| f.gst_value() == v)
    }

    /// The name in caps (`format=(string)NAME`).
    pub fn name(self) -> &'static str {
        match self {
            VideoFormat::Gray8 => "GRAY8",
            VideoFormat::I420 => "I420",
            VideoFormat::Nv12 => "NV12",
            VideoFormat::Rgba => "RGBA",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Gray8, Self::I420, Self::Nv12, Self::Rgba]
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name))
    }
}

/// One plane: where it starts, its stride, and how many bytes of how many rows are visible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plane {
    pub offset: u64,
    pub stride: u32,
    pub rows: u32,
    pub row_bytes: u32,
}

/// The layout GStreamer uses by default for a frame (strides rounded up to 4 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameLayout {
    pub format: VideoFormat,
    pub width: u32,
    pub height: u32,
    pub planes: Vec<Plane>,
    /// Bytes of the whole frame.
    pub size: u64,
}

fn round4(v: u32) -> u32 {
    v.div_ceil(4) * 4
}

impl FrameLayout {
    /// `None` for a zero or absurd size.
    pub fn new(format: VideoFormat, width: u32, height: u32) -> Option<Self> {
        if width == 0 || height == 0 || width > 1 << 15 || height > 1 << 15 {
            return None;
        }
        let (cw, ch) = (width.div_ceil(2), height.div_ceil(2));
        // (stride, rows, row bytes) of each plane.
        let dims: Vec<(u32, u32, u32)> = match format {
            VideoFormat::Gray8 => vec![(round4(width), height, width)],
            VideoFormat::Rgba => vec![(width * 4, height, width * 4)],
            VideoFormat::I420 => vec![
                (round4(width), height, width),
                (round4(cw), ch, cw),
                (round4(cw), ch, cw),
            ],
            VideoFormat::Nv12 => vec![(round4(width), height, width), (round4(cw * 2), ch, cw * 2)],
        };
        let mut planes = Vec::new();
        let mut offset = 0u64;
        for (stride, rows, row_bytes) in dims {
            planes.push(Plane {
                offset,
                stride,
                rows,
                row_bytes,
            });
            // GStreamer pads 4:2:0 luma to an even row count before the chroma planes.
            let padded = if format == VideoFormat::Gray8 || format == VideoFormat::Rgba {
                rows
            } else if planes.len() == 1 {
                height.div_ceil(2) * 2
            } else {
                rows
            };
            offset += stride as u64 * padded as u64;
        }
        Some(Self {
            format,
            width,
            height,
            planes,
            size: offset,
        })
    }

    /// The caps string gpushmsrc outputs for these frames at `fps_n/fps_d`.
    pub fn caps(&self, fps_n: u32, fps_d: u32) -> String {
        format!(
            "video/x-raw, format=(string){}, width=(int){}, height=(int){}, framerate=(fraction){fps_n}/{fps_d}",
            self.format.name(),
            self.width,
            self.height
        )
    }

    /// Fills the geometry fields of `meta` (format, size, planes).
    pub fn describe(&self, meta: &mut FrameMeta) {
        meta.video_format = self.format.gst_value();
        meta.width = self.width;
        meta.height = self.height;
        meta.payload_size = self.size;
        meta.n_planes = self.planes.len() as u32;
        for (i, p) in self.planes.iter().enumerate() {
            meta.plane_offset[i] = p.offset;
            meta.plane_stride[i] = p.stride;
        }
    }

    /// The layout a received frame describes, checked: a format this crate knows, and every
    /// plane inside the payload with a stride at least one row wide. A frame that fails is
    /// refused whole (a peer's mistake or attack never becomes an out-of-bounds read).
    pub fn of_frame(meta: &FrameMeta) -> Result<Self, String> {
        let format = VideoFormat::from_gst_value(meta.video_format).ok_or_else(|| {
            format!(
                "video format {} is not one this crate lays out",
                meta.video_format
            )
        })?;
        let expected = Self::new(format, meta.width, meta.height)
            .ok_or_else(|| format!("frame size {}x{} is out of range", meta.width, meta.height))?;
        if meta.n_planes as usize != expected.planes.len() {
            return Err(format!(
                "{} frames have {} planes, this one says {}",
                format.name(),
                expected.planes.len(),
                meta.n_planes
            ));
        }
        let mut planes = expected.planes.clone();
        for (i, p) in planes.iter_mut().enumerate() {
            p.offset = meta.plane_offset[i];
            p.stride = meta.plane_stride[i];
            if p.stride < p.row_bytes {
                return Err(format!(
                    "plane {i}: stride {} is narrower than its {} visible bytes a row",
                    p.stride, p.row_bytes
                ));
            }
            let end = (p.stride as u64)
                .checked_mul(p.rows.saturating_sub(1) as u64)
                .and_then(|v| v.checked_add(p.row_bytes as u64))
                .and_then(|v| v.checked_add(p.offset));
            if end.is_none_or(|e| e > meta.payload_size) {
                return Err(format!(
                    "plane {i} (offset {}, stride {}, {} rows) overruns the frame's {} bytes",
                    p.offset, p.stride, p.rows, meta.payload_size
                ));
            }
        }
        Ok(Self {
            planes,
            size: meta.payload_size,
            ..expected
        })
    }
}

/// The test pattern gpushm's examples and tests use: every byte of row `row` of plane `plane`
/// of frame `frame` has this value, so a consumer that knows the frame number can check every
/// byte it received.
pub fn pattern_value(frame: u64, plane: usize, row: usize) -> u8 {
    (frame
        .wrapping_mul(7)
        .wrapping_add(plane as u64 * 31)
        .wrapping_add(row as u64 * 3)
        & 0xff) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_gstreamer_defaults() {
        // Values from gst_video_info_set_format().
        let l = FrameLayout::new(VideoFormat::I420, 320, 240).unwrap();
        assert_eq!(
            l.planes
                .iter()
                .map(|p| (p.offset, p.stride))
                .collect::<Vec<_>>(),
            vec![(0, 320), (76800, 160), (96000, 160)]
        );
        assert_eq!(l.size, 115200);
        let l = FrameLayout::new(VideoFormat::Nv12, 1920, 1080).unwrap();
        assert_eq!(l.planes[1].offset, 1920 * 1080);
        assert_eq!(l.size, 1920 * 1080 * 3 / 2);
        let l = FrameLayout::new(VideoFormat::Gray8, 6, 3).unwrap();
        assert_eq!((l.planes[0].stride, l.size), (8, 24));
    }

    #[test]
    fn received_geometry_is_checked() {
        let l = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
        let mut m = FrameMeta::default();
        l.describe(&mut m);
        assert!(FrameLayout::of_frame(&m).is_ok());
        m.plane_stride[0] = 1;
        assert!(FrameLayout::of_frame(&m).unwrap_err().contains("narrower"));
        m.plane_stride[0] = 64;
        m.plane_offset[0] = 64;
        assert!(FrameLayout::of_frame(&m).unwrap_err().contains("overruns"));
        m.plane_offset[0] = 0;
        m.video_format = 9999;
        assert!(FrameLayout::of_frame(&m).is_err());
    }
}
