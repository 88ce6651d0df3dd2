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

use crate::ring::producer_end::FrameMeta;

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

/// What one pixel of a plane holds: `per_pixel` components of `bytes` bytes each (GRAY16_LE:
/// 1 of 2, little-endian; BGRx: 4 of 1; YUY2: 2 of 1, a luma and a chroma sample; the UV plane
/// of NV12: 2 of 1). `bytes` 0: the components are not whole bytes (v210, UYVP, 10-bit formats
/// packed in 32-bit words): such a plane can only be read as bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Components {
    pub bytes: u8,
    pub per_pixel: u8,
    pub big_endian: bool,
}

impl Components {
    pub const fn new(bytes: u8, per_pixel: u8) -> Self {
        Self {
            bytes,
            per_pixel,
            big_endian: false,
        }
    }

    /// As stored in shared memory (`SlotDesc::plane_components`): bits 0–7 bytes, 8–15
    /// components a pixel, bit 16 big-endian.
    pub fn pack(self) -> u32 {
        self.bytes as u32 | (self.per_pixel as u32) << 8 | (self.big_endian as u32) << 16
    }

    pub fn unpack(v: u32) -> Self {
        Self {
            bytes: v as u8,
            per_pixel: (v >> 8) as u8,
            big_endian: v & 1 << 16 != 0,
        }
    }

    /// Bytes of one pixel (0 when the components are not whole bytes).
    pub fn pixel_bytes(self) -> u32 {
        self.bytes as u32 * self.per_pixel as u32
    }
}

/// One plane: where it starts, its stride, how many bytes of how many rows are visible, and
/// what a pixel holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plane {
    pub offset: u64,
    pub stride: u32,
    pub rows: u32,
    pub row_bytes: u32,
    pub components: Components,
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
        let one = Components::new(1, 1);
        // (stride, rows, row bytes, components) of each plane.
        let dims: Vec<(u32, u32, u32, Components)> = match format {
            VideoFormat::Gray8 => vec![(round4(width), height, width, one)],
            VideoFormat::Rgba => vec![(width * 4, height, width * 4, Components::new(1, 4))],
            VideoFormat::I420 => vec![
                (round4(width), height, width, one),
                (round4(cw), ch, cw, one),
                (round4(cw), ch, cw, one),
            ],
            VideoFormat::Nv12 => vec![
                (round4(width), height, width, one),
                (round4(cw * 2), ch, cw * 2, Components::new(1, 2)),
            ],
        };
        let mut planes = Vec::new();
        let mut offset = 0u64;
        for (stride, rows, row_bytes, components) in dims {
            planes.push(Plane {
                offset,
                stride,
                rows,
                row_bytes,
                components,
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
            meta.plane_rows[i] = p.rows;
            meta.plane_row_bytes[i] = p.row_bytes;
            meta.plane_components[i] = p.components.pack();
        }
    }
}

/// A received frame's layout, as its producer published it with the frame: any raw video
/// format GStreamer knows, with no format table on this side. Checked: every plane lies inside
/// the frame's bytes (a peer's mistake or attack never becomes an out-of-bounds read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameGeometry {
    /// The format's name in the caps (`BGRx`, `NV12`, `GRAY16_LE`).
    pub format: String,
    pub width: u32,
    pub height: u32,
    pub planes: Vec<Plane>,
    /// Bytes of the whole frame.
    pub size: u64,
}

