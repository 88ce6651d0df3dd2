// SPDX-License-Identifier: MPL-2.0
//! One connection to a producer once the handshake is done: the messages it sends (rings,
//! GPU memory, caps, EOS, the reason it cut us), the rings mapped, and the frames taken from
//! the delivery queue, each with its [`SlotLease`]. How to wait for the next one is
//! [`super::wait`]'s business.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::frame::Frame;
use super::lease::{Releaser, SlotLease};
use super::options::ConnectOptions;
use super::wait::SpinStats;
use crate::ring::consumer_end::ConsumerRing;
use crate::ring::shm;
use crate::wire::{Conn, Message, RING_DEVICE, RING_WRITABLE};
use crate::{Error, Result};

/// Caps generations remembered for frames still queued from before a caps change.
const CAPS_HISTORY: usize = 8;

pub(crate) struct Connection {
    /// Moved into the releaser when the connection is dropped (see `Drop`).
    pub(super) conn: ManuallyDrop<Conn>,
    pub(super) client_id: u32,
    /// Readable when the producer delivered a frame while we wait.
    pub(super) ready: shm::Doorbell,
    pub(super) releaser: Arc<Releaser>,
    pub(super) rings: VecDeque<Arc<ConsumerRing>>,
    pub(super) caps: VecDeque<(u32, Arc<str>)>,
    pub(super) eos: bool,
    pub(super) gone: Option<Error>,
    pub(super) writable: bool,
    pub(super) device_memory: bool,
    /// A device ring announced by Ring, waiting for its DeviceMemory.
    pub(super) device_pending: Option<ConsumerRing>,
    /// poll() saw the socket readable (or hung up) since it was last read.
    pub(super) socket_ready: bool,
    /// The caller polls the frame-ready eventfd itself ([`Self::ready_fd`]): the producer
    /// writes it after every delivery, not only while we wait.
    pub(super) always_wake: AtomicBool,
    /// Low-latency mode's budget per frame ([`ConnectOptions::spin`]; zero: off).
    pub(super) spin: Duration,
    /// When the next frame is due (low-latency mode).
    pub(super) cadence: crate::cadence::Cadence,
    /// This thread's timer slack, ns (low-latency mode wakes up that much earlier).
    pub(super) slack_ns: u64,
    /// Low-latency mode: frames that came while polling, and polls that ended without one.
    pub(super) spin_stats: SpinStats,
    /// A wake-up that finds no frame may poll for it ([`EARLY_WAKE_POLL`]): once per frame
    /// taken, so that a producer that rings for nothing costs us one poll a frame at most.
    pub(super) early_poll: bool,
    /// Those polls: frames they caught, and polls that ended without one.
    pub(super) early_stats: SpinStats,
}

impl Connection {
    /// The connection of client `client_id` once its Welcome came, with its frame-ready
    /// doorbell and its releaser.
    pub(super) fn new(
        conn: Conn,
        client_id: u32,
        ready: shm::Doorbell,
        releaser: Arc<Releaser>,
        opts: &ConnectOptions,
    ) -> Self {
        Self {
            conn: ManuallyDrop::new(conn),
            client_id,
            ready,
            releaser,
            rings: VecDeque::new(),
            caps: VecDeque::new(),
            eos: false,
            gone: None,
            writable: opts.writable_ring,
            device_memory: opts.device_memory,
            device_pending: None,
            socket_ready: true,
            always_wake: AtomicBool::new(false),
            spin: opts.spin,
            cadence: Default::default(),
            slack_ns: if opts.spin.is_zero() {
                0
            } else {
                crate::cadence::timer_slack_ns()
            },
            spin_stats: SpinStats::default(),
            early_poll: true,
            early_stats: SpinStats::default(),
        }
    }

    pub fn client_id(&self) -> u32 {
        self.client_id
    }

    /// Frames the producer took back because we fell behind.
    pub fn dropped(&self) -> u64 {
        self.releaser.ch.dropped()
    }

    /// Frames of this connection we reference now (leases alive, wherever they are).
    pub fn leases(&self) -> usize {
        self.releaser.leases.load(Ordering::Acquire)
    }

    /// Frames the producer lets us reference at once (0: it did not say).
    pub fn budget(&self) -> u32 {
        self.releaser.ch.budget()
    }

