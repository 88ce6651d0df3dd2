// SPDX-License-Identifier: MPL-2.0
//! Plane geometry of GStreamer video formats, computed in one place for every element: how
//! many rows a plane has and how many bytes of each row are visible.

fn components_of_plane(info: &gst_video::VideoInfo, p: usize) -> impl Iterator<Item = u8> + '_ {
    let finfo = info.format_info();
    (0..finfo.n_components() as u8).filter(move |&c| finfo.plane()[c as usize] as usize == p)
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
