// SPDX-License-Identifier: MPL-2.0
//! A subscriber's connection once the handshake is done: what the producer announces on the
//! socket ([`Announced`]: rings, GPU memory, caps, EOS, the reason it cut us), and the frames
//! taken from the delivery queue, each with its [`SlotLease`]. How to wait for the next one
//! is `wait.rs`'s business.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::frame::Frame;
use super::lease::SlotLease;
use super::options::ConnectOptions;
use super::Subscriber;
use crate::ring::consumer_end::ConsumerRing;
use crate::wire::{Message, RING_DEVICE, RING_WRITABLE};
use crate::{Error, Result};

/// Caps generations remembered for frames still queued from before a caps change.
const CAPS_HISTORY: usize = 8;

/// FrameMetas kept for frames not taken yet, at most (a leaky consumer's frames may be taken
/// back before it takes them).
const FRAME_METAS_KEPT: usize = 64;

/// Messages handled per look at the socket at most: a producer that floods its socket keeps
/// a waiting consumer no longer than this past its timeout or an interrupt.
const MESSAGES_PER_PUMP: usize = 64;

/// Messages a producer may send with no frame between them: a few announce each ring and
/// caps (two for a caps change), EOS, its reason for cutting us. More is a flood, and the
/// producer is treated as broken.
const MESSAGES_WITHOUT_FRAME: u32 = 256;

/// What the producer announced on the socket: the rings mapped (the newest and the one
/// before, whose frames may still be queued), the caps of the last generations, EOS, and why
/// it went away.
pub(super) struct Announced {
    pub rings: VecDeque<Arc<ConsumerRing>>,
    pub caps: VecDeque<(u32, Arc<str>)>,
    /// Events received and not handed out yet, oldest first (see [`crate::wire`]).
    pub events: VecDeque<(u32, Arc<str>)>,
    /// The seq of the newest event received (or given up on).
    pub events_seen: u32,
    /// Bytes of `events`.
    pub events_bytes: usize,
    /// The metas of the frames to come (FrameMetas), by frame seq, the newest last.
    pub frame_metas: VecDeque<(u64, Arc<str>)>,
    pub eos: bool,
    pub gone: Option<Error>,
    /// We asked for a writable ring / can map GPU memory: only then may the producer send
    /// one.
    pub writable: bool,
    pub device_memory: bool,
    /// A device ring announced by Ring, waiting for its DeviceMemory.
    pub device_pending: Option<ConsumerRing>,
    /// Messages since the last frame taken (see [`MESSAGES_WITHOUT_FRAME`]).
    pub since_frame: u32,
}

impl Announced {
    pub fn new(opts: &ConnectOptions) -> Self {
        Self {
            rings: VecDeque::new(),
            caps: VecDeque::new(),
            events: VecDeque::new(),
            events_seen: 0,
            events_bytes: 0,
            frame_metas: VecDeque::new(),
            eos: false,
            gone: None,
            writable: opts.writable_ring,
            device_memory: opts.device_memory,
            device_pending: None,
            since_frame: 0,
        }
    }

    fn push_ring(&mut self, ring: ConsumerRing) {
        self.rings.push_back(Arc::new(ring));
        // Keep the previous ring: frames queued before the switch still use it.
        while self.rings.len() > 2 {
            self.rings.pop_front();
        }
    }
}

