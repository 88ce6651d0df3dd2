// SPDX-License-Identifier: MPL-2.0
//! A buffer pool whose buffers are the slots of one ring, so that upstream renders straight
//! into shared memory.
//!
//! A buffer that comes back to the pool while consumers still hold its slot is parked by the
//! server and handed back to the pool only when the last consumer released it.
//!
//! A slot is lent again only once its memory is gone and no consumer holds it. The memory can
//! outlive its pool buffer: a shallow copy (`videorate ! queue ! gpushmsink` pushes those) still
//! waiting in a queue when the original went back to the pool. Until that copy is gone too the
//! slot stays out, so upstream never draws over a frame that is still on its way. When the
//! memory goes while consumers hold the slot, a marker is parked for the slot instead of a
//! buffer, and the slot comes free with it.
//!
//! Once published, a slot's memory is read-only ([`lock_published`]) until the buffer is back
//! among the free buffers: an upstream element that kept the buffer and maps it for writing gets a
//! copy (GStreamer's copy-on-write, `gst_memory_make_mapped`), not the bytes consumers hold.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use gst::glib;
use gst::subclass::prelude::*;

/// The sink's engine: slots are owned by buffers of its pool.
pub type Server = gpushm::server::Server<gst::Buffer>;
use crate::memory::wrap_slot_memory;
use gpushm::ring::producer_end::ProducerRing;

glib::wrapper! {
    pub struct SlotPool(ObjectSubclass<imp::SlotPool>) @extends gst::BufferPool, gst::Object;
}

impl SlotPool {
    /// A pool over `ring`'s slots. With `cuda_on_request`, an upstream element that sets
    /// [`POOL_OPTION_CUDA_META`] gets the ring registered with that CUDA device (see
    /// [`crate::cuda::select`]) and GpuShmCudaMeta on the buffers.
    pub fn new(
        ring: Arc<ProducerRing>,
        server: Weak<Server>,
        cuda_on_request: Option<i32>,
    ) -> Self {
        let pool: Self = glib::Object::new();
        let mut st = pool.imp().state.lock().unwrap_or_else(|e| e.into_inner());
        st.free_slots = (0..ring.slot_count()).rev().collect();
        st.ring = Some(ring);
        st.server = server;
        st.cuda_on_request = cuda_on_request;
        drop(st);
        pool
    }

    pub fn ring(&self) -> Option<Arc<ProducerRing>> {
        self.imp()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ring
            .clone()
    }

    /// Puts a buffer back among the pool's free buffers (after every consumer released it).
    pub fn requeue(&self, buffer: gst::Buffer) {
        self.imp().requeue(buffer);
    }

    /// The slot a pool buffer wraps.
    pub fn slot_of(&self, buffer: &gst::BufferRef) -> Option<u32> {
        let ring = self.ring()?;
        slot_of_buffer(&ring, buffer)
    }

