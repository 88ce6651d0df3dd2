// SPDX-License-Identifier: MPL-2.0
//! The inter elements' own tests (gst-plugins-rs generic/inter/tests/inter.rs: intersink and
//! intersrc within one process), across processes: the producer's pad in this process, as
//! inter.rs pushes into intersink, its consumers in processes of their own (or the consumer
//! here and its producers in processes, where the consumer is what changes). inter.rs names
//! a producer with `producer-name`; gpushm names it with its socket (or `stream`): switching
//! one is switching the other. Where gpushm differs by design, the test checks gpushm's
//! equivalent and says so; README's "Coming from" table lists the differences.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gst::prelude::*;

/// Real-time pipelines: one at a time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// inter.rs `start_producer`: gpushmsink on `sock`, fed by a pad of this thread with
/// stream-start, caps `video/x-raw` and a time segment. It waits for its first consumer, as
/// inter.rs's consumers are there before its producer pushes.
fn start_producer(sock: &Path) -> (gst::Pad, gst::Element) {
    let element = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", sock.to_str().unwrap())
        .property("sync", false)
        .property("wait-for-connection", true)
        .build()
        .unwrap();
    let srcpad = gst::Pad::builder(gst::PadDirection::Src).build();
    srcpad.set_active(true).unwrap();
    srcpad.link(&element.static_pad("sink").unwrap()).unwrap();
    play(&srcpad, &element);
    (srcpad, element)
}

/// PLAYING, and the stream's sticky events (again, after a stop).
fn play(srcpad: &gst::Pad, element: &gst::Element) {
    element.set_state(gst::State::Playing).unwrap();
    assert!(srcpad.push_event(gst::event::StreamStart::builder("foo").build()));
    assert!(srcpad.push_event(gst::event::Caps::new(
        &gst::Caps::builder("video/x-raw").build()
    )));
    assert!(
        srcpad.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
            gst::ClockTime,
        >::new()))
    );
}

/// inter.rs `push_one`, with the byte `tag` as content so that the consumers' files tell
/// which buffer they got. Once a consumer is there (bounded: the push would wait for one
/// forever).
fn push_one(srcpad: &gst::Pad, pts: u64, tag: u8) {
    let sink = srcpad.peer().unwrap().parent_element().unwrap();
    wait_for_clients(&sink, 1);
    let mut inbuf = gst::Buffer::from_slice([tag]);
    inbuf
        .get_mut()
        .unwrap()
        .set_pts(gst::ClockTime::from_nseconds(pts));
    srcpad.push(inbuf).unwrap();
}

/// inter.rs `start_consumer`: a consumer process of `sock` (waiting for it, reconnecting when
/// it goes), writing each buffer's bytes to a file as they come.
fn start_consumer(sock: &Path, file: &Path) -> Proc {
    Proc::spawn(
        gst_launch(&format!(
            "gpushmsrc socket-path={} mode=lossless ! filesink buffer-mode=unbuffered location={}",
            sock.display(),
            file.display()
        )),
        "consumer",
    )
}

/// The file's bytes once it has `n` (bounded wait: a loaded machine starts processes slowly).
fn wait_bytes(file: &Path, n: usize) -> Vec<u8> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let got = std::fs::read(file).unwrap_or_default();
        if got.len() >= n || Instant::now() > end {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn paths(dir: &Path, names: &[&str]) -> Vec<PathBuf> {
    names.iter().map(|n| dir.join(n)).collect()
}

/// inter.rs `test_forward_one_buffer`: one buffer, pushed once the consumer is there,
/// arrives. (Its PTS is the consumer's running time, not 1 ns: gpushmsrc maps timestamps to
/// its own pipeline; the content says it is the buffer.)
#[test]
fn inter_forward_one_buffer() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let [sock, file] = paths(dir.path(), &["p1.sock", "c.bin"]).try_into().unwrap();
    let mut hc = start_consumer(&sock, &file);
    let (srcpad, element) = start_producer(&sock);
    push_one(&srcpad, 1, 0xab);
    assert_eq!(wait_bytes(&file, 1), [0xab]);
    element.set_state(gst::State::Null).unwrap();
    hc.kill9();
}

