// SPDX-License-Identifier: MPL-2.0
//! In-process tests of each element: Harness for the sink and the src, plus small pipelines.

mod common;
use common::*;

use gst::prelude::*;
use gst_check::Harness;
use gst_video::prelude::*;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::str::FromStr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A Harness around a gpushmsink configured before it starts (Harness plays elements with
/// sink pads as soon as it wraps them).
fn sink_harness_with(sock: &Path, caps: &str, configure: impl FnOnce(&gst::Element)) -> Harness {
    let e = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", sock.to_str().unwrap())
        .property("sync", false)
        .property("async", false)
        .build()
        .unwrap();
    configure(&e);
    let mut h = Harness::with_element(&e, Some("sink"), None);
    h.set_src_caps_str(caps);
    h.play();
    h
}

fn sink_harness(sock: &Path, caps: &str) -> Harness {
    sink_harness_with(sock, caps, |_| {})
}

fn src_harness(sock: &Path, lossless: bool) -> Harness {
    let mut h = Harness::new("gpushmsrc");
    let e = h.element().unwrap();
    e.set_property("socket-path", sock.to_str().unwrap());
    e.set_property("lossless", lossless);
    h.play();
    h
}

fn gray_frame(n: u64, w: usize, h: usize) -> gst::Buffer {
    let data: Vec<u8> = (0..w * h)
        .map(|i| ((i as u64 * 13 + n * 7) % 256) as u8)
        .collect();
    let mut b = gst::Buffer::from_mut_slice(data);
    let r = b.get_mut().unwrap();
    r.set_pts(gst::ClockTime::from_mseconds(40 * n));
    r.set_duration(gst::ClockTime::from_mseconds(40));
    r.set_offset(n);
    if n % 2 == 1 {
        r.set_flags(gst::BufferFlags::DELTA_UNIT);
    }
    b
}

fn error_of(pipeline: &gst::Element, timeout: Duration) -> String {
    let bus = pipeline.bus().unwrap();
    let msg = bus
        .timed_pop_filtered(
            gst::ClockTime::from_nseconds(timeout.as_nanos() as u64),
            &[gst::MessageType::Error],
        )
        .expect("an error message");
    match msg.view() {
        gst::MessageView::Error(e) => format!("{} {}", e.error(), e.debug().unwrap_or_default()),
        _ => unreachable!(),
    }
}

/// `slots`: 0 (the default) gives a ring in host memory 8 slots (16 are for GPU memory,
/// tests/gpu.rs); a count is taken as set, and 1, too few for a ring, gives 2.
#[test]
fn slots_auto_gives_a_host_ring_eight_and_a_count_is_taken_as_set() {
    init();
    let dir = tmpdir();
    for (i, (set, want)) in [(None, 8), (Some(0u32), 8), (Some(5), 5), (Some(1), 2)]
        .into_iter()
        .enumerate()
    {
        let sock = dir.path().join(format!("slots{i}.sock"));
        let mut h = sink_harness_with(
            &sock,
            "video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1",
            |e| {
                if let Some(n) = set {
                    e.set_property("slots", n);
                }
            },
        );
        assert_eq!(h.push(gray_frame(0, 64, 48)), Ok(gst::FlowSuccess::Ok));
        let q = gpushm::subscriber::query(
            &gpushm::names::Endpoint::Path(sock.clone()),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(q.report.slot_count, want, "slots={set:?}");
    }
}

#[test]
fn sink_without_socket_path_says_so() {
    init();
    let p = gst::parse::launch("videotestsrc ! gpushmsink").unwrap();
    assert!(p.set_state(gst::State::Playing).is_err());
    let e = error_of(&p, Duration::from_secs(5));
    assert!(e.contains("neither socket-path nor stream is set"), "{e}");
    p.set_state(gst::State::Null).unwrap();
}

#[test]
fn src_without_producer_times_out_with_a_clear_error() {
    init();
    let dir = tmpdir();
    let p = gst::parse::launch(&format!(
        "gpushmsrc timeout=200000000 socket-path={}/nobody ! fakesink",
        dir.path().display()
    ))
    .unwrap();
    // Waiting for a producer happens in the streaming thread: the state change returns at once.
    let t = Instant::now();
    assert!(p.set_state(gst::State::Playing).is_ok());
    assert!(
        t.elapsed() < Duration::from_millis(150),
        "set_state waited {:?}",
        t.elapsed()
    );
    let e = error_of(&p, Duration::from_secs(5));
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "the error came before the timeout"
    );
    assert!(
        e.contains("no gpushmsink is serving") && e.contains("nobody"),
        "{e}"
    );
    assert!(!e.contains("protocol error"), "{e}");
    p.set_state(gst::State::Null).unwrap();
}

/// A pipeline waiting for a producer stops at once when asked to.
#[test]
fn src_waiting_for_a_producer_stops_at_once() {
    init();
    let dir = tmpdir();
    let p = gst::parse::launch(&format!(
        "gpushmsrc timeout=18446744073709551615 socket-path={}/later ! fakesink",
        dir.path().display()
    ))
    .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    p.set_state(gst::State::Null).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "took {:?}",
        t.elapsed()
    );
}

/// Connect errors that waiting cannot fix are posted at once with their real cause.
#[test]
fn src_connect_errors_that_cannot_fix_themselves_fail_at_once() {
    init();
    let dir = tmpdir();
    let file = dir.path().join("regular");
    std::fs::write(&file, b"x").unwrap();
    let long = format!("{}/{}", dir.path().display(), "l".repeat(120));
    for (path, expect) in [
        (file.display().to_string(), "is not a socket"),
        (dir.path().display().to_string(), "is a directory"),
        (long, "too long"),
    ] {
        let p = gst::parse::launch(&format!(
            "gpushmsrc timeout=10000000000 socket-path={path} ! fakesink"
        ))
        .unwrap();
        let t = Instant::now();
        p.set_state(gst::State::Playing).unwrap();
        let e = error_of(&p, Duration::from_secs(5));
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{path}: took {:?} for {e}",
            t.elapsed()
        );
        assert!(e.contains(expect), "{path}: {e}");
        assert!(!e.contains("protocol error"), "{e}");
        p.set_state(gst::State::Null).unwrap();
    }
}

/// Frames a consumer keeps stay intact while the ring goes round many times: the slot of a
/// frame downstream holds is not given back before downstream drops it. This holds for frames
/// in memories the consumer made ahead (for slots frames came in before, and in the buffer
/// made ahead for the slot it expects next) as for fresh ones. Every frame has its own bytes,
/// also when the ring's order changes (kept frames take slots out of the round) and the
/// expected slot is not the one the frame came in.
#[test]
fn held_frames_stay_intact_while_the_ring_goes_round() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("held.sock");
    let mut sink = sink_harness_with(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
        |e| e.set_property("slots", 8u32),
    );
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut n = 0u64;
    let mut next = |sink: &mut Harness, src: &mut Harness| {
        assert_eq!(sink.push(gray_frame(n, 64, 48)), Ok(gst::FlowSuccess::Ok));
        let b = src.pull().expect("a buffer");
        assert_eq!(b.offset(), n);
        let expect = gray_frame(n, 64, 48);
        assert!(
            b.map_readable().unwrap().as_slice() == expect.map_readable().unwrap().as_slice(),
            "frame {n} arrived with other bytes"
        );
        n += 1;
        b
    };
    // Twice round the ring: every slot has had a frame.
    for _ in 0..16 {
        drop(next(&mut sink, &mut src));
    }
    // One frame kept for a while, then another: the slots go round in another order, and
    // frames come in other slots than the one the consumer expects.
    for _ in 0..2 {
        let one = next(&mut sink, &mut src);
        for _ in 0..6 {
            drop(next(&mut sink, &mut src));
        }
        drop(one);
    }
    // Two frames kept (zero-copy: within the client budget) while the ring goes round
    // four more times (the frames beyond the budget arrive as copies).
    let kept: Vec<gst::Buffer> = (0..2).map(|_| next(&mut sink, &mut src)).collect();
    for _ in 0..32 {
        drop(next(&mut sink, &mut src));
    }
    for b in &kept {
        let expect = gray_frame(b.offset(), 64, 48);
        assert!(
            b.map_readable().unwrap().as_slice() == expect.map_readable().unwrap().as_slice(),
            "frame {} changed while it was held",
            b.offset()
        );
    }
    let copied = src.element().unwrap().property::<u64>("frames-copied");
    assert_eq!(
        copied, 32,
        "only the frames that came while two were kept are copies: the kept ones are in the ring"
    );
}

/// Buffers an app keeps after its gpushmsrc pipeline went to NULL keep their slots: the
/// producer goes round the ring many times without writing over them and never waits for the
/// closed lossless consumer, and forgets it once the last buffer is dropped.
#[test]
fn buffers_kept_after_the_src_went_to_null_are_not_overwritten() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("null.sock");
    let mut sink = sink_harness_with(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
        |e| e.set_property("slots", 8u32),
    );
    let sink_el = sink.element().unwrap();
    let mut src = src_harness(&sock, true);
    let until = |what: &str, f: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    until("the consumer", &|| {
        sink_el.property::<u32>("num-clients") == 1
    });
    let same = |b: &gst::Buffer| {
        let expect = gray_frame(b.offset(), 64, 48);
        let equal =
            b.map_readable().unwrap().as_slice() == expect.map_readable().unwrap().as_slice();
        equal
    };
    let kept: Vec<gst::Buffer> = (0..2u64)
        .map(|n| {
            assert_eq!(sink.push(gray_frame(n, 64, 48)), Ok(gst::FlowSuccess::Ok));
            let b = src.pull().expect("a buffer");
            assert!(same(&b));
            b
        })
        .collect();
    assert_eq!(src.element().unwrap().property::<u64>("frames-copied"), 0);
    src.element().unwrap().set_state(gst::State::Null).unwrap();
    drop(src);
    until("the close", &|| sink_el.property::<u32>("num-clients") == 0);
    // Eight times round the six slots left.
    for n in 2..50u64 {
        assert_eq!(sink.push(gray_frame(n, 64, 48)), Ok(gst::FlowSuccess::Ok));
    }
    for b in &kept {
        assert!(same(b), "frame {} was overwritten after NULL", b.offset());
    }
    let clients = |s: &gst::Structure| s.get::<gst::Array>("clients").unwrap().len();
    let stats = sink_el.property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("times-lagged").unwrap(), 0, "{stats}");
    assert_eq!(clients(&stats), 1, "{stats}");
    let c = stats.get::<gst::Array>("clients").unwrap().as_slice()[0]
        .get::<gst::Structure>()
        .unwrap();
    assert!(c.get::<bool>("closed").unwrap(), "{c}");
    assert_eq!(c.get::<u32>("held-slots").unwrap(), 2, "{c}");
    drop(kept);
    until("the consumer's last buffer to close it", &|| {
        clients(&sink_el.property::<gst::Structure>("stats")) == 0
    });
}

