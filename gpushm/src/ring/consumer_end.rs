// SPDX-License-Identifier: MPL-2.0
//! The consumer's end: maps the ring read-only, takes frames from its delivery queue and gives
//! them back through its release queue. Every value read from shared memory is checked before
//! it is used: a buggy or hostile producer yields an error, never a crash.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use memmap2::{Mmap, MmapMut};

use super::frame::{Entry, FrameMeta, TimeCode};
use super::layout::Base;
use super::layout::*;
use super::shm;
use crate::{Error, Result};

/// The mapping, kept alive; `ptr` is its first byte.
enum Mapping {
    Ro { ptr: *mut u8, _map: Mmap },
    Rw { ptr: *mut u8, _map: MmapMut },
}

impl Mapping {
    fn ptr(&self) -> *mut u8 {
        match self {
            Mapping::Ro { ptr, .. } | Mapping::Rw { ptr, .. } => *ptr,
        }
    }
}

// SAFETY: the pointers are the mappings' own, which live as long as the enum.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

/// A ring mapped read-only (or, on request, read-write for GPU registration).
pub struct ConsumerRing {
    /// Something that must live exactly as long as the mapping and go before it (a GPU
    /// registration). Declared first: fields drop in order.
    attachment: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    _map: Mapping,
    writable: bool,
    base: Base,
    geom: RingGeometry,
    ring_gen: u32,
}

impl ConsumerRing {
    /// Maps and validates a ring announced by a `Ring` message.
    /// Maps and validates a ring announced by a `Ring` message: read-only, unless `writable`
    /// is asked for and the descriptor allows it.
    pub fn open(
        fd: OwnedFd,
        writable: bool,
        ring_gen: u32,
        slot_count: u32,
        slot_size: u64,
        total_size: u64,
    ) -> Result<Self> {
        if total_size > (MAX_SLOTS as u64 + 1) * (MAX_SLOT_SIZE + 1) {
            return Err(Error::protocol(format!(
                "ring of {total_size} bytes is larger than any valid ring"
            )));
        }
        shm::check_sealed_memfd(fd.as_fd(), total_size, "ring")?;
        let map = match writable.then(|| shm::map_rw(&fd, total_size)) {
            Some(Ok(mut m)) => Mapping::Rw {
                ptr: m.as_mut_ptr(),
                _map: m,
            },
            // A read-only descriptor: map it read-only.
            _ => {
                let m = shm::map_ro(&fd, total_size)?;
                Mapping::Ro {
                    ptr: m.as_ptr() as *mut u8,
                    _map: m,
                }
            }
        };
        let writable = matches!(map, Mapping::Rw { .. });
        let base = Base(NonNull::new(map.ptr()).ok_or_else(|| Error::corrupt("null mapping"))?);
        Self::validate(base, total_size, ring_gen, slot_count, slot_size).map(|geom| Self {
            attachment: Default::default(),
            _map: map,
            writable,
            base,
            geom,
            ring_gen,
        })
    }

    fn validate(
        base: Base,
        len: u64,
        ring_gen: u32,
        slot_count: u32,
        slot_size: u64,
    ) -> Result<RingGeometry> {
        if len < RING_HEADER_SIZE as u64 {
            return Err(Error::corrupt("ring smaller than its header"));
        }
        // SAFETY: at least RING_HEADER_SIZE bytes are mapped; all atomics.
        let h = unsafe { &*(base.0.as_ptr() as *const RingHeader) };
        let version = h.version.load(Ordering::Acquire);
        if h.magic.load(Ordering::Relaxed) != RING_MAGIC {
            return Err(Error::corrupt(
                "ring magic is wrong: this is not a gpushm ring",
            ));
        }
        if version != LAYOUT_VERSION {
            return Err(Error::corrupt(format!(
                "ring layout version {version} is not supported (this side reads {LAYOUT_VERSION})"
            )));
        }
        let got = |name: &str, v: u64, want: u64| -> Result<()> {
            if v != want {
                Err(Error::corrupt(format!(
                    "ring header {name} is {v}, {want} expected"
                )))
            } else {
                Ok(())
            }
        };
        got(
            "header_size",
            h.header_size.load(Ordering::Relaxed) as u64,
            RING_HEADER_SIZE as u64,
        )?;
        got(
            "desc_size",
            h.desc_size.load(Ordering::Relaxed) as u64,
            SLOT_DESC_SIZE as u64,
        )?;
        got(
            "ring_gen",
            h.ring_gen.load(Ordering::Relaxed) as u64,
            ring_gen as u64,
        )?;
        got(
            "slot_count",
            h.slot_count.load(Ordering::Relaxed) as u64,
            slot_count as u64,
        )?;
        got("slot_size", h.slot_size.load(Ordering::Relaxed), slot_size)?;
        let geom = RingGeometry::new(slot_count, slot_size).ok_or_else(|| {
            Error::corrupt(format!(
                "{slot_count} slots of {slot_size} bytes is not a valid ring"
            ))
        })?;
        got("slot_size (page multiple)", slot_size, geom.slot_size)?;
        got(
            "desc_offset",
            h.desc_offset.load(Ordering::Relaxed),
            geom.desc_offset,
        )?;
        got(
            "data_offset",
            h.data_offset.load(Ordering::Relaxed),
            geom.data_offset,
        )?;
        got(
            "total_size",
            h.total_size.load(Ordering::Relaxed),
            geom.total_size,
        )?;
        got("mapped size", len, geom.total_size)?;
        Ok(geom)
    }

