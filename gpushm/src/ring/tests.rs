// SPDX-License-Identifier: MPL-2.0
//! The two ends of the ring against each other, and against a peer that writes anything
//! into the shared memory it can reach.

use super::consumer_end::*;
use super::frame::{Entry, FrameMeta};
use super::layout::*;
use super::shm;
use crate::ring::producer_end::{ClientChannel, ProducerRing};
use crate::Error;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
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