/// Every raw format reaches the core crate's Subscriber with the geometry its producer
/// published (rows, visible bytes, components a pixel), with no format table on that side:
/// packed RGB in 4 and 3 bytes, gray in 8 and 16 bits, packed 4:2:2 and 10-bit semi-planar,
/// odd sizes among them, and every visible byte equal to what was pushed.
#[test]
fn every_raw_format_reaches_the_core_subscriber_with_its_geometry() {
    use gpushm::format::Components;
    init();
    // (format, width, height, components of each plane).
    type Case = (&'static str, u32, u32, &'static [(u8, u8)]);
    let cases: &[Case] = &[
        ("BGRx", 33, 17, &[(1, 4)]),
        ("RGBx", 64, 48, &[(1, 4)]),
        ("BGRA", 31, 9, &[(1, 4)]),
        ("ARGB", 16, 16, &[(1, 4)]),
        ("RGB", 33, 17, &[(1, 3)]),
        ("BGR", 10, 7, &[(1, 3)]),
        ("GRAY8", 33, 17, &[(1, 1)]),
        ("GRAY16_LE", 33, 17, &[(2, 1)]),
        ("YUY2", 34, 17, &[(1, 2)]),
        ("P010_10LE", 33, 17, &[(2, 1), (2, 2)]),
        ("I420", 33, 17, &[(1, 1), (1, 1), (1, 1)]),
        ("I420_10LE", 34, 18, &[(2, 1), (2, 1), (2, 1)]),
        // 10:10:10:2 in one 32-bit word a pixel.
        ("RGB10A2_LE", 9, 5, &[(4, 1)]),
        ("UYVY", 64, 48, &[(1, 2)]),
        ("YUY2", 33, 9, &[(1, 2)]),
    ];
    for &(format, w, h, comps) in cases {
        let dir = tmpdir();
        let sock = dir.path().join("fmt.sock");
        let caps = format!("video/x-raw,format={format},width={w},height={h},framerate=30/1");
        let mut sink = sink_harness(&sock, &caps);
        let mut sub = gpushm::subscriber::Subscriber::connect(
            &sock,
            gpushm::subscriber::ConnectOptions {
                lossless: true,
                ..Default::default()
            },
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while sink.element().unwrap().property::<u32>("num-clients") == 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        let info = gst_video::VideoInfo::from_caps(&gst::Caps::from_str(&caps).unwrap()).unwrap();
        let data: Vec<u8> = (0..info.size()).map(|i| (i * 7 + i / 251) as u8).collect();
        assert_eq!(
            sink.push(gst::Buffer::from_slice(data.clone())),
            Ok(gst::FlowSuccess::Ok)
        );
        let frame = sub
            .next_frame(Some(Duration::from_secs(5)))
            .unwrap()
            .unwrap();
        let g = frame.layout().unwrap_or_else(|e| panic!("{format}: {e}"));
        assert_eq!((g.format.as_str(), g.width, g.height), (format, w, h));
        assert_eq!(g.planes.len(), comps.len(), "{format}");
        let bytes = frame.to_vec();
        for (p, (plane, &(cb, cn))) in g.planes.iter().zip(comps).enumerate() {
            assert_eq!(
                plane.components,
                Components::new(cb, cn),
                "{format} plane {p}"
            );
            assert_eq!(
                plane.rows as usize,
                gstgpushm::pattern::plane_rows(&info, p)
            );
            let width = info.comp_width(
                info.format_info()
                    .plane()
                    .iter()
                    .position(|&x| x as usize == p)
                    .unwrap() as u8,
            );
            // Whole macropixels: odd-width 4:2:2 rows end with a whole one.
            let width = if format.starts_with("YUY2") || format.starts_with("UYVY") {
                width.next_multiple_of(2)
            } else {
                width
            };
            assert_eq!(
                plane.row_bytes,
                width * plane.components.pixel_bytes(),
                "{format} plane {p}"
            );
            assert_eq!(plane.offset as usize, info.offset()[p]);
            assert_eq!(plane.stride as i32, info.stride()[p]);
            for r in 0..plane.rows as usize {
                let at = plane.offset as usize + r * plane.stride as usize;
                let row = at..at + plane.row_bytes as usize;
                assert!(
                    bytes[row.clone()] == data[row],
                    "{format} plane {p} row {r}"
                );
            }
        }
        // One plane of whole components: viewable as height x width x components.
        assert_eq!(g.packed().is_some(), comps.len() == 1, "{format}");
    }
}

/// gpushmsink's pool lends the buffer that came back last, not the one that came back first
/// (GstBufferPool's own queue): a producer a fast consumer keeps up with writes into the two
/// or three slots it has in turn, still in the cache, not into every slot the pool ever
/// allocated. Buffers it keeps free are freed when the pool stops: all its slots can be
/// acquired again after.
#[test]
fn the_sink_pool_lends_the_buffer_that_came_back_last() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("lifo.sock");
    let caps_str = "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1";
    let sink = sink_harness(&sock, caps_str);
    let caps = gst::Caps::from_str(caps_str).unwrap();
    let mut q = gst::query::Allocation::new(Some(&caps), true);
    let pad = sink.element().unwrap().static_pad("sink").unwrap();
    assert!(pad.query(&mut q), "gpushmsink answers the ALLOCATION query");
    let (pool, size, min, max) = q
        .allocation_pools()
        .into_iter()
        .find_map(|(p, size, min, max)| p.map(|p| (p, size, min, max)))
        .expect("gpushmsink offers a pool");
    assert!(max >= 4, "a pool of {max} buffers");
    let mut config = pool.config();
    config.set_params(Some(&caps), size, min, max);
    pool.set_config(config).unwrap();
    let addr = |b: &gst::Buffer| b.map_readable().unwrap().as_ptr() as usize;
    for round in 0..2 {
        pool.set_active(true).unwrap();
        let bufs: Vec<gst::Buffer> = (0..4).map(|_| pool.acquire_buffer(None).unwrap()).collect();
        let addrs: Vec<usize> = bufs.iter().map(addr).collect();
        // Back in order: the last one back is lent first, then the one before it.
        drop(bufs);
        let again = pool.acquire_buffer(None).unwrap();
        assert_eq!(
            addr(&again),
            addrs[3],
            "round {round}: the last buffer back comes first"
        );
        let next = pool.acquire_buffer(None).unwrap();
        assert_eq!(
            addr(&next),
            addrs[2],
            "round {round}: then the one before it"
        );
        drop((again, next));
        // Every slot at once, the free ones included.
        let all: Vec<gst::Buffer> = (0..max)
            .map(|_| pool.acquire_buffer(None).unwrap())
            .collect();
        let mut distinct: Vec<usize> = all.iter().map(addr).collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            max as usize,
            "round {round}: every slot once"
        );
        drop(all);
        // Stopping frees the buffers kept free; the next round starts over.
        pool.set_active(false).unwrap();
    }
}

