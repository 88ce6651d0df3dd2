// SPDX-License-Identifier: MPL-2.0
//! The producer's end: creates the ring memfd and one control memfd per client, publishes
//! frames, hands them to clients and takes them back.
//!
//! The producer never trusts what a client wrote: it keeps its own record of which frames it
//! handed to each client (`pending` until taken, `held` after), and every position or release a
//! client writes is checked against that record. A client can only hurt itself.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use memmap2::MmapMut;

use super::layout::*;
use super::shm;
use crate::{Error, Result};

pub use super::frame::{Entry, FrameMeta, TimeCode};
pub(crate) use crate::ring::layout::Base;

/// The GPU memory that holds a device ring's pixels, as consumers are sent it (see
/// [`crate::cuda::vmm`]; made there, kept here so that the transport needs no CUDA).
#[derive(Debug)]
pub struct DeviceShare {
    /// The GPU, named the same way in every process.
    pub gpu_uuid: [u8; 16],
    /// Bytes of the allocation (at least the ring's total size: it mirrors the memfd).
    pub size: u64,
    /// The allocation's shareable descriptor, duplicated for each consumer by SCM_RIGHTS.
    pub fd: OwnedFd,
}

/// The producer's ring: one sealed memfd, mapped once, read-write.
pub struct ProducerRing {
    /// Something that must live exactly as long as the mapping and go before it (a GPU
    /// registration). Declared first: fields drop in order.
    attachment: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    fd: OwnedFd,
    /// Opened read-only when the ring was made, before any client could touch the memfd:
    /// clients get duplicates of it, so nothing a client does to the inode (fchmod) can stop
    /// the producer from handing out more.
    ro_fd: OwnedFd,
    /// The ring is not sealed against writes: clients that ask get a writable descriptor.
    writable: bool,
    _map: MmapMut,
    base: Base,
    geom: RingGeometry,
    ring_gen: u32,
    /// Set for a device ring: its pixels are in GPU memory, the memfd's slot bytes unused.
    device: std::sync::OnceLock<DeviceShare>,
}

impl ProducerRing {
    /// A new ring. Unless `writable`, it is sealed against writes once the producer has
    /// mapped it: no consumer can ever write to it, whatever descriptor tricks it plays.
    pub fn create(
        ring_gen: u32,
        slot_count: u32,
        min_slot_size: u64,
        writable: bool,
    ) -> Result<Self> {
        let geom = RingGeometry::new(slot_count, min_slot_size).ok_or_else(|| {
            Error::Invalid(format!(
                "cannot build a ring of {slot_count} slots of {min_slot_size} bytes \
                 (1..={MAX_SLOTS} slots of at most {MAX_SLOT_SIZE} bytes)"
            ))
        })?;
        let fd = shm::create_memfd(&format!("gpushm-ring-{ring_gen}"), geom.total_size)?;
        let mut map = shm::map_rw(&fd, geom.total_size)?;
        let ro_fd = shm::reopen_read_only(fd.as_fd())?;
        shm::seal(fd.as_fd(), !writable)?;
        let base =
            Base(NonNull::new(map.as_mut_ptr()).ok_or_else(|| Error::corrupt("null mapping"))?);
        let ring = Self {
            attachment: Default::default(),
            fd,
            ro_fd,
            writable,
            _map: map,
            base,
            geom,
            ring_gen,
            device: Default::default(),
        };
        let h = ring.header();
        h.magic.store(RING_MAGIC, Ordering::Relaxed);
        h.header_size
            .store(RING_HEADER_SIZE as u32, Ordering::Relaxed);
        h.desc_size.store(SLOT_DESC_SIZE as u32, Ordering::Relaxed);
        h.slot_count.store(slot_count, Ordering::Relaxed);
        h.slot_size.store(geom.slot_size, Ordering::Relaxed);
        h.desc_offset.store(geom.desc_offset, Ordering::Relaxed);
        h.data_offset.store(geom.data_offset, Ordering::Relaxed);
        h.total_size.store(geom.total_size, Ordering::Relaxed);
        h.ring_gen.store(ring_gen, Ordering::Relaxed);
        h.version.store(LAYOUT_VERSION, Ordering::Release);
        Ok(ring)
    }

