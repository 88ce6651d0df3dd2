// SPDX-License-Identifier: MPL-2.0
//! Where frames are laid out in shared memory.
//!
//! Two kinds of shared-memory objects exist, both memfds sealed against resizing:
//!
//! ```text
//! ring memfd (one per producer ring; producer RW, consumers get a read-only descriptor)
//! +-----------------+-------------------------------+------------------------------------+
//! | RingHeader      | SlotDesc[slot_count]          | slot 0 | slot 1 | ... (page-aligned) |
//! | (256 B)         | (256 B each)                  | slot_size bytes each               |
//! +-----------------+-------------------------------+------------------------------------+
//! 0                 desc_offset                      data_offset                 total_size
//!
//! client memfd (one per connected consumer; both sides RW, only that consumer sees it)
//! +-----------------+------------------------------+------------------------------+
//! | ClientHeader    | delivery QueueEntry[capacity] | release QueueEntry[capacity] | latency u32[96] |
//! | (256 B)         | producer -> consumer          | consumer -> producer         | consumer        |
//! +-----------------+------------------------------+------------------------------+-----------------+
//! ```
//!
//! The latency histogram counts, per bucket (see [`latency_bucket`]), the frames the consumer
//! took that long after they were published (CLOCK_MONOTONIC, `SlotDesc::publish_ns`). Only
//! the consumer writes it; the producer only reports it (`gpushm top`), so a consumer that
//! lies there misleads nobody but whoever reads its own figures.
//!
//! Everything in shared memory is an atomic, so no `&mut` is ever formed to mapped memory and
//! a peer writing concurrently is never undefined behaviour, only a value that has to be
//! validated. Offsets and indices are stored, never pointers.

use std::mem::{offset_of, size_of};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// "GPUSHMR1" little-endian.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"GPUSHMR1");
/// "GPUSHMC1" little-endian.
pub const CLIENT_MAGIC: u64 = u64::from_le_bytes(*b"GPUSHMC1");
/// Bumped whenever any struct in this file changes. Version 4 added each plane's rows, visible
/// bytes per row and components ([`SlotDesc::plane_rows`]): a consumer of version 3 refuses a
/// version 4 ring (and the other way round) with "ring layout version 4 is not supported (this
/// side reads 3)", gpushmsrc as an element error at connection. Version 5 added the client
/// block's latency histogram. Version 6 moved what the client writes in the client block's
/// header 128 bytes away from what the producer writes (see [`ClientHeader`]).
pub const LAYOUT_VERSION: u32 = 6;

pub const MAX_PLANES: usize = 4;
/// Upper bound for the slot count of one ring.
pub const MAX_SLOTS: u32 = 64;
/// Upper bound for one slot (a 8K RGBA frame is 128 MiB).
pub const MAX_SLOT_SIZE: u64 = 256 << 20;
/// Entries of each client queue. A client can never have more than `MAX_SLOTS` frames of one
/// ring outstanding, and at most two rings overlap while caps change.
pub const CLIENT_QUEUE_CAPACITY: u32 = 2 * MAX_SLOTS;

/// Value stored for an absent timestamp / offset.
pub const NONE_U64: u64 = u64::MAX;

pub fn page_size() -> u64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE) {
        Ok(Some(v)) if v > 0 => v as u64,
        _ => 4096,
    }
}

pub fn round_up(v: u64, to: u64) -> Option<u64> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// Page 0 of the ring memfd. Written once by the producer before the descriptor is handed out;
/// `version` is stored last with Release.
#[repr(C)]
pub struct RingHeader {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub header_size: AtomicU32,
    pub desc_size: AtomicU32,
    pub slot_count: AtomicU32,
    pub slot_size: AtomicU64,
    pub desc_offset: AtomicU64,
    pub data_offset: AtomicU64,
    pub total_size: AtomicU64,
    pub ring_gen: AtomicU32,
    pub _reserved0: AtomicU32,
    pub _reserved: [AtomicU64; 24],
}