/// A consumer of a stream that is not live, whose frames come back to back (a producer flat
/// out), polls for the next frame before it sleeps: the producer delivers it without a
/// wake-up, which costs its thread a system call and an interrupt to the sleeping core every
/// frame. Each frame is pushed as soon as the consumer took the last one, so the consumer
/// is always waiting for it when it comes, and a poll (twice the usual interval) catches it
/// unless the pushing threads did not get a CPU meanwhile: the run goes on until one was
/// caught. A machine so slow that the median interval is 500 µs or more must not poll at all,
/// nor a process that may use one CPU only. The frames come complete and in order, and the
/// sink's `woken` counts only the frames no poll caught.
#[test]
fn back_to_back_frames_of_a_stream_that_is_not_live_come_without_wake_ups() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("b2b.sock");
    // appsrc is not live (a harness is): its frames are marked so.
    let pipeline = gst::parse::launch(&format!(
        "appsrc name=src format=time caps=video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1 \
         ! gpushmsink name=sink socket-path={} sync=false",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let appsrc = pipeline
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    let sink_el = pipeline.by_name("sink").unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "gpushmsink made no socket");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut sub = gpushm::subscriber::Subscriber::connect(
        &sock,
        gpushm::subscriber::ConnectOptions {
            lossless: true,
            ..Default::default()
        },
    )
    .unwrap();
    while sink_el.property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    // At least 300 frames, then until a poll caught one (at most 5000, 30 s): on a machine
    // loaded past its cores the producer may not run while the consumer polls, and after 4
    // polls in vain the consumer pauses polling for 64 frames.
    const FRAMES: u64 = 300;
    const MAX_FRAMES: u64 = 5000;
    let (took, next) = mpsc::channel();
    let consumer = std::thread::spawn(move || {
        let mut published = Vec::new();
        let mut n = 0;
        // Until the end of the stream.
        while let Some(f) = sub.next_frame(Some(Duration::from_secs(10))).unwrap() {
            let want = gray_frame(n, 64, 48);
            assert!(
                f.to_vec() == want.map_readable().unwrap().as_slice(),
                "frame {n} has its bytes"
            );
            published.push(f.meta.publish_ns);
            drop(f);
            took.send((n, sub.back_to_back_polls().caught)).unwrap();
            n += 1;
        }
        let mut intervals: Vec<u64> = published.windows(2).map(|w| w[1] - w[0]).collect();
        intervals.sort_unstable();
        (sub.back_to_back_polls(), intervals[intervals.len() / 2], n)
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    loop {
        let mut b = gray_frame(n, 64, 48);
        b.make_mut().set_pts(gst::ClockTime::from_mseconds(40 * n));
        assert_eq!(appsrc.push_buffer(b), Ok(gst::FlowSuccess::Ok));
        let (got, caught) = next.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(got, n);
        n += 1;
        if (n >= FRAMES && caught > 0) || n >= MAX_FRAMES || Instant::now() > deadline {
            break;
        }
    }
    assert_eq!(appsrc.end_of_stream(), Ok(gst::FlowSuccess::Ok));
    let (polls, median, frames) = consumer.join().unwrap();
    assert_eq!(frames, n, "every frame pushed was taken");
    let woken = sink_el
        .property::<gst::Structure>("stats")
        .get::<u64>("woken")
        .unwrap();
    let one_cpu = std::thread::available_parallelism().is_ok_and(|n| n.get() == 1);
    if one_cpu {
        // Polling would keep the producer from the one CPU.
        assert_eq!(polls.caught + polls.missed, 0, "one CPU: {polls:?}");
    } else if median < gpushm::policy::BACK_TO_BACK_POLL.as_nanos() as u64 {
        assert!(
            polls.caught >= 1,
            "no poll caught a frame: {polls:?}, woken {woken}, median interval {median} ns"
        );
    } else {
        eprintln!("frames {median} ns apart: too slow to poll for");
        assert_eq!(polls.caught + polls.missed, 0, "{polls:?}");
    }
    assert!(
        woken <= frames - polls.caught,
        "woken {woken} times for {frames} frames, {} of them caught by polling",
        polls.caught
    );
    pipeline.set_state(gst::State::Null).unwrap();
}

/// A buffer of gpushmsink's pool pushed again while a consumer still holds the frame it
/// carried the first time (a tee, a repeated frame): the second push goes out as a copy in
/// another slot, and the held frame keeps its bytes.
#[test]
fn a_pool_buffer_pushed_again_while_held_goes_out_as_a_copy() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("again.sock");
    let caps_str = "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1";
    let mut sink = sink_harness(&sock, caps_str);
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    // The pool gpushmsink offers upstream, as videotestsrc would get it.
    let caps = gst::Caps::from_str(caps_str).unwrap();
    let mut q = gst::query::Allocation::new(Some(&caps), true);
    let pad = sink.element().unwrap().static_pad("sink").unwrap();
    assert!(pad.query(&mut q), "gpushmsink answers the ALLOCATION query");
    let (pool, size, min, max) = q
        .allocation_pools()
        .into_iter()
        .find_map(|(p, size, min, max)| p.map(|p| (p, size, min, max)))
        .expect("gpushmsink offers a pool");
    let mut config = pool.config();
    config.set_params(Some(&caps), size, min, max);
    pool.set_config(config).unwrap();
    pool.set_active(true).unwrap();
    let mut buf = pool.acquire_buffer(None).unwrap();
    {
        let b = buf.get_mut().unwrap();
        let want = gray_frame(0, 64, 48);
        b.copy_from_slice(0, want.map_readable().unwrap().as_slice())
            .unwrap();
        b.set_pts(gst::ClockTime::ZERO);
        b.set_offset(0);
    }
    assert_eq!(sink.push(buf.clone()), Ok(gst::FlowSuccess::Ok));
    let held = src.pull().expect("the frame in the pool's buffer");
    assert_eq!(held.offset(), 0);
    // Pushed again as the next frame (videorate repeating a frame does this).
    buf.make_mut().set_offset(1);
    assert_eq!(sink.push(buf.clone()), Ok(gst::FlowSuccess::Ok));
    let second = src.pull().expect("the second frame");
    assert_eq!(second.offset(), 1);
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(
        stats.get::<u64>("frames-copied").unwrap(),
        1,
        "the second push was copied: its slot was held"
    );
    let want = gray_frame(0, 64, 48);
    for b in [&held, &second] {
        assert!(
            b.map_readable().unwrap().as_slice() == want.map_readable().unwrap().as_slice(),
            "frame {} has the bytes it was pushed with",
            b.offset()
        );
    }
    drop((held, second, buf));
}

/// Upstream keeps a buffer of gpushmsink's pool after pushing it and writes into it again (an
/// app reusing its frame, a source drawing the next frame into the same buffer). The frame a
/// consumer holds keeps its bytes: the published memory is read-only, so the write map gets a
/// copy. Pushed again, the buffer goes out as a copy, and its slot still comes back to the
/// pool: every slot can be acquired at once afterwards.
#[test]
fn upstream_writing_into_a_pushed_pool_buffer_leaves_held_frames_alone() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("rewrite.sock");
    let caps_str = "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1";
    let mut sink = sink_harness(&sock, caps_str);
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let caps = gst::Caps::from_str(caps_str).unwrap();
    let mut q = gst::query::Allocation::new(Some(&caps), true);
    let pad = sink.element().unwrap().static_pad("sink").unwrap();
    assert!(pad.query(&mut q), "gpushmsink answers the ALLOCATION query");
    let (pool, size, min, max) = q
        .allocation_pools()
        .into_iter()
        .find_map(|(p, size, min, max)| p.map(|p| (p, size, min, max)))
        .expect("gpushmsink offers a pool");
    assert!(max > 1, "a pool of {max} buffers");
    let mut config = pool.config();
    config.set_params(Some(&caps), size, min, max);
    pool.set_config(config).unwrap();
    pool.set_active(true).unwrap();
    let pattern = |n: u64| gray_frame(n, 64, 48).map_readable().unwrap().to_vec();
    let mut buf = pool.acquire_buffer(None).unwrap();
    {
        let b = buf.get_mut().unwrap();
        b.copy_from_slice(0, &pattern(0)).unwrap();
        b.set_offset(0);
    }
    assert_eq!(sink.push(buf.clone()), Ok(gst::FlowSuccess::Ok));
    let held = src.pull().expect("the frame in the pool's buffer");
    assert!(held.map_readable().unwrap().as_slice() == pattern(0));
    // The sink let go of the buffer: upstream's reference is the only one, so it may write.
    {
        let b = buf
            .get_mut()
            .expect("after the push, upstream holds the buffer's only reference");
        let mut map = b
            .map_writable()
            .expect("mapping for writing works (on a copy)");
        map.as_mut_slice().copy_from_slice(&pattern(1));
    }
    assert!(
        held.map_readable().unwrap().as_slice() == pattern(0),
        "the held frame did not change when upstream wrote into the buffer it pushed"
    );
    buf.make_mut().set_offset(1);
    assert_eq!(sink.push(buf), Ok(gst::FlowSuccess::Ok));
    let second = src.pull().expect("the second frame");
    assert_eq!(second.offset(), 1);
    assert!(second.map_readable().unwrap().as_slice() == pattern(1));
    assert!(held.map_readable().unwrap().as_slice() == pattern(0));
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-copied").unwrap(), 1);
    // A fresh buffer of the pool goes out in place (and so is made read-only)...
    let mut fresh = pool.acquire_buffer(None).unwrap();
    {
        let b = fresh.get_mut().unwrap();
        b.copy_from_slice(0, &pattern(2)).unwrap();
        b.set_offset(2);
    }
    assert_eq!(sink.push(fresh), Ok(gst::FlowSuccess::Ok));
    let third = src.pull().expect("the third frame");
    assert!(third.map_readable().unwrap().as_slice() == pattern(2));
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(
        stats.get::<u64>("frames-copied").unwrap(),
        1,
        "sent in place"
    );
    drop((held, second, third));
    // ...and writable in place again once it is back in the pool (checked below). No slot was
    // lost either: all of them at once, with a deadline instead of a hang.
    let (tx, rx) = mpsc::channel();
    let p = pool.clone();
    std::thread::spawn(move || {
        let all: Result<Vec<_>, _> = (0..max).map(|_| p.acquire_buffer(None)).collect();
        let _ = tx.send(all);
    });
    let all = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("every one of the pool's slots can be acquired again, at once")
        .unwrap();
    assert_eq!(all.len(), max as usize);
    for b in &all {
        assert!(
            !b.peek_memory(0)
                .flags()
                .contains(gst::MemoryFlags::READONLY),
            "a buffer back in the pool is writable in place again"
        );
    }
    drop(all);
    pool.set_active(false).unwrap();
}

