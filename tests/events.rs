// SPDX-License-Identifier: MPL-2.0
//! The producer's tags and custom events reach every consumer process, in order with the
//! buffers: stream and global tags, serialized custom events, the current tags to a consumer
//! that joins late, and tags into a recording.

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

use gst::prelude::*;

/// Real-time pipelines: one at a time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a consumer's `fakesink silent=false` saw, in order: `E <event line>` or `B` per
/// buffer.
fn seen(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| {
            let (_, m) = l.split_once("last-message = ")?;
            if m.starts_with("chain") {
                Some("B".to_string())
            } else {
                m.starts_with("event").then(|| format!("E {m}"))
            }
        })
        .collect()
}

/// A consumer process that prints every event and buffer its fakesink gets.
fn consumer(sock: &Path, extra: &str) -> Proc {
    let c = gst_launch_verbose(&format!(
        "gpushmsrc socket-path={} mode=lossless {extra} ! fakesink silent=false",
        sock.display()
    ));
    Proc::spawn(c, "consumer")
}

/// Two consumers of one producer (this thread pushes a stream tag and a global tag before the
/// first buffer, custom events after the 10th and 20th of 30 buffers and a custom-both one
/// after the 15th, straight into gpushmsink's sink pad): each sees the tags
/// before the first buffer, `marker n=10` after exactly 10 buffers and `n=20` after 20, a
/// custom-both event where it was sent, and every buffer. Before, no tag or custom event
/// reached a consumer (taginject's title was lost to every recorder behind gpushm).
#[test]
fn tags_and_custom_events_reach_every_consumer_in_order_with_the_buffers() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("events.sock");
    // This thread pushes into gpushmsink through a pad of its own: each event reaches it
    // exactly between the buffers it was pushed between (appsrc would push its events before
    // whichever buffer its streaming thread takes next).
    let sink = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", sock.to_str().unwrap())
        .property("sync", false)
        .build()
        .unwrap();
    let pad = gst::Pad::builder(gst::PadDirection::Src).build();
    pad.link(&sink.static_pad("sink").unwrap()).unwrap();
    pad.set_active(true).unwrap();
    let _ = sink.set_state(gst::State::Playing);
    assert!(pad.push_event(gst::event::StreamStart::new("events")));
    assert!(pad.push_event(gst::event::Caps::new(
        &"video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1"
            .parse::<gst::Caps>()
            .unwrap()
    )));
    assert!(
        pad.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
            gst::ClockTime,
        >::new()))
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let consumers = [consumer(&sock, ""), consumer(&sock, "")];
    wait_for_clients(&sink, 2);
    let tags = |title: &str, scope| {
        let mut t = gst::TagList::new();
        let tm = t.get_mut().unwrap();
        tm.add::<gst::tags::Title>(&title, gst::TagMergeMode::Append);
        tm.set_scope(scope);
        gst::event::Tag::new(t)
    };
    assert!(pad.push_event(tags("hello-stream", gst::TagScope::Stream)));
    assert!(pad.push_event(tags("hello-global", gst::TagScope::Global)));
    for i in 0..30u64 {
        if i == 10 || i == 20 {
            let s = gst::Structure::builder("marker")
                .field("n", i as i32)
                .build();
            assert!(pad.push_event(gst::event::CustomDownstream::new(s)));
        }
        if i == 15 {
            let s = gst::Structure::builder("both").field("n", 15i32).build();
            assert!(pad.push_event(gst::event::CustomBoth::new(s)));
        }
        let mut b = gst::Buffer::from_mut_slice(vec![i as u8; 64 * 48]);
        let bm = b.get_mut().unwrap();
        bm.set_pts(gst::ClockTime::from_mseconds(i * 33));
        bm.set_duration(gst::ClockTime::from_mseconds(33));
        assert_eq!(pad.push(b), Ok(gst::FlowSuccess::Ok));
    }
    assert!(pad.push_event(gst::event::Eos::new()));
    for c in consumers {
        let (st, out) = c.finish(Duration::from_secs(30));
        assert!(st.success(), "{out:?}");
        let seen = seen(&out);
        let buffers_before = |needle: &str| {
            let at = seen
                .iter()
                .position(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("no event with {needle:?}: {seen:#?}"));
            seen[..at].iter().filter(|l| *l == "B").count()
        };
        assert_eq!(buffers_before("hello-stream"), 0, "{seen:#?}");
        assert_eq!(buffers_before("hello-global"), 0, "{seen:#?}");
        assert_eq!(buffers_before("marker, n=(int)10"), 10, "{seen:#?}");
        assert_eq!(buffers_before("both, n=(int)15"), 15, "{seen:#?}");
        assert_eq!(buffers_before("marker, n=(int)20"), 20, "{seen:#?}");
        assert_eq!(seen.iter().filter(|l| *l == "B").count(), 30);
    }
    sink.set_state(gst::State::Null).unwrap();
}