    /// Whether the frame just taken should be copied out of the ring and given back at once,
    /// and if so how many frames we reference (the one just taken included). We keep at most
    /// `zero_copy_limit()` frames zero-copy, so the producer never has to wait for frames
    /// downstream keeps, and frames still arrive while this process gets no CPU for a moment.
    pub fn should_copy(&self) -> Option<usize> {
        let held = self.leases();
        (self.budget() > 0 && held > self.zero_copy_limit()).then_some(held)
    }

    /// Frames we keep zero-copy at most: our budget less room for frames on their way to us
    /// (two when the budget allows, one otherwise).
    pub fn zero_copy_limit(&self) -> usize {
        crate::policy::zero_copy_limit(self.budget() as usize)
    }

    /// Counts a frame copied out of the ring (reported to the producer's statistics too).
    pub fn count_copy(&self) -> u64 {
        let n = self.releaser.copied.fetch_add(1, Ordering::Relaxed) + 1;
        self.releaser.ch.set_copied(n);
        n
    }

    /// Frames copied out of the ring on this connection.
    pub fn copied(&self) -> u64 {
        self.releaser.copied.load(Ordering::Relaxed)
    }

    /// The newest caps the producer announced.
    pub fn caps(&self) -> Option<Arc<str>> {
        self.caps.back().map(|c| c.1.clone())
    }

    pub fn is_eos(&self) -> bool {
        self.eos
    }

    pub fn socket_fd(&self) -> RawFd {
        self.conn.raw_fd()
    }

    /// Handles every message waiting on the socket.
    pub(super) fn pump(&mut self) -> Result<()> {
        if self.gone.is_some() {
            return Ok(());
        }
        loop {
            let (msg, mut fds) = match self.conn.try_recv() {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(()),
                Err(e) => {
                    // An Error message read just before (the producer's reason) stays.
                    self.gone.get_or_insert(e);
                    return Ok(());
                }
            };
            match msg {
                Message::Ring {
                    ring_gen,
                    flags,
                    slot_count,
                    slot_size,
                    total_size,
                } => {
                    let fd = fds
                        .pop()
                        .ok_or_else(|| Error::protocol("Ring arrived without its descriptor"))?;
                    if flags & RING_WRITABLE != 0 && !self.writable {
                        return Err(Error::protocol(
                            "the producer sent a writable ring nobody asked for",
                        ));
                    }
                    if flags & RING_DEVICE != 0 && !self.device_memory {
                        return Err(Error::protocol(
                            "the producer sent a ring in GPU memory nobody asked for",
                        ));
                    }
                    let ring = ConsumerRing::open(
                        fd,
                        flags & RING_WRITABLE != 0,
                        ring_gen,
                        slot_count,
                        slot_size,
                        total_size,
                    )?;
                    if flags & RING_DEVICE != 0 {
                        // Usable once its GPU memory is mapped.
                        self.device_pending = Some(ring);
                    } else {
                        self.push_ring(ring);
                    }
                }
                Message::DeviceMemory {
                    ring_gen,
                    gpu_uuid,
                    size,
                } => {
                    let fd = fds.pop().ok_or_else(|| {
                        Error::protocol("DeviceMemory arrived without its descriptor")
                    })?;
                    let ring = self
                        .device_pending
                        .take()
                        .filter(|r| r.ring_gen() == ring_gen)
                        .ok_or_else(|| {
                            Error::protocol(format!(
                                "GPU memory for ring {ring_gen}, which is not a device ring announced just before"
                            ))
                        })?;
                    let (_, len) = ring.mapping();
                    if size < len as u64 {
                        return Err(Error::protocol(format!(
                            "the GPU memory of ring {ring_gen} is {size} bytes, smaller than the ring ({len})"
                        )));
                    }
                    map_device_ring(&ring, fd, &gpu_uuid)?;
                    self.push_ring(ring);
                }
                Message::Caps { caps_gen, caps } => {
                    self.caps.push_back((caps_gen, caps.into()));
                    while self.caps.len() > CAPS_HISTORY {
                        self.caps.pop_front();
                    }
                }
                Message::Eos => self.eos = true,
                Message::Error { message } => {
                    // It cut us: every slot we held is the producer's again.
                    *self
                        .releaser
                        .reason
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(message.clone());
                    self.releaser.cut.store(true, Ordering::Release);
                    self.gone = Some(Error::Refused(format!(
                        "the producer closed the connection: {message}"
                    )));
                }
                m => {
                    return Err(Error::protocol(format!(
                        "unexpected {m:?} from the producer"
                    )))
                }
            }
        }
    }

    fn push_ring(&mut self, ring: ConsumerRing) {
        self.rings.push_back(Arc::new(ring));
        // Keep the previous ring: frames queued before the switch still use it.
        while self.rings.len() > 2 {
            self.rings.pop_front();
        }
    }