    /// A buffer of this pool (through `gst_buffer_pool_acquire_buffer`, so that it comes back
    /// here), waiting for one as `acquire_buffer` does unless `dontwait`, but giving up with
    /// `Flushing` once `cancelled` says so: for another pool that lends our slots
    /// ([`super::cuda_pool`]), flushed on its own. Its flushing calls [`Self::wake`].
    pub fn acquire_unless(
        &self,
        dontwait: bool,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<gst::Buffer, gst::FlowError> {
        let now = gst::BufferPoolAcquireParams::with_flags(gst::BufferPoolAcquireFlags::DONTWAIT);
        let imp = self.imp();
        // A buffer lent once the other pool is flushing goes back at once: its flush must
        // not see one come out after it.
        let unless_cancelled = |r: Result<gst::Buffer, gst::FlowError>| match r {
            Ok(_) if cancelled() => Err(gst::FlowError::Flushing),
            r => r,
        };
        let seen = imp.changes();
        match gst::prelude::BufferPoolExtManual::acquire_buffer(self, Some(&now)) {
            Err(gst::FlowError::Eos) if !dontwait => {}
            r => return unless_cancelled(r),
        }
        imp.wait_for_slots(seen, || {
            if cancelled() {
                return Some(Err(gst::FlowError::Flushing));
            }
            match gst::prelude::BufferPoolExtManual::acquire_buffer(self, Some(&now)) {
                Err(gst::FlowError::Eos) => None,
                r => Some(unless_cancelled(r)),
            }
        })
    }

    /// Deactivates the pool for good: its ring was replaced, or the sink stopped. A CUDA pool
    /// over it that upstream starts again does not bring it back ([`Self::is_retired`]).
    pub fn retire(&self) {
        self.imp()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retired = true;
        let _ = gst::prelude::BufferPoolExt::set_active(self, false);
    }

    /// Whether [`Self::retire`] was called.
    pub fn is_retired(&self) -> bool {
        self.imp()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retired
    }

    /// Wakes a wait in [`Self::acquire_unless`] to look at its `cancelled` again.
    pub fn wake(&self) {
        self.imp().bump();
    }
}

/// Registers a whole ring with `dev`, once (it stays attached to the ring, and is dropped
/// before the ring's mapping). Upstream may write: registered writable.
pub fn register_ring(dev: &Arc<crate::cuda::Device>, ring: &ProducerRing) -> Result<(), String> {
    if ring.attachment().is_some() {
        return Ok(());
    }
    let (base, len) = ring.mapping();
    // SAFETY: attached to the ring, so dropped before its mapping.
    let att = unsafe { crate::cuda::register::register_mapping(dev, base, len, false) };
    let r = match att.downcast_ref::<crate::cuda::register::NotRegistered>() {
        Some(why) => Err(format!(
            "cannot register the ring with {}: {}",
            dev.name, why.0
        )),
        None => Ok(()),
    };
    ring.attach(att);
    r
}

/// Whether `pool` is flushing (or inactive), as GstBufferPool's own acquire checks it: the
/// pool's `flushing` field, which gstreamer-rs has no getter for.
///
/// # Safety
/// `pool` is a live GstBufferPool.
pub unsafe fn is_flushing(pool: *mut gst::ffi::GstBufferPool) -> bool {
    // SAFETY: the caller's contract; an int GstBufferPool sets atomically
    // (GST_BUFFER_POOL_IS_FLUSHING reads it the same way).
    unsafe {
        std::sync::atomic::AtomicI32::from_ptr(std::ptr::addr_of_mut!((*pool).flushing))
            .load(Ordering::SeqCst)
            != 0
    }
}

/// Makes the memory of a published pool buffer read-only until the buffer is back in the
/// pool's free buffers, so that a write map through the buffer (or a copy sharing its memory)
/// gets a copy instead of the frame consumers hold. Writes through a GpuShmCudaMeta device
/// pointer are not covered.
pub fn lock_published(buffer: &gst::BufferRef) {
    if let Some(mem) = (buffer.n_memory() == 1).then(|| buffer.peek_memory(0)) {
        // SAFETY: a flag of a memory we made; GStreamer tests it when the memory is mapped.
        // A plain read-modify-write: render() holds a reference, so upstream cannot be
        // mapping the memory for writing now, and nothing else writes its flags.
        unsafe { (*mem.as_mut_ptr()).mini_object.flags |= gst::ffi::GST_MEMORY_FLAG_READONLY };
    }
}

/// Undoes [`lock_published`] for a buffer whose slot no consumer holds, back in the pool. Only
/// for a buffer whose one memory is its slot's ([`slot_of_buffer`] said so when it came back,
/// and a buffer the pool holds does not change): a foreign read-only memory stays read-only.
fn unlock(buffer: &gst::BufferRef) {
    if let Some(mem) = (buffer.n_memory() == 1).then(|| buffer.peek_memory(0)) {
        if mem.flags().contains(gst::MemoryFlags::READONLY) {
            // SAFETY: as in lock_published; only the pool holds the buffer now.
            unsafe { (*mem.as_mut_ptr()).mini_object.flags &= !gst::ffi::GST_MEMORY_FLAG_READONLY };
        }
    }
}

/// What a slot's memory keeps: the mapping, and the slot, which goes back to the pool when
/// the memory is freed (after every buffer that shared it).
struct SlotKeep {
    _ring: Arc<ProducerRing>,
    slot: u32,
    pool: glib::WeakRef<SlotPool>,
}

impl Drop for SlotKeep {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.imp().memory_gone(self.slot);
        }
    }
}