/// What the producer says about the frame in one slot. The producer fills every field, then
/// stores `seq` with Release; a consumer loads `seq` with Acquire and compares it to the sequence
/// number it was handed in its delivery queue.
#[repr(C)]
pub struct SlotDesc {
    /// Frame sequence number, starting at 1; 0 = never written.
    pub seq: AtomicU64,
    pub payload_size: AtomicU64,
    pub pts: AtomicU64,
    pub dts: AtomicU64,
    pub duration: AtomicU64,
    pub offset: AtomicU64,
    pub offset_end: AtomicU64,
    /// PTS/DTS as absolute clock time (base time + running time) of the producer's pipeline.
    pub pts_clock: AtomicU64,
    pub dts_clock: AtomicU64,
    /// CLOCK_MONOTONIC nanoseconds when the producer published the frame.
    pub publish_ns: AtomicU64,
    pub buffer_flags: AtomicU32,
    pub caps_gen: AtomicU32,
    /// GstVideoFormat value, width and height the planes below describe.
    pub video_format: AtomicU32,
    pub width: AtomicU32,
    pub height: AtomicU32,
    pub n_planes: AtomicU32,
    pub plane_offset: [AtomicU64; MAX_PLANES],
    pub plane_stride: [AtomicU32; MAX_PLANES],
    /// The producer pipeline's latency (ns): how long after its PTS a frame is published at
    /// the earliest. `NONE_U64` when unknown.
    pub latency: AtomicU64,
    /// GstVideoTimeCode of the frame, when `tc_flags` has [`TC_PRESENT`]: flags (bit 0
    /// present, bits 8.. GstVideoTimeCodeFlags), fps_n, fps_d, hours, minutes, seconds,
    /// frames, field_count.
    pub tc_flags: AtomicU32,
    pub tc_fps_n: AtomicU32,
    pub tc_fps_d: AtomicU32,
    pub tc_hours: AtomicU32,
    pub tc_minutes: AtomicU32,
    pub tc_seconds: AtomicU32,
    pub tc_frames: AtomicU32,
    pub tc_field_count: AtomicU32,
    /// [`STREAM_LIVE`]: the producer's pipeline is live (it drops frames while it waits).
    pub stream_flags: AtomicU32,
    /// The `seq` of the last Event message sent before this frame (0: none): the consumer
    /// hands out the events up to it before the frame (see [`crate::wire`]).
    pub events_seq: AtomicU32,
    /// Rows of each plane (raw video; 0: not published, e.g. a tiled format).
    pub plane_rows: [AtomicU32; MAX_PLANES],
    /// Visible bytes of one row of each plane (the rest of the stride is padding).
    pub plane_row_bytes: [AtomicU32; MAX_PLANES],
    /// What one pixel of each plane holds, packed by [`crate::format::Components::pack`]:
    /// bytes of one component (0: components are not whole bytes, like v210), components a
    /// pixel, byte order. With these a consumer views any format without a table of its own.
    pub plane_components: [AtomicU32; MAX_PLANES],
    /// The producer's pipeline clock less CLOCK_MONOTONIC (ns, two's complement): 0 for the
    /// default system clock, the measured difference for any other (see [`crate::time`]).
    pub clock_offset: AtomicU64,
}

/// `SlotDesc::stream_flags` bit: the producer's pipeline is live.
pub const STREAM_LIVE: u32 = 1;
/// `SlotDesc::stream_flags` bit: a FrameMetas message for this frame was sent before it (see
/// [`crate::wire`]).
pub const STREAM_HAS_METAS: u32 = 2;

/// `SlotDesc::tc_flags` bit: the frame carries a time code.
pub const TC_PRESENT: u32 = 1;

