// SPDX-License-Identifier: MPL-2.0
//! A producer for apps without GStreamer, [`Publisher`]: it serves a socket path, lends slots
//! of its ring to fill in place ([`Publisher::acquire`], a [`Slot`]) and publishes them with
//! the same per-client policy as gpushmsink (it drives a [`Server`], as gpushmsink does).
//! Python's `gpushm.Publisher` and C's `gpushm_publisher` are this type.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::policy::Policy;
use crate::ring::frame::FrameMeta;
use crate::ring::producer_end::ProducerRing;
use crate::server::{Published, Requeue, Server};
use crate::{Error, Result};

pub use crate::server::{ClientStats, Config, Stats};

/// What owns a slot of a [`Publisher`] while clients read it.
pub struct SlotToken(u32);

type FreeSlots = Arc<(Mutex<Vec<u32>>, Condvar)>;

/// The ring frames go into now, and its free slots (each ring has its own: slots of an older
/// ring come back to that ring's list, which is then simply dropped).
#[derive(Clone)]
struct Current {
    ring: Arc<ProducerRing>,
    layout: crate::format::FrameLayout,
    fps: (u32, u32),
    free: FreeSlots,
}

/// A producer for apps without GStreamer: serves a socket path, hands out slots to fill in
/// place ([`Publisher::acquire`]) and publishes them with the same per-client policy as
/// gpushmsink. gpushmsrc and [`crate::subscriber::Subscriber`] receive its frames.
///
/// ```
/// use gpushm::format::{FrameLayout, VideoFormat};
/// use gpushm::publisher::{Config, Publisher};
/// # let dir = std::env::temp_dir().join(format!("gpushm-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
/// let camera = Publisher::new(&dir.join("cam"), layout, (30, 1), 8, Config::default()).unwrap();
/// let mut slot = camera.acquire(std::time::Duration::from_secs(1)).unwrap();
/// slot.bytes_mut().fill(128);
/// camera.publish(slot, None).unwrap();
/// # drop(camera); std::fs::remove_dir_all(&dir).ok();
/// ```
pub struct Publisher {
    server: Arc<Server<SlotToken>>,
    current: Mutex<Current>,
    /// Where rings go: the GPU of a device ring (see [`Self::new_on_device`]).
    placement: Placement,
    slots: u32,
    start_ns: u64,
    frames: std::sync::atomic::AtomicU64,
    /// The low-latency mode of the wait for a lossless consumer at its budget, ns (see
    /// [`Publisher::set_spin`]; 0: off).
    spin_ns: std::sync::atomic::AtomicU64,
}

/// Where a [`Publisher`]'s rings go: host memory, or the GPU memory of `device`.
#[derive(Clone, Default)]
struct Placement {
    #[cfg(feature = "cuda")]
    device: Option<Arc<crate::cuda::Device>>,
}

/// A slot of a [`Publisher`] lent to the app to fill; publish it, or drop it to give it
/// back unpublished.
pub struct Slot {
    cur: Current,
    slot: u32,
    published: bool,
}