/// A parked stand-in for a slot whose memory is gone while consumers still hold the slot: no
/// memory, the slot in its offset.
fn marker(slot: u32) -> gst::Buffer {
    let mut b = gst::Buffer::new();
    if let Some(b) = b.get_mut() {
        b.set_offset(slot as u64);
    }
    b
}

/// The slot of `ring` whose memory `buffer` is, if it is exactly one slot.
pub fn slot_of_buffer(ring: &ProducerRing, buffer: &gst::BufferRef) -> Option<u32> {
    if buffer.n_memory() != 1 {
        return None;
    }
    let mem = buffer.peek_memory(0);
    // Slots are system memory (wrap_slot_memory). Mapping other memory for the CPU to find out
    // may cost a copy: a GstCudaMemory is downloaded to the host when mapped so.
    if mem.offset() != 0 || !mem.is_type("SystemMemory") {
        return None;
    }
    let map = mem.map_readable().ok()?;
    let slot = ring.slot_of_ptr(map.as_ptr())?;
    (map.size() as u64 <= ring.slot_size()).then_some(slot)
}

mod imp {
    use super::*;

    #[derive(Default)]
    pub struct State {
        pub ring: Option<Arc<ProducerRing>>,
        pub server: Weak<Server>,
        /// Slots with no memory and no consumer: alloc_buffer lends these.
        pub free_slots: Vec<u32>,
        /// Slots whose memory is gone; consumers may still hold them (alloc_buffer asks).
        pub gone: Vec<u32>,
        /// Buffers free to lend, the one that came back last on top. GstBufferPool's own
        /// queue lends the one that came back first, which puts every slot the pool ever
        /// allocated (8 at a consumer's burst) in turn: each is written once a round, from
        /// memory, where this reuses the two or three a fast consumer keeps in turn, still in
        /// the cache, and the producer's first touches of slots stop at those.
        pub free: Vec<gst::Buffer>,
        pub size: usize,
        pub video_info: Option<gst_video::VideoInfo>,
        /// cuda-register=auto: the device (cuda-device-id) to register with on request.
        pub cuda_on_request: Option<i32>,
        /// Its ring was replaced ([`super::SlotPool::retire`]).
        pub retired: bool,
    }

    #[derive(Default)]
    pub struct SlotPool {
        pub state: Mutex<State>,
        /// Bumped whenever a buffer or a slot may have come free, or on flushing: what a
        /// blocked acquire_buffer waits on. Without waiters a bump is one atomic add (it
        /// happens for every buffer that comes back).
        changes: AtomicU64,
        waiters: AtomicUsize,
        wait_lock: Mutex<()>,
        changed: Condvar,
    }

    #[glib::object_subclass]
    impl ObjectSubclass for SlotPool {
        const NAME: &'static str = "GstGpuShmSlotPool";
        type Type = super::SlotPool;
        type ParentType = gst::BufferPool;
    }

    impl ObjectImpl for SlotPool {
        fn dispose(&self) {
            // GStreamer 1.20.0 deactivates a pool only in finalize, once our state (the free
            // buffers among it) is gone; 1.20.1 and later in dispose, as this does first.
            use gst::prelude::*;
            let _ = self.obj().set_active(false);
        }
    }
    impl GstObjectImpl for SlotPool {}

    impl SlotPool {
        /// A parked buffer (or marker) whose slot no consumer holds any more. May run with the
        /// server's lock held: takes only the pool's own locks.
        pub fn requeue(&self, buffer: gst::Buffer) {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if buffer.n_memory() == 0 {
                st.free_slots.push(buffer.offset() as u32);
                drop(st);
                self.bump();
                return;
            }
            drop(st);
            // Parked by release_buffer, which found its slot's memory in it.
            unlock(&buffer);
            self.keep_free(buffer);
            self.bump();
        }