    pub fn ring_gen(&self) -> u32 {
        self.ring_gen
    }
    pub fn geometry(&self) -> RingGeometry {
        self.geom
    }

    /// Attaches `v` to the mapping's lifetime (first caller wins); see the field.
    pub fn attach(&self, v: Box<dyn std::any::Any + Send + Sync>) -> bool {
        self.attachment.set(v).is_ok()
    }

    pub fn attachment(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        self.attachment.get().map(|b| b.as_ref())
    }

    /// Whether the mapping is writable (asked for by GPUs that cannot register read-only).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The whole mapping, for registering it with a GPU in one piece.
    pub fn mapping(&self) -> (*const u8, usize) {
        (self.base.0.as_ptr(), self.geom.total_size as usize)
    }

    /// Reads the first slot's descriptor: the descriptors' page in the TLB and this ring's
    /// fields in the cache before a frame is read (low-latency mode's warm-up).
    pub(crate) fn warm_up(&self) -> u64 {
        let off = self.geom.desc_offset as usize;
        // SAFETY: in bounds (validated geometry: a ring has at least one slot), aligned, all
        // atomics.
        let d = unsafe { &*(self.base.0.as_ptr().add(off) as *const SlotDesc) };
        d.seq.load(Ordering::Relaxed)
    }

    /// Reads and checks the descriptor of a frame this consumer took from its queue. Returns
    /// the metadata and a pointer to the slot's first byte; `payload_size` bytes from there lie
    /// inside the mapping.
    #[link_section = ".text.hot.gpushm"]
    pub fn read_frame(&self, e: &Entry) -> Result<(FrameMeta, *const u8)> {
        if e.ring_gen != self.ring_gen {
            return Err(Error::protocol(format!(
                "frame for ring {} read from ring {}",
                e.ring_gen, self.ring_gen
            )));
        }
        if e.slot >= self.geom.slot_count {
            return Err(Error::corrupt(format!(
                "slot {} out of range (ring has {})",
                e.slot, self.geom.slot_count
            )));
        }
        let off = self.geom.desc_offset as usize + e.slot as usize * SLOT_DESC_SIZE;
        // SAFETY: in bounds (validated geometry), aligned, all atomics.
        let d = unsafe { &*(self.base.0.as_ptr().add(off) as *const SlotDesc) };
        let seq = d.seq.load(Ordering::Acquire);
        if seq != e.seq {
            return Err(Error::corrupt(format!(
                "slot {} holds frame {seq}, frame {} was announced",
                e.slot, e.seq
            )));
        }
        let r = Ordering::Relaxed;
        let mut m = FrameMeta {
            payload_size: d.payload_size.load(r),
            pts: d.pts.load(r),
            dts: d.dts.load(r),
            duration: d.duration.load(r),
            offset: d.offset.load(r),
            offset_end: d.offset_end.load(r),
            pts_clock: d.pts_clock.load(r),
            dts_clock: d.dts_clock.load(r),
            publish_ns: d.publish_ns.load(r),
            buffer_flags: d.buffer_flags.load(r),
            caps_gen: d.caps_gen.load(r),
            video_format: d.video_format.load(r),
            width: d.width.load(r),
            height: d.height.load(r),
            n_planes: d.n_planes.load(r),
            ..Default::default()
        };
        for i in 0..MAX_PLANES {
            m.plane_offset[i] = d.plane_offset[i].load(r);
            m.plane_stride[i] = d.plane_stride[i].load(r);
            m.plane_rows[i] = d.plane_rows[i].load(r);
            m.plane_row_bytes[i] = d.plane_row_bytes[i].load(r);
            m.plane_components[i] = d.plane_components[i].load(r);
        }
        m.latency = d.latency.load(r);
        m.clock_offset = d.clock_offset.load(r) as i64;
        m.events_seq = d.events_seq.load(r);
        let flags = d.stream_flags.load(r);
        m.live = flags & STREAM_LIVE != 0;
        m.has_metas = flags & STREAM_HAS_METAS != 0;
        let tc_flags = d.tc_flags.load(r);
        if tc_flags & TC_PRESENT != 0 {
            m.timecode = Some(TimeCode {
                flags: tc_flags >> 8,
                fps_n: d.tc_fps_n.load(r),
                fps_d: d.tc_fps_d.load(r),
                hours: d.tc_hours.load(r),
                minutes: d.tc_minutes.load(r),
                seconds: d.tc_seconds.load(r),
                frames: d.tc_frames.load(r),
                field_count: d.tc_field_count.load(r),
            });
        }
        // A producer rewriting the slot while we read it is a bug on its side; catch it.
        std::sync::atomic::fence(Ordering::Acquire);
        if d.seq.load(Ordering::Relaxed) != e.seq {
            return Err(Error::corrupt(format!(
                "slot {} was rewritten while frame {} was read",
                e.slot, e.seq
            )));
        }
        // Zero bytes is a valid buffer for caps other than raw video (a gap, an empty packet).
        if m.payload_size > self.geom.slot_size {
            return Err(Error::corrupt(format!(
                "frame {} claims {} bytes in a slot of {}",
                e.seq, m.payload_size, self.geom.slot_size
            )));
        }
        if m.n_planes as usize > MAX_PLANES {
            return Err(Error::corrupt(format!(
                "frame {} claims {} planes",
                e.seq, m.n_planes
            )));
        }
        for i in 0..m.n_planes as usize {
            if m.plane_offset[i] >= m.payload_size
                || m.plane_stride[i] == 0
                || m.plane_stride[i] > i32::MAX as u32
            {
                return Err(Error::corrupt(format!(
                    "frame {} plane {i}: offset {} stride {} do not fit {} bytes",
                    e.seq, m.plane_offset[i], m.plane_stride[i], m.payload_size
                )));
            }
        }
        // SAFETY: slot_offset + payload_size <= total_size by the checks above.
        let ptr = unsafe {
            self.base
                .0
                .as_ptr()
                .add(self.geom.slot_offset(e.slot) as usize)
        };
        Ok((m, ptr))
    }
}