impl Slot {
    /// The slot's bytes: the frame, laid out as [`Self::layout`] says. Empty for a slot in
    /// GPU memory ([`Self::is_on_device`]): fill that through [`Self::device_ptr`] or
    /// [`Self::fill_from_host`].
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.is_on_device() {
            return &mut [];
        }
        // SAFETY: the slot is ours alone until published (no client references it, and
        // clients only ever map the ring read-only); the layout's size fits the slot.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.cur.ring.slot_ptr(self.slot),
                self.cur.layout.size as usize,
            )
        }
    }

    /// Whether the slot is in GPU memory (a [`Publisher::new_on_device`] ring).
    pub fn is_on_device(&self) -> bool {
        self.cur.ring.device().is_some()
    }

    /// The slot's device address, writable until published, for a slot in GPU memory.
    #[cfg(feature = "cuda")]
    pub fn device_ptr(&self) -> Option<u64> {
        crate::cuda::vmm::device_ptr_of_slot(&self.cur.ring, self.slot)
    }

    /// Copies a whole frame (`layout().size` bytes) from GPU memory at `src` (a tensor on
    /// the ring's GPU) into a slot in GPU memory.
    #[cfg(feature = "cuda")]
    pub fn fill_from_device(&mut self, src: u64, len: usize) -> Result<()> {
        let size = self.cur.layout.size as usize;
        if len != size {
            return Err(Error::Invalid(format!(
                "a frame of this layout is {size} bytes, not {len}"
            )));
        }
        let mem = crate::cuda::vmm::of(self.cur.ring.attachment()).ok_or_else(|| {
            Error::Invalid("the slot is in host memory: fill it from the host".into())
        })?;
        let dst = self
            .device_ptr()
            .ok_or_else(|| Error::Invalid("the slot is outside its GPU memory".into()))?;
        mem.copy_from_device(dst, src, len)
            .map_err(|e| Error::Invalid(e.to_string()))
    }

    /// Copies a whole frame (`layout().size` bytes) from host memory into the slot, in
    /// host or GPU memory.
    pub fn fill_from_host(&mut self, frame: &[u8]) -> Result<()> {
        let size = self.cur.layout.size as usize;
        if frame.len() != size {
            return Err(Error::Invalid(format!(
                "a frame of this layout is {size} bytes, not {}",
                frame.len()
            )));
        }
        #[cfg(feature = "cuda")]
        if let Some(mem) = crate::cuda::vmm::of(self.cur.ring.attachment()) {
            let dst = self
                .device_ptr()
                .ok_or_else(|| Error::Invalid("the slot is outside its GPU memory".into()))?;
            return mem
                .copy_from_host(dst, frame)
                .map_err(|e| Error::Invalid(e.to_string()));
        }
        let copied = crate::frame_copy::copy_frame(self.bytes_mut(), frame);
        if copied != size {
            return Err(Error::Invalid(format!(
                "the slot holds {copied} of the frame's {size} bytes"
            )));
        }
        Ok(())
    }

    /// The layout of the frame this slot holds.
    pub fn layout(&self) -> &crate::format::FrameLayout {
        &self.cur.layout
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.published {
            let (free, cond) = &*self.cur.free;
            free.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.slot);
            cond.notify_one();
        }
    }
}

impl Publisher {
    /// Serves `path` with a ring of `slots` frames laid out as `layout`, at `fps` (n, d).
    pub fn new(
        path: &Path,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
        config: Config,
    ) -> Result<Self> {
        Self::start(path, layout, fps, slots, config, Placement::default())
    }

    /// Like [`Self::new`], with the frames' pixels in `device`'s memory (a device ring, see
    /// [`crate::cuda::vmm`]): consumers that map GPU memory
    /// ([`crate::subscriber::ConnectOptions::device_memory`]) read them there, on the GPU, and
    /// other consumers are turned away, told why. Fill slots with
    /// [`Slot::fill_from_host`] or through [`Slot::device_ptr`].
    #[cfg(feature = "cuda")]
    pub fn new_on_device(
        path: &Path,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
        config: Config,
        device: Arc<crate::cuda::Device>,
    ) -> Result<Self> {
        let placement = Placement {
            device: Some(device),
        };
        Self::start(path, layout, fps, slots, config, placement)
    }

    fn start(
        path: &Path,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
        config: Config,
        placement: Placement,
    ) -> Result<Self> {
        let server: Arc<Server<SlotToken>> = Server::start(path, config, Box::new(|_| {}))?;
        let current = match Self::ring(&server, &placement, layout, fps, slots) {
            Ok(c) => c,
            Err(e) => {
                server.stop();
                return Err(e);
            }
        };
        Ok(Self {
            server,
            current: Mutex::new(current),
            placement,
            slots,
            start_ns: crate::monotonic_ns(),
            frames: Default::default(),
            spin_ns: Default::default(),
        })
    }