/// A shallow copy of a pool buffer that outlives the buffer (videorate pushes copies that share
/// the frame's memory, and a queue may still hold one when the original goes back to the
/// pool): the slot is not lent again while the copy exists, so upstream does not draw over it,
/// and not while a consumer holds the frame the copy carried.
#[test]
fn a_copy_of_a_pool_buffer_keeps_its_slot_until_it_and_its_readers_are_gone() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("copy-outlives.sock");
    let caps_str = "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1";
    let mut sink = sink_harness(&sock, caps_str);
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let caps = gst::Caps::from_str(caps_str).unwrap();
    let mut q = gst::query::Allocation::new(Some(&caps), true);
    let pad = sink.element().unwrap().static_pad("sink").unwrap();
    assert!(pad.query(&mut q), "gpushmsink answers the ALLOCATION query");
    let (pool, size, min, max) = q
        .allocation_pools()
        .into_iter()
        .find_map(|(p, size, min, max)| p.map(|p| (p, size, min, max)))
        .expect("gpushmsink offers a pool");
    let mut config = pool.config();
    config.set_params(Some(&caps), size, min, max);
    pool.set_config(config).unwrap();
    pool.set_active(true).unwrap();
    let pattern = |n: u64| gray_frame(n, 64, 48).map_readable().unwrap().to_vec();
    let first_byte = |b: &gst::BufferRef| b.map_readable().unwrap().as_ptr() as usize;
    let mut original = pool.acquire_buffer(None).unwrap();
    {
        let b = original.get_mut().unwrap();
        b.copy_from_slice(0, &pattern(0)).unwrap();
        b.set_offset(0);
    }
    let slot_addr = first_byte(&original);
    // The copy waits (in a queue, say) while the original goes back to the pool.
    let copy = original.copy();
    drop(original);
    // Upstream draws the next frames: never into the copy's slot.
    let mut next = Vec::new();
    for n in 1..max as u64 {
        let mut b = pool.acquire_buffer(None).unwrap();
        assert_ne!(
            first_byte(&b),
            slot_addr,
            "the slot of a copy still on its way was lent again"
        );
        let r = b.get_mut().unwrap();
        r.copy_from_slice(0, &pattern(n)).unwrap();
        r.set_offset(n);
        next.push(b);
    }
    assert!(copy.map_readable().unwrap().as_slice() == pattern(0));
    // The copy goes out in place and a consumer holds it; then the copy itself is gone.
    assert_eq!(sink.push(copy), Ok(gst::FlowSuccess::Ok));
    let held = src.pull().expect("the copied frame");
    assert_eq!(held.offset(), 0);
    assert!(held.map_readable().unwrap().as_slice() == pattern(0));
    for b in next {
        assert_eq!(sink.push(b), Ok(gst::FlowSuccess::Ok));
        let got = src.pull().expect("a frame");
        assert!(got.map_readable().unwrap().as_slice() == pattern(got.offset()));
    }
    // Every slot but the held one can be lent; the held one only once the consumer let go.
    let (tx, rx) = mpsc::channel();
    let p = pool.clone();
    std::thread::spawn(move || {
        let all: Result<Vec<_>, _> = (0..max).map(|_| p.acquire_buffer(None)).collect();
        let _ = tx.send(all);
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "all the slots were lent while a consumer still held one"
    );
    assert!(held.map_readable().unwrap().as_slice() == pattern(0));
    drop(held);
    let all = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the held slot is lent again once the consumer let go")
        .unwrap();
    assert_eq!(all.len(), max as usize);
    assert!(all.iter().any(|b| first_byte(b) == slot_addr));
    drop(all);
    pool.set_active(false).unwrap();
}

/// Buffers that are not from the sink's pool are copied into a slot: one with a VideoMeta of
/// another layout (rows padded to 80 bytes) is copied row by row into the caps' layout, one in
/// two memories without a VideoMeta in one piece. Consumers see the right pixels either way.
#[test]
fn foreign_buffers_of_any_layout_arrive_with_their_pixels() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("layouts.sock");
    let caps_str = "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1";
    let mut sink = sink_harness(&sock, caps_str);
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let info = gst_video::VideoInfo::from_caps(&gst::Caps::from_str(caps_str).unwrap()).unwrap();
    let pixel = |n: u64, x: usize, y: usize| ((x + 3 * y + 17 * n as usize) % 251) as u8;
    // Frame 0: rows of 64 pixels padded to 80 bytes, said so by a VideoMeta.
    let mut padded = vec![0xEEu8; 80 * 48];
    for y in 0..48 {
        for x in 0..64 {
            padded[y * 80 + x] = pixel(0, x, y);
        }
    }
    let mut b0 = gst::Buffer::from_mut_slice(padded);
    {
        let b = b0.get_mut().unwrap();
        gst_video::VideoMeta::add_full(
            b,
            gst_video::VideoFrameFlags::empty(),
            gst_video::VideoFormat::Gray8,
            64,
            48,
            &[0],
            &[80],
        )
        .unwrap();
        b.set_offset(0);
    }
    // Frame 1: the caps' layout, in two memories.
    let tight: Vec<u8> = (0..48)
        .flat_map(|y| (0..64).map(move |x| pixel(1, x, y)))
        .collect();
    let mut b1 = gst::Buffer::new();
    {
        let b = b1.get_mut().unwrap();
        b.append_memory(gst::Memory::from_slice(tight[..1000].to_vec()));
        b.append_memory(gst::Memory::from_slice(tight[1000..].to_vec()));
        b.set_offset(1);
    }
    for (n, buf) in [b0, b1].into_iter().enumerate() {
        assert_eq!(sink.push(buf), Ok(gst::FlowSuccess::Ok));
        let got = src.pull().expect("a frame");
        assert_eq!(got.offset(), n as u64);
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(got.as_ref(), &info)
            .expect("the frame maps with the caps");
        let stride = frame.plane_stride()[0] as usize;
        let data = frame.plane_data(0).unwrap();
        for y in 0..48 {
            for x in 0..64 {
                assert_eq!(
                    data[y * stride + x],
                    pixel(n as u64, x, y),
                    "frame {n} at {x},{y}"
                );
            }
        }
    }
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-copied").unwrap(), 2);
}

/// A large frame not from the pool (1.4 MiB) in two memories split at an odd byte, the
/// second over `frame_copy`'s streaming threshold, is copied into its slot whole: every byte
/// arrives, none is added.
#[test]
fn a_large_foreign_frame_in_two_memories_arrives_byte_exact() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("large.sock");
    let (w, h) = (1000usize, 1500usize);
    let caps_str = format!("video/x-raw,format=GRAY8,width={w},height={h},framerate=25/1");
    let mut sink = sink_harness(&sock, &caps_str);
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    for n in 0..3u64 {
        let bytes: Vec<u8> = (0..w * h)
            .map(|i| ((i * 7 + (i >> 11) + n as usize * 13) % 251) as u8)
            .collect();
        // Split at an odd byte: the second memory, over 1 MiB itself, lands at an unaligned
        // place of the slot (the streaming copy's unaligned head and tail).
        let cut = 77_777 + n as usize;
        let mut b = gst::Buffer::new();
        {
            let b = b.get_mut().unwrap();
            b.append_memory(gst::Memory::from_slice(bytes[..cut].to_vec()));
            b.append_memory(gst::Memory::from_slice(bytes[cut..].to_vec()));
            b.set_offset(n);
        }
        assert_eq!(sink.push(b), Ok(gst::FlowSuccess::Ok));
        let got = src.pull().expect("a frame");
        assert_eq!(got.offset(), n);
        let map = got.map_readable().unwrap();
        assert_eq!(map.len(), w * h, "frame {n}");
        if let Some(i) = (0..w * h).find(|&i| map[i] != bytes[i]) {
            panic!("frame {n}: byte {i} is {} not {}", map[i], bytes[i]);
        }
    }
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-copied").unwrap(), 3);
}

/// NV12 frames not from the pool: with a VideoMeta that agrees with the caps and trailing bytes
/// after the frame (copied in one piece, the trailing bytes left out), and with the caps'
/// strides but the UV plane further on (copied plane by plane). Both arrive with their pixels.
#[test]
fn foreign_nv12_frames_with_moved_planes_or_trailing_bytes_arrive_intact() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("nv12.sock");
    let caps_str = "video/x-raw,format=NV12,width=64,height=48,framerate=25/1";
    let mut sink = sink_harness(&sock, caps_str);
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let info = gst_video::VideoInfo::from_caps(&gst::Caps::from_str(caps_str).unwrap()).unwrap();
    // Plane 0: 64x48 luma; plane 1: 32x24 UV pairs, 64 bytes a row.
    let byte = |n: u64, plane: usize, x: usize, y: usize| {
        ((x * 5 + y * 11 + plane * 101 + n as usize * 29) % 253) as u8
    };
    let rows = [48usize, 24];
    let frame = |n: u64, uv_offset: usize, trailing: usize| {
        let mut data = vec![0xA5u8; uv_offset + 64 * 24 + trailing];
        for (plane, start) in [0, uv_offset].into_iter().enumerate() {
            for y in 0..rows[plane] {
                for x in 0..64 {
                    data[start + y * 64 + x] = byte(n, plane, x, y);
                }
            }
        }
        let mut b = gst::Buffer::from_mut_slice(data);
        {
            let b = b.get_mut().unwrap();
            gst_video::VideoMeta::add_full(
                b,
                gst_video::VideoFrameFlags::empty(),
                gst_video::VideoFormat::Nv12,
                64,
                48,
                &[0, uv_offset],
                &[64, 64],
            )
            .unwrap();
            b.set_offset(n);
        }
        b
    };
    // Frame 0 as the caps say, 1000 bytes more; frame 1 with 256 bytes between the planes.
    let pushed = [frame(0, 64 * 48, 1000), frame(1, 64 * 48 + 256, 0)];
    for (n, buf) in pushed.into_iter().enumerate() {
        assert_eq!(sink.push(buf), Ok(gst::FlowSuccess::Ok));
        let got = src.pull().expect("a frame");
        assert_eq!(got.offset(), n as u64);
        let f = gst_video::VideoFrameRef::from_buffer_ref_readable(got.as_ref(), &info)
            .expect("the frame maps with the caps");
        for (plane, &plane_rows) in rows.iter().enumerate() {
            let stride = f.plane_stride()[plane] as usize;
            let data = f.plane_data(plane as u32).unwrap();
            for y in 0..plane_rows {
                for x in 0..64 {
                    assert_eq!(
                        data[y * stride + x],
                        byte(n as u64, plane, x, y),
                        "frame {n}, plane {plane} at {x},{y}"
                    );
                }
            }
        }
    }
}