/// Head of a client memfd: a cache line written by the producer, and 128 bytes in, one written
/// by the client. Both sides write their positions for every frame: on one line, each write
/// took the line from the other side's core and each read took it back, several times a
/// frame (`bench core-tiny` on the H100 machine, once apart: 15 % less CPU a frame on the
/// producer's side, 11 % on the consumer's).
#[repr(C)]
pub struct ClientHeader {
    // The producer's line.
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub capacity: AtomicU32,
    /// Deliveries written (producer).
    pub wpos: AtomicU64,
    /// Releases consumed (producer).
    pub rel_rpos: AtomicU64,
    /// Frames this client did not get: revoked because it fell behind, or skipped because it
    /// held its whole budget.
    pub dropped: AtomicU64,
    /// Frames this client may reference at once (producer): the client keeps fewer zero-copy
    /// frames than this and copies the rest, so that it never holds the producer up.
    pub budget: AtomicU32,
    /// Nonzero once the producer cut this client (producer), written before it takes the
    /// client's slots back: frames the client still holds may be overwritten from then on.
    pub revoked: AtomicU32,
    /// Nonzero while the producer waits for slots to come back (producer): the client rings
    /// the slot-released doorbell after a release only then. Otherwise the producer takes
    /// releases when it publishes, and at least every 100 ms.
    pub producer_waits: AtomicU32,
    /// 1 + the CPU the producer's last wake-up ahead of a frame came from (producer; 0:
    /// none): a client woken there sleeps again rather than poll on the producer's CPU. The
    /// client clears it before a sleep, only when it is set (a write takes the line).
    pub early_wake_cpu: AtomicU32,
    pub _reserved0: AtomicU64,
    /// The line beside the producer's, left empty: cores that fetch lines in 128-byte pairs
    /// (x86's adjacent-line prefetch) would pair the two sides' lines again. 64 bytes apart
    /// measured the same on the H100 machine; 128 is what crossbeam's CachePadded uses there.
    pub _pad: [AtomicU64; 8],
    // The client's line.
    /// Deliveries taken (consumer), or revoked by the producer with a CAS for a leaky client.
    pub rpos: AtomicU64,
    /// Releases written (consumer).
    pub rel_wpos: AtomicU64,
    /// Frames the client copied out of the ring instead of keeping them zero-copy (client;
    /// a statistic the producer only reports).
    pub copied: AtomicU64,
    /// Nonzero while the client waits (or is about to wait) on its frame-ready doorbell
    /// (client): the producer rings it after a delivery only then, so a client
    /// busy with a backlog costs no system call per frame. [`WAITS_SLEEPING`] while it sleeps
    /// in a subscriber's wait, [`WAITS_POLLED`] while an event loop of the caller's polls the
    /// doorbell: only the first is woken ahead of a frame.
    pub consumer_waits: AtomicU32,
    /// 1 + the CPU the client last went to sleep on in a subscriber's wait (client; 0:
    /// unknown). A unix socket's wake-up asks the scheduler to run the woken thread on the
    /// waker's CPU: the producer wakes no client ahead of a frame from that CPU, where the
    /// client would take the CPU from the producer's way to the frame.
    pub sleep_cpu: AtomicU32,
    pub _reserved: [AtomicU64; 12],
}

/// One frame handed to, or given back by, a client.
#[repr(C)]
pub struct QueueEntry {
    pub seq: AtomicU64,
    /// `ring_gen << 32 | slot`.
    pub loc: AtomicU64,
}

pub const RING_HEADER_SIZE: usize = 256;
pub const SLOT_DESC_SIZE: usize = 256;
pub const CLIENT_HEADER_SIZE: usize = 256;