    /// Low-latency mode of [`Self::publish`]'s wait for a lossless consumer that holds its
    /// whole budget: poll that consumer's releases for up to `spin` before sleeping (a
    /// wake-up through the connection thread is two thread hops), at most once a frame and
    /// never past the wait's bound. Pays off for small frames sent flat out. Zero (the
    /// default): off; at most [`crate::policy::MAX_SPIN`]. The figures: `stats().0`'s
    /// `spin_caught` and `spin_missed`.
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        crate::policy::check_spin(spin)?;
        self.spin_ns
            .store(spin.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn ring(
        server: &Arc<Server<SlotToken>>,
        placement: &Placement,
        layout: crate::format::FrameLayout,
        fps: (u32, u32),
        slots: u32,
    ) -> Result<Current> {
        if fps.0 == 0 || fps.1 == 0 {
            return Err(Error::Invalid(format!(
                "frame rate {}/{} is not a rate",
                fps.0, fps.1
            )));
        }
        let free: FreeSlots = Arc::new((Mutex::new((0..slots).rev().collect()), Condvar::new()));
        let requeue: Requeue<SlotToken> = {
            let free = free.clone();
            Arc::new(move |t: SlotToken| {
                free.0.lock().unwrap_or_else(|e| e.into_inner()).push(t.0);
                free.1.notify_one();
            })
        };
        #[cfg(feature = "cuda")]
        let prepare = |r: &ProducerRing| match &placement.device {
            Some(d) => crate::cuda::vmm::place_ring(r, d)
                .map_err(|e| Error::Invalid(format!("cannot put the ring in GPU memory: {e}"))),
            None => Ok(()),
        };
        #[cfg(not(feature = "cuda"))]
        let prepare = |_: &ProducerRing| Ok(());
        #[cfg(not(feature = "cuda"))]
        let _ = placement;
        let ring = server.new_ring(
            slots,
            layout.size,
            &layout.caps(fps.0, fps.1),
            requeue,
            &prepare,
        )?;
        Ok(Current {
            ring,
            layout,
            fps,
            free,
        })
    }

    /// Changes the frames' format or size: a new ring, announced to every consumer (like a
    /// caps change in GStreamer). Slots lent before are of the old ring: they can no longer be
    /// published ([`Self::publish`] says so and takes the slot back); lend new ones.
    pub fn set_layout(&self, layout: crate::format::FrameLayout, fps: (u32, u32)) -> Result<()> {
        let c = Self::ring(&self.server, &self.placement, layout, fps, self.slots)?;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = c;
        Ok(())
    }

    pub fn layout(&self) -> crate::format::FrameLayout {
        self.cur().layout
    }

    fn cur(&self) -> Current {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Consumers connected now.
    pub fn num_clients(&self) -> usize {
        self.server.num_clients()
    }

    /// Wakes the consumers that sleep until a frame comes, ahead of the next one: call it
    /// when a frame is a few µs from [`Self::publish`] (its last step starts), so that their
    /// wake-up runs meanwhile. See [`Server::wake_early`] for when it wakes nobody.
    pub fn wake_early(&self) {
        self.server.wake_early();
    }

    /// The connection thread's id, once it runs (0 before).
    #[cfg(test)]
    pub(crate) fn connection_tid(&self) -> i32 {
        self.server.connection_tid()
    }

    /// Wakes the consumers that sleep until a frame comes `ahead` before each frame is due,
    /// as learnt from the last frames' publish times (`Duration::ZERO`, the default: never).
    /// See [`Server::set_wake_ahead`].
    pub fn set_wake_ahead(&self, ahead: Duration) -> Result<()> {
        self.server.set_wake_ahead(ahead)
    }

    /// Whether frames go into GPU memory ([`Self::new_on_device`]).
    pub fn is_on_device(&self) -> bool {
        self.cur().ring.device().is_some()
    }

    pub fn stats(&self) -> (Stats, Vec<ClientStats>) {
        self.server.stats()
    }

    /// A free slot to fill, waiting up to `timeout` for one (consumers hold them all).
    pub fn acquire(&self, timeout: Duration) -> Result<Slot> {
        let cur = self.cur();
        // A timeout too large to add waits for a century.
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400));
        let mut f = cur.free.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut waiting = None;
        loop {
            if let Some(slot) = f.pop() {
                drop(f);
                return Ok(Slot {
                    cur,
                    slot,
                    published: false,
                });
            }
            if waiting.is_none() {
                // Consumers wake the connection thread on releases while we wait; what they
                // released already comes back now (into `free`, hence without its lock).
                drop(f);
                waiting = Some(self.server.want_releases());
                f = cur.free.0.lock().unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(
                    "every slot is still held by consumers".into(),
                ));
            }
            f = cur
                .free
                .1
                .wait_timeout(f, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Publishes a filled slot to every consumer. `capture_ns` is when the frame was captured
    /// (CLOCK_MONOTONIC, see [`crate::monotonic_ns`]); `None` means now.
    pub fn publish(&self, mut lease: Slot, capture_ns: Option<u64>) -> Result<()> {
        let cur = lease.cur.clone();
        let n = self
            .frames
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = capture_ns.unwrap_or_else(crate::monotonic_ns);
        let frame_ns = 1_000_000_000u64 * cur.fps.1 as u64 / cur.fps.0 as u64;
        let mut meta = FrameMeta {
            pts: t.saturating_sub(self.start_ns),
            dts: crate::ring::layout::NONE_U64,
            duration: frame_ns,
            offset: n,
            offset_end: n + 1,
            pts_clock: t,
            dts_clock: crate::ring::layout::NONE_U64,
            latency: 0,
            live: true,
            ..Default::default()
        };
        cur.layout.describe(&mut meta);
        let gen = cur.ring.ring_gen();
        let slot = lease.slot;
        lease.published = true;
        drop(lease);
        let policy = Policy {
            budget: (self.slots as usize / 2).max(1),
            max_wait: Duration::from_nanos(frame_ns.clamp(40_000_000, 200_000_000)),
            spin: Duration::from_nanos(self.spin_ns.load(std::sync::atomic::Ordering::Relaxed)),
        };
        let result = match self.server.publish_frame(gen, slot, meta, policy, 0) {
            Ok(Published::SlotBusy(why)) => Err(Error::Invalid(format!(
                "{why}: a frame lent before set_layout() cannot be published; lend a new one"
            ))),
            r => r.map(|_| ()),
        };
        // The slot comes back when the last consumer releases it (at once if none holds it).
        if let Some(t) = self.server.buffer_returned(gen, slot, SlotToken(slot)) {
            let (free, cond) = &*cur.free;
            free.lock().unwrap_or_else(|e| e.into_inner()).push(t.0);
            cond.notify_one();
        }
        result
    }

    /// Tells every consumer the stream ended.
    pub fn send_eos(&self) {
        self.server.send_eos();
    }

    /// Sends an event of the stream to every consumer, handed out with the next frame
    /// published ([`crate::subscriber::Frame::events`]) or at the end
    /// ([`crate::subscriber::Subscriber::take_events`]); with `sticky_key` consumers that
    /// connect later get the latest of that key first. The payload is the application's own.
    pub fn send_event(&self, payload: &str, sticky_key: Option<&str>) {
        self.server.send_event(payload, sticky_key);
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.server.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{FrameLayout, VideoFormat};

    fn thread_cpu() -> Duration {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap();
        Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32)
    }

    /// A hostile producer that says it woke a subscriber ahead of a frame, from another CPU,
    /// and rings its doorbell without end, never publishing: the subscriber polls once (it
    /// polls once per frame it takes), spends little CPU, and times out as asked.
    #[test]
    fn a_producer_ringing_early_without_end_costs_a_subscriber_one_poll() {
        let _serial = crate::timing_test();
        let dir = std::env::temp_dir().join(format!("gpushm-pub-ring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
        let cam = Publisher::new(&dir.join("cam"), layout, (30, 1), 4, Config::default()).unwrap();
        let path = dir.join("cam");
        let consumer = std::thread::spawn(move || {
            let mut sub =
                crate::subscriber::Subscriber::connect(&path, Default::default()).unwrap();
            let cpu0 = thread_cpu();
            let start = Instant::now();
            let r = sub.next_frame(Some(Duration::from_secs(1)));
            (
                r.map(|f| f.is_some()),
                start.elapsed(),
                thread_cpu() - cpu0,
                sub.early_polls(),
            )
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while cam.num_clients() == 0 {
            assert!(Instant::now() < deadline, "no client");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut rings = 0u64;
        while !consumer.is_finished() {
            cam.server.ring_every_client_from_nowhere();
            rings += 1;
            std::thread::sleep(Duration::from_micros(100));
        }
        let (r, took, cpu, polls) = consumer.join().unwrap();
        eprintln!("{rings} rings: {took:?}, {cpu:?} of CPU, early polls {polls:?}");
        assert!(
            matches!(r, Err(crate::Error::Timeout(_))),
            "the subscriber's wait ended otherwise: {r:?}"
        );
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert!(rings > 100, "the producer rang only {rings} times");
        assert_eq!(polls.caught + polls.missed, 1, "one poll: {polls:?}");
        assert!(
            cpu < Duration::from_millis(500),
            "{cpu:?} of CPU for 1 s of rings"
        );
        drop(cam);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A frame lent before set_layout() is of the old ring: publishing it says why (it would
    /// carry the new caps over the old layout), and frames of the new layout go out.
    #[test]
    fn a_frame_lent_before_a_layout_change_is_refused_with_a_reason() {
        let dir = std::env::temp_dir().join(format!("gpushm-pub-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = FrameLayout::new(VideoFormat::Gray8, 64, 48).unwrap();
        let cam = Publisher::new(&dir.join("cam"), layout, (30, 1), 4, Config::default()).unwrap();
        let old = cam.acquire(Duration::from_secs(1)).unwrap();
        let smaller = FrameLayout::new(VideoFormat::Gray8, 32, 24).unwrap();
        cam.set_layout(smaller, (30, 1)).unwrap();
        let err = cam.publish(old, None).unwrap_err().to_string();
        assert!(
            err.contains("not the current ring") && err.contains("set_layout"),
            "{err}"
        );
        let new = cam.acquire(Duration::from_secs(1)).unwrap();
        cam.publish(new, None).unwrap();
        drop(cam);
        std::fs::remove_dir_all(&dir).ok();
    }
}