#[test]
fn frames_metadata_and_eos_travel_through_the_harnesses() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("h.sock");
    let mut sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let mut src = src_harness(&sock, true);
    // Wait until the client is registered before pushing.
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    // One at a time: a consumer may hold at most half the ring (client-budget).
    let mut last_pts = None;
    let mut last_publish = 0;
    for n in 0..6u64 {
        let pushed = gpushm::monotonic_ns();
        assert_eq!(sink.push(gray_frame(n, 64, 48)), Ok(gst::FlowSuccess::Ok));
        let b = src.pull().expect("a buffer");
        let pulled = gpushm::monotonic_ns();
        let expect = gray_frame(n, 64, 48);
        assert_eq!(
            b.map_readable().unwrap().as_slice(),
            expect.map_readable().unwrap().as_slice(),
            "frame {n}"
        );
        assert_eq!(b.offset(), n);
        assert_eq!(b.duration(), Some(gst::ClockTime::from_mseconds(40)));
        assert_eq!(b.flags().contains(gst::BufferFlags::DELTA_UNIT), n % 2 == 1);
        assert_eq!(b.flags().contains(gst::BufferFlags::DISCONT), n == 0);
        // The harness pushes faster than real time (not live, no clock sync): timestamps
        // are placed at publish times, never in the future (the spacing of a syncing
        // producer is checked across processes, with --exact-pts).
        let pts = b.pts().expect("pts");
        if let Some(l) = last_pts {
            assert!(pts >= l, "PTS never go backwards");
        }
        last_pts = Some(pts);
        let vm = b.meta::<gst_video::VideoMeta>().expect("video meta");
        assert_eq!((vm.width(), vm.height(), vm.stride()[0]), (64, 48, 64));
        let publish = gst::Caps::new_empty_simple(gstgpushm::PUBLISH_TIMESTAMP_CAPS);
        let published: Vec<u64> = b
            .iter_meta::<gst::ReferenceTimestampMeta>()
            .filter(|m| m.reference() == publish.as_ref())
            .map(|m| m.timestamp().nseconds())
            .collect();
        // One publish time per buffer (the consumer fills in a meta made ahead of the
        // frame): when this frame was published, on CLOCK_MONOTONIC.
        assert_eq!(published.len(), 1, "frame {n}: {published:?}");
        assert!(
            (pushed..=pulled).contains(&published[0]) && published[0] > last_publish,
            "frame {n}: published at {}, pushed at {pushed}, pulled at {pulled}, previous {last_publish}",
            published[0]
        );
        last_publish = published[0];
        // Writers get a copy (GStreamer copies non-writable memory on a write map); the ring
        // itself is mapped PROT_READ (see the ring's unit tests).
        assert!(
            b.peek_memory(0)
                .flags()
                .contains(gst::MemoryFlags::READONLY),
            "consumers get read-only memory"
        );
    }
    let caps = src
        .sinkpad()
        .unwrap()
        .current_caps()
        .expect("caps from the producer");
    let s = caps.structure(0).unwrap();
    assert_eq!(
        (
            s.get::<&str>("format").unwrap(),
            s.get::<i32>("width").unwrap()
        ),
        ("GRAY8", 64)
    );
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-sent").unwrap(), 6);
    assert_eq!(
        stats.get::<u64>("frames-copied").unwrap(),
        6,
        "harness buffers are not from the pool"
    );
    assert!(sink.push_event(gst::event::Eos::new()));
    // Serialized events reach the harness after the buffers: look for EOS.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(e) = src.try_pull_event() {
            if e.type_() == gst::EventType::Eos {
                break;
            }
        } else {
            assert!(Instant::now() < deadline, "no EOS from the src");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Pulls buffers from a src harness until one comes, at most for `within`.
fn pull_within(src: &mut Harness, within: Duration) -> Option<gst::Buffer> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(b) = src.try_pull() {
            return Some(b);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// gpushmsink takes buffers around GstBaseSink's chain function when it would only call
/// render() (sync=false, playing): what GstBaseSink does for each buffer must still happen.
/// Out-of-segment buffers are dropped, the position query answers the last buffer's (or
/// gap's) stream time and the end after EOS, settings changed through GstBaseSink's setters
/// (which notify nobody) send buffers back its way (a last sample is kept), EOS refuses
/// buffers, a flush starts over, and a stopped sink has no position.
#[test]
fn buffers_around_basesink_keep_segment_position_settings_and_eos() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("d.sock");
    let mut sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let el = sink.element().unwrap();
    let mut src = src_harness(&sock, true);
    let deadline = Instant::now() + Duration::from_secs(5);
    while el.property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let ms = gst::ClockTime::from_mseconds;
    let position = || el.query_position::<gst::ClockTime>();
    let frame_of = |b: &gst::Buffer| b.offset();

    assert_eq!(sink.push(gray_frame(0, 64, 48)), Ok(gst::FlowSuccess::Ok));
    let b = pull_within(&mut src, Duration::from_secs(5)).expect("frame 0");
    assert_eq!(frame_of(&b), 0);
    assert_eq!(position(), Some(ms(0)));

    // A segment from 1 s (stream time = PTS): frame 10 (0.4 s) is outside, frame 30
    // (1.2 s) inside.
    let mut seg = gst::FormattedSegment::<gst::ClockTime>::new();
    seg.set_start(gst::ClockTime::SECOND);
    seg.set_time(gst::ClockTime::SECOND);
    assert!(sink.push_event(gst::event::Segment::new(&seg)));
    assert_eq!(sink.push(gray_frame(10, 64, 48)), Ok(gst::FlowSuccess::Ok));
    assert_eq!(sink.push(gray_frame(30, 64, 48)), Ok(gst::FlowSuccess::Ok));
    let b = pull_within(&mut src, Duration::from_secs(5)).expect("frame 30");
    assert_eq!(
        frame_of(&b),
        30,
        "the frame outside the segment was dropped"
    );
    assert_eq!(position(), Some(ms(1200)));
    let stats = el.property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-sent").unwrap(), 2);

    // gst_base_sink_set_last_sample_enabled notifies nobody: the next buffer must still go
    // GstBaseSink's way, which keeps it as the last sample.
    let base = el.downcast_ref::<gst_base::BaseSink>().unwrap();
    let last_sample_enabled = |on: bool| {
        // SAFETY: GstBaseSink's setter on a live GstBaseSink.
        unsafe { gst_base::ffi::gst_base_sink_set_last_sample_enabled(base.as_ptr(), on.into()) }
    };
    last_sample_enabled(true);
    assert_eq!(sink.push(gray_frame(31, 64, 48)), Ok(gst::FlowSuccess::Ok));
    assert_eq!(
        frame_of(&pull_within(&mut src, Duration::from_secs(5)).expect("frame 31")),
        31
    );
    let last = base
        .last_sample()
        .expect("a last sample, kept by GstBaseSink");
    assert_eq!(last.buffer().unwrap().offset(), 31);
    assert_eq!(position(), Some(ms(1240)));
    drop(last);
    last_sample_enabled(false);

    // A gap counts as position, as a buffer does.
    assert!(sink.push_event(gst::event::Gap::builder(ms(1500)).duration(ms(40)).build()));
    assert_eq!(position(), Some(ms(1500)));

    // After EOS, buffers are refused with EOS, whichever way they would go, and the position
    // is where the stream ended.
    assert!(sink.push_event(gst::event::Eos::new()));
    assert_eq!(position(), Some(ms(1540)));
    assert_eq!(sink.push(gray_frame(32, 64, 48)), Err(gst::FlowError::Eos));
    // A flush starts over: frames flow again, from a new segment.
    assert!(sink.push_event(gst::event::FlushStart::new()));
    assert!(sink.push_event(gst::event::FlushStop::new(true)));
    let seg = gst::FormattedSegment::<gst::ClockTime>::new();
    assert!(sink.push_event(gst::event::Segment::new(&seg)));
    assert_eq!(sink.push(gray_frame(33, 64, 48)), Ok(gst::FlowSuccess::Ok));
    // (The consumer ended at EOS: the sink's count says the frame went out.)
    let stats = el.property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-sent").unwrap(), 4);
    assert_eq!(position(), Some(ms(1320)));
    // No position once stopped (GstBaseSink has none either).
    el.set_state(gst::State::Ready).unwrap();
    assert_eq!(position(), None);
}

/// A live pipeline with sync=false (buffers around GstBaseSink) pauses and plays again:
/// frames stop and resume, and the position follows them.
#[test]
fn a_non_syncing_live_sink_pauses_and_resumes() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("p.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=64,height=48,framerate=50/1 ! gpushmsink name=sink sync=false socket-path={}",
        sock.display()
    ))
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} lossless=true ! appsink name=out sync=false max-buffers=1000",
        sock.display()
    ))
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    let out = consumer
        .downcast_ref::<gst::Bin>()
        .unwrap()
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    let pull = |n: usize| -> Vec<u64> {
        (0..n)
            .map(|i| {
                out.try_pull_sample(gst::ClockTime::from_seconds(5))
                    .unwrap_or_else(|| panic!("sample {i}"))
                    .buffer()
                    .unwrap()
                    .offset()
            })
            .collect()
    };
    let before = pull(10);
    let pos1 = producer
        .query_position::<gst::ClockTime>()
        .expect("position");
    producer.set_state(gst::State::Paused).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let paused = producer
        .query_position::<gst::ClockTime>()
        .expect("position");
    assert!(paused >= pos1, "position {pos1}, then {paused} once paused");
    // Whatever was on its way before the pause.
    while out
        .try_pull_sample(gst::ClockTime::from_mseconds(100))
        .is_some()
    {}
    assert!(
        out.try_pull_sample(gst::ClockTime::from_mseconds(300))
            .is_none(),
        "no frames while paused"
    );
    producer.set_state(gst::State::Playing).unwrap();
    let after = pull(10);
    let pos2 = producer
        .query_position::<gst::ClockTime>()
        .expect("position");
    assert!(
        after.iter().all(|o| *o > *before.last().unwrap()),
        "{before:?} then {after:?}"
    );
    assert!(pos2 > pos1, "position {pos1} then {pos2}");
    producer.set_state(gst::State::Null).unwrap();
    consumer.set_state(gst::State::Null).unwrap();
}