    pub fn header(&self) -> &RingHeader {
        // SAFETY: the mapping is at least one page, page-aligned, and RingHeader is all atomics.
        unsafe { &*(self.base.0.as_ptr() as *const RingHeader) }
    }

    fn desc(&self, slot: u32) -> &SlotDesc {
        assert!(slot < self.geom.slot_count);
        let off = self.geom.desc_offset as usize + slot as usize * SLOT_DESC_SIZE;
        // SAFETY: in bounds (geometry), aligned (256-byte multiples), all atomics.
        unsafe { &*(self.base.0.as_ptr().add(off) as *const SlotDesc) }
    }

    pub fn geometry(&self) -> RingGeometry {
        self.geom
    }
    pub fn ring_gen(&self) -> u32 {
        self.ring_gen
    }
    pub fn slot_count(&self) -> u32 {
        self.geom.slot_count
    }
    pub fn slot_size(&self) -> u64 {
        self.geom.slot_size
    }

    /// Start of a slot's bytes. Writing through it is allowed only while the producer owns the
    /// slot (no client references it).
    pub fn slot_ptr(&self, slot: u32) -> *mut u8 {
        assert!(slot < self.geom.slot_count);
        // SAFETY: in bounds of the mapping.
        unsafe {
            self.base
                .0
                .as_ptr()
                .add(self.geom.slot_offset(slot) as usize)
        }
    }

    /// The slot a pointer to the start of a slot belongs to.
    pub fn slot_of_ptr(&self, ptr: *const u8) -> Option<u32> {
        let start = self.base.0.as_ptr() as usize + self.geom.data_offset as usize;
        let p = ptr as usize;
        if p < start {
            return None;
        }
        let rel = (p - start) as u64;
        if !rel.is_multiple_of(self.geom.slot_size) {
            return None;
        }
        let slot = rel / self.geom.slot_size;
        (slot < self.geom.slot_count as u64).then_some(slot as u32)
    }

    /// Attaches `v` to the mapping's lifetime (first caller wins); see the field.
    pub fn attach(&self, v: Box<dyn std::any::Any + Send + Sync>) -> bool {
        self.attachment.set(v).is_ok()
    }

    pub fn attachment(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        self.attachment.get().map(|b| b.as_ref())
    }

    /// Makes this a device ring (before it is announced): its pixels are in `share`, which
    /// every consumer is sent with the ring. False if it already was one.
    pub fn set_device(&self, share: DeviceShare) -> bool {
        self.device.set(share).is_ok()
    }

    /// The GPU memory holding the pixels, for a device ring.
    pub fn device(&self) -> Option<&DeviceShare> {
        self.device.get()
    }

    /// The whole mapping, for registering it with a GPU in one piece.
    pub fn mapping(&self) -> (*mut u8, usize) {
        (self.base.0.as_ptr(), self.geom.total_size as usize)
    }

    /// A read-only descriptor of the ring for a client.
    pub fn read_only_fd(&self) -> Result<OwnedFd> {
        dup(&self.ro_fd)
    }

    /// Whether clients may get a writable descriptor ([`Self::read_write_fd`]).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// A writable descriptor of the ring, for a client whose GPU cannot register read-only
    /// memory, when the ring was made writable; otherwise an error.
    pub fn read_write_fd(&self) -> Result<OwnedFd> {
        if !self.writable {
            return Err(Error::Invalid(
                "the ring is sealed against writes: the producer does not allow writable rings"
                    .into(),
            ));
        }
        dup(&self.fd)
    }