    /// The next frame, if one is queued. `Err(Disconnected)` once the producer is gone and
    /// every frame it delivered was taken.
    #[link_section = ".text.hot.gpushm"]
    pub fn try_next(&mut self) -> Result<Option<Frame>> {
        // Read the socket only when poll() said it has news (or a frame needs news): no
        // syscall per frame for nothing.
        if std::mem::take(&mut self.socket_ready) {
            self.pump()?;
        }
        self.releaser.flush();
        let Some(e) = self.releaser.ch.take()? else {
            return match self.gone.take() {
                Some(err) if !self.eos => Err(err),
                _ => Ok(None),
            };
        };
        let lookup = |c: &Self| c.rings.iter().find(|r| r.ring_gen() == e.ring_gen).cloned();
        let ring = match lookup(self) {
            Some(r) => r,
            None => {
                self.pump()?;
                lookup(self).ok_or_else(|| {
                    Error::protocol(format!("frame {} is in unknown ring {}", e.seq, e.ring_gen))
                })?
            }
        };
        self.releaser.leases.fetch_add(1, Ordering::AcqRel);
        self.early_poll = true;
        let lease = SlotLease {
            entry: e,
            ring: ring.clone(),
            releaser: self.releaser.clone(),
        };
        let (meta, ptr) = ring.read_frame(&e)?;
        if meta.publish_ns != 0 && meta.publish_ns != crate::ring::layout::NONE_U64 {
            self.releaser
                .ch
                .record_latency(crate::monotonic_ns().saturating_sub(meta.publish_ns));
            if !self.spin.is_zero() {
                self.cadence.record(meta.publish_ns);
            }
        }
        let find = |c: &Self| {
            c.caps
                .iter()
                .find(|c| c.0 == meta.caps_gen)
                .map(|c| c.1.clone())
        };
        if find(self).is_none() {
            // Caps are sent before the first frame that uses them: they are on the socket.
            self.pump()?;
        }
        let caps = find(self).ok_or_else(|| {
            Error::protocol(format!(
                "frame {} uses unknown caps generation {}",
                e.seq, meta.caps_gen
            ))
        })?;
        Ok(Some(Frame {
            meta,
            seq: e.seq,
            ptr,
            caps,
            lease,
        }))
    }
}

impl Drop for Connection {
    /// Tells the producer we take no more frames, and hands the socket to the leases: the
    /// producer keeps the slots of frames still held until the last lease is gone.
    fn drop(&mut self) {
        let releaser = self.releaser.clone();
        let held = || releaser.leases.load(Ordering::Acquire) > 0;
        if self.gone.is_none() && held() {
            // What the producer sent before is read now: an Error in it is why it cut us.
            let _ = self.pump();
        }
        // SAFETY: taken once, here; the field is not used after.
        let conn = unsafe { ManuallyDrop::take(&mut self.conn) };
        if !held() {
            // Nothing held: closing the socket says it all.
            return;
        }
        // Whatever went wrong on the connection, the socket stays open while frames are held:
        // closing it would give their slots back. A send that fails (the producer went away
        // or cut us) changes nothing.
        let _ = conn.send(&Message::Close, &[]);
        *self
            .releaser
            .closed_link
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(conn);
    }
}

/// Maps the GPU memory `fd` of a device ring (on the GPU named `gpu_uuid`), read-only, as
/// the ring's attachment.
#[cfg(feature = "cuda")]
fn map_device_ring(
    ring: &ConsumerRing,
    fd: std::os::fd::OwnedFd,
    gpu_uuid: &[u8; 16],
) -> Result<()> {
    use crate::cuda::vmm::{device_by_uuid, DeviceMemory};
    let (base, len) = ring.mapping();
    let mut mem = device_by_uuid(gpu_uuid)
        .and_then(|dev| DeviceMemory::import(&dev, std::os::fd::AsFd::as_fd(&fd), len))
        .map_err(|e| Error::Invalid(format!("cannot map the producer's GPU memory: {e}")))?;
    mem.mirror(base, len);
    if !ring.attach(Box::new(mem)) {
        return Err(Error::Invalid("the ring already has a GPU mapping".into()));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn map_device_ring(_: &ConsumerRing, _: std::os::fd::OwnedFd, _: &[u8; 16]) -> Result<()> {
    Err(Error::Invalid(
        "the producer's frames are in GPU memory and gpushm was built without its cuda feature"
            .into(),
    ))
}