#[test]
fn caps_change_mid_stream_makes_a_new_ring() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("caps.sock");
    let mut sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let mut src = src_harness(&sock, true);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Two frames stay queued across the caps change: they keep the old ring alive.
    sink.push(gray_frame(0, 64, 48)).unwrap();
    sink.push(gray_frame(1, 64, 48)).unwrap();
    sink.set_src_caps_str("video/x-raw,format=GRAY8,width=128,height=96,framerate=25/1");
    for n in 0..6u64 {
        if n >= 2 {
            sink.push(gray_frame(n, 128, 96)).unwrap();
        }
        let b = src.pull().expect("a buffer");
        let (w, h) = if n < 2 { (64, 48) } else { (128, 96) };
        let expect = gray_frame(n, w, h);
        assert_eq!(b.size(), w * h, "frame {n}");
        assert_eq!(
            b.map_readable().unwrap().as_slice(),
            expect.map_readable().unwrap().as_slice()
        );
        let vm = b.meta::<gst_video::VideoMeta>().unwrap();
        assert_eq!(vm.width() as usize, w);
    }
    let caps = src.sinkpad().unwrap().current_caps().unwrap();
    assert_eq!(caps.structure(0).unwrap().get::<i32>("width").unwrap(), 128);
}

#[test]
fn videotestsrc_renders_straight_into_the_ring() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("vts.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc num-buffers=50 ! video/x-raw,format=NV12,width=320,height=240 ! gpushmsink name=sink sync=false wait-for-connection=true socket-path={}",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc lossless=true socket-path={} ! appsink name=out sync=false",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    let appsink = consumer
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    let mut got = 0;
    while appsink.pull_sample().is_ok() {
        got += 1;
    }
    assert_eq!(got, 50);
    let stats = producer
        .by_name("sink")
        .unwrap()
        .property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-sent").unwrap(), 50);
    assert_eq!(
        stats.get::<u64>("frames-copied").unwrap(),
        0,
        "videotestsrc used the ring's pool"
    );
    consumer.set_state(gst::State::Null).unwrap();
    producer.set_state(gst::State::Null).unwrap();
}

#[test]
fn live_timestamps_map_to_the_consumer_running_time() {
    live_timestamps_map_with(None);
}

/// The consumer's pipeline runs on another clock than the producer's CLOCK_MONOTONIC (here
/// the wall clock): frames are still placed at their publish moment on that clock.
#[test]
fn live_timestamps_map_onto_a_consumer_clock_other_than_monotonic() {
    init();
    let clock = gst::SystemClock::obtain();
    // A clock of its own: the system clock is shared by the process.
    let wall: gst::Clock = gst::glib::Object::builder::<gst::SystemClock>()
        .property("clock-type", gst::ClockType::Realtime)
        .build()
        .upcast();
    assert!(
        wall.time().nseconds().abs_diff(clock.time().nseconds()) > 60_000_000_000,
        "the wall clock is far from CLOCK_MONOTONIC here"
    );
    live_timestamps_map_with(Some(wall));
}

/// A live producer's frames get PTS on the consumer's running time (consumer on `clock`, or
/// its default one), advancing with the frames.
fn live_timestamps_map_with(clock: Option<gst::Clock>) {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("live.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc is-live=true ! video/x-raw,format=GRAY8,width=64,height=48,framerate=50/1 ! gpushmsink socket-path={}",
        sock.display()
    ))
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    // The producer's running time is a second ahead of the consumer's: without the mapping the
    // consumer's PTS would be about a second in its future.
    std::thread::sleep(Duration::from_secs(1));
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} ! appsink name=out sync=false",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    if let Some(c) = &clock {
        consumer.use_clock(Some(c));
    }
    consumer.set_state(gst::State::Playing).unwrap();
    let appsink = consumer
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    let mut first = None;
    for i in 0..30 {
        let s = appsink.pull_sample().unwrap();
        let pts = s.buffer().unwrap().pts().unwrap();
        let now = consumer.clock().unwrap().time() - consumer.base_time().unwrap();
        // Stamped by the producer a frame or so ago (generous bound for loaded CI machines). It
        // can be slightly ahead: GstSystemClock does not wait for times under 500 us away, so a
        // syncing sink may publish a little before the frame's clock time.
        let lag = now.nseconds() as i64 - pts.nseconds() as i64;
        assert!(
            (-1_000_000..500_000_000).contains(&lag),
            "running-time lag {lag} ns"
        );
        // The first frames may be placed at the pipeline's start (published before it).
        if i == 5 {
            first = Some(pts);
        }
        if let (29, Some(first)) = (i, first) {
            // 24 frames at 50 fps later (frames may be dropped on a loaded machine: more).
            assert!(
                pts.checked_sub(first)
                    .is_some_and(|d| d >= gst::ClockTime::from_mseconds(24 * 20 - 10)),
                "PTS advance with the frames: {pts} after {first}"
            );
        }
    }
    consumer.set_state(gst::State::Null).unwrap();
    producer.set_state(gst::State::Null).unwrap();
}

#[test]
fn socket_gets_the_requested_permissions() {
    init();
    let dir = tmpdir();
    for (perms, want) in [(None, 0o600), (Some(0o660u32), 0o660)] {
        let sock = dir.path().join(format!("perm{want:o}.sock"));
        let h = sink_harness_with(&sock, "video/x-raw,format=GRAY8,width=8,height=8", |e| {
            if let Some(p) = perms {
                e.set_property("perms", p);
            }
        });
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, want);
        drop(h);
        assert!(!sock.exists(), "the sink removes its socket when it stops");
    }
}

#[test]
fn client_signals_and_num_clients() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("sig.sock");
    let sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let e = sink.element().unwrap();
    let (tx, rx) = mpsc::channel();
    let tx2 = tx.clone();
    e.connect("client-connected", false, move |v| {
        let _ = tx.send(("connected", v[1].get::<i32>().unwrap()));
        None
    });
    e.connect("client-disconnected", false, move |v| {
        // Signals during teardown may find the receiver gone: never panic in a callback.
        let _ = tx2.send(("disconnected", v[1].get::<i32>().unwrap()));
        None
    });
    let src = src_harness(&sock, false);
    let (what, id) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(what, "connected");
    assert_eq!(e.property::<u32>("num-clients"), 1);
    drop(src);
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(1)).unwrap(),
        ("disconnected", id)
    );
    assert_eq!(e.property::<u32>("num-clients"), 0);
}

#[test]
fn garbage_and_silent_clients_are_dropped_and_others_still_served() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("garbage.sock");
    let mut sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let mut garbage = UnixStream::connect(&sock).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let silent = UnixStream::connect(&sock).unwrap();
    garbage
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut reply = Vec::new();
    let _ = garbage.read_to_end(&mut reply);
    assert!(
        String::from_utf8_lossy(&reply).contains("bad magic"),
        "the sink explains why it hangs up"
    );
    let mut src = src_harness(&sock, true);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    sink.push(gray_frame(0, 64, 48)).unwrap();
    assert_eq!(src.pull().unwrap().offset(), 0);
    // A client that never says Hello is dropped after the handshake timeout.
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 16];
    assert_eq!((&silent).read(&mut buf).unwrap_or(0), 0);
    assert!(t.elapsed() < Duration::from_secs(4));
}

#[test]
fn shutting_down_a_waiting_src_does_not_hang() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("idle.sock");
    let _sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} ! fakesink",
        sock.display()
    ))
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    consumer.set_state(gst::State::Null).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );
}