/// The consumer's end of its control memfd.
pub struct ConsumerChannel {
    _map: MmapMut,
    base: Base,
    capacity: u32,
    /// Serialises releases: buffers are dropped on any thread.
    rel: Mutex<u64>,
}

impl ConsumerChannel {
    pub fn open(fd: OwnedFd, capacity: u32) -> Result<Self> {
        if capacity == 0 || capacity > 4 * CLIENT_QUEUE_CAPACITY {
            return Err(Error::protocol(format!(
                "queue capacity {capacity} is out of range"
            )));
        }
        Self::check_version(&fd)?;
        let size = client_block_size(capacity);
        shm::check_sealed_memfd(fd.as_fd(), size, "client control block")?;
        let mut map = shm::map_rw(&fd, size)?;
        let base =
            Base(NonNull::new(map.as_mut_ptr()).ok_or_else(|| Error::corrupt("null mapping"))?);
        let ch = Self {
            _map: map,
            base,
            capacity,
            rel: Mutex::new(0),
        };
        let h = ch.header();
        // Looked at again in the whole mapping: the producer may have written it since.
        if h.magic.load(Ordering::Relaxed) != CLIENT_MAGIC
            || h.version.load(Ordering::Acquire) != LAYOUT_VERSION
            || h.capacity.load(Ordering::Relaxed) != capacity
        {
            return Err(Error::corrupt(
                "client control block has a wrong magic, version or capacity",
            ));
        }
        let w = h.rel_wpos.load(Ordering::Relaxed);
        *ch.rel.lock().unwrap_or_else(|e| e.into_inner()) = w;
        Ok(ch)
    }

    /// The block's magic and layout version, read before its size is checked: a producer of
    /// another layout version (whose block has another size) is named as such, as a ring of
    /// another version is.
    fn check_version(fd: &OwnedFd) -> Result<()> {
        shm::check_sealed_memfd(fd.as_fd(), 16, "client control block")?;
        let map = shm::map_ro(fd, 16)?;
        // SAFETY: 16 bytes mapped, page-aligned: the magic and the version of every layout,
        // read as atomics (the producer may write them concurrently).
        let (magic, version) = unsafe {
            let p = map.as_ptr();
            (
                (*(p as *const AtomicU64)).load(Ordering::Relaxed),
                (*(p.add(8) as *const AtomicU32)).load(Ordering::Acquire),
            )
        };
        if magic != CLIENT_MAGIC {
            return Err(Error::corrupt(
                "client control block magic is wrong: this is not a gpushm client block",
            ));
        }
        if version != LAYOUT_VERSION {
            return Err(Error::corrupt(format!(
                "client block layout version {version} is not supported (this side reads {LAYOUT_VERSION})"
            )));
        }
        Ok(())
    }

    pub(super) fn header(&self) -> &ClientHeader {
        // SAFETY: the mapping holds a whole client block of `capacity` entries a queue.
        unsafe { client_header(self.base) }
    }