        /// Keeps a buffer that came back for the next acquire, unless GstBufferPool would not
        /// lend it again (the checks of its default release_buffer): then the parent frees it.
        fn keep_free(&self, buffer: gst::Buffer) {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if buffer.flags().contains(gst::BufferFlags::TAG_MEMORY)
                || buffer.size() != st.size
                || !buffer.is_all_memory_writable()
            {
                drop(st);
                self.parent_release_buffer(buffer);
                return;
            }
            st.free.push(buffer);
        }

        /// A free buffer, the last that came back first, or a new one (the parent allocates
        /// while it has allocated fewer than the slots). Never waits.
        fn acquire_now(
            &self,
            params: &gst::BufferPoolAcquireParams,
        ) -> Result<gst::Buffer, gst::FlowError> {
            use gst::prelude::*;
            let pool = self.obj();
            // SAFETY: our own live pool.
            if unsafe { is_flushing(pool.upcast_ref::<gst::BufferPool>().as_ptr()) } {
                return Err(gst::FlowError::Flushing);
            }
            let top = self
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .free
                .pop();
            match top {
                Some(b) => Ok(b),
                None => self.parent_acquire_buffer(Some(params)),
            }
        }

        /// The memory of `slot` was freed. Takes only the pool's own locks: it runs wherever
        /// the last reference went, the server's lock possibly held.
        pub(super) fn memory_gone(&self, slot: u32) {
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .gone
                .push(slot);
            self.bump();
        }

        pub(super) fn bump(&self) {
            self.changes.fetch_add(1, Ordering::SeqCst);
            // A waiter counts itself before it looks at `changes`: either it sees this bump,
            // or it is counted here and gets the notification (under the lock it waits with).
            if self.waiters.load(Ordering::SeqCst) > 0 {
                drop(self.wait_lock.lock().unwrap_or_else(|e| e.into_inner()));
                self.changed.notify_all();
            }
        }

        pub(super) fn changes(&self) -> u64 {
            self.changes.load(Ordering::SeqCst)
        }

        /// Every slot is out: waits for one to come free, `try_now` after each change (or
        /// 50 ms) until it returns a result. `seen` is [`Self::changes`] from before the look
        /// that found none.
        pub(super) fn wait_for_slots(
            &self,
            mut seen: u64,
            mut try_now: impl FnMut() -> Option<Result<gst::Buffer, gst::FlowError>>,
        ) -> Result<gst::Buffer, gst::FlowError> {
            // Consumers do not wake the producer for each release: take back what they
            // released, and have them wake it while we wait. GstBufferPool's own wait would
            // miss a slot that comes free without a buffer coming back (its memory outlived
            // the buffer), so the wait is ours; the timeout is only a safety net.
            let server = self
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .server
                .upgrade();
            let _waiting = server.as_ref().map(|s| s.want_releases());
            loop {
                self.wait_change(seen, Duration::from_millis(50));
                seen = self.changes();
                if let Some(r) = try_now() {
                    return r;
                }
            }
        }