/// A lossless consumer whose downstream keeps every frame gets copies beyond its budget:
/// render never waits for it, every frame arrives intact, and the copies are counted on both
/// sides.
#[test]
fn a_consumer_that_keeps_every_frame_gets_copies_and_never_blocks_render() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("block.sock");
    let mut sink = sink_harness_with(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
        |e| e.set_property("slots", 4u32),
    );
    let e = sink.element().unwrap();
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc name=src lossless=true socket-path={} ! appsink name=out sync=false max-buffers=100",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    while e.property::<u32>("num-clients") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    for n in 0..12 {
        assert_eq!(sink.push(gray_frame(n, 64, 48)), Ok(gst::FlowSuccess::Ok));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "render waited: {:?}",
        t.elapsed()
    );
    let src = consumer.by_name("src").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    // Budget = half of 4 slots: one frame stays zero-copy, the eleven others are copies.
    while src.property::<u64>("frames-copied") < 11 {
        assert!(
            Instant::now() < deadline,
            "copies: {}",
            src.property::<u64>("frames-copied")
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(src.property::<u64>("frames-copied"), 11);
    assert_eq!(src.property::<u64>("frames-dropped"), 0);
    let stats = e.property::<gst::Structure>("stats");
    let clients = stats.get::<gst::Array>("clients").unwrap();
    let c = clients.first().unwrap().get::<gst::Structure>().unwrap();
    assert_eq!(c.get::<u64>("frames-copied").unwrap(), 11);
    assert_eq!(c.get::<u64>("frames-dropped").unwrap(), 0);
    assert_eq!(c.get::<u32>("held-slots").unwrap(), 1);
    let appsink = consumer
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    for n in 0..12 {
        let s = appsink
            .try_pull_sample(gst::ClockTime::from_seconds(1))
            .expect("every frame arrived");
        let b = s.buffer().unwrap();
        assert_eq!(b.offset(), n);
        assert_eq!(
            b.map_readable().unwrap().as_slice(),
            gray_frame(n, 64, 48).map_readable().unwrap().as_slice(),
            "frame {n}"
        );
    }
    // When the consumer goes away, its slot comes back.
    consumer.set_state(gst::State::Null).unwrap();
    drop(consumer);
    let deadline = Instant::now() + Duration::from_secs(2);
    while e.property::<u32>("num-clients") > 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    for n in 12..20 {
        assert_eq!(sink.push(gray_frame(n, 64, 48)), Ok(gst::FlowSuccess::Ok));
    }
}

#[test]
fn a_client_that_releases_twice_is_disconnected_and_others_go_on() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("double.sock");
    let mut sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let (tx, rx) = mpsc::channel();
    sink.element()
        .unwrap()
        .connect("client-disconnected", false, move |v| {
            // Later signals (teardown) may find the receiver gone.
            let _ = tx.send(v[1].get::<i32>().unwrap());
            None
        });
    let RawClient {
        conn: _conn,
        ch,
        release,
        ..
    } = raw_client(&sock, 0);
    let mut honest = src_harness(&sock, true);
    while sink.element().unwrap().property::<u32>("num-clients") < 2 {
        std::thread::sleep(Duration::from_millis(5));
    }
    sink.push(gray_frame(0, 64, 48)).unwrap();
    assert_eq!(honest.pull().unwrap().offset(), 0);
    // The hostile client takes the frame and gives it back twice.
    let deadline = Instant::now() + Duration::from_secs(5);
    let e = loop {
        if let Some(e) = ch.take().unwrap() {
            break e;
        }
        assert!(Instant::now() < deadline, "the hostile client got no frame");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(ch.release(e) && ch.release(e));
    release.ring();
    let id = rx
        .recv_timeout(Duration::from_secs(2))
        .expect("the double release disconnects it");
    assert_eq!(id, 1, "the hostile client, not the honest one");
    for n in 1..4 {
        sink.push(gray_frame(n, 64, 48)).unwrap();
        assert_eq!(honest.pull().unwrap().offset(), n);
    }
}

#[test]
fn a_client_that_sends_descriptors_is_refused() {
    use std::io::IoSlice;
    use std::os::fd::AsRawFd;
    init();
    let dir = tmpdir();
    let sock = dir.path().join("fds.sock");
    let _sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
    );
    let mut s = UnixStream::connect(&sock).unwrap();
    let hello = gpushm::wire::Message::Hello {
        flags: 0,
        pid: 1,
        name: "fds".into(),
    }
    .encode();
    let stray = std::fs::File::open("/dev/null").unwrap();
    let fds = [stray.as_raw_fd()];
    nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
        s.as_raw_fd(),
        &[IoSlice::new(&hello)],
        &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
        nix::sys::socket::MsgFlags::empty(),
        None,
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    let text = String::from_utf8_lossy(&reply);
    assert!(text.contains("sent file descriptors"), "{text}");
    assert!(!text.contains("GSHW\u{1}\u{0}\u{2}"), "no Welcome was sent");
}