impl Subscriber {
    /// Handles the messages waiting on the socket, [`MESSAGES_PER_PUMP`] at most (the socket
    /// is then read again at the next look, whatever poll says).
    pub(super) fn pump(&mut self) -> Result<()> {
        if self.announced.gone.is_some() {
            return Ok(());
        }
        for _ in 0..MESSAGES_PER_PUMP {
            let (msg, mut fds) = match self.conn.try_recv() {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(()),
                Err(e) => {
                    // An Error message read just before (the producer's reason) stays.
                    self.announced.gone.get_or_insert(e);
                    return Ok(());
                }
            };
            if let Message::FrameMetas { seq, payload } = msg {
                let m = &mut self.announced.frame_metas;
                if m.len() >= FRAME_METAS_KEPT {
                    m.pop_front();
                }
                m.push_back((seq, payload.into()));
                continue;
            }
            if let Message::Event { seq, payload } = msg {
                // Not counted as a flood: a stream may say much between frames (tags before
                // the first); what is kept is bounded instead.
                let a = &mut self.announced;
                a.events_bytes += payload.len();
                a.events.push_back((seq, payload.into()));
                while a.events.len() > crate::policy::EVENTS_KEPT_MAX
                    || a.events_bytes > crate::policy::EVENTS_KEPT_BYTES
                {
                    let Some(old) = a.events.pop_front() else {
                        break;
                    };
                    a.events_bytes -= old.1.len();
                }
                self.announced.events_seen = seq;
                continue;
            }
            self.announced.since_frame += 1;
            if self.announced.since_frame > MESSAGES_WITHOUT_FRAME {
                self.announced.gone = Some(Error::protocol(format!(
                    "the producer sent over {MESSAGES_WITHOUT_FRAME} messages and no frame: a flood"
                )));
                return Ok(());
            }
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
                    if flags & RING_WRITABLE != 0 && !self.announced.writable {
                        return Err(Error::protocol(
                            "the producer sent a writable ring nobody asked for",
                        ));
                    }
                    if flags & RING_DEVICE != 0 && !self.announced.device_memory {
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
                        self.announced.device_pending = Some(ring);
                    } else {
                        self.announced.push_ring(ring);
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
                        .announced
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
                    self.announced.push_ring(ring);
                }
                Message::Caps { caps_gen, caps } => {
                    self.announced.caps.push_back((caps_gen, caps.into()));
                    while self.announced.caps.len() > CAPS_HISTORY {
                        self.announced.caps.pop_front();
                    }
                }
                Message::Eos => self.announced.eos = true,
                Message::Error { message } => {
                    // It cut us: every slot we held is the producer's again.
                    *self
                        .releaser
                        .reason
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(message.clone());
                    self.releaser.cut.store(true, Ordering::Release);
                    self.announced.gone = Some(Error::Refused(format!(
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
        // More may wait: read again at the next look.
        self.waiting.socket_ready = true;
        Ok(())
    }

    /// The next frame if one is ready, without waiting: `Ok(None)` when none is (see
    /// [`Self::is_eos`]). `Err(Disconnected)` once the producer is gone and every frame it
    /// delivered was taken.
    #[link_section = ".text.hot.gpushm"]
    pub fn try_next_frame(&mut self) -> Result<Option<Frame>> {
        // Read the socket only when poll() said it has news (or a frame needs news): no
        // syscall per frame for nothing.
        if std::mem::take(&mut self.waiting.socket_ready) {
            self.pump()?;
        }
        self.releaser.flush();
        if self.releaser.stuck.load(Ordering::Relaxed) {
            return Err(Error::protocol(
                "the producer takes back none of the frames given back (its release queue stays full)",
            ));
        }
        let Some(e) = self.releaser.ch.take()? else {
            return match self.announced.gone.take() {
                Some(err) if !self.announced.eos => Err(err),
                _ => Ok(None),
            };
        };
        let lookup = |c: &Self| {
            c.announced
                .rings
                .iter()
                .find(|r| r.ring_gen() == e.ring_gen)
                .cloned()
        };
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
        self.waiting.early_poll = true;
        self.waiting.back_to_back_poll = true;
        self.announced.since_frame = 0;
        let lease = SlotLease {
            entry: e,
            ring: ring.clone(),
            releaser: self.releaser.clone(),
        };
        let (meta, ptr) = ring.read_frame(&e)?;
        self.waiting.live = meta.live;
        if meta.publish_ns != 0 && meta.publish_ns != crate::ring::layout::NONE_U64 {
            self.releaser
                .ch
                .record_latency(crate::monotonic_ns().saturating_sub(meta.publish_ns));
            self.waiting.cadence.record(meta.publish_ns);
        }
        let find = |c: &Self| {
            c.announced
                .caps
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
        let events = self.events_up_to(meta.events_seq)?;
        let metas = match meta.has_metas {
            true => self.frame_metas_of(e.seq)?,
            false => None,
        };
        Ok(Some(Frame {
            meta,
            seq: e.seq,
            ptr,
            caps,
            lease,
            events,
            metas,
        }))
    }

    /// The metas sent for frame `seq` (the newest if sent again), dropping those of earlier
    /// frames. They were sent before the frame: on the socket if not read yet.
    fn frame_metas_of(&mut self, seq: u64) -> Result<Option<Arc<str>>> {
        let find = |a: &Announced| {
            a.frame_metas
                .iter()
                .rev()
                .find(|m| m.0 == seq)
                .map(|m| m.1.clone())
        };
        let mut found = find(&self.announced);
        if found.is_none() {
            self.pump()?;
            found = find(&self.announced);
        }
        self.announced.frame_metas.retain(|m| m.0 > seq);
        Ok(found)
    }

    /// The events received with a seq up to `last` (a frame's `events_seq`), taken out in
    /// order. They were sent before the frame, so they are on the socket if not read yet.
    fn events_up_to(&mut self, last: u32) -> Result<Vec<Arc<str>>> {
        // Wrapping order: `seq` is up to `last` when it is less than 2^31 behind.
        let up_to = |seq: u32| (last.wrapping_sub(seq) as i32) >= 0;
        let mut pumps = 0;
        while last != 0
            && self.announced.events_seen != last
            && up_to(self.announced.events_seen)
            && self.announced.gone.is_none()
            && pumps < crate::policy::EVENTS_KEPT_MAX / MESSAGES_PER_PUMP
        {
            let before = self.announced.events_seen;
            self.pump()?;
            pumps += 1;
            if self.announced.events_seen == before {
                // Nothing more on the socket: sent before we connected (a late joiner gets
                // only the sticky ones), or never. Not looked for again.
                self.announced.events_seen = last;
            }
        }
        let mut out = Vec::new();
        while let Some(e) = self.announced.events.front() {
            if last == 0 || !up_to(e.0) {
                break;
            }
            let e = self.announced.events.pop_front().expect("front").1;
            self.announced.events_bytes -= e.len();
            out.push(e);
        }
        Ok(out)
    }

    /// The events received and not handed out yet, in order: those after the last frame,
    /// for the end of the stream.
    pub fn take_events(&mut self) -> Vec<Arc<str>> {
        let _ = self.pump();
        self.announced.events_bytes = 0;
        self.announced.events.drain(..).map(|e| e.1).collect()
    }
}

impl Drop for Subscriber {
    /// Tells the producer we take no more frames, and hands the socket to the leases: the
    /// producer keeps the slots of frames still held until the last lease is gone.
    fn drop(&mut self) {
        let releaser = self.releaser.clone();
        let held = || releaser.leases.load(Ordering::Acquire) > 0;
        if self.announced.gone.is_none() && held() {
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