impl FrameGeometry {
    /// The geometry `meta` describes, for a frame with `caps`. An error says why a frame
    /// cannot be viewed plane by plane (not raw video, a tiled format, a layout that does not
    /// fit); its bytes can still be read whole.
    pub fn of_frame(meta: &FrameMeta, caps: &str) -> Result<Self, String> {
        let format = caps_field(caps, "format")
            .filter(|_| caps.starts_with("video/x-raw"))
            .ok_or_else(|| {
                let media = caps.split([',', ';']).next().unwrap_or("");
                format!("the stream is {media}, not raw video")
            })?;
        let n = meta.n_planes as usize;
        if n == 0 || n > crate::ring::layout::MAX_PLANES {
            return Err(format!("{format} frames come with {n} planes"));
        }
        if meta.width == 0 || meta.height == 0 {
            return Err(format!("frame size {}x{}", meta.width, meta.height));
        }
        let mut planes = Vec::with_capacity(n);
        for i in 0..n {
            let p = Plane {
                offset: meta.plane_offset[i],
                stride: meta.plane_stride[i],
                rows: meta.plane_rows[i],
                row_bytes: meta.plane_row_bytes[i],
                components: Components::unpack(meta.plane_components[i]),
            };
            if p.rows == 0 || p.row_bytes == 0 {
                return Err(format!(
                    "the producer did not publish the rows of {format}'s plane {i} (a tiled format, or a producer older than layout version 4)"
                ));
            }
            if p.stride < p.row_bytes {
                return Err(format!(
                    "plane {i}: stride {} is narrower than its {} visible bytes a row",
                    p.stride, p.row_bytes
                ));
            }
            let end = (p.stride as u64)
                .checked_mul(p.rows as u64 - 1)
                .and_then(|v| v.checked_add(p.row_bytes as u64))
                .and_then(|v| v.checked_add(p.offset));
            if end.is_none_or(|e| e > meta.payload_size) {
                return Err(format!(
                    "plane {i} (offset {}, stride {}, {} rows of {} bytes) overruns the frame's {} bytes",
                    p.offset, p.stride, p.rows, p.row_bytes, meta.payload_size
                ));
            }
            let c = p.components;
            if c.bytes != 0
                && (![1, 2, 4, 8].contains(&c.bytes)
                    || c.per_pixel == 0
                    || !p.row_bytes.is_multiple_of(c.pixel_bytes()))
            {
                return Err(format!(
                    "plane {i}: {} components of {} bytes a pixel do not divide its {} bytes a row",
                    c.per_pixel, c.bytes, p.row_bytes
                ));
            }
            planes.push(p);
        }
        // The first plane holds every line of the picture (luma, or the packed pixels), at
        // one bit a pixel at least: a size beyond it is a producer's mistake or a lie, which
        // a consumer looping over width and height would read past the frame for.
        let first = planes[0];
        if first.rows < meta.height || first.row_bytes as u64 * 8 < meta.width as u64 {
            return Err(format!(
                "frame size {}x{} does not fit its first plane ({} rows of {} bytes)",
                meta.width, meta.height, first.rows, first.row_bytes
            ));
        }
        Ok(Self {
            format: format.to_string(),
            width: meta.width,
            height: meta.height,
            planes,
            size: meta.payload_size,
        })
    }

    /// For a frame of one plane whose pixels are whole components (BGRx, RGB, GRAY16_LE,
    /// YUY2, RGBA): that plane, to view as height x width x components. `None` for planar
    /// formats (view them plane by plane) and packings that are not whole bytes. (A row may
    /// hold more than `width` pixels' bytes: odd-width YUY2 ends with a whole macropixel.)
    pub fn packed(&self) -> Option<Plane> {
        match self.planes.as_slice() {
            [p] if p.components.bytes != 0 && p.rows == self.height => {
                (p.row_bytes / p.components.pixel_bytes() >= self.width).then_some(*p)
            }
            _ => None,
        }
    }
}

/// Whether `caps` (a caps string) describe raw video: the one place this is decided, for
/// every consumer policy and timestamp rule that treats raw video apart.
pub fn is_raw_video(caps: &str) -> bool {
    let name = caps.split([',', ';', '(']).next().unwrap_or("");
    name.trim() == "video/x-raw"
}