    /// Writes the descriptor of `slot`, then makes it visible as frame `seq`.
    pub fn publish(&self, slot: u32, seq: u64, m: &FrameMeta) {
        let d = self.desc(slot);
        let r = Ordering::Relaxed;
        d.seq.store(0, r);
        d.payload_size.store(m.payload_size, r);
        d.pts.store(m.pts, r);
        d.dts.store(m.dts, r);
        d.duration.store(m.duration, r);
        d.offset.store(m.offset, r);
        d.offset_end.store(m.offset_end, r);
        d.pts_clock.store(m.pts_clock, r);
        d.dts_clock.store(m.dts_clock, r);
        d.publish_ns.store(m.publish_ns, r);
        d.buffer_flags.store(m.buffer_flags, r);
        d.caps_gen.store(m.caps_gen, r);
        d.video_format.store(m.video_format, r);
        d.width.store(m.width, r);
        d.height.store(m.height, r);
        d.n_planes.store(m.n_planes, r);
        for i in 0..MAX_PLANES {
            d.plane_offset[i].store(m.plane_offset[i], r);
            d.plane_stride[i].store(m.plane_stride[i], r);
            d.plane_rows[i].store(m.plane_rows[i], r);
            d.plane_row_bytes[i].store(m.plane_row_bytes[i], r);
            d.plane_components[i].store(m.plane_components[i], r);
        }
        d.latency.store(m.latency, r);
        d.clock_offset.store(m.clock_offset as u64, r);
        d.events_seq.store(m.events_seq, r);
        let tc = m.timecode.unwrap_or_default();
        let present = if m.timecode.is_some() { TC_PRESENT } else { 0 };
        d.tc_flags.store(present | tc.flags << 8, r);
        d.tc_fps_n.store(tc.fps_n, r);
        d.tc_fps_d.store(tc.fps_d, r);
        d.tc_hours.store(tc.hours, r);
        d.tc_minutes.store(tc.minutes, r);
        d.tc_seconds.store(tc.seconds, r);
        d.tc_frames.store(tc.frames, r);
        d.tc_field_count.store(tc.field_count, r);
        let flags =
            if m.live { STREAM_LIVE } else { 0 } | if m.has_metas { STREAM_HAS_METAS } else { 0 };
        d.stream_flags.store(flags, r);
        d.seq.store(seq, Ordering::Release);
    }
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd> {
    fd.try_clone().map_err(|e| {
        Error::os(
            "dup",
            nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
        )
    })
}

/// The producer's end of one client's control memfd, plus the producer's private record of
/// what that client references.
pub struct ClientChannel {
    fd: OwnedFd,
    _map: MmapMut,
    base: Base,
    capacity: u32,
    wpos: u64,
    rpos_seen: u64,
    rel_rpos: u64,
    dropped: u64,
    /// Of `dropped`, the frames never handed over because the client held its whole budget.
    skipped: u64,
    taken: u64,
    pending: VecDeque<Entry>,
    held: Vec<Entry>,
    /// The budget last stored in the header.
    budget: Option<u32>,
}

impl ClientChannel {
    pub fn create(capacity: u32) -> Result<Self> {
        if capacity == 0 || capacity > 4 * CLIENT_QUEUE_CAPACITY {
            return Err(Error::Invalid(format!(
                "queue capacity {capacity} is out of range"
            )));
        }
        let size = client_block_size(capacity);
        let fd = shm::create_sealed_memfd("gpushm-client", size)?;
        let mut map = shm::map_rw(&fd, size)?;
        let base =
            Base(NonNull::new(map.as_mut_ptr()).ok_or_else(|| Error::corrupt("null mapping"))?);
        let ch = Self {
            fd,
            _map: map,
            base,
            capacity,
            wpos: 0,
            rpos_seen: 0,
            rel_rpos: 0,
            dropped: 0,
            skipped: 0,
            taken: 0,
            pending: VecDeque::new(),
            held: Vec::new(),
            budget: None,
        };
        let h = ch.header();
        h.magic.store(CLIENT_MAGIC, Ordering::Relaxed);
        h.capacity.store(capacity, Ordering::Relaxed);
        h.version.store(LAYOUT_VERSION, Ordering::Release);
        Ok(ch)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn header(&self) -> &ClientHeader {
        // SAFETY: the mapping holds a whole client block of `capacity` entries a queue.
        unsafe { client_header(self.base) }
    }

    fn entry(&self, queue: usize, pos: u64) -> &QueueEntry {
        // SAFETY: as above; capacity > 0 (checked when the block was made or opened).
        unsafe { queue_entry(self.base, self.capacity, queue, pos) }
    }

    /// Reads the client's read position and moves what it took from `pending` to `held`.
    pub fn sync_taken(&mut self) -> Result<()> {
        let r = self.header().rpos.load(Ordering::Acquire);
        if r < self.rpos_seen || r > self.wpos {
            return Err(Error::protocol(format!(
                "client moved its read position to {r}, outside {}..={}",
                self.rpos_seen, self.wpos
            )));
        }
        while self.rpos_seen < r {
            let e = self
                .pending
                .pop_front()
                .ok_or_else(|| Error::corrupt("pending queue out of step"))?;
            self.held.push(e);
            self.rpos_seen += 1;
            self.taken += 1;
        }
        Ok(())
    }

    /// Frames the client took (moved its read position past), revoked ones not counted.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// Frames handed over but not yet taken.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Frames taken and not yet released.
    pub fn held_len(&self) -> usize {
        self.held.len()
    }

    /// Frames the client did not get: revoked because it fell behind, or skipped.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Of [`Self::dropped`], the frames never handed over because the client held its whole
    /// budget.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The client's latency histogram (see [`crate::ring::layout::latency_bucket`]): its own
    /// figures, only reported.
    pub fn latency_histogram(&self) -> Vec<u32> {
        // SAFETY: the mapping holds a whole client block of `capacity` entries a queue.
        let hist = unsafe { client_latency(self.base, self.capacity) };
        hist.iter().map(|b| b.load(Ordering::Relaxed)).collect()
    }

    /// Asks the client to write its slot-released eventfd after each release (`true`), or
    /// to leave releases for the producer to pick up (`false`). Ordered before any later
    /// look at the release queue.
    pub fn set_producer_waits(&self, on: bool) {
        self.header()
            .producer_waits
            .store(on as u32, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Whether the client waits on its frame-ready eventfd, so that a delivery made before
    /// this call must write it. (A client that lies only misses or gets wake-ups.)
    pub fn consumer_waits(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.header().consumer_waits.load(Ordering::Relaxed) != 0
    }

    /// Whether the client sleeps in a subscriber's wait for a frame (not polling the doorbell
    /// in an event loop of its own) and went to sleep on a CPU other than `cpu` (1 + the
    /// CPU, see [`crate::ring::layout::this_cpu`]): a wake-up from `cpu` ahead of a frame then ends
    /// that sleep early without taking `cpu` from us. (A client that lies only misses or
    /// gets such wake-ups.)
    pub fn consumer_sleeps_off(&self, cpu: u32) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        let h = self.header();
        let slept_on = h.sleep_cpu.load(Ordering::Acquire);
        h.consumer_waits.load(Ordering::Acquire) == crate::ring::layout::WAITS_SLEEPING
            && cpu != 0
            && slept_on != 0
            && slept_on != cpu
    }

    /// Tells the client which CPU (1 + the CPU) a wake-up ahead of a frame comes from.
    pub fn set_early_wake_cpu(&self, cpu: u32) {
        self.header().early_wake_cpu.store(cpu, Ordering::Relaxed);
    }

    /// Tells the client, before its slots are taken back, that its frames are no longer its
    /// own.
    pub fn mark_revoked(&self) {
        self.header().revoked.store(1, Ordering::SeqCst);
    }

    /// Tells the client how many frames it may reference at once.
    pub fn set_budget(&mut self, budget: u32) {
        // Stored only when it changes: the client reads the producer's line of the header
        // each frame.
        if self.budget != Some(budget) {
            self.budget = Some(budget);
            self.header().budget.store(budget, Ordering::Relaxed);
        }
    }

    /// Frames the client says it copied out of the ring (its own count, only reported).
    pub fn copied(&self) -> u64 {
        self.header().copied.load(Ordering::Relaxed)
    }

    /// Counts a frame this client does not get (it holds its whole budget), where the
    /// consumer sees it too.
    pub fn skip(&mut self) {
        self.skipped += 1;
        self.dropped += 1;
        self.header().dropped.store(self.dropped, Ordering::Relaxed);
    }

    /// Takes back the oldest frame the client has not taken yet. Returns it if revoked, or
    /// `None` if the client took it in the meantime (or nothing was pending).
    pub fn revoke_oldest(&mut self) -> Result<Option<Entry>> {
        self.sync_taken()?;
        if self.pending.is_empty() {
            return Ok(None);
        }
        let r = self.rpos_seen;
        match self
            .header()
            .rpos
            .compare_exchange(r, r + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                self.rpos_seen += 1;
                self.dropped += 1;
                self.header().dropped.store(self.dropped, Ordering::Relaxed);
                Ok(self.pending.pop_front())
            }
            Err(_) => {
                self.sync_taken()?;
                Ok(None)
            }
        }
    }

    /// Hands frame `e` to the client. The caller then wakes it through its eventfd.
    pub fn deliver(&mut self, e: Entry) -> Result<()> {
        self.sync_taken()?;
        if self.wpos - self.rpos_seen >= self.capacity as u64 {
            return Err(Error::protocol("the client's delivery queue is full"));
        }
        let q = self.entry(0, self.wpos);
        q.seq.store(e.seq, Ordering::Relaxed);
        q.loc.store(pack_loc(e.ring_gen, e.slot), Ordering::Relaxed);
        self.wpos += 1;
        self.header().wpos.store(self.wpos, Ordering::Release);
        self.pending.push_back(e);
        Ok(())
    }

    /// Reads the frames the client gave back. Each must be one it holds; anything else is a
    /// protocol violation and the caller disconnects the client.
    pub fn take_releases(&mut self) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        self.take_releases_into(&mut out)?;
        Ok(out)
    }