/// inter.rs `test_change_name_of_producer`: consumers of p1 and of p2; the producer serves
/// p1 (buffer 1 to the first only), then p2 (buffer 2, the second's first), then p1 again
/// (buffer 3: the first consumer's next, and it never saw buffer 2). gpushmsink's socket
/// changes in NULL (it serves from READY on), so the producer stops and starts on the new
/// one; its consumers reconnect by themselves.
#[test]
fn inter_change_name_of_producer() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let [p1, p2, f1, f2] = paths(dir.path(), &["p1.sock", "p2.sock", "c1.bin", "c2.bin"])
        .try_into()
        .unwrap();
    let mut hc1 = start_consumer(&p1, &f1);
    let mut hc2 = start_consumer(&p2, &f2);
    let (srcpad, element) = start_producer(&p1);
    push_one(&srcpad, 1, 1);
    assert_eq!(wait_bytes(&f1, 1), [1]);

    let rename = |sock: &Path| {
        element.set_state(gst::State::Null).unwrap();
        element.set_property("socket-path", sock.to_str().unwrap());
        play(&srcpad, &element);
    };
    rename(&p2);
    push_one(&srcpad, 2, 2);
    assert_eq!(wait_bytes(&f2, 1), [2]);

    rename(&p1);
    push_one(&srcpad, 3, 3);
    assert_eq!(wait_bytes(&f1, 2), [1, 3]);
    assert_eq!(std::fs::read(&f2).unwrap(), [2]);
    element.set_state(gst::State::Null).unwrap();
    hc1.kill9();
    hc2.kill9();
}

/// A live producer process of `sock` whose frames are all black (`pattern=black`) or white.
fn pattern_producer(sock: &Path, pattern: &str) -> Proc {
    let p = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true pattern={pattern} \
             ! video/x-raw,format=GRAY8,width=16,height=16,framerate=30/1 \
             ! gpushmsink socket-path={}",
            sock.display()
        )),
        pattern,
    );
    wait_for_path(sock, Duration::from_secs(10));
    p
}

/// The value of every byte of the next frame the consumer's appsink gets (all the same).
fn pull_value(sink: &gst_app::AppSink) -> u8 {
    let sample = sink
        .try_pull_sample(gst::ClockTime::from_seconds(20))
        .expect("a frame");
    let map = sample.buffer().unwrap().map_readable().unwrap();
    assert!(map.iter().all(|&b| b == map[0]), "a frame of two values");
    map[0]
}

/// inter.rs `test_change_producer_name`: producers p1 and p2 run, the consumer follows p1
/// (p2's frames reach no one), then switches to p2 (p1's frames reach no one). Here the
/// producers are live processes, one black and one white, and the consumer is in this
/// process: its frames are all black, then, once switched (gpushmsrc's socket changes in
/// READY), all white.
#[test]
fn inter_change_producer_name() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let [p1, p2] = paths(dir.path(), &["p1.sock", "p2.sock"])
        .try_into()
        .unwrap();
    let mut black = pattern_producer(&p1, "black");
    let mut white = pattern_producer(&p2, "white");
    let hc = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} ! appsink name=sink sync=false max-buffers=1",
        p1.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let sink = hc
        .by_name("sink")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    hc.set_state(gst::State::Playing).unwrap();
    let before: Vec<u8> = (0..3).map(|_| pull_value(&sink)).collect();
    hc.set_state(gst::State::Ready).unwrap();
    hc.by_name("gpushmsrc0")
        .unwrap()
        .set_property("socket-path", p2.to_str().unwrap());
    hc.set_state(gst::State::Playing).unwrap();
    let after: Vec<u8> = (0..3).map(|_| pull_value(&sink)).collect();
    hc.set_state(gst::State::Null).unwrap();
    assert!(before.iter().all(|&v| v < 64), "not all black: {before:?}");
    assert!(after.iter().all(|&v| v > 192), "not all white: {after:?}");
    black.kill9();
    white.kill9();
}

/// inter.rs `test_event_forwarding`: a custom downstream event (`MyEvent`, unsigned = 100)
/// and EOS after a buffer reach the consumer, the event first. intersink forwards the event
/// types set in its `event-types`; gpushmsink forwards serialized custom events always.
#[test]
fn inter_event_forwarding() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("p.sock");
    let hc = Proc::spawn(
        gst_launch_verbose(&format!(
            "gpushmsrc socket-path={} mode=lossless ! fakesink silent=false",
            sock.display()
        )),
        "consumer",
    );
    let (srcpad, intersink) = start_producer(&sock);
    push_one(&srcpad, 1, 1);
    let s = gst::Structure::builder("MyEvent")
        .field("unsigned", 100u64)
        .build();
    assert!(srcpad.push_event(gst::event::CustomDownstream::new(s)));
    assert!(srcpad.push_event(gst::event::Eos::new()));
    let (st, lines) = hc.finish(Duration::from_secs(30));
    intersink.set_state(gst::State::Null).unwrap();
    assert!(st.success(), "{lines:?}");
    let at = |what: &str| {
        lines
            .iter()
            .position(|l| l.contains("last-message = event") && l.contains(what))
    };
    let found = at("MyEvent, unsigned=(guint64)100").unwrap_or_else(|| panic!("{lines:#?}"));
    let eos = at("eos").unwrap_or_else(|| panic!("{lines:#?}"));
    assert!(found < eos, "{lines:#?}");
}