        /// Waits until [`Self::bump`] moved past `seen`, at most `timeout`.
        fn wait_change(&self, seen: u64, timeout: Duration) {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let g = self.wait_lock.lock().unwrap_or_else(|e| e.into_inner());
            let _ = self
                .changed
                .wait_timeout_while(g, timeout, |_| self.changes() == seen);
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl BufferPoolImpl for SlotPool {
        fn options() -> &'static [&'static str] {
            static OPTIONS: [&str; 2] = [
                "GstBufferPoolOptionVideoMeta",
                crate::cudameta::POOL_OPTION_CUDA_META,
            ];
            &OPTIONS
        }

        fn set_config(&self, config: &mut gst::BufferPoolConfigRef) -> bool {
            let Some((caps, size, min, _max)) = config.params() else {
                return false;
            };
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let Some(ring) = st.ring.clone() else {
                return false;
            };
            let n = ring.slot_count();
            if size as u64 > ring.slot_size() || size == 0 {
                return false;
            }
            st.size = size as usize;
            st.video_info = caps
                .as_ref()
                .filter(|c| c.structure(0).is_some_and(|s| s.name() == "video/x-raw"))
                .and_then(|c| gst_video::VideoInfo::from_caps(c).ok());
            let cuda_id = st.cuda_on_request;
            drop(st);
            if let Some(id) =
                cuda_id.filter(|_| config.has_option(crate::cudameta::POOL_OPTION_CUDA_META))
            {
                // Upstream asks for device pointers: the first time, this creates the CUDA
                // context and registers the ring (once per ring).
                match crate::cuda::select(id) {
                    Ok(crate::cuda::Selected::Device(d)) => {
                        if let Err(why) = register_ring(&d, &ring) {
                            gst::warning!(gst::CAT_DEFAULT, obj = self.obj(), "{why}");
                        }
                    }
                    Ok(crate::cuda::Selected::Unavailable(e)) => {
                        gst::info!(gst::CAT_DEFAULT, obj = self.obj(), "no GpuShmCudaMeta: {e}")
                    }
                    Err(e) => {
                        gst::warning!(gst::CAT_DEFAULT, obj = self.obj(), "no GpuShmCudaMeta: {e}");
                    }
                }
            }
            // Never more buffers than slots.
            config.set_params(caps.as_ref(), size, min.min(n), n);
            self.parent_set_config(config)
        }

        fn acquire_buffer(
            &self,
            params: Option<&gst::BufferPoolAcquireParams>,
        ) -> Result<gst::Buffer, gst::FlowError> {
            let flags = params.map_or(gst::BufferPoolAcquireFlags::empty(), |p| p.flags());
            let mut now = params.copied().unwrap_or_else(|| {
                gst::BufferPoolAcquireParams::with_flags(gst::BufferPoolAcquireFlags::empty())
            });
            now.set_flags(flags | gst::BufferPoolAcquireFlags::DONTWAIT);
            let seen = self.changes();
            match self.acquire_now(&now) {
                Err(gst::FlowError::Eos)
                    if !flags.contains(gst::BufferPoolAcquireFlags::DONTWAIT) => {}
                r => return r,
            }
            self.wait_for_slots(seen, || match self.acquire_now(&now) {
                Err(gst::FlowError::Eos) => None,
                r => Some(r),
            })
        }

        fn flush_start(&self) {
            self.parent_flush_start();
            self.bump();
        }

        fn stop(&self) -> bool {
            // The free buffers go to the parent's queue, which its stop frees.
            let free =
                std::mem::take(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()).free);
            for b in free {
                self.parent_release_buffer(b);
            }
            self.parent_stop()
        }

        fn alloc_buffer(
            &self,
            _params: Option<&gst::BufferPoolAcquireParams>,
        ) -> Result<gst::Buffer, gst::FlowError> {
            // Slots whose memory is gone come free unless a consumer holds them; then a marker
            // is parked for the slot and requeue() frees it. Asked without the pool's lock
            // (requeue takes it under the server's).
            let (ring, server, gone) = {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                (
                    st.ring.clone().ok_or(gst::FlowError::Error)?,
                    st.server.upgrade(),
                    std::mem::take(&mut st.gone),
                )
            };
            let freed: Vec<u32> = gone
                .into_iter()
                .filter(|&slot| match &server {
                    Some(s) => s
                        .buffer_returned(ring.ring_gen(), slot, marker(slot))
                        .is_some(),
                    None => true,
                })
                .collect();
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.free_slots.extend(freed);
            let slot = st.free_slots.pop().ok_or(gst::FlowError::Eos)?;
            let cuda = crate::cuda::register::device_ptr_in(ring.attachment(), ring.slot_ptr(slot));
            let slot_size = ring.slot_size();
            let mem = wrap_slot_memory(
                ring.slot_ptr(slot),
                ring.slot_size() as usize,
                st.size,
                false,
                Box::new(SlotKeep {
                    _ring: ring.clone(),
                    slot,
                    pool: self.obj().downgrade(),
                }),
            );
            let mut buffer = gst::Buffer::new();
            {
                let b = buffer.get_mut().expect("new buffer is writable");
                b.append_memory(mem);
                if let Some((device_ptr, device)) = cuda {
                    crate::cudameta::add(
                        b,
                        crate::cudameta::CudaPtr {
                            device,
                            device_ptr,
                            size: slot_size,
                            read_only: false,
                        },
                    );
                }
                if let Some(info) = &st.video_info {
                    let _ = crate::geometry::add_caps_layout_meta(b, info);
                }
            }
            Ok(buffer)
        }