const _: () = assert!(size_of::<RingHeader>() == RING_HEADER_SIZE);
const _: () = assert!(size_of::<SlotDesc>() == SLOT_DESC_SIZE);
const _: () = assert!(size_of::<ClientHeader>() == CLIENT_HEADER_SIZE);
const _: () = assert!(size_of::<QueueEntry>() == 16);
const _: () = assert!(offset_of!(RingHeader, version) == 8);
const _: () = assert!(offset_of!(RingHeader, slot_size) == 24);
const _: () = assert!(offset_of!(RingHeader, ring_gen) == 56);
const _: () = assert!(offset_of!(SlotDesc, buffer_flags) == 80);
const _: () = assert!(offset_of!(SlotDesc, plane_offset) == 104);
const _: () = assert!(offset_of!(SlotDesc, plane_stride) == 136);
const _: () = assert!(offset_of!(ClientHeader, wpos) == 16);
const _: () = assert!(offset_of!(ClientHeader, rel_rpos) == 24);
const _: () = assert!(offset_of!(ClientHeader, dropped) == 32);
const _: () = assert!(offset_of!(ClientHeader, budget) == 40);
const _: () = assert!(offset_of!(ClientHeader, revoked) == 44);
const _: () = assert!(offset_of!(ClientHeader, producer_waits) == 48);
const _: () = assert!(offset_of!(ClientHeader, early_wake_cpu) == 52);
// The client's line starts a cache line of its own.
const _: () = assert!(offset_of!(ClientHeader, rpos) == 128);
const _: () = assert!(offset_of!(ClientHeader, rel_wpos) == 136);
const _: () = assert!(offset_of!(ClientHeader, copied) == 144);
const _: () = assert!(offset_of!(ClientHeader, consumer_waits) == 152);
const _: () = assert!(offset_of!(ClientHeader, sleep_cpu) == 156);

/// 1 + the CPU this thread runs on now (0: unknown), as [`ClientHeader::sleep_cpu`] and
/// [`ClientHeader::early_wake_cpu`] hold it. A vDSO call, no system call.
pub fn this_cpu() -> u32 {
    nix::sched::sched_getcpu().map_or(0, |c| (c as u32).wrapping_add(1))
}

/// [`ClientHeader::consumer_waits`]: the client sleeps in a subscriber's wait for a frame.
pub const WAITS_SLEEPING: u32 = 1;
/// [`ClientHeader::consumer_waits`]: the caller's event loop polls the frame-ready doorbell
/// (rung after every delivery, never ahead of one).
pub const WAITS_POLLED: u32 = 2;
const _: () = assert!(offset_of!(SlotDesc, latency) == 152);
const _: () = assert!(offset_of!(SlotDesc, tc_flags) == 160);
const _: () = assert!(offset_of!(SlotDesc, plane_rows) == 200);
const _: () = assert!(offset_of!(SlotDesc, plane_components) == 232);

/// Geometry of a ring memfd, computed by the producer and re-derived and checked by consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingGeometry {
    pub slot_count: u32,
    pub slot_size: u64,
    pub desc_offset: u64,
    pub data_offset: u64,
    pub total_size: u64,
}

impl RingGeometry {
    /// Geometry for `slot_count` slots holding at least `min_slot_size` bytes each.
    pub fn new(slot_count: u32, min_slot_size: u64) -> Option<Self> {
        if slot_count == 0
            || slot_count > MAX_SLOTS
            || min_slot_size == 0
            || min_slot_size > MAX_SLOT_SIZE
        {
            return None;
        }
        let page = page_size();
        let slot_size = round_up(min_slot_size, page)?;
        let desc_offset = RING_HEADER_SIZE as u64;
        let desc_end = desc_offset + slot_count as u64 * SLOT_DESC_SIZE as u64;
        let data_offset = round_up(desc_end, page)?;
        let total_size = data_offset.checked_add(slot_size.checked_mul(slot_count as u64)?)?;
        Some(Self {
            slot_count,
            slot_size,
            desc_offset,
            data_offset,
            total_size,
        })
    }

    pub fn slot_offset(&self, slot: u32) -> u64 {
        self.data_offset + slot as u64 * self.slot_size
    }
}

/// Frames a consumer with `budget` keeps zero-copy at most (it copies further ones): its
/// budget less room for frames on their way to it, two when the budget allows, one otherwise.
/// The producer serves a client that is not waited for (leaky or lagging) up to one more.
pub fn zero_copy_limit(budget: usize) -> usize {
    if budget >= 3 {
        budget - 2
    } else {
        budget.saturating_sub(1)
    }
}