    pub(super) fn entry(&self, queue: usize, pos: u64) -> &QueueEntry {
        // SAFETY: as above; capacity > 0 (checked when the block was made or opened).
        unsafe { queue_entry(self.base, self.capacity, queue, pos) }
    }

    /// Counts a frame taken `ns` after it was published in the latency histogram the producer
    /// reports (only this consumer writes it).
    pub fn record_latency(&self, ns: u64) {
        // SAFETY: the mapping holds a whole client block of `capacity` entries a queue.
        let hist = unsafe { client_latency(self.base, self.capacity) };
        let b = &hist[latency_bucket(ns)];
        b.store(b.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Says whether we wait on the frame-ready eventfd (the producer writes it only then),
    /// ordered before any later look at the delivery queue: `0`, or how we wait
    /// ([`crate::ring::layout::WAITS_SLEEPING`], [`crate::ring::layout::WAITS_POLLED`]).
    pub fn set_waiting(&self, how: u32) {
        let h = self.header();
        if how == crate::ring::layout::WAITS_SLEEPING {
            // Where this sleep is, and no early wake-up for it yet (what an earlier sleep was
            // told must not make this one poll).
            h.sleep_cpu
                .store(crate::ring::layout::this_cpu(), Ordering::Relaxed);
            // Written only when set: the field sits on the producer's cache line.
            if h.early_wake_cpu.load(Ordering::Relaxed) != 0 {
                h.early_wake_cpu.store(0, Ordering::Relaxed);
            }
        }
        h.consumer_waits.store(how, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// 1 + the CPU the producer's last wake-up ahead of a frame came from (0: none).
    pub fn early_wake_cpu(&self) -> u32 {
        self.header().early_wake_cpu.load(Ordering::Relaxed)
    }

    /// Whether a frame seems to be queued for us (a hint: [`Self::take`] checks).
    #[link_section = ".text.hot.gpushm"]
    pub fn has_delivery(&self) -> bool {
        let h = self.header();
        h.wpos.load(Ordering::Acquire) != h.rpos.load(Ordering::Acquire)
    }

    /// Whether the producer waits for slots, so that a release made before this call must
    /// write the slot-released eventfd.
    pub fn producer_waits(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.header().producer_waits.load(Ordering::Relaxed) != 0
    }

    /// Takes the oldest frame handed to us, if any.
    #[link_section = ".text.hot.gpushm"]
    pub fn take(&self) -> Result<Option<Entry>> {
        let h = self.header();
        loop {
            let r = h.rpos.load(Ordering::Acquire);
            let w = h.wpos.load(Ordering::Acquire);
            if w < r || w - r > self.capacity as u64 {
                return Err(Error::corrupt(format!(
                    "delivery queue positions {r}..{w} are inconsistent"
                )));
            }
            if r == w {
                return Ok(None);
            }
            let q = self.entry(0, r);
            let seq = q.seq.load(Ordering::Relaxed);
            let (ring_gen, slot) = unpack_loc(q.loc.load(Ordering::Relaxed));
            // Owning the entry means moving rpos past it; if the producer revoked it first,
            // try the next one.
            if h.rpos
                .compare_exchange(r, r + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok(Some(Entry {
                    seq,
                    ring_gen,
                    slot,
                }));
            }
        }
    }

    /// Frames the producer took back because we fell behind.
    pub fn dropped(&self) -> u64 {
        self.header().dropped.load(Ordering::Relaxed)
    }

    /// The producer cut us and took our slots back.
    pub fn revoked(&self) -> bool {
        self.header().revoked.load(Ordering::Acquire) != 0
    }

    /// Frames we may reference at once, as the producer says (0: not said, or nonsense).
    pub fn budget(&self) -> u32 {
        let b = self.header().budget.load(Ordering::Relaxed);
        if b > MAX_SLOTS {
            0
        } else {
            b
        }
    }

    /// Tells the producer how many frames we copied out of the ring so far.
    pub fn set_copied(&self, n: u64) {
        self.header().copied.store(n, Ordering::Relaxed);
    }

    /// Gives a frame back. Returns false if the release queue is full (the producer has not
    /// caught up yet); the caller keeps the entry and tries again later.
    #[link_section = ".text.hot.gpushm"]
    pub fn release(&self, e: Entry) -> bool {
        let mut w = self.rel.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.header().rel_rpos.load(Ordering::Acquire);
        if *w < r || *w - r >= self.capacity as u64 {
            return false;
        }
        let q = self.entry(1, *w);
        q.seq.store(e.seq, Ordering::Relaxed);
        q.loc.store(pack_loc(e.ring_gen, e.slot), Ordering::Relaxed);
        *w += 1;
        self.header().rel_wpos.store(*w, Ordering::Release);
        true
    }
}