/// The value of `field` in the first structure of a caps string (`format=(string)BGRx` or
/// `format=BGRx`), unquoted.
pub fn caps_field<'a>(caps: &'a str, field: &str) -> Option<&'a str> {
    let first = caps.split(';').next()?;
    first.split(',').skip(1).find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        if k.trim() != field {
            return None;
        }
        let v = v.trim();
        let v = v
            .strip_prefix('(')
            .map_or(v, |r| r.split_once(')').map_or(r, |x| x.1));
        Some(v.trim().trim_matches('"'))
    })
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
        let caps = FrameLayout::new(VideoFormat::Gray8, 64, 48)
            .unwrap()
            .caps(30, 1);
        let l = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
        let mut m = FrameMeta::default();
        l.describe(&mut m);
        let g = FrameGeometry::of_frame(&m, &caps).unwrap();
        assert_eq!(
            (g.format.as_str(), g.planes.as_slice()),
            ("GRAY8", l.planes.as_slice())
        );
        assert_eq!(g.packed(), Some(l.planes[0]));
        m.plane_stride[0] = 1;
        assert!(FrameGeometry::of_frame(&m, &caps)
            .unwrap_err()
            .contains("narrower"));
        m.plane_stride[0] = 64;
        m.plane_offset[0] = 64;
        assert!(FrameGeometry::of_frame(&m, &caps)
            .unwrap_err()
            .contains("overruns"));
        m.plane_offset[0] = 0;
        m.plane_rows[0] = u32::MAX;
        assert!(FrameGeometry::of_frame(&m, &caps)
            .unwrap_err()
            .contains("overruns"));
        m.plane_rows[0] = 0;
        assert!(FrameGeometry::of_frame(&m, &caps)
            .unwrap_err()
            .contains("rows"));
        m.plane_rows[0] = 48;
        m.plane_components[0] = Components::new(2, 3).pack();
        assert!(FrameGeometry::of_frame(&m, &caps)
            .unwrap_err()
            .contains("divide"));
        m.plane_components[0] = Components::new(3, 1).pack();
        assert!(FrameGeometry::of_frame(&m, &caps).is_err());
        m.plane_components[0] = Components::new(1, 1).pack();
        m.n_planes = 5;
        assert!(FrameGeometry::of_frame(&m, &caps).is_err());
        m.n_planes = 1;
        // A size the first plane cannot hold (a C consumer looping over it read past the
        // frame): refused, whatever the planes say.
        m.height = 4800;
        assert!(FrameGeometry::of_frame(&m, &caps)
            .unwrap_err()
            .contains("does not fit"));
        m.height = 48;
        m.width = u32::MAX;
        assert!(FrameGeometry::of_frame(&m, &caps).is_err());
        m.width = 64;
        assert!(FrameGeometry::of_frame(&m, &caps).is_ok());
        assert!(
            FrameGeometry::of_frame(&m, "audio/x-raw, format=(string)S16LE")
                .unwrap_err()
                .contains("audio/x-raw")
        );
    }

    #[test]
    fn raw_video_is_told_apart() {
        assert!(is_raw_video("video/x-raw, format=(string)NV12"));
        assert!(is_raw_video(
            "video/x-raw(memory:SystemMemory), format=NV12"
        ));
        assert!(is_raw_video("video/x-raw"));
        assert!(!is_raw_video("video/x-raw-foo, a=1"));
        assert!(!is_raw_video("video/x-h264, stream-format=avc"));
        assert!(!is_raw_video("audio/x-raw, format=S16LE"));
    }

    #[test]
    fn caps_fields_are_found_with_or_without_types() {
        let c = "video/x-raw, format=(string)BGRx, width=(int)3, height=(int)2";
        assert_eq!(caps_field(c, "format"), Some("BGRx"));
        assert_eq!(caps_field(c, "width"), Some("3"));
        assert_eq!(
            caps_field("video/x-raw,format=NV12", "format"),
            Some("NV12")
        );
        assert_eq!(
            caps_field("video/x-raw, format=\"I420\"", "format"),
            Some("I420")
        );
        assert_eq!(caps_field("video/x-raw", "format"), None);
        assert_eq!(
            caps_field("video/x-h264, stream-format=avc", "format"),
            None
        );
    }

    #[test]
    fn components_pack_and_unpack() {
        for c in [
            Components::new(1, 4),
            Components::new(2, 1),
            Components {
                bytes: 2,
                per_pixel: 1,
                big_endian: true,
            },
            Components::default(),
        ] {
            assert_eq!(Components::unpack(c.pack()), c);
        }
    }
}