/// A mapping base that may be shared between threads: all access goes through atomics or
/// through slot memory whose ownership the ring protocol hands around.
#[derive(Clone, Copy)]
pub(crate) struct Base(pub(crate) NonNull<u8>);
// SAFETY: see the type's documentation.
unsafe impl Send for Base {}
unsafe impl Sync for Base {}

/// The header of a client memfd mapped at `base`.
///
/// # Safety
/// `base` maps at least a whole client block (see [`client_block_size`]).
pub(crate) unsafe fn client_header<'a>(base: Base) -> &'a ClientHeader {
    // SAFETY: per the contract; ClientHeader is all atomics, so a peer writing it
    // concurrently is never undefined behaviour.
    unsafe { &*(base.0.as_ptr() as *const ClientHeader) }
}

/// Entry `pos` of queue `queue` (0: deliveries, 1: releases) of a client memfd mapped at
/// `base` with `capacity` entries per queue.
///
/// # Safety
/// As [`client_header`], for a block of `capacity` entries per queue; `capacity > 0`.
pub(crate) unsafe fn queue_entry<'a>(
    base: Base,
    capacity: u32,
    queue: usize,
    pos: u64,
) -> &'a QueueEntry {
    let idx = (pos % capacity as u64) as usize;
    let off = CLIENT_HEADER_SIZE + (queue * capacity as usize + idx) * size_of::<QueueEntry>();
    // SAFETY: in bounds of the block per the contract, 16-byte aligned, all atomics.
    unsafe { &*(base.0.as_ptr().add(off) as *const QueueEntry) }
}

/// Buckets of a client's latency histogram: four a doubling, from 1 µs (bucket 0 holds
/// everything below 1 µs) up: the last bucket holds everything from about 12.6 s.
pub const LATENCY_BUCKETS: usize = 96;
const LATENCY_SUBS: u32 = 4;

/// The bucket a latency of `ns` nanoseconds is counted in.
pub fn latency_bucket(ns: u64) -> usize {
    let us = ns / 1000;
    if us == 0 {
        return 0;
    }
    // ns in [base, 2 base), base = 2^k µs: bucket 1 + 4k + the quarter of that doubling.
    let k = (63 - us.leading_zeros()).min(62);
    let base = 1000u64 << k;
    let quarter = ((ns - base) as u128 * 4 / base as u128) as u32;
    ((1 + k * LATENCY_SUBS + quarter.min(3)) as usize).min(LATENCY_BUCKETS - 1)
}

/// The lowest latency (ns) bucket `i` counts (0 for bucket 0).
pub fn latency_bucket_floor(i: usize) -> u64 {
    if i == 0 {
        return 0;
    }
    let i = (i - 1) as u32;
    let (k, quarter) = (i / LATENCY_SUBS, (i % LATENCY_SUBS) as u64);
    let base = 1000u64 << k.min(40);
    base + base / 4 * quarter
}

/// The latency below which `pct` percent of the frames counted in `hist` were taken: the
/// upper edge of the bucket the percentile falls in (an overestimate of at most one
/// quarter-doubling, about 19 %), or for the last bucket its lower edge (about 12.6 s: "that
/// or more"). `None` when nothing was counted.
pub fn latency_percentile(hist: &[u32], pct: f64) -> Option<u64> {
    let total: u64 = hist.iter().map(|&c| c as u64).sum();
    if total == 0 {
        return None;
    }
    let want = ((total as f64 * pct / 100.0).ceil() as u64).clamp(1, total);
    let mut seen = 0u64;
    for (i, &c) in hist.iter().enumerate() {
        seen += c as u64;
        if seen >= want {
            return Some(if i + 1 < hist.len() {
                latency_bucket_floor(i + 1)
            } else {
                latency_bucket_floor(i)
            });
        }
    }
    None
}

