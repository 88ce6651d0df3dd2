// SPDX-License-Identifier: MPL-2.0
//! What both ends of the ring say about frames: the metadata of one frame, its time code, and
//! the (frame, ring, slot) triple that travels through the client queues.

use super::layout::MAX_PLANES;

/// Everything the producer says about one frame; the consumer reads back the same struct.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameMeta {
    pub payload_size: u64,
    pub pts: u64,
    pub dts: u64,
    pub duration: u64,
    pub offset: u64,
    pub offset_end: u64,
    pub pts_clock: u64,
    pub dts_clock: u64,
    pub publish_ns: u64,
    pub buffer_flags: u32,
    pub caps_gen: u32,
    pub video_format: u32,
    pub width: u32,
    pub height: u32,
    pub n_planes: u32,
    pub plane_offset: [u64; MAX_PLANES],
    pub plane_stride: [u32; MAX_PLANES],
    /// Rows of each plane (0: not published).
    pub plane_rows: [u32; MAX_PLANES],
    /// Visible bytes of a row of each plane.
    pub plane_row_bytes: [u32; MAX_PLANES],
    /// Each plane's components, packed ([`crate::format::Components::pack`]).
    pub plane_components: [u32; MAX_PLANES],
    /// The producer pipeline's latency in ns (`NONE_U64`: unknown).
    pub latency: u64,
    pub timecode: Option<TimeCode>,
    /// The producer's pipeline is live.
    pub live: bool,
    /// A FrameMetas message for this frame was sent before it.
    pub has_metas: bool,
    /// The producer's pipeline clock less CLOCK_MONOTONIC, ns (see [`crate::time`]).
    pub clock_offset: i64,
    /// The last event sent before this frame ([`crate::ring::layout::SlotDesc::events_seq`]).
    pub events_seq: u32,
}

/// A frame's SMPTE time code (GstVideoTimeCode without its config's latest daily jam).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeCode {
    pub fps_n: u32,
    pub fps_d: u32,
    /// GstVideoTimeCodeFlags bits.
    pub flags: u32,
    pub hours: u32,
    pub minutes: u32,
    pub seconds: u32,
    pub frames: u32,
    pub field_count: u32,
}

/// One frame in flight: frame `seq` sits in `slot` of ring `ring_gen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub ring_gen: u32,
    pub slot: u32,
}

/// The fields of a frame's metadata that say how its bytes are laid out (format, size,
/// planes, payload): two frames with the same key (and caps) are laid out the same way, so a
/// consumer checks or describes a layout once, not every frame (gpushmsrc's layout check, the
/// C API's frame info).
#[derive(Debug, Clone, Copy)]
pub struct LayoutKey([u64; 5 + 5 * MAX_PLANES]);

impl LayoutKey {
    pub fn of(m: &FrameMeta) -> Self {
        let mut k = [0u64; 5 + 5 * MAX_PLANES];
        k[..5].copy_from_slice(&[
            m.video_format as u64,
            m.width as u64,
            m.height as u64,
            m.n_planes as u64,
            m.payload_size,
        ]);
        for p in 0..MAX_PLANES {
            k[5 + p * 5..10 + p * 5].copy_from_slice(&[
                m.plane_offset[p],
                m.plane_stride[p] as u64,
                m.plane_rows[p] as u64,
                m.plane_row_bytes[p] as u64,
                m.plane_components[p] as u64,
            ]);
        }
        Self(k)
    }
}

impl PartialEq for LayoutKey {
    /// Compared in line: `==` on the arrays calls libc's memcmp, a page of code the frame's
    /// way touches for nothing else.
    #[inline(always)]
    fn eq(&self, other: &Self) -> bool {
        self.0.iter().zip(&other.0).fold(0, |d, (a, b)| d | (a ^ b)) == 0
    }
}

impl Eq for LayoutKey {}