/// A consumer that joins a live producer 1 s in gets the stream's current tags (taginject
/// sent them with the first buffer, long before) ahead of its first buffer.
#[test]
fn a_late_consumer_gets_the_current_tags_first() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("late-tags.sock");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true num-buffers=150 ! video/x-raw,format=GRAY8,width=64,height=48,framerate=30/1 \
             ! taginject tags=\"title=late-joiner,language-code=fr\" ! gpushmsink socket-path={}",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(1));
    let (st, out) = consumer(&sock, "num-buffers=5").finish(Duration::from_secs(30));
    assert!(st.success(), "{out:?}");
    let seen = seen(&out);
    let tag = seen
        .iter()
        .position(|l| l.contains("late-joiner"))
        .unwrap_or_else(|| panic!("no tags: {seen:#?}"));
    let first = seen.iter().position(|l| l == "B").expect("a buffer");
    assert!(tag < first, "{seen:#?}");
    assert!(seen[tag].contains("language-code"), "{}", seen[tag]);
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "{pout:?}");
}

/// Records what `producer` (a pipeline fragment ending before gpushmsink) makes, through
/// gpushm, with `mux` in a consumer process, then reads the file back with `demux`: the tags
/// the demuxer finds.
fn tags_of_a_recording(producer: &str, mux: &str, demux: &str) -> gst::TagList {
    let dir = tmpdir();
    let sock = dir.path().join("rec-tags.sock");
    let file = dir.path().join("rec.out");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "{producer} ! gpushmsink socket-path={} wait-for-connection=true",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let recorder = recorder(&sock, mux, &file);
    let (st, out) = recorder.finish(Duration::from_secs(30));
    assert!(st.success(), "{out:?}");
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(ps.success(), "{pout:?}");
    tags_in(&file, demux)
}

/// A consumer process recording the stream of `sock` with `mux` into `file`.
fn recorder(sock: &Path, mux: &str, file: &Path) -> Proc {
    Proc::spawn(
        gst_launch(&format!(
            "gpushmsrc socket-path={} mode=lossless ! {mux} ! filesink location={}",
            sock.display(),
            file.display()
        )),
        "recorder",
    )
}

/// The tags `demux` finds in `file`.
fn tags_in(file: &Path, demux: &str) -> gst::TagList {
    let read = gst::parse::launch(&format!(
        "filesrc location={} ! {demux} ! fakesink",
        file.display()
    ))
    .unwrap();
    read.set_state(gst::State::Playing).unwrap();
    let bus = read.bus().unwrap();
    let mut all = gst::TagList::new();
    while let Some(m) = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(20),
        &[
            gst::MessageType::Tag,
            gst::MessageType::Eos,
            gst::MessageType::Error,
        ],
    ) {
        match m.view() {
            gst::MessageView::Tag(t) => {
                all = all.merge(&t.tags(), gst::TagMergeMode::Append);
            }
            gst::MessageView::Error(e) => panic!("reading the recording: {e:?}"),
            _ => break,
        }
    }
    read.set_state(gst::State::Null).unwrap();
    all
}

fn title_and_artist(tags: &gst::TagList) -> (Option<String>, Option<String>) {
    (
        tags.get::<gst::tags::Title>().map(|t| t.get().to_string()),
        tags.get::<gst::tags::Artist>().map(|t| t.get().to_string()),
    )
}

/// The tags of H.264 video reach recordings made behind gpushm: taginject's title and
/// artist, read back from a Matroska file and from an MP4 file by their demuxers (and
/// x264enc's encoder tag from the Matroska one).
#[test]
fn a_recording_through_gpushm_keeps_the_producers_tags() {
    init();
    let _g = serial();
    let video = "videotestsrc num-buffers=30 ! video/x-raw,width=160,height=120,framerate=30/1 \
                 ! taginject tags=\"title=recorded,artist=gpushm\" ! x264enc key-int-max=10 \
                 ! h264parse";
    let mkv = tags_of_a_recording(video, "h264parse ! matroskamux", "matroskademux");
    let want = (Some("recorded".to_string()), Some("gpushm".to_string()));
    assert_eq!(title_and_artist(&mkv), want, "{mkv:?}");
    assert!(mkv.get::<gst::tags::Encoder>().is_some(), "{mkv:?}");
    let mp4 = tags_of_a_recording(video, "h264parse ! mp4mux", "qtdemux");
    assert_eq!(title_and_artist(&mp4), want, "{mp4:?}");
}

