// SPDX-License-Identifier: MPL-2.0
//! The cases of shmsink/shmsrc's own tests (gst-plugins-bad tests/check/elements/shm.c) and
//! the caps-less scenarios of users switching from them, in two processes: gpushmsink takes a
//! stream without caps as shmsink does, and gpushmsrc pushes its bytes without caps (a
//! capsfilter downstream gives them caps, as after shmsrc).

mod common;
use common::*;

use std::path::Path;
use std::time::Duration;

use gst::prelude::*;

/// Real-time pipelines: one at a time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A producer in this process: an appsrc with `caps` (`None`: none at all, as shm.c's pads)
/// into gpushmsink on `sock`, waiting for its first consumer.
fn appsrc_producer(sock: &Path, caps: Option<&str>) -> (gst::Pipeline, gst_app::AppSrc) {
    let caps = caps.map_or(String::new(), |c| format!("caps={c}"));
    let p = gst::parse::launch(&format!(
        "appsrc name=src format=bytes {caps} ! gpushmsink socket-path={} wait-for-connection=true sync=false",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let src = p
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    wait_for_path(sock, Duration::from_secs(10));
    (p, src)
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A consumer process writing every byte it gets to `file`.
fn recorder(sock: &Path, file: &Path, extra: &str) -> Proc {
    Proc::spawn(
        gst_launch(&format!(
            "gpushmsrc socket-path={} mode=lossless {extra} ! filesink location={}",
            sock.display(),
            file.display()
        )),
        "consumer",
    )
}

fn finish(p: gst::Pipeline) {
    let msg = p.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    let ok = matches!(
        msg.as_ref().map(|m| m.view()),
        Some(gst::MessageView::Eos(_))
    );
    p.set_state(gst::State::Null).unwrap();
    assert!(ok, "the producer did not end well: {msg:?}");
}

/// shm.c `test_shm_sysmem_alloc`: a stream with no caps at all (a bytes segment), one buffer
/// of 1000 bytes in system memory: the consumer gets it, 1000 bytes, the same bytes.
/// Before, gpushmsink stopped with "Got a buffer before caps" (not-negotiated).
#[test]
fn shm_sysmem_alloc_a_buffer_without_caps_arrives() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("nocaps.sock");
    let out = dir.path().join("out.bin");
    let (p, src) = appsrc_producer(&sock, None);
    let c = recorder(&sock, &out, "");
    let data = bytes(1000, 7);
    src.push_buffer(gst::Buffer::from_slice(data.clone()))
        .unwrap();
    src.end_of_stream().unwrap();
    finish(p);
    let (st, lines) = c.finish(Duration::from_secs(30));
    assert!(st.success(), "{lines:?}");
    assert_eq!(std::fs::read(&out).unwrap(), data);
}

/// shm.c `test_shm_alloc`: caps `application/x-test`, a buffer as large as a slot can be
/// made for (1 MiB here), then smaller ones: each arrives whole, in order.
#[test]
fn shm_alloc_application_caps_and_a_large_buffer_arrive_whole() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("alloc.sock");
    let out = dir.path().join("out.bin");
    let (p, src) = appsrc_producer(&sock, Some("application/x-test"));
    let c = recorder(&sock, &out, "");
    let mut all = Vec::new();
    for (i, n) in [1 << 20, 1000, 4096].into_iter().enumerate() {
        let d = bytes(n, i as u8);
        all.extend_from_slice(&d);
        src.push_buffer(gst::Buffer::from_slice(d)).unwrap();
    }
    src.end_of_stream().unwrap();
    finish(p);
    let (st, lines) = c.finish(Duration::from_secs(30));
    assert!(st.success(), "{lines:?}");
    assert!(std::fs::read(&out).unwrap() == all, "the bytes differ");
}

/// shmsink users' live case: `fakesrc is-live=true sizetype=fixed` without caps into the
/// sink, a consumer with a capsfilter giving the bytes caps: every buffer arrives, with the
/// capsfilter's caps downstream.
#[test]
fn a_live_stream_without_caps_gets_its_caps_from_a_capsfilter() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("live.sock");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "fakesrc is-live=true num-buffers=20 sizetype=fixed sizemax=768 filltype=pattern-span datarate=15360 \
             ! gpushmsink socket-path={} wait-for-connection=true",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let c = gst_launch_verbose(&format!(
        "gpushmsrc socket-path={} mode=lossless ! video/x-raw,format=GRAY8,width=32,height=24,framerate=20/1 ! fakesink silent=false",
        sock.display()
    ));
    let (st, lines) = Proc::spawn(c, "consumer").finish(Duration::from_secs(30));
    assert!(st.success(), "{lines:?}");
    let chains = lines
        .iter()
        .filter(|l| l.contains("last-message = chain") && l.contains("(768 bytes"))
        .count();
    assert_eq!(chains, 20, "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("fakesink0.GstPad:sink: caps = video/x-raw, format=(string)GRAY8")),
        "{lines:?}"
    );
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "{pout:?}");
}