/// A leaky consumer whose downstream blocks (a sink waiting 10 s on its clock) keeps at most
/// max-size-buffers frames queued and drops the oldest, counting them in frames-dropped.
#[test]
fn a_blocked_leaky_consumer_drops_its_oldest_queued_frames_and_counts_them() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("budget.sock");
    let mut sink = sink_harness_with(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
        |e| e.set_property("slots", 4u32),
    );
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc name=src max-size-buffers=2 socket-path={} ! fakesink sync=true ts-offset=10000000000",
        sock.display()
    ))
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let src = consumer
        .downcast_ref::<gst::Bin>()
        .unwrap()
        .by_name("src")
        .unwrap();
    // The source's streaming thread waits in create() for a while first, the receiver thread
    // asleep meanwhile: it must still wake and take over once downstream blocks.
    std::thread::sleep(Duration::from_millis(200));
    for n in 0..6 {
        sink.push(gray_frame(n, 64, 48)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
    }
    // One frame waits in fakesink, two in the queue: the three others were dropped.
    let deadline = Instant::now() + Duration::from_secs(5);
    while src.property::<u64>("frames-dropped") < 3 {
        assert!(
            Instant::now() < deadline,
            "the consumer never counted its drops ({})",
            src.property::<u64>("frames-dropped")
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(src.property::<u64>("frames-dropped"), 3);
    // The producer lost nothing for it: the consumer took every frame.
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-dropped").unwrap(), 0);
    // Queries are answered while the source's thread is blocked downstream.
    let mut q = gst::query::Latency::new();
    assert!(src.query(&mut q));
    assert!(q.result().0, "a live source");
    consumer.set_state(gst::State::Null).unwrap();
}

/// Frames flow, then downstream blocks for a while mid-stream: the receiver thread (asleep
/// while frames kept coming) wakes within its grace and takes frames from the ring, so the
/// producer loses nothing for this consumer; the leaky queue drops its oldest frames instead.
#[test]
fn downstream_blocking_mid_stream_costs_the_producer_nothing() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("midstream.sock");
    let mut sink = sink_harness_with(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1",
        |e| e.set_property("slots", 8u32),
    );
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc name=src max-size-buffers=2 socket-path={} ! fakesink name=out sync=false",
        sock.display()
    ))
    .unwrap();
    let bin = consumer.downcast_ref::<gst::Bin>().unwrap();
    let src = bin.by_name("src").unwrap();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let seen = seen.clone();
        bin.by_name("out")
            .unwrap()
            .static_pad("sink")
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, _| {
                if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 10 {
                    std::thread::sleep(Duration::from_millis(600));
                }
                gst::PadProbeReturn::Ok
            });
    }
    consumer.set_state(gst::State::Playing).unwrap();
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    for n in 0..30 {
        sink.push(gray_frame(n, 64, 48)).unwrap();
        std::thread::sleep(Duration::from_millis(40));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while seen.load(std::sync::atomic::Ordering::SeqCst) + src.property::<u64>("frames-dropped")
        < 30
    {
        assert!(Instant::now() < deadline, "frames went missing");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The receiver queued what came while downstream blocked (dropping the oldest beyond
    // max-size-buffers): the producer never had to skip a frame for us.
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-dropped").unwrap(), 0, "{stats}");
    assert!(
        src.property::<u64>("frames-dropped") > 0,
        "downstream did block"
    );
    consumer.set_state(gst::State::Null).unwrap();
}

/// Interlacing flags (INTERLACED, TFF, RFF, ONEFIELD), the producer's own DISCONT and
/// DROPPABLE, and the GstVideoTimeCodeMeta of each frame reach the consumer.
#[test]
fn interlaced_flags_and_timecodes_arrive() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("interlaced.sock");
    let mut sink = sink_harness(
        &sock,
        "video/x-raw,format=GRAY8,width=64,height=48,framerate=25/1,interlace-mode=mixed",
    );
    let mut src = src_harness(&sock, true);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    use gst_video::VideoBufferFlags as V;
    let cases = [
        V::INTERLACED | V::TFF,
        V::empty(),
        V::INTERLACED | V::RFF,
        V::INTERLACED | V::ONEFIELD | V::TFF,
    ];
    for (n, vflags) in cases.iter().enumerate() {
        let n = n as u64;
        let mut b = gray_frame(n, 64, 48);
        {
            let r = b.get_mut().unwrap();
            r.set_flags(gst::BufferFlags::from_bits_retain(vflags.bits()));
            r.set_flags(gst::BufferFlags::DROPPABLE);
            let tc = gst_video::ValidVideoTimeCode::new(
                gst::Fraction::new(25, 1),
                None,
                gst_video::VideoTimeCodeFlags::INTERLACED,
                10,
                20,
                30,
                n as u32,
                1 + n as u32 % 2,
            )
            .unwrap();
            gst_video::VideoTimeCodeMeta::add(r, &tc);
        }
        assert_eq!(sink.push(b), Ok(gst::FlowSuccess::Ok));
        let out = src.pull().expect("a buffer");
        // flags() keeps only the core flags: read the video ones from the buffer itself.
        // SAFETY: a field of a buffer we hold.
        let got = V::from_bits_truncate(unsafe { (*out.as_ptr()).mini_object.flags });
        for f in [V::INTERLACED, V::TFF, V::RFF, V::ONEFIELD] {
            assert_eq!(got.contains(f), vflags.contains(f), "frame {n}: {f:?}");
        }
        assert!(out.flags().contains(gst::BufferFlags::DROPPABLE));
        let vm = out.meta::<gst_video::VideoMeta>().unwrap();
        assert_eq!(
            vm.video_frame_flags()
                .contains(gst_video::VideoFrameFlags::INTERLACED),
            vflags.contains(V::INTERLACED)
        );
        let tc = out
            .meta::<gst_video::VideoTimeCodeMeta>()
            .expect("time code meta")
            .tc();
        assert_eq!(
            (tc.hours(), tc.minutes(), tc.seconds(), tc.frames()),
            (10, 20, 30, n as u32)
        );
        assert_eq!(tc.field_count(), 1 + n as u32 % 2);
        assert_eq!(tc.fps(), gst::Fraction::new(25, 1));
        assert!(tc
            .flags()
            .contains(gst_video::VideoTimeCodeFlags::INTERLACED));
    }
}

/// The property tables of docs/elements.md say what gst-inspect-1.0 says: every property an
/// element defines itself is in its table (inherited ones the docs document, like do-timestamp,
/// may be there too), with its default (or "read-only", or "(required)" for a string with
/// none), and no row names a property that does not exist.
#[test]
fn documented_property_tables_match_the_elements() {
    init();
    const DOC: &str = include_str!("../docs/elements.md");
    // Defaults as the docs write them: numbers with units, octal permissions, enum nicks.
    fn parse_number(text: &str) -> Option<i128> {
        let t = text.trim();
        let (num, mult) = [
            (" MiB", 1i128 << 20),
            (" ms", 1_000_000),
            (" s", 1_000_000_000),
        ]
        .iter()
        .find_map(|(u, m)| t.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((t, 1));
        let num = num.split(' ').next()?;
        if num.len() > 1 && num.starts_with('0') && num.chars().all(|c| c.is_ascii_digit()) {
            return i128::from_str_radix(num, 8).ok();
        }
        num.parse::<i128>().ok().map(|n| n * mult)
    }
    fn value_text(pspec: &glib::ParamSpec) -> Option<String> {
        let v = pspec.default_value();
        if let Ok(b) = v.get::<bool>() {
            return Some(b.to_string());
        }
        if let Some(e) = glib::EnumValue::from_value(v) {
            return Some(e.1.nick().to_string());
        }
        if let Some(n) = [
            v.get::<u32>().ok().map(i128::from),
            v.get::<i32>().ok().map(i128::from),
            v.get::<u64>().ok().map(i128::from),
            v.get::<i64>().ok().map(i128::from),
        ]
        .into_iter()
        .flatten()
        .next()
        {
            return Some(n.to_string());
        }
        match v.get::<Option<String>>() {
            Ok(None) => Some("(none)".into()),
            Ok(Some(s)) => Some(s),
            Err(_) => None,
        }
    }
    use gst::glib;
    for element in ["gpushmsink", "gpushmsrc", "cudasum"] {
        let heading = format!("### {element}\n");
        let start = DOC
            .find(&heading)
            .unwrap_or_else(|| panic!("no '### {element}' section in docs/elements.md"));
        let section = &DOC[start + heading.len()..];
        let section = &section[..section.find("\n#").unwrap_or(section.len())];
        let mut rows = std::collections::BTreeMap::new();
        for line in section.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = line.split(" | ").collect();
            let names: Vec<&str> = cells[0]
                .trim_start_matches("| ")
                .split(" / ")
                .map(|n| n.trim_matches('`'))
                .collect();
            let defaults: Vec<&str> = cells[1].split(" / ").collect();
            for (i, name) in names.iter().enumerate() {
                let d = defaults.get(i).or(defaults.last()).unwrap();
                rows.insert(name.to_string(), d.replace("**", "").trim().to_string());
            }
        }
        let e = gst::ElementFactory::make(element).build().unwrap();
        let own: Vec<glib::ParamSpec> = e
            .list_properties()
            .iter()
            .filter(|p| p.owner_type() == e.type_())
            .cloned()
            .collect();
        for p in &own {
            let name = p.name();
            let Some(documented) = rows.get(name) else {
                panic!("{element}: property {name} is not in the table of docs/elements.md");
            };
            if !p.flags().contains(glib::ParamFlags::WRITABLE) {
                assert_eq!(documented, "read-only", "{element}: {name}");
                continue;
            }
            let want = value_text(p).unwrap_or_default();
            let same = match (parse_number(documented), want.parse::<i128>().ok()) {
                (Some(a), Some(b)) => a == b,
                _ => documented.split(' ').next() == Some(want.as_str()),
            };
            assert!(
                same,
                "{element}: the docs say {name} defaults to {documented:?}, the element to {want:?}"
            );
        }
        for name in rows.keys() {
            assert!(
                e.find_property(name).is_some(),
                "{element}: docs/elements.md documents a property {name} it does not have"
            );
        }
    }
}

/// Only a plain, uncalibrated GstSystemClock on CLOCK_MONOTONIC counts as CLOCK_MONOTONIC
/// itself (offset exactly 0); a realtime or calibrated clock is measured instead.
#[test]
fn only_the_plain_monotonic_system_clock_is_taken_for_clock_monotonic() {
    init();
    let mono = gst::glib::Object::builder::<gst::SystemClock>()
        .property("clock-type", gst::ClockType::Monotonic)
        .build();
    assert!(gstgpushm::clock::is_monotonic(mono.upcast_ref()));
    let realtime = gst::glib::Object::builder::<gst::SystemClock>()
        .property("clock-type", gst::ClockType::Realtime)
        .build();
    assert!(!gstgpushm::clock::is_monotonic(realtime.upcast_ref()));
    let calibrated = gst::glib::Object::builder::<gst::SystemClock>()
        .property("clock-type", gst::ClockType::Monotonic)
        .build();
    calibrated.set_calibration(gst::ClockTime::ZERO, gst::ClockTime::from_seconds(5), 1, 1);
    assert!(!gstgpushm::clock::is_monotonic(calibrated.upcast_ref()));
}

/// A caps query never offers what the sink then refuses: with a filter it answers the filter
/// less its device-memory structures (so that cudadownload, gldownload or nvvidconv before it
/// pick system memory without a capsfilter), without one ANY; accept-caps agrees. With
/// ring=device, raw video in CUDA memory is taken too.
#[test]
fn the_sink_answers_caps_queries_with_system_memory_only() {
    init();
    let dir = tmpdir();
    let sink = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", dir.path().join("q.sock").to_str().unwrap())
        .property_from_str("ring", "host")
        .build()
        .unwrap();
    let pad = sink.static_pad("sink").unwrap();
    let filter: gst::Caps = "video/x-raw(memory:CUDAMemory), format=NV12, width=64, height=48; \
         video/x-raw, format=NV12, width=64, height=48; \
         video/x-raw(memory:GLMemory, meta:GstVideoOverlayComposition), format=RGBA; \
         video/x-raw(memory:SystemMemory, meta:GstVideoOverlayComposition), format=RGBA; \
         video/x-raw(ANY), format=GRAY8; audio/x-raw, rate=48000"
        .parse()
        .unwrap();
    let expected: gst::Caps = "video/x-raw, format=NV12, width=64, height=48; \
         video/x-raw(memory:SystemMemory, meta:GstVideoOverlayComposition), format=RGBA; \
         video/x-raw, format=GRAY8; audio/x-raw, rate=48000"
        .parse()
        .unwrap();
    let got = pad.query_caps(Some(&filter));
    assert!(got.is_strictly_equal(&expected), "{got}");
    assert!(pad.query_caps(None).is_any());
    let cuda: gst::Caps =
        "video/x-raw(memory:CUDAMemory), format=NV12, width=64, height=48, framerate=30/1"
            .parse()
            .unwrap();
    let system: gst::Caps = "video/x-raw, format=NV12, width=64, height=48, framerate=30/1"
        .parse()
        .unwrap();
    assert!(!pad.query_accept_caps(&cuda));
    assert!(pad.query_accept_caps(&system));
    // ring=device takes raw video in CUDA memory too (copied on the GPU into its ring).
    sink.set_property_from_str("ring", "device");
    let got = pad.query_caps(Some(&filter));
    let expected: gst::Caps = "video/x-raw(memory:CUDAMemory), format=NV12, width=64, height=48; \
         video/x-raw, format=NV12, width=64, height=48; \
         video/x-raw(memory:SystemMemory, meta:GstVideoOverlayComposition), format=RGBA; \
         video/x-raw, format=GRAY8; audio/x-raw, rate=48000"
        .parse()
        .unwrap();
    assert!(got.is_strictly_equal(&expected), "{got}");
    assert!(pad.query_accept_caps(&cuda));
}

/// What the property flags say is what the elements do. gpushmsink serves its socket from
/// READY on (GstBaseSink starts in NULL to READY): its socket-path is flagged changeable in
/// NULL only, and a change in READY is refused with a warning (the path stays the one it
/// serves) instead of being kept silently for the next start. gpushmsrc connects when it
/// starts (READY to PAUSED): a socket-path set in READY is the one it connects to.
#[test]
fn socket_paths_change_when_their_flags_say() {
    init();
    let dir = tmpdir();
    let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let sink = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", a.to_str().unwrap())
        .build()
        .unwrap();
    let flags = sink.find_property("socket-path").unwrap().flags();
    assert!(!flags.contains(gst::PARAM_FLAG_MUTABLE_READY), "{flags:?}");
    let pipeline = gst::Pipeline::new();
    let src = gst::ElementFactory::make("videotestsrc")
        .property("is-live", true)
        .build()
        .unwrap();
    pipeline.add_many([&src, &sink]).unwrap();
    src.link(&sink).unwrap();
    pipeline.set_state(gst::State::Ready).unwrap();
    assert!(a.exists(), "the sink serves from READY on");
    sink.set_property("socket-path", b.to_str().unwrap());
    assert_eq!(
        sink.property::<Option<String>>("socket-path").as_deref(),
        a.to_str()
    );
    let warning = pipeline.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(5),
        &[gst::MessageType::Warning],
    );
    match warning.as_ref().map(|m| m.view()) {
        Some(gst::MessageView::Warning(w)) => assert!(
            w.error()
                .to_string()
                .contains("only be changed in the NULL state"),
            "{}",
            w.error()
        ),
        other => panic!("no warning: {other:?}"),
    }
    // In NULL the change is taken.
    pipeline.set_state(gst::State::Null).unwrap();
    sink.set_property("socket-path", b.to_str().unwrap());
    pipeline.set_state(gst::State::Playing).unwrap();
    wait_for_path(&b, Duration::from_secs(5));
    // gpushmsrc: flagged changeable in READY, and taken there.
    let consumer =
        gst::parse::launch("gpushmsrc name=src num-buffers=3 timeout=5000000000 ! fakesink")
            .unwrap()
            .downcast::<gst::Pipeline>()
            .unwrap();
    let gsrc = consumer.by_name("src").unwrap();
    let flags = gsrc.find_property("socket-path").unwrap().flags();
    assert!(flags.contains(gst::PARAM_FLAG_MUTABLE_READY), "{flags:?}");
    gsrc.set_property("socket-path", a.to_str().unwrap());
    consumer.set_state(gst::State::Ready).unwrap();
    gsrc.set_property("socket-path", b.to_str().unwrap());
    consumer.set_state(gst::State::Playing).unwrap();
    let msg = consumer.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(20),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    consumer.set_state(gst::State::Null).unwrap();
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(
        matches!(
            msg.as_ref().map(|m| m.view()),
            Some(gst::MessageView::Eos(_))
        ),
        "gpushmsrc did not read 3 frames from the path set in READY: {msg:?}"
    );
}