/// The tags of an audio stream reach a recording made behind gpushm: a producer in this
/// process sends a stream tag list (title, artist) before 20 buffers of raw audio; the
/// Matroska file its consumer process writes has them. (The producer is a pad of this
/// thread: GStreamer 1.22's taginject loses its tags behind audiotestsrc, whose own tag
/// event replaces them.)
#[test]
fn an_audio_recording_through_gpushm_keeps_the_producers_tags() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("audio-tags.sock");
    let file = dir.path().join("audio.mkv");
    let sink = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", sock.to_str().unwrap())
        .property("sync", false)
        .property("wait-for-connection", true)
        .build()
        .unwrap();
    let pad = gst::Pad::builder(gst::PadDirection::Src).build();
    pad.link(&sink.static_pad("sink").unwrap()).unwrap();
    pad.set_active(true).unwrap();
    sink.set_state(gst::State::Playing).unwrap();
    // audioconvert's audio caps make gst-launch take the muxer's audio pad.
    let rec = recorder(&sock, "audioconvert ! matroskamux", &file);
    wait_for_clients(&sink, 1);
    assert!(pad.push_event(gst::event::StreamStart::new("audio")));
    assert!(pad.push_event(gst::event::Caps::new(
        &"audio/x-raw,format=S16LE,layout=interleaved,rate=48000,channels=2"
            .parse::<gst::Caps>()
            .unwrap()
    )));
    assert!(
        pad.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
            gst::ClockTime,
        >::new()))
    );
    let mut tags = gst::TagList::new();
    {
        let t = tags.get_mut().unwrap();
        t.add::<gst::tags::Title>(&"a song", gst::TagMergeMode::Append);
        t.add::<gst::tags::Artist>(&"gpushm", gst::TagMergeMode::Append);
    }
    assert!(pad.push_event(gst::event::Tag::new(tags)));
    for i in 0..20u64 {
        // 10 ms of stereo S16 at 48 kHz.
        let mut b = gst::Buffer::from_slice(vec![(i * 7) as u8; 480 * 4]);
        let bm = b.get_mut().unwrap();
        bm.set_pts(gst::ClockTime::from_mseconds(i * 10));
        bm.set_duration(gst::ClockTime::from_mseconds(10));
        pad.push(b).unwrap();
    }
    assert!(pad.push_event(gst::event::Eos::new()));
    let (st, out) = rec.finish(Duration::from_secs(30));
    sink.set_state(gst::State::Null).unwrap();
    assert!(st.success(), "{out:?}");
    let tags = tags_in(&file, "matroskademux");
    assert_eq!(
        title_and_artist(&tags),
        (Some("a song".to_string()), Some("gpushm".to_string())),
        "{tags:?}"
    );
}

/// A consumer that joins an H.264 stream between keyframes (key-int-max=300: the next one
/// would be frame 300, after the producer's last, 290) asks the producer's encoder for one
/// (force-key-unit, sent by gpushmsrc itself) and gets its 15 frames from that keyframe on
/// (gpushmsrc skips frames a decoder cannot start at); before, it got none before the stream
/// ended.
#[test]
fn a_late_consumer_of_h264_asks_for_a_keyframe_and_starts_at_once() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fku.sock");
    let producer = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true num-buffers=290 ! video/x-raw,width=160,height=120,framerate=30/1 \
             ! x264enc key-int-max=300 tune=zerolatency ! h264parse ! gpushmsink socket-path={}",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));
    let (st, out) = Proc::spawn(
        gst_launch_verbose(&format!(
            "gpushmsrc socket-path={} num-buffers=15 ! h264parse ! fakesink silent=false",
            sock.display()
        )),
        "late consumer",
    )
    .finish(Duration::from_secs(30));
    assert!(st.success(), "{out:?}");
    let got = out
        .iter()
        .filter(|l| l.contains("fakesink0: last-message = chain"))
        .count();
    assert_eq!(got, 15, "{out:?}");
    drop(producer);
}

/// A consumer that sends 1000 force-key-unit events as fast as it can gets no more through
/// than the producer's `upstream-event-rate` (2 a second here, with a burst of 2) allows over
/// the producer's life: the encoder makes a handful of keyframes, not one a frame (62 of 120
/// without the limit).
#[test]
fn a_flood_of_force_key_unit_gets_no_more_through_than_the_rate() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("fku-flood.sock");
    let started = Instant::now();
    let producer = Proc::spawn(
        gst_launch_verbose(&format!(
            "videotestsrc is-live=true num-buffers=120 ! video/x-raw,width=160,height=120,framerate=30/1 \
             ! x264enc key-int-max=300 tune=zerolatency ! h264parse ! identity silent=false \
             ! gpushmsink socket-path={} upstream-event-rate=2 wait-for-connection=true",
            sock.display()
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc socket-path={} ! fakesink sync=false",
        sock.display()
    ))
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..1000 {
        consumer.send_event(gst_video::UpstreamForceKeyUnitEvent::builder().build());
        std::thread::sleep(Duration::from_millis(1));
    }
    let (ps, lines) = producer.finish(Duration::from_secs(30));
    // Rate times the producer's whole life bounds what got through, however slow the machine.
    let life = started.elapsed().as_secs() + 1;
    consumer.set_state(gst::State::Null).unwrap();
    assert!(ps.success(), "{lines:?}");
    let chains: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("identity0: last-message = chain"))
        .collect();
    let keyframes = chains.iter().filter(|l| !l.contains("delta-unit")).count() as u64;
    assert_eq!(chains.len(), 120, "{lines:?}");
    // The first frame, the burst of 2, then 2 a second.
    let most = 1 + 2 + 2 * life;
    assert!(
        (2..=most).contains(&keyframes),
        "{keyframes} keyframes (at most {most}) for 1000 requests"
    );
}