    /// [`Self::take_releases`], appending to `out`: the producer's way for every frame, which
    /// allocates nothing once `out` has room. On an error `out` and what the client holds are
    /// as they were.
    pub fn take_releases_into(&mut self, out: &mut Vec<Entry>) -> Result<()> {
        // The release position first: a client takes a frame before it releases it, so once
        // a release is seen, the read position that took the frame is seen too (Acquire).
        // The other order can see a release of a frame not yet known as taken.
        let w = self.header().rel_wpos.load(Ordering::Acquire);
        self.sync_taken()?;
        if w == self.rel_rpos {
            return Ok(());
        }
        if w < self.rel_rpos || w - self.rel_rpos > self.capacity as u64 {
            return Err(Error::protocol(format!(
                "client moved its release position to {w}, outside {}..={}",
                self.rel_rpos,
                self.rel_rpos + self.capacity as u64
            )));
        }
        // Validated as it goes: on an error, what this batch took out of `held` goes back,
        // and the caller drops the client and gives back everything it still holds, this
        // batch included.
        let start = out.len();
        for pos in self.rel_rpos..w {
            let q = self.entry(1, pos);
            let seq = q.seq.load(Ordering::Relaxed);
            let (ring_gen, slot) = unpack_loc(q.loc.load(Ordering::Relaxed));
            let e = Entry {
                seq,
                ring_gen,
                slot,
            };
            let Some(i) = self.held.iter().position(|h| *h == e) else {
                self.held.extend(out.drain(start..));
                return Err(Error::protocol(format!(
                    "client released frame {seq} (ring {ring_gen}, slot {slot}) that it does not hold"
                )));
            };
            self.held.swap_remove(i);
            out.push(e);
        }
        self.rel_rpos = w;
        self.header()
            .rel_rpos
            .store(self.rel_rpos, Ordering::Release);
        Ok(())
    }

    /// Every frame the client still references: what to give back when it goes away.
    pub fn outstanding(&self) -> impl Iterator<Item = &Entry> {
        self.pending.iter().chain(self.held.iter())
    }
}
