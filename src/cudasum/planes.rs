// SPDX-License-Identifier: MPL-2.0
//! Which bytes of a frame cudasum reads, and the CPU reference the GPU results must equal.

/// One plane: `rows` rows of `row_bytes` visible bytes, `stride` apart from `offset`; byte
/// `col` of a row belongs to channel `col % channels`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plane {
    pub offset: usize,
    pub stride: usize,
    pub row_bytes: usize,
    pub rows: usize,
    pub channels: usize,
}

impl Plane {
    /// One past the last byte read.
    pub fn end(&self) -> usize {
        self.offset + self.stride * (self.rows - 1) + self.row_bytes
    }
}

/// The formats cudasum handles: 8 bits per component, at most 4 bytes per pixel.
pub const FORMATS: &[gst_video::VideoFormat] = {
    use gst_video::VideoFormat::*;
    &[
        Gray8, Nv12, Nv21, I420, Yv12, Y42b, Y444, Rgba, Bgra, Argb, Abgr, Rgbx, Bgrx, Xrgb, Xbgr,
        Rgb, Bgr, Yuy2, Uyvy,
    ]
};

/// The planes of a frame with `info`, laid out as `offsets`/`strides` (a VideoMeta) or by
/// `info` itself, checked to lie within `size` bytes.
pub fn planes(
    info: &gst_video::VideoInfo,
    layout: Option<(&[usize], &[i32])>,
    size: usize,
) -> Result<Vec<Plane>, String> {
    let finfo = info.format_info();
    if !FORMATS.contains(&info.format()) {
        return Err(format!("format {} is not supported", info.format()));
    }
    let (offsets, strides) = layout.unwrap_or((info.offset(), info.stride()));
    let mut out = Vec::new();
    for p in 0..info.n_planes() as usize {
        let comps: Vec<u8> = (0..finfo.n_components() as u8)
            .filter(|&c| finfo.plane()[c as usize] as usize == p)
            .collect();
        let first = *comps
            .first()
            .ok_or_else(|| format!("plane {p} has no component"))?;
        let channels = finfo.pixel_stride()[first as usize] as usize;
        let rows = crate::geometry::plane_rows(info, p);
        // Packed 4:2:2 (one 4-byte group per 2 pixels) comes out right too: a chroma sample
        // spans 4 bytes at half the width.
        let row_bytes = crate::geometry::plane_row_bytes(info, p);
        let stride = *strides.get(p).ok_or("missing stride")?;
        if stride <= 0 || (stride as usize) < row_bytes {
            return Err(format!(
                "plane {p}: stride {stride} is smaller than a row of {row_bytes} bytes"
            ));
        }
        let plane = Plane {
            offset: *offsets.get(p).ok_or("missing offset")?,
            stride: stride as usize,
            row_bytes,
            rows,
            channels: if matches!(
                info.format(),
                gst_video::VideoFormat::Yuy2 | gst_video::VideoFormat::Uyvy
            ) {
                4
            } else {
                channels
            },
        };
        if rows == 0 || row_bytes == 0 || plane.end() > size {
            return Err(format!(
                "plane {p} ({plane:?}) does not fit the buffer's {size} bytes"
            ));
        }
        out.push(plane);
    }
    Ok(out)
}

/// The planes of `buffer` (with `info`), laid out as its GstVideoMeta says, or by `info`.
pub fn buffer_planes(
    info: &gst_video::VideoInfo,
    buffer: &gst::BufferRef,
) -> Result<Vec<Plane>, String> {
    let layout = buffer
        .meta::<gst_video::VideoMeta>()
        .map(|m| (m.offset().to_vec(), m.stride().to_vec()));
    planes(
        info,
        layout.as_ref().map(|(o, s)| (&o[..], &s[..])),
        buffer.size(),
    )
}

/// Per-plane, per-channel byte sums, computed on the CPU.
pub fn cpu_sums(data: &[u8], planes: &[Plane]) -> Vec<[u64; 4]> {
    planes
        .iter()
        .map(|p| {
            let mut acc = [0u64; 4];
            for r in 0..p.rows {
                let row = &data[p.offset + r * p.stride..p.offset + r * p.stride + p.row_bytes];
                if p.channels == 1 {
                    acc[0] += row.iter().map(|&b| b as u64).sum::<u64>();
                } else {
                    for (i, &b) in row.iter().enumerate() {
                        acc[i % p.channels] += b as u64;
                    }
                }
            }
            acc
        })
        .collect()
}

/// Sum of all bytes of each plane.
pub fn plane_totals(sums: &[[u64; 4]]) -> Vec<u64> {
    sums.iter().map(|s| s.iter().sum()).collect()
}

/// Sum of each colour component (in the format's component order, e.g. Y, U, V or R, G, B, A).
pub fn component_sums(info: &gst_video::VideoInfo, sums: &[[u64; 4]]) -> Vec<u64> {
    let finfo = info.format_info();
    (0..finfo.n_components() as usize)
        .map(|c| {
            let p = finfo.plane()[c] as usize;
            let ch = match info.format() {
                // Y0 U Y1 V / U Y0 V Y1: luma takes two channels.
                gst_video::VideoFormat::Yuy2 | gst_video::VideoFormat::Uyvy => {
                    let first = finfo.poffset()[c] as usize % 4;
                    if c == 0 {
                        return sums[p][first] + sums[p][first + 2];
                    }
                    first
                }
                _ => finfo.poffset()[c] as usize % finfo.pixel_stride()[c].max(1) as usize,
            };
            sums.get(p).map_or(0, |s| s[ch])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_frame_sums_to_136() {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, 4, 4)
            .build()
            .unwrap();
        let data: Vec<u8> = (1..=16).collect();
        let p = planes(&info, None, data.len()).unwrap();
        assert_eq!(plane_totals(&cpu_sums(&data, &p)), vec![136]);
    }

    #[test]
    fn nv12_components_and_padding() {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, 6, 4)
            .build()
            .unwrap();
        let mut data = vec![0u8; info.size()];
        let p = planes(&info, None, data.len()).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[1].rows, p[1].row_bytes, p[1].channels), (2, 6, 2));
        for r in 0..4 {
            for c in 0..6 {
                data[p[0].offset + r * p[0].stride + c] = 1;
            }
        }
        for r in 0..2 {
            for c in 0..3 {
                data[p[1].offset + r * p[1].stride + 2 * c] = 2; // U
                data[p[1].offset + r * p[1].stride + 2 * c + 1] = 3; // V
            }
        }
        // Padding bytes (stride 8 > 6) are not counted.
        data[p[0].offset + 6] = 200;
        let s = cpu_sums(&data, &p);
        assert_eq!(component_sums(&info, &s), vec![24, 12, 18]);
        assert_eq!(plane_totals(&s), vec![24, 30]);
    }

    #[test]
    fn bad_layouts_are_refused() {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, 16, 16)
            .build()
            .unwrap();
        assert!(planes(&info, None, 255).is_err(), "buffer too small");
        assert!(
            planes(&info, Some((&[0], &[8])), 4096).is_err(),
            "stride smaller than a row"
        );
        assert!(
            planes(&info, Some((&[4000], &[16])), 4096).is_err(),
            "offset past the end"
        );
        let v210 = gst_video::VideoInfo::builder(gst_video::VideoFormat::V210, 48, 2)
            .build()
            .unwrap();
        assert!(
            planes(&v210, None, v210.size()).is_err(),
            "10-bit formats are not handled"
        );
    }
}
