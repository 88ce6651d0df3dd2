// SPDX-License-Identifier: MPL-2.0
//! Handles: generation-checked ids in opaque pointers, never addresses, so that a stale,
//! NULL or foreign handle is an error code and never undefined behaviour.

use super::*;

/// Kinds of handle (the id's top byte).
pub(crate) const KIND_SUBSCRIBER: u64 = 1;
pub(crate) const KIND_FRAME: u64 = 2;
pub(crate) const KIND_PUBLISHER: u64 = 3;
pub(crate) const KIND_SLOT: u64 = 4;
pub(crate) const KIND_CPU_LATENCY: u64 = 5;
pub(crate) const GEN_BITS: u32 = 32;
/// Handles alive at once, per kind, at most (the id's index field).
pub(crate) const MAX_INDEX: usize = (1 << 24) - 2;
pub(crate) const GEN_MASK: u64 = (1 << GEN_BITS) - 1;

pub(crate) struct Entry<T> {
    pub(crate) gen: u64,
    pub(crate) item: Option<Arc<T>>,
}

pub(crate) struct Table<T> {
    pub(crate) kind: u64,
    pub(crate) entries: Vec<Entry<T>>,
    pub(crate) free: Vec<usize>,
    /// Objects given back for reuse (frames: a frame's way then calls neither malloc nor
    /// free, two more pages of code after a sleep).
    pub(crate) spare: Vec<Arc<T>>,
}

/// Frame objects kept for reuse, at most.
pub(crate) const SPARE_FRAMES: usize = 4;

impl<T> Table<T> {
    pub(crate) const fn new(kind: u64) -> Self {
        Self {
            kind,
            entries: Vec::new(),
            free: Vec::new(),
            spare: Vec::new(),
        }
    }

    #[inline(always)]
    pub(crate) fn id(&self, index: usize, gen: u64) -> u64 {
        (self.kind << 56) | (((index as u64) + 1) << GEN_BITS) | gen
    }

    /// A handle for `item`; `item` back with the error when none is left (to be dropped
    /// after the table's lock: see [`insert`]).
    #[inline(always)]
    pub(crate) fn insert(&mut self, item: Arc<T>) -> Result<u64, (Fail, Arc<T>)> {
        let index = match self.free.pop() {
            Some(i) => i,
            None if self.entries.len() > MAX_INDEX => {
                return Err((
                    Fail(
                        GPUSHM_ERROR_SYSTEM,
                        "too many live handles (release and destroy what you no longer use)".into(),
                    ),
                    item,
                ))
            }
            None => {
                self.entries.push(Entry { gen: 1, item: None });
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[index];
        e.item = Some(item);
        let gen = e.gen;
        Ok(self.id(index, gen))
    }

    #[inline(always)]
    pub(crate) fn index(&self, id: u64) -> Option<usize> {
        if id >> 56 != self.kind {
            return None;
        }
        let i = ((id & ((1 << 56) - 1)) >> GEN_BITS).checked_sub(1)? as usize;
        let e = self.entries.get(i)?;
        (e.gen == id & GEN_MASK && e.item.is_some()).then_some(i)
    }

    #[inline(always)]
    pub(crate) fn get(&self, id: u64) -> Option<Arc<T>> {
        self.index(id).and_then(|i| self.entries[i].item.clone())
    }

    #[inline(always)]
    pub(crate) fn remove(&mut self, id: u64) -> Option<Arc<T>> {
        let i = self.index(id)?;
        let e = &mut self.entries[i];
        // Generation 0 is never handed out (ids are never NULL), and an index whose 32-bit
        // generation ran out is retired: a stale id never matches a later handle.
        e.gen = (e.gen + 1) & GEN_MASK;
        if e.gen != 0 {
            self.free.push(i);
        }
        e.item.take()
    }
}

#[inline(always)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) static SUBSCRIBERS: Mutex<Table<SubObj>> = Mutex::new(Table::new(KIND_SUBSCRIBER));
pub(crate) static FRAMES: Mutex<Table<FrameObj>> = Mutex::new(Table::new(KIND_FRAME));
pub(crate) static PUBLISHERS: Mutex<Table<PubObj>> = Mutex::new(Table::new(KIND_PUBLISHER));
pub(crate) static SLOTS: Mutex<Table<SlotObj>> = Mutex::new(Table::new(KIND_SLOT));
pub(crate) static CPU_LATENCIES: Mutex<Table<CpuLatency>> =
    Mutex::new(Table::new(KIND_CPU_LATENCY));

#[cold]
#[inline(never)]
pub(crate) fn bad_handle(what: &str) -> Fail {
    Fail(
        GPUSHM_ERROR_BAD_HANDLE,
        format!("not a live {what} handle (NULL, destroyed, or another kind)"),
    )
}

/// A handle in `table` for `item`. Refused (no handle left), `item` is dropped after the
/// table's lock: dropping a frame or a connection may ring or close descriptors.
#[inline(always)]
pub(crate) fn insert<T>(table: &Mutex<Table<T>>, item: Arc<T>) -> Result<u64, Fail> {
    let r = lock(table).insert(item);
    r.map_err(|(fail, item)| {
        drop(item);
        fail
    })
}

#[inline(always)]
pub(crate) fn get<T>(
    table: &Mutex<Table<T>>,
    h: *const std::ffi::c_void,
    what: &str,
) -> Result<Arc<T>, Fail> {
    lock(table).get(h as u64).ok_or_else(|| bad_handle(what))
}