        fn free_buffer(&self, buffer: gst::Buffer) {
            // Its slot comes free when the memory does (SlotKeep), which may be now.
            drop(buffer);
            self.bump();
        }

        fn release_buffer(&self, buffer: gst::Buffer) {
            let (server, ring) = {
                let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                (st.server.upgrade(), st.ring.clone())
            };
            // Parked only while it still carries its slot's memory: one whose memory was
            // replaced (copy-on-write) goes back at once, and its slot follows the memory.
            let slot = ring.as_ref().and_then(|r| slot_of_buffer(r, &buffer));
            let buffer = match (server, &ring, slot) {
                (Some(server), Some(ring), Some(slot)) => {
                    match server.buffer_returned(ring.ring_gen(), slot, buffer) {
                        Some(buffer) => buffer,
                        None => return,
                    }
                }
                _ => buffer,
            };
            if slot.is_some() {
                unlock(&buffer);
            }
            self.keep_free(buffer);
            self.bump();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gst::prelude::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    /// [`SlotPool::acquire_unless`], what the CUDA pool lends slots with: a free slot at once;
    /// none left and `dontwait`, `Eos`; none left, it waits until one comes back; and a wait
    /// given up once the other pool is flushed (`cancelled`, then [`SlotPool::wake`]), with
    /// `Flushing`, though no slot came back; and a buffer acquired once it is cancelled is
    /// not handed out.
    #[test]
    fn acquire_unless_waits_for_a_slot_and_gives_up_when_cancelled() {
        gst::init().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let server = Server::start(
            &dir.path().join("s.sock"),
            gpushm::server::Config::default(),
            Box::new(|_| {}),
        )
        .unwrap();
        let caps = gst::Caps::builder("video/x-raw")
            .field("format", "GRAY8")
            .field("width", 64)
            .field("height", 64)
            .field("framerate", gst::Fraction::new(25, 1))
            .build();
        let ring = server
            .new_ring(2, 4096, &caps.to_string(), Arc::new(|_| {}), &|_| Ok(()))
            .unwrap();
        let pool = SlotPool::new(ring, Arc::downgrade(&server), None);
        let mut config = pool.config();
        config.set_params(Some(&caps), 4096, 0, 0);
        pool.set_config(config).unwrap();
        pool.set_active(true).unwrap();
        let never = || false;
        let a = pool.acquire_unless(false, &never).unwrap();
        let b = pool.acquire_unless(false, &never).unwrap();
        assert_ne!(pool.slot_of(&a), pool.slot_of(&b));
        assert_eq!(
            pool.acquire_unless(true, &never).unwrap_err(),
            gst::FlowError::Eos
        );
        // One comes back while we wait.
        let slot_a = pool.slot_of(&a);
        let back = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(a);
        });
        let c = pool.acquire_unless(false, &never).unwrap();
        assert_eq!(pool.slot_of(&c), slot_a);
        back.join().unwrap();
        // Cancelled while we wait: given up, though nothing came back.
        let cancel = Arc::new(AtomicBool::new(false));
        let (p, flag) = (pool.clone(), cancel.clone());
        let flusher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::SeqCst);
            p.wake();
        });
        let t = Instant::now();
        assert_eq!(
            pool.acquire_unless(false, &|| cancel.load(Ordering::SeqCst))
                .unwrap_err(),
            gst::FlowError::Flushing
        );
        assert!(t.elapsed() < Duration::from_secs(30));
        flusher.join().unwrap();
        // Cancelled with a slot free: not handed out, and back in the pool.
        drop(b);
        assert_eq!(
            pool.acquire_unless(false, &|| true).unwrap_err(),
            gst::FlowError::Flushing
        );
        let d = pool.acquire_unless(true, &never).unwrap();
        drop((c, d));
        pool.set_active(false).unwrap();
        server.stop();
    }
}
