// SPDX-License-Identifier: MPL-2.0
//! Plane geometry of GStreamer video formats, computed in one place for every element: how
//! many rows a plane has and how many bytes of each row are visible.

fn components_of_plane(info: &gst_video::VideoInfo, p: usize) -> impl Iterator<Item = u8> + '_ {
    let finfo = info.format_info();
    (0..finfo.n_components() as u8).filter(move |&c| finfo.plane()[c as usize] as usize == p)
}

/// Adds the GstVideoMeta of a frame laid out as `info` says (the caps' own offsets and
/// strides): a ring slot's layout, or a buffer made for the caps.
pub fn add_caps_layout_meta(
    b: &mut gst::BufferRef,
    info: &gst_video::VideoInfo,
) -> Result<(), gst::glib::BoolError> {
    gst_video::VideoMeta::add_full(
        b,
        gst_video::VideoFrameFlags::empty(),
        info.format(),
        info.width(),
        info.height(),
        info.offset(),
        info.stride(),
    )
    .map(|_| ())
}

/// Rows of plane `p`.
pub fn plane_rows(info: &gst_video::VideoInfo, p: usize) -> usize {
    components_of_plane(info, p)
        .map(|c| info.comp_height(c))
        .max()
        .unwrap_or(0) as usize
}

/// Visible bytes of one row of plane `p`.
pub fn plane_row_bytes(info: &gst_video::VideoInfo, p: usize) -> usize {
    let finfo = info.format_info();
    components_of_plane(info, p)
        .map(|c| info.comp_width(c) as usize * finfo.pixel_stride()[c as usize] as usize)
        .max()
        .unwrap_or(0)
}

/// What one pixel of plane `p` holds, published with every frame so that consumers view any
/// format without a table of their own (see `gpushm::format::Components`): the bytes of one
/// component, how many a pixel holds (padding like BGRx's x included), and the byte order.
/// Components of 10 or 12 bits count as the word each sits in (I420_10LE: 2 bytes), or the
/// whole pixel as one word when they share it (RGB10A2_LE: 4 bytes); formats with no fixed
/// pixel stride (v210, UYVP) get none: consumers read those as bytes.
pub fn plane_components(info: &gst_video::VideoInfo, p: usize) -> gpushm::format::Components {
    let finfo = info.format_info();
    let Some(c) = components_of_plane(info, p).next() else {
        return Default::default();
    };
    let ps = finfo.pixel_stride()[c as usize].max(0) as u32;
    let bits = finfo.bits();
    let (bytes, per_pixel) = if ps == 0 {
        (0, 0)
    } else if bits.is_multiple_of(8) {
        (bits / 8, ps.checked_div(bits / 8).unwrap_or(0))
    } else {
        // Components not of whole bytes, each in a word of its own (I420_10LE: 10 bits in 16),
        // or packed together in one word a pixel (RGB10A2_LE: one 32-bit word).
        let n = components_of_plane(info, p).count().max(1) as u32;
        let depth = finfo.depth()[c as usize];
        match ps / n {
            w @ (2 | 4 | 8) if ps.is_multiple_of(n) && depth <= w * 8 => (w, n),
            _ => (ps, 1),
        }
    };
    if bytes == 0
        || ![1, 2, 4, 8].contains(&bytes)
        || !ps.is_multiple_of(bytes)
        || per_pixel == 0
        || per_pixel > u8::MAX as u32
    {
        return Default::default();
    }
    gpushm::format::Components {
        bytes: bytes as u8,
        per_pixel: per_pixel as u8,
        big_endian: bytes > 1 && !finfo.flags().contains(gst_video::VideoFormatFlags::LE),
    }
}

/// Fills the rows, visible bytes a row and components of each plane of `m` (whose strides
/// are set): what a consumer needs to view the frame. A plane without a fixed pixel stride is
/// published as whole rows of bytes; tiled formats get no rows (consumers read them whole).
pub fn describe_planes(info: &gst_video::VideoInfo, m: &mut gpushm::ring::frame::FrameMeta) {
    let tiled = info.format_info().is_tiled();
    for p in 0..(m.n_planes as usize).min(gpushm::ring::layout::MAX_PLANES) {
        if tiled {
            m.plane_rows[p] = 0;
            m.plane_row_bytes[p] = 0;
            m.plane_components[p] = 0;
            continue;
        }
        let c = plane_components(info, p);
        m.plane_rows[p] = plane_rows(info, p) as u32;
        m.plane_row_bytes[p] = match plane_row_bytes(info, p) as u32 {
            0 => m.plane_stride[p],
            n => n,
        };
        m.plane_components[p] = c.pack();
    }
}