/// shmsink users' stop case: a producer without caps that ends (EOS) and one that is killed:
/// the consumer ends at EOS without an error in the first case and (reconnect=false) reports
/// the producer gone in the second, having received whole buffers before.
#[test]
fn a_stream_without_caps_ends_cleanly_or_reports_its_producer_gone() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("stop.sock");
    let out = dir.path().join("out.bin");
    let (p, src) = appsrc_producer(&sock, None);
    let c = recorder(&sock, &out, "");
    let mut all = Vec::new();
    for i in 0..10u8 {
        let d = bytes(500, i);
        all.extend_from_slice(&d);
        src.push_buffer(gst::Buffer::from_slice(d)).unwrap();
    }
    src.end_of_stream().unwrap();
    finish(p);
    let (st, lines) = c.finish(Duration::from_secs(30));
    assert!(st.success(), "{lines:?}");
    assert!(std::fs::read(&out).unwrap() == all);

    let sock = dir.path().join("killed.sock");
    let mut producer = Proc::spawn(
        gst_launch(&format!(
            "fakesrc is-live=true sizetype=fixed sizemax=100 datarate=2000 ! gpushmsink socket-path={}",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let out = dir.path().join("killed.bin");
    // Unbuffered, so the file shows what the consumer received before the kill: kill only
    // once it has received something (a loaded machine may take seconds to start gst-launch).
    let c = Proc::spawn(
        gst_launch(&format!(
            "gpushmsrc socket-path={} mode=lossless reconnect=false ! filesink buffer-mode=unbuffered location={}",
            sock.display(),
            out.display()
        )),
        "consumer",
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::fs::metadata(&out).map_or(0, |m| m.len()) == 0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    producer.kill9();
    let (st, lines) = c.finish(Duration::from_secs(30));
    assert!(!st.success(), "the consumer did not notice: {lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("went away")),
        "no readable error: {lines:?}"
    );
    let got = std::fs::metadata(&out).unwrap().len();
    assert!(got > 0 && got.is_multiple_of(100), "{got} bytes: {lines:?}");
}

/// shmsink users' fill-and-resume case: a consumer that stops taking buffers while a
/// producer without caps pushes flat out (200 buffers of 1000 bytes: far more than the ring
/// holds) fills the ring; the producer waits (lossless, within its max-wait), and when the
/// consumer takes again every byte arrives, in order (fakesrc's pattern spans buffers: byte
/// k of the stream is k mod 256).
#[test]
fn a_full_ring_holds_the_producer_until_the_consumer_resumes_and_nothing_is_lost() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fill.sock");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "fakesrc num-buffers=200 sizetype=fixed sizemax=1000 filltype=pattern-span \
             ! gpushmsink socket-path={} wait-for-connection=true max-wait=10000000000",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} mode=lossless ! appsink name=sink sync=false max-buffers=1",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let sink = consumer
        .by_name("sink")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    let first = sink
        .try_pull_sample(gst::ClockTime::from_seconds(20))
        .expect("a first buffer");
    let mut all = first.buffer().unwrap().map_readable().unwrap().to_vec();
    // Nothing taken for 1.5 s: the ring fills and the producer waits.
    std::thread::sleep(Duration::from_millis(1500));
    while let Some(s) = sink.try_pull_sample(gst::ClockTime::from_seconds(10)) {
        all.extend_from_slice(&s.buffer().unwrap().map_readable().unwrap());
        if sink.is_eos() {
            break;
        }
    }
    consumer.set_state(gst::State::Null).unwrap();
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "{pout:?}");
    assert_eq!(all.len(), 200_000);
    let wrong = all.iter().enumerate().position(|(k, &b)| b != k as u8);
    assert_eq!(wrong, None, "the bytes differ from the pattern there");
}