fn latency_offset(capacity: u32) -> usize {
    CLIENT_HEADER_SIZE + 2 * capacity as usize * size_of::<QueueEntry>()
}

/// The latency histogram of a client block mapped at `base` with `capacity` entries a queue.
///
/// # Safety
/// As [`client_header`], for a block of `capacity` entries per queue.
pub(crate) unsafe fn client_latency<'a>(base: Base, capacity: u32) -> &'a [AtomicU32] {
    // SAFETY: in bounds of the block per the contract (client_block_size counts it), 4-byte
    // aligned (the queues before it are 16-byte entries), all atomics.
    unsafe {
        std::slice::from_raw_parts(
            base.0.as_ptr().add(latency_offset(capacity)) as *const AtomicU32,
            LATENCY_BUCKETS,
        )
    }
}

pub fn client_block_size(capacity: u32) -> u64 {
    (latency_offset(capacity) + LATENCY_BUCKETS * size_of::<AtomicU32>()) as u64
}

pub fn pack_loc(ring_gen: u32, slot: u32) -> u64 {
    (ring_gen as u64) << 32 | slot as u64
}

pub fn unpack_loc(loc: u64) -> (u32, u32) {
    ((loc >> 32) as u32, loc as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_cover_their_values_and_percentiles_land_in_them() {
        for ns in [
            0u64,
            999,
            1000,
            1500,
            2999,
            3000,
            7000,
            50_000,
            1_000_000,
            33_333_333,
            u64::MAX,
        ] {
            let b = latency_bucket(ns);
            assert!(b < LATENCY_BUCKETS);
            assert!(latency_bucket_floor(b) <= ns, "{ns} below its bucket {b}");
            if b + 1 < LATENCY_BUCKETS {
                assert!(
                    ns < latency_bucket_floor(b + 1),
                    "{ns} above its bucket {b}"
                );
            }
        }
        // Buckets rise with the value.
        let mut last = 0;
        for us in 1..100_000u64 {
            let b = latency_bucket(us * 1000);
            assert!(b >= last);
            last = b;
        }
        let mut hist = [0u32; LATENCY_BUCKETS];
        assert_eq!(latency_percentile(&hist, 50.0), None);
        // 98 frames at 40 µs, 2 at 5 ms: p50 is about 40 µs, p99 about 5 ms.
        hist[latency_bucket(40_000)] += 98;
        hist[latency_bucket(5_000_000)] += 2;
        let p50 = latency_percentile(&hist, 50.0).unwrap();
        let p99 = latency_percentile(&hist, 99.0).unwrap();
        assert!((40_000..=48_000).contains(&p50), "p50 {p50}");
        assert!((5_000_000..=6_000_000).contains(&p99), "p99 {p99}");
    }

    #[test]
    fn geometry_is_page_aligned() {
        let page = page_size();
        let g = RingGeometry::new(8, 1920 * 1080 * 3 / 2).unwrap();
        assert_eq!(g.slot_size % page, 0);
        assert_eq!(g.data_offset % page, 0);
        assert!(g.slot_size >= 1920 * 1080 * 3 / 2);
        assert_eq!(g.total_size, g.data_offset + 8 * g.slot_size);
        assert!(g.desc_offset + 8 * SLOT_DESC_SIZE as u64 <= g.data_offset);
        assert_eq!(g.slot_offset(3) % page, 0);
    }

    #[test]
    fn geometry_rejects_silly_sizes() {
        assert!(RingGeometry::new(0, 100).is_none());
        assert!(RingGeometry::new(MAX_SLOTS + 1, 100).is_none());
        assert!(RingGeometry::new(4, 0).is_none());
        assert!(RingGeometry::new(4, MAX_SLOT_SIZE + 1).is_none());
    }

    #[test]
    fn loc_round_trips() {
        assert_eq!(unpack_loc(pack_loc(7, 63)), (7, 63));
        assert_eq!(unpack_loc(pack_loc(u32::MAX, 0)), (u32::MAX, 0));
    }
}
