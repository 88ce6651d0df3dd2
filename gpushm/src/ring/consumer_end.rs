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
        m.live = d.stream_flags.load(r) & STREAM_LIVE != 0;
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

    fn header(&self) -> &ClientHeader {
        // SAFETY: the mapping holds a whole client block of `capacity` entries a queue.
        unsafe { client_header(self.base) }
    }

    fn entry(&self, queue: usize, pos: u64) -> &QueueEntry {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::producer_end::{ClientChannel, ProducerRing};
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    fn meta(seq: u64, size: u64) -> FrameMeta {
        FrameMeta {
            payload_size: size,
            pts: seq * 1000,
            offset: seq,
            n_planes: 1,
            plane_stride: [64, 0, 0, 0],
            ..Default::default()
        }
    }

    fn open_pair(slots: u32, size: u64) -> (ProducerRing, ConsumerRing) {
        let p = ProducerRing::create(1, slots, size, false).unwrap();
        let g = p.geometry();
        let c = ConsumerRing::open(
            p.read_only_fd().unwrap(),
            false,
            1,
            slots,
            g.slot_size,
            g.total_size,
        )
        .unwrap();
        (p, c)
    }

    fn client_pair() -> (ClientChannel, ConsumerChannel) {
        let p = ClientChannel::create(CLIENT_QUEUE_CAPACITY).unwrap();
        let fd = p.fd().try_clone_to_owned().unwrap();
        let c = ConsumerChannel::open(fd, CLIENT_QUEUE_CAPACITY).unwrap();
        (p, c)
    }

    /// A producer thread writes frames whose bytes depend on their number; a consumer thread
    /// takes, checks and releases them through the real memfd mappings, many times around the
    /// ring and around the queues.
    #[test]
    fn concurrent_producer_and_consumer_wrap_around() {
        const SLOTS: u32 = 4;
        const FRAMES: u64 = 3000;
        let (ring, cring) = open_pair(SLOTS, 4096);
        let (mut pch, cch) = client_pair();
        let cch = Arc::new(cch);
        let done = Arc::new(AtomicU64::new(0));
        let consumer = {
            let cch = cch.clone();
            let done = done.clone();
            std::thread::spawn(move || {
                let mut next = 1u64;
                while next <= FRAMES {
                    let Some(e) = cch.take().unwrap() else {
                        std::thread::yield_now();
                        continue;
                    };
                    assert_eq!(e.seq, next, "lossless client sees every frame in order");
                    let (m, ptr) = cring.read_frame(&e).unwrap();
                    assert_eq!(m.offset, e.seq);
                    let data = unsafe { std::slice::from_raw_parts(ptr, m.payload_size as usize) };
                    assert!(
                        data.iter().all(|&b| b == (e.seq % 251) as u8),
                        "frame {} corrupted",
                        e.seq
                    );
                    while !cch.release(e) {
                        std::thread::yield_now();
                    }
                    next += 1;
                }
                done.store(1, Ordering::Release);
            })
        };
        let mut free: Vec<u32> = (0..SLOTS).collect();
        let mut seq = 0u64;
        while seq < FRAMES {
            for e in pch.take_releases().unwrap() {
                free.push(e.slot);
            }
            let Some(slot) = free.pop() else {
                std::thread::yield_now();
                continue;
            };
            seq += 1;
            let size = 1000 + (seq % 3000);
            unsafe { std::ptr::write_bytes(ring.slot_ptr(slot), (seq % 251) as u8, size as usize) };
            ring.publish(slot, seq, &meta(seq, size));
            pch.deliver(Entry {
                seq,
                ring_gen: 1,
                slot,
            })
            .unwrap();
        }
        consumer.join().unwrap();
        assert_eq!(done.load(Ordering::Acquire), 1);
        pch.take_releases().unwrap();
        assert_eq!(pch.outstanding().count(), 0);
    }

    #[test]
    fn leaky_revocation_races_safely_with_take() {
        let (mut pch, cch) = client_pair();
        let mut revoked = 0;
        for seq in 1..=10_000u64 {
            pch.deliver(Entry {
                seq,
                ring_gen: 1,
                slot: (seq % 4) as u32,
            })
            .unwrap();
            if pch.pending_len() > 2 && pch.revoke_oldest().unwrap().is_some() {
                revoked += 1;
            }
            if seq % 3 == 0 {
                if let Some(e) = cch.take().unwrap() {
                    assert!(cch.release(e));
                }
            }
            pch.take_releases().unwrap();
        }
        assert!(revoked > 0);
        assert_eq!(cch.dropped(), revoked);
        assert!(pch.pending_len() <= 3);
    }

    #[test]
    fn client_lies_are_caught() {
        // Releasing a frame it never took.
        let (mut pch, cch) = client_pair();
        pch.deliver(Entry {
            seq: 1,
            ring_gen: 1,
            slot: 0,
        })
        .unwrap();
        assert!(cch.release(Entry {
            seq: 9,
            ring_gen: 1,
            slot: 3
        }));
        assert!(pch
            .take_releases()
            .unwrap_err()
            .to_string()
            .contains("does not hold"));

        // Double release.
        let (mut pch, cch) = client_pair();
        pch.deliver(Entry {
            seq: 1,
            ring_gen: 1,
            slot: 0,
        })
        .unwrap();
        let e = cch.take().unwrap().unwrap();
        assert!(cch.release(e));
        assert_eq!(pch.take_releases().unwrap(), vec![e]);
        assert!(cch.release(e));
        assert!(pch.take_releases().is_err());

        // A batch that starts with a frame it holds and goes on with one it never got: the
        // held frame is still held afterwards, so dropping the client gives it back.
        let (mut pch, cch) = client_pair();
        let held = Entry {
            seq: 1,
            ring_gen: 1,
            slot: 0,
        };
        pch.deliver(held).unwrap();
        let e = cch.take().unwrap().unwrap();
        assert!(cch.release(e));
        assert!(cch.release(Entry {
            seq: 7,
            ring_gen: 1,
            slot: 2
        }));
        // What the caller had gathered from other clients stays as it was.
        let other = Entry {
            seq: 9,
            ring_gen: 1,
            slot: 3,
        };
        let mut out = vec![other];
        assert!(pch.take_releases_into(&mut out).is_err());
        assert_eq!(out, vec![other]);
        assert_eq!(pch.outstanding().copied().collect::<Vec<_>>(), vec![held]);

        // Read position moved past what was written.
        let (mut pch, cch) = client_pair();
        cch.header().rpos.store(5, Ordering::Relaxed);
        assert!(pch.sync_taken().is_err());
        // Release position far ahead.
        let (mut pch, cch) = client_pair();
        cch.header().rel_wpos.store(1 << 40, Ordering::Relaxed);
        assert!(pch.take_releases().is_err());
    }

    /// A producer of another layout version (its client block of another size) is named as
    /// such, as a ring of another version is, whether its block is smaller or larger.
    #[test]
    fn a_client_block_of_another_layout_version_is_named() {
        for (version, less) in [(LAYOUT_VERSION - 1, 128), (LAYOUT_VERSION + 1, 0)] {
            let size = client_block_size(CLIENT_QUEUE_CAPACITY) - less;
            let fd = shm::create_sealed_memfd("gpushm-client", size).unwrap();
            let mut map = shm::map_rw(&fd, size).unwrap();
            map[..8].copy_from_slice(&CLIENT_MAGIC.to_le_bytes());
            map[8..12].copy_from_slice(&version.to_le_bytes());
            map[12..16].copy_from_slice(&CLIENT_QUEUE_CAPACITY.to_le_bytes());
            let e = ConsumerChannel::open(fd, CLIENT_QUEUE_CAPACITY)
                .err()
                .expect("refused")
                .to_string();
            assert!(
                e.contains(&format!(
                    "client block layout version {version} is not supported (this side reads {LAYOUT_VERSION})"
                )),
                "{e}"
            );
        }
        // Not a client block at all.
        let size = client_block_size(CLIENT_QUEUE_CAPACITY);
        let fd = shm::create_sealed_memfd("gpushm-client", size).unwrap();
        let e = ConsumerChannel::open(fd, CLIENT_QUEUE_CAPACITY)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("not a gpushm client block"), "{e}");
    }

    #[test]
    fn corrupted_header_is_rejected() {
        let p = ProducerRing::create(1, 4, 4096, false).unwrap();
        let g = p.geometry();
        let open = || {
            ConsumerRing::open(
                p.read_only_fd().unwrap(),
                false,
                1,
                4,
                g.slot_size,
                g.total_size,
            )
        };
        assert!(open().is_ok());
        let h = p.header();
        type Case<'a> = (&'a str, Box<dyn Fn() + 'a>, Box<dyn Fn() + 'a>);
        let cases: Vec<Case> = vec![
            (
                "magic",
                Box::new(|| h.magic.store(7, Ordering::Relaxed)),
                Box::new(|| h.magic.store(RING_MAGIC, Ordering::Relaxed)),
            ),
            (
                "version",
                Box::new(|| h.version.store(99, Ordering::Relaxed)),
                Box::new(|| h.version.store(LAYOUT_VERSION, Ordering::Relaxed)),
            ),
            (
                "slot_count",
                Box::new(|| h.slot_count.store(1000, Ordering::Relaxed)),
                Box::new(|| h.slot_count.store(4, Ordering::Relaxed)),
            ),
            (
                "slot_size",
                Box::new(|| h.slot_size.store(u64::MAX, Ordering::Relaxed)),
                Box::new(|| h.slot_size.store(g.slot_size, Ordering::Relaxed)),
            ),
            (
                "data_offset",
                Box::new(|| h.data_offset.store(g.total_size, Ordering::Relaxed)),
                Box::new(|| h.data_offset.store(g.data_offset, Ordering::Relaxed)),
            ),
            (
                "desc_size",
                Box::new(|| h.desc_size.store(8, Ordering::Relaxed)),
                Box::new(|| h.desc_size.store(SLOT_DESC_SIZE as u32, Ordering::Relaxed)),
            ),
        ];
        for (name, break_it, fix_it) in cases {
            break_it();
            let err = open()
                .err()
                .unwrap_or_else(|| panic!("corrupted {name} accepted"));
            assert!(matches!(err, Error::Corrupt(_)), "{name}: {err}");
            fix_it();
            assert!(open().is_ok(), "{name} restored");
        }
        // A message that disagrees with the header, and an absurd size.
        assert!(ConsumerRing::open(
            p.read_only_fd().unwrap(),
            false,
            2,
            4,
            g.slot_size,
            g.total_size
        )
        .is_err());
        assert!(ConsumerRing::open(
            p.read_only_fd().unwrap(),
            false,
            1,
            4,
            g.slot_size,
            u64::MAX
        )
        .is_err());
        assert!(ConsumerRing::open(
            p.read_only_fd().unwrap(),
            false,
            1,
            4,
            g.slot_size,
            g.total_size * 2
        )
        .is_err());
    }

    #[test]
    fn wake_ups_are_asked_for_by_the_side_that_waits() {
        let (mut p, c) = client_pair();
        // Neither side waits: no eventfd is written for deliveries or releases.
        assert!(!p.consumer_waits());
        assert!(!c.producer_waits());
        assert!(!c.has_delivery());
        let e = Entry {
            seq: 1,
            ring_gen: 1,
            slot: 0,
        };
        p.deliver(e).unwrap();
        assert!(c.has_delivery());
        // A consumer about to sleep says so; the producer then wakes it, ahead of a frame too.
        // Not from the CPU it went to sleep on, where it would take the CPU from the producer.
        c.set_waiting(crate::ring::layout::WAITS_SLEEPING);
        assert!(p.consumer_waits());
        let slept_on = c.header().sleep_cpu.load(Ordering::Relaxed);
        assert_ne!(slept_on, 0, "the CPU it sleeps on is told");
        assert!(p.consumer_sleeps_off(slept_on + 1));
        assert!(!p.consumer_sleeps_off(0), "no wake-up from an unknown CPU");
        assert!(!p.consumer_sleeps_off(slept_on));
        // The CPU such a wake-up came from reaches the consumer.
        assert_eq!(c.early_wake_cpu(), 0);
        p.set_early_wake_cpu(slept_on + 1);
        assert_eq!(c.early_wake_cpu(), slept_on + 1);
        // One whose event loop polls the doorbell is woken by deliveries only.
        c.set_waiting(crate::ring::layout::WAITS_POLLED);
        assert!(p.consumer_waits());
        assert!(!p.consumer_sleeps_off(slept_on + 1));
        c.set_waiting(0);
        assert!(!p.consumer_waits());
        assert!(!p.consumer_sleeps_off(slept_on + 1));
        assert_eq!(c.take().unwrap(), Some(e));
        assert!(!c.has_delivery());
        // A producer waiting for slots says so; the consumer then wakes it on release.
        p.set_producer_waits(true);
        assert!(c.producer_waits());
        assert!(c.release(e));
        assert_eq!(p.take_releases().unwrap(), vec![e]);
        p.set_producer_waits(false);
        assert!(!c.producer_waits());
        // Nothing released: nothing taken.
        assert!(p.take_releases().unwrap().is_empty());
    }

    #[test]
    fn empty_buffer_is_a_frame() {
        let (p, c) = open_pair(4, 4096);
        let e = Entry {
            seq: 3,
            ring_gen: 1,
            slot: 1,
        };
        // Caps other than raw video: no planes, zero bytes (an empty packet).
        p.publish(
            1,
            3,
            &FrameMeta {
                payload_size: 0,
                n_planes: 0,
                ..meta(3, 1)
            },
        );
        let (got, _) = c.read_frame(&e).expect("an empty frame is valid");
        assert_eq!(got.payload_size, 0);
    }

    #[test]
    fn corrupted_descriptor_is_rejected() {
        let (p, c) = open_pair(4, 4096);
        let e = Entry {
            seq: 7,
            ring_gen: 1,
            slot: 2,
        };
        p.publish(2, 7, &meta(7, 4096));
        assert!(c.read_frame(&e).is_ok());
        let bad = [
            FrameMeta {
                payload_size: 1 << 40,
                ..meta(7, 1)
            },
            FrameMeta {
                n_planes: 9,
                ..meta(7, 100)
            },
            FrameMeta {
                plane_offset: [5000, 0, 0, 0],
                ..meta(7, 100)
            },
            FrameMeta {
                plane_stride: [0, 0, 0, 0],
                ..meta(7, 100)
            },
            FrameMeta {
                plane_stride: [u32::MAX, 0, 0, 0],
                ..meta(7, 100)
            },
        ];
        for m in bad {
            p.publish(2, 7, &m);
            assert!(
                matches!(c.read_frame(&e), Err(Error::Corrupt(_))),
                "{m:?} accepted"
            );
        }
        p.publish(2, 7, &meta(7, 100));
        assert!(
            c.read_frame(&Entry { seq: 8, ..e }).is_err(),
            "wrong sequence number"
        );
        assert!(
            c.read_frame(&Entry { slot: 4, ..e }).is_err(),
            "slot out of range"
        );
        assert!(
            c.read_frame(&Entry {
                slot: u32::MAX,
                ..e
            })
            .is_err(),
            "slot out of range"
        );
        assert!(
            c.read_frame(&Entry { ring_gen: 9, ..e }).is_err(),
            "other ring"
        );
    }

    #[test]
    fn corrupted_client_block_is_rejected() {
        let p = ClientChannel::create(8).unwrap();
        assert!(ConsumerChannel::open(p.fd().try_clone_to_owned().unwrap(), 16).is_err());
        assert!(ConsumerChannel::open(p.fd().try_clone_to_owned().unwrap(), 0).is_err());
        let c = ConsumerChannel::open(p.fd().try_clone_to_owned().unwrap(), 8).unwrap();
        c.header().wpos.store(1 << 50, Ordering::Relaxed);
        assert!(c.take().is_err());
    }

    #[test]
    fn slot_of_ptr_maps_back() {
        let p = ProducerRing::create(1, 4, 5000, false).unwrap();
        for s in 0..4 {
            assert_eq!(p.slot_of_ptr(p.slot_ptr(s)), Some(s));
            assert_eq!(p.slot_of_ptr(unsafe { p.slot_ptr(s).add(1) }), None);
        }
        assert_eq!(p.slot_of_ptr(p.mapping().0), None);
        assert_eq!(
            p.slot_of_ptr(unsafe { p.slot_ptr(3).add(p.slot_size() as usize) }),
            None
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn any_meta() -> impl Strategy<Value = FrameMeta> {
            (
                (any::<u64>(), any::<u32>(), any::<u32>()),
                proptest::array::uniform4(any::<u64>()),
                proptest::array::uniform4(any::<u32>()),
                prop_oneof![any::<u64>(), 0u64..70_000],
            )
                .prop_map(|((a, n, f), offs, strides, size)| FrameMeta {
                    payload_size: size,
                    pts: a,
                    n_planes: n % 8,
                    buffer_flags: f,
                    plane_offset: offs.map(|o| if o % 2 == 0 { o % 70_000 } else { o }),
                    plane_stride: strides.map(|s| if s % 2 == 0 { s % 5000 } else { s }),
                    ..Default::default()
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

            /// Whatever a producer writes in a descriptor, the consumer errors or returns a
            /// frame whose bytes lie inside its slot.
            #[test]
            fn descriptors_are_validated(m in any_meta(), slot in 0u32..6, seq in 1u64..5, claim in 1u64..5) {
                let (p, c) = open_pair(4, 65536);
                p.publish(slot.min(3), seq, &m);
                if let Ok((got, ptr)) = c.read_frame(&Entry { seq: claim, ring_gen: 1, slot }) {
                    prop_assert!(slot < 4 && seq == claim);
                    prop_assert!(got.payload_size <= c.geometry().slot_size);
                    prop_assert!(got.n_planes as usize <= MAX_PLANES);
                    for i in 0..got.n_planes as usize {
                        prop_assert!(got.plane_offset[i] < got.payload_size);
                    }
                    let (base, len) = c.mapping();
                    prop_assert!(ptr as usize + got.payload_size as usize <= base as usize + len);
                }
            }

            /// Random header values: opening errors, or the geometry is exactly the announced one.
            #[test]
            fn headers_are_validated(field in 0usize..9, value in any::<u64>()) {
                let p = ProducerRing::create(1, 4, 8192, false).unwrap();
                let g = p.geometry();
                let h = p.header();
                match field {
                    0 => h.magic.store(value, Ordering::Relaxed),
                    1 => h.version.store(value as u32, Ordering::Relaxed),
                    2 => h.header_size.store(value as u32, Ordering::Relaxed),
                    3 => h.desc_size.store(value as u32, Ordering::Relaxed),
                    4 => h.slot_count.store(value as u32, Ordering::Relaxed),
                    5 => h.slot_size.store(value, Ordering::Relaxed),
                    6 => h.desc_offset.store(value, Ordering::Relaxed),
                    7 => h.data_offset.store(value, Ordering::Relaxed),
                    _ => h.total_size.store(value, Ordering::Relaxed),
                }
                if let Ok(c) = ConsumerRing::open(p.read_only_fd().unwrap(), false, 1, 4, g.slot_size, g.total_size) {
                    prop_assert_eq!(c.geometry(), g);
                }
            }

            /// A consumer scribbling over everything it can write never makes the producer
            /// panic or count frames it never handed out.
            #[test]
            fn client_scribbles_are_validated(ops in proptest::collection::vec((0u8..6, any::<u64>()), 1..60)) {
                let (mut pch, cch) = client_pair();
                let mut delivered = 0u64;
                for (op, v) in ops {
                    let h = cch.header();
                    let r = match op {
                        0 => {
                            delivered += 1;
                            pch.deliver(Entry { seq: delivered, ring_gen: 1, slot: (v % 4) as u32 }).map(|_| ())
                        }
                        1 => { h.rpos.store(v % 200, Ordering::Relaxed); pch.sync_taken() }
                        2 => { h.rel_wpos.store(v % 300, Ordering::Relaxed); pch.take_releases().map(|_| ()) }
                        3 => {
                            let q = cch.entry(1, v % 300);
                            q.seq.store(v % (delivered + 2), Ordering::Relaxed);
                            q.loc.store(pack_loc(1, (v % 5) as u32), Ordering::Relaxed);
                            Ok(())
                        }
                        4 => { if let Ok(Some(e)) = cch.take() { cch.release(e); } pch.take_releases().map(|_| ()) }
                        _ => pch.revoke_oldest().map(|_| ()),
                    };
                    let outstanding: Vec<Entry> = pch.outstanding().copied().collect();
                    prop_assert!(outstanding.len() as u64 <= delivered);
                    for e in &outstanding {
                        prop_assert!(e.seq >= 1 && e.seq <= delivered && e.slot < 4);
                    }
                    if r.is_err() {
                        // The producer would disconnect this client here.
                        break;
                    }
                }
            }
        }
    }
}
