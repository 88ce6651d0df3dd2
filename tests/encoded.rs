// SPDX-License-Identifier: MPL-2.0
//! Caps other than raw video: H.264, JPEG, audio, RTP and arbitrary data, with real producer
//! and consumer processes (gst-launch-1.0). The producer decodes the very stream it shares in
//! its own process (a tee before gpushmsink); every consumer must decode the same frames,
//! checksum for checksum.

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

use gst::prelude::*;
use gst_check::Harness;

/// Real-time pipelines: one at a time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `(pts, checksum)` of each line checksumsink printed.
fn checksums(lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (t, c) = (it.next()?, it.next()?);
            (c.len() == 40 && c.chars().all(|c| c.is_ascii_hexdigit()) && it.next().is_none())
                .then(|| (t.to_string(), c.to_string()))
        })
        .collect()
}

fn sums(lines: &[String]) -> Vec<String> {
    checksums(lines).into_iter().map(|(_, c)| c).collect()
}

/// Runs the producer `pipeline` (with `{sock}` and `{dec}` replaced, and gpushmsink's info
/// log on) and a consumer `consumer` (same), the consumer started `delay` after the producer's
/// socket appeared. Returns (producer lines,
/// consumer lines); both must exit 0.
fn run_pair(
    sock: &Path,
    producer: &str,
    consumer: &str,
    delay: Duration,
) -> (Vec<String>, Vec<String>) {
    let s = sock.to_str().unwrap();
    let fill = |p: &str| p.replace("{sock}", s).replace("{dec}", h264dec());
    let mut pc = gst_launch(&fill(producer));
    // The sink's info lines say when a ring grows.
    pc.env("GST_DEBUG", "gpushmsink:4")
        .env("GST_DEBUG_NO_COLOR", "1");
    let p = Proc::spawn(pc, "producer");
    wait_for_path(sock, Duration::from_secs(10));
    std::thread::sleep(delay);
    let c = Proc::spawn(gst_launch(&fill(consumer)), "consumer");
    let (cs, cout) = c.finish(Duration::from_secs(60));
    let (ps, pout) = p.finish(Duration::from_secs(60));
    assert!(
        ps.success(),
        "producer failed: {ps}\n{}\nconsumer:\n{}",
        pout.join("\n"),
        cout.join("\n")
    );
    assert!(
        cs.success(),
        "consumer failed: {cs}\n{}\nproducer:\n{}",
        cout.join("\n"),
        pout.join("\n")
    );
    (pout, cout)
}

/// Constrained baseline, so that openh264dec decodes it too.
const H264: &str = "x264enc key-int-max=15 threads=1 tune=zerolatency \
    ! video/x-h264,profile=constrained-baseline ! h264parse";

/// The H.264 decoder: avdec_h264 (gst-libav, installed by scripts/install-deps.sh), or
/// openh264dec where gst-libav is too large to carry (the GPU machine's packed runtime).
/// Producer and consumer use the same one, so their output must match.
fn h264dec() -> &'static str {
    init();
    if gst::ElementFactory::find("avdec_h264").is_some() {
        "avdec_h264"
    } else {
        "openh264dec"
    }
}

/// `frames` frames of `pattern` (320x240) encoded with `encode` in the producer, which shares
/// the encoded stream through `share` (ending in gpushmsink) and decodes it itself with
/// `decode`; the consumer runs `gpushmsrc lossless=true ! consume`. Both end in checksumsink:
/// the consumer must get every frame the producer decoded, equal. Returns the producer's output.
fn assert_same_decode(
    name: &str,
    frames: usize,
    pattern: &str,
    encode: &str,
    share: &str,
    decode: &str,
    consume: &str,
) -> Vec<String> {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join(format!("{name}.sock"));
    let (p, c) = run_pair(
        &sock,
        &format!(
            "videotestsrc num-buffers={frames} pattern={pattern} ! video/x-raw,width=320,height=240,framerate=30/1 \
             ! {encode} ! tee name=t t. ! queue ! {share} t. ! queue ! {decode} ! checksumsink"
        ),
        &format!("gpushmsrc socket-path={{sock}} lossless=true ! {consume} ! checksumsink"),
        Duration::ZERO,
    );
    let (reference, got) = (sums(&p), sums(&c));
    assert_eq!(reference.len(), frames, "{p:?}");
    assert_eq!(got, reference, "{name}: decoded frames differ");
    p
}

const SHARE: &str = "gpushmsink socket-path={sock} wait-for-connection=true";

#[test]
fn h264_decodes_frame_for_frame_like_in_one_process() {
    assert_same_decode(
        "h264",
        60,
        "ball",
        H264,
        SHARE,
        "{dec}",
        "h264parse ! {dec}",
    );
}

#[test]
fn jpeg_decodes_frame_for_frame_like_in_one_process() {
    assert_same_decode("jpeg", 30, "smpte", "jpegenc", SHARE, "jpegdec", "jpegdec");
}

#[test]
fn rtp_payloaded_h264_depayloads_and_decodes() {
    assert_same_decode(
        "rtp",
        45,
        "ball",
        H264,
        &format!("rtph264pay config-interval=-1 mtu=1200 ! {SHARE}"),
        "{dec}",
        "rtph264depay ! h264parse ! {dec}",
    );
}

#[test]
fn a_buffer_larger_than_the_slots_arrives_intact() {
    // Snow compresses badly: I-frames of tens of KiB against 4 KiB slots.
    let p = assert_same_decode(
        "big",
        30,
        "snow",
        H264,
        &format!("{SHARE} max-buffer-size=4096"),
        "{dec}",
        "h264parse ! {dec}",
    );
    assert!(
        p.iter().any(|l| l.contains("does not fit slots of 4096")),
        "no buffer outgrew the slots: the test proves nothing\n{}",
        p.join("\n")
    );
}

#[test]
fn a_consumer_joining_two_seconds_late_decodes_from_its_first_keyframe() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("late.sock");
    // Live, 4 s, a keyframe every half second: the consumer joins mid-GOP.
    let (p, c) = run_pair(
        &sock,
        &format!(
            "videotestsrc is-live=true num-buffers=120 pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 \
             ! {H264} ! tee name=t t. ! queue ! gpushmsink socket-path={{sock}} \
             t. ! queue ! {{dec}} ! checksumsink"
        ),
        "gpushmsrc socket-path={sock} ! h264parse ! {dec} ! checksumsink",
        Duration::from_millis(2000),
    );
    let (reference, got) = (sums(&p), sums(&c));
    assert_eq!(reference.len(), 120);
    assert!(
        got.len() >= 20 && got.len() <= 100,
        "joined 2 s into 4 s and got {} frames",
        got.len()
    );
    // Its first frame is a keyframe (the next of every 15th, or the one it asked the encoder
    // for as it joined: force-key-unit), and from there it decodes exactly what the producer
    // decoded: no broken frame, none missing.
    let start = reference
        .iter()
        .position(|r| *r == got[0])
        .expect("the first decoded frame is one of the producer's");
    assert_eq!(
        got,
        reference[start..start + got.len()],
        "decoded frames differ"
    );
    assert_eq!(start + got.len(), 120, "the end of the stream is missing");
}

#[test]
fn audio_arrives_byte_exact_with_continuous_timestamps() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("audio.sock");
    // Live: consumers keep the producer's spacing. 100 buffers of 1024 frames at 48 kHz
    // (2.1 s); the consumer joins after half a second and gets the rest.
    let (p, c) = run_pair(
        &sock,
        "audiotestsrc is-live=true num-buffers=100 samplesperbuffer=1024 wave=ticks \
         ! audio/x-raw,format=S16LE,rate=48000,channels=2,layout=interleaved \
         ! tee name=t t. ! queue ! gpushmsink socket-path={sock} \
         t. ! queue ! checksumsink",
        "gpushmsrc socket-path={sock} lossless=true ! audio/x-raw,format=S16LE,rate=48000,channels=2 ! checksumsink",
        Duration::from_millis(500),
    );
    let (reference, got) = (checksums(&p), checksums(&c));
    assert_eq!(reference.len(), 100);
    assert!(got.len() >= 40, "got {} buffers", got.len());
    let sums_of = |v: &[(String, String)]| v.iter().map(|x| x.1.clone()).collect::<Vec<_>>();
    let (reference, got_sums) = (sums_of(&reference), sums_of(&got));
    // wave=ticks repeats every second: match the whole run, not just its first buffer.
    let start = (0..=reference.len() - got_sums.len())
        .find(|&i| reference[i..i + got_sums.len()] == got_sums[..])
        .unwrap_or_else(|| panic!("audio bytes differ from the producer's: {got_sums:?}"));
    assert_eq!(
        start + got_sums.len(),
        100,
        "the end of the stream is missing"
    );
    // PTS continuous: each buffer starts where the previous one ended (1024 / 48000 s).
    let ns = |t: &str| -> i64 {
        let p: Vec<&str> = t.split(':').collect();
        let (h, m): (i64, i64) = (p[0].parse().unwrap(), p[1].parse().unwrap());
        let (s, f) = p[2].split_once('.').unwrap();
        ((h * 60 + m) * 60 + s.parse::<i64>().unwrap()) * 1_000_000_000 + f.parse::<i64>().unwrap()
    };
    let step = 1024 * 1_000_000_000i64 / 48000;
    for w in got.windows(2) {
        let d = ns(&w[1].0) - ns(&w[0].0);
        assert!(
            (d - step).abs() <= 1000,
            "PTS step {d} ns between {} and {}, expected {step}",
            w[0].0,
            w[1].0
        );
    }
}

#[test]
fn encoded_caps_into_cudasum_is_a_clear_error() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("cudasum.sock");
    let s = sock.to_str().unwrap();
    let p = Proc::spawn(
        gst_launch(&format!(
            "videotestsrc is-live=true num-buffers=300 ! video/x-raw,width=320,height=240,framerate=30/1 \
             ! jpegenc ! gpushmsink socket-path={s}"
        )),
        "producer",
    );
    wait_for_path(&sock, Duration::from_secs(10));
    let c = Proc::spawn(
        gst_launch(&format!("gpushmsrc socket-path={s} ! cudasum ! fakesink")),
        "consumer",
    );
    let (status, out) = c.finish(Duration::from_secs(30));
    drop(p);
    let out = out.join("\n");
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("refused the producer's caps image/jpeg")
            && out.contains("need a parser and decoder"),
        "{out}"
    );
}

/// Data caps through harnesses in one process: every flag, timestamp and offset, empty and
/// oversized buffers, keyframe gating and stream headers.
#[test]
fn flags_offsets_headers_and_any_size_travel() {
    init();
    let dir = tmpdir();
    let sock = dir.path().join("data.sock");
    let header = gst::Buffer::from_slice(b"HEADER-1".to_vec());
    let caps = gst::Caps::builder("application/x-gpushm-test")
        .field("streamheader", gst::Array::new([header.to_send_value()]))
        .field("codec_data", gst::Buffer::from_slice(vec![1u8, 2, 3, 4]))
        .build();
    let e = gst::ElementFactory::make("gpushmsink")
        .property("socket-path", sock.to_str().unwrap())
        .property("sync", false)
        .property("async", false)
        .property("max-buffer-size", 4096u32)
        .build()
        .unwrap();
    let mut sink = Harness::with_element(&e, Some("sink"), None);
    sink.set_src_caps(caps.clone());
    sink.play();
    let mut src = Harness::new("gpushmsrc");
    let el = src.element().unwrap();
    el.set_property("socket-path", sock.to_str().unwrap());
    el.set_property("lossless", true);
    src.play();
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.element().unwrap().property::<u32>("num-clients") == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    use gst::BufferFlags as F;
    let buffer = |n: u64, size: usize, flags: F| {
        let data: Vec<u8> = (0..size).map(|i| (i as u64 * 31 + n) as u8).collect();
        let mut b = gst::Buffer::from_mut_slice(data);
        let r = b.get_mut().unwrap();
        r.set_pts(gst::ClockTime::from_mseconds(40 * n + 80));
        r.set_dts(gst::ClockTime::from_mseconds(40 * n));
        r.set_duration(gst::ClockTime::from_mseconds(40));
        r.set_offset(1000 + n);
        r.set_offset_end(2000 + n);
        r.set_flags(flags);
        b
    };
    // Joined mid-stream: two delta units are skipped, the keyframe comes after the caps'
    // stream header.
    let sent = [
        (0, 100, F::DELTA_UNIT),
        (1, 100, F::DELTA_UNIT),
        (2, 3000, F::empty()),
        (3, 0, F::DELTA_UNIT | F::DROPPABLE),
        (4, 20_000, F::DELTA_UNIT | F::MARKER),
        (5, 10, F::HEADER),
        (6, 4096, F::DELTA_UNIT | F::CORRUPTED | F::NON_DROPPABLE),
    ];
    for &(n, size, flags) in &sent {
        assert_eq!(
            sink.push(buffer(n, size, flags)),
            Ok(gst::FlowSuccess::Ok),
            "buffer {n}"
        );
    }
    let h = src.pull().expect("the stream header");
    assert_eq!(h.map_readable().unwrap().as_slice(), b"HEADER-1");
    assert!(h.flags().contains(F::HEADER));
    let mut last_pts = None;
    for &(n, size, flags) in &sent[2..] {
        let b = src.pull().expect("a buffer");
        let expect = buffer(n, size, flags);
        assert_eq!(b.size(), size, "buffer {n}");
        assert_eq!(
            b.map_readable().unwrap().as_slice(),
            expect.map_readable().unwrap().as_slice(),
            "buffer {n}"
        );
        let mut want = flags;
        if n == 2 {
            // The first after the skipped ones.
            want |= F::DISCONT;
        }
        assert_eq!(b.flags() - F::TAG_MEMORY, want, "buffer {n} flags");
        assert_eq!(b.duration(), Some(gst::ClockTime::from_mseconds(40)));
        assert_eq!((b.offset(), b.offset_end()), (1000 + n, 2000 + n));
        let (pts, dts) = (b.pts().expect("pts"), b.dts().expect("dts"));
        assert!(dts <= pts, "buffer {n}: dts {dts} after pts {pts}");
        if let Some(l) = last_pts {
            assert!(pts >= l);
        }
        last_pts = Some(pts);
    }
    assert_eq!(src.element().unwrap().property::<u64>("frames-skipped"), 2);
    let got = src.sinkpad().unwrap().current_caps().expect("caps");
    assert_eq!(got, caps);
    let stats = sink.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("frames-sent").unwrap(), 7);
}

/// A default consumer (mode=auto) of a wait-for-connection producer gets the whole stream
/// from its first buffer: audio byte-exact, and H.264 decoded frame for frame like in the
/// producer's own process, whether the consumer comes at once or a second later (three runs
/// each). Auto is lossless for everything but live raw video.
#[test]
fn a_default_consumer_of_a_wait_for_connection_producer_loses_nothing() {
    init();
    let _g = serial();
    for run in 0..3 {
        let dir = tmpdir();
        let sock = dir.path().join("audio.sock");
        let (p, c) = run_pair(
            &sock,
            "audiotestsrc num-buffers=100 ! tee name=t t. ! queue ! gpushmsink socket-path={sock} wait-for-connection=true \
             t. ! queue ! checksumsink",
            "gpushmsrc socket-path={sock} ! checksumsink",
            Duration::ZERO,
        );
        assert_eq!(sums(&p).len(), 100);
        assert_eq!(sums(&c).len(), 100, "audio, run {run}: buffers lost");
        assert_eq!(sums(&c), sums(&p), "audio, run {run}: buffers changed");
        for delay in [Duration::ZERO, Duration::from_secs(1)] {
            let sock = dir.path().join(format!("h264-{}.sock", delay.as_millis()));
            let (p, c) = run_pair(
                &sock,
                &format!(
                    "videotestsrc is-live=true num-buffers=90 pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 \
                     ! {H264} ! tee name=t t. ! queue ! gpushmsink socket-path={{sock}} wait-for-connection=true \
                     t. ! queue ! {{dec}} ! checksumsink"
                ),
                "gpushmsrc socket-path={sock} ! h264parse ! {dec} ! checksumsink",
                delay,
            );
            assert_eq!(sums(&p).len(), 90, "{p:?}");
            assert_eq!(
                sums(&c).len(),
                90,
                "H.264 with the consumer {delay:?} late, run {run}: frames lost"
            );
            assert_eq!(
                sums(&c),
                sums(&p),
                "H.264 with the consumer {delay:?} late, run {run}: frames lost or changed"
            );
        }
    }
}

/// (PTS, DTS) relative to the first frame's DTS, of every frame of an MP4 recording, and how
/// many of them decode: with avdec_h264 (openh264dec cannot decode B-frames), `None` where it
/// is not installed (the GPU machine's packed runtime: there only the times are compared;
/// `make test` installs it).
fn recorded_times(path: &Path) -> (Vec<(i64, i64)>, Option<usize>) {
    init();
    let pull = pull_buffers;
    let demux = format!("filesrc location={} ! qtdemux ! h264parse", path.display());
    let times: Vec<(i64, i64)> = pull(&format!(
        "{demux} ! video/x-h264,alignment=au ! appsink name=out sync=false"
    ))
    .iter()
    .map(|b| {
        let ns = |t: Option<gst::ClockTime>| {
            t.expect("recorded frames have PTS and DTS").nseconds() as i64
        };
        (ns(b.pts()), ns(b.dts()))
    })
    .collect();
    let decoded = gst::ElementFactory::find("avdec_h264").map(|_| {
        pull(&format!(
            "{demux} ! avdec_h264 ! appsink name=out sync=false"
        ))
        .len()
    });
    let d0 = times.first().map_or(0, |t| t.1);
    (
        times.iter().map(|&(p, d)| (p - d0, d - d0)).collect(),
        decoded,
    )
}

/// x264enc with B-frames (its first DTS come before its first PTS), live and not (a file read
/// flat out, the producer's sink not syncing), recorded to MP4 through gpushm by a default
/// consumer: every frame decodes, and the PTS and DTS of each
/// frame relative to the first equal those of the same stream recorded in the producer's own
/// process (exactly when not live, within 1 ms live). Three runs each.
#[test]
fn b_frames_record_through_gpushm_as_in_one_process() {
    init();
    let _g = serial();
    for run in 0..3 {
        for live in [false, true] {
            let dir = tmpdir();
            let sock = dir.path().join("bframes.sock");
            let (reference, got) = (dir.path().join("ref.mp4"), dir.path().join("got.mp4"));
            run_pair(
                &sock,
                &format!(
                    "videotestsrc is-live={live} num-buffers=90 pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 \
                     ! x264enc bframes=2 key-int-max=30 threads=1 ! h264parse ! tee name=t \
                     t. ! queue ! gpushmsink socket-path={{sock}} wait-for-connection=true sync={live} \
                     t. ! queue ! mp4mux ! filesink location={}",
                    reference.display()
                ),
                &format!(
                    "-e gpushmsrc socket-path={{sock}} ! h264parse ! mp4mux ! filesink location={}",
                    got.display()
                ),
                Duration::ZERO,
            );
            let (want, want_decoded) = recorded_times(&reference);
            let (have, have_decoded) = recorded_times(&got);
            assert_eq!(want.len(), 90, "run {run}, live {live}");
            assert_eq!(have.len(), 90, "run {run}, live {live}: frames lost");
            assert!(
                want_decoded.is_none_or(|d| d == 90),
                "run {run}, live {live}"
            );
            assert_eq!(
                have_decoded, want_decoded,
                "run {run}, live {live}: frames that do not decode"
            );
            let slack = if live { 1_000_000 } else { 0 };
            for (i, (w, h)) in want.iter().zip(&have).enumerate() {
                assert!(
                    (w.0 - h.0).abs() <= slack && (w.1 - h.1).abs() <= slack,
                    "run {run}, live {live}, frame {i}: (pts, dts) {h:?} through gpushm, {w:?} in one process"
                );
            }
        }
    }
}

/// Every buffer the appsink named `out` of `pipeline` gets until EOS (or 10 s without one).
fn pull_buffers(pipeline: &str) -> Vec<gst::Buffer> {
    let p = gst::parse::launch(pipeline)
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
    let out = p
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    let mut v = Vec::new();
    while let Some(s) = out.try_pull_sample(gst::ClockTime::from_seconds(10)) {
        v.push(s.buffer_owned().unwrap());
    }
    p.set_state(gst::State::Null).unwrap();
    v
}

/// (PTS, DTS) of every sample of a QuickTime-family file (MP4, MOV), as qtdemux gives them.
fn muxed_times(path: &Path) -> Vec<(u64, u64)> {
    pull_buffers(&format!(
        "filesrc location={} ! qtdemux ! appsink name=out sync=false",
        path.display()
    ))
    .iter()
    .map(|b| {
        let ns = |t: Option<gst::ClockTime>| t.expect("samples have PTS and DTS").nseconds();
        (ns(b.pts()), ns(b.dts()))
    })
    .collect()
}

/// x264enc and jpegenc, live, behind a wait-for-connection gpushmsink, recorded by a lossless
/// consumer started 1 s after the producer (its backlog comes in a burst): all 150 frames, no
/// two with one PTS, and the PTS and DTS of each, relative to the first, exactly those of the
/// same stream recorded in the producer's own process (three runs each). Before, frames of
/// the burst were stamped at their publish moments, 1 ns apart at worst: duplicate PTS in
/// the file, a span of 4.956 s instead of 4.967.
#[test]
fn a_live_recording_through_wait_for_connection_keeps_every_frame_time() {
    init();
    let _g = serial();
    const SOURCE: &str = "videotestsrc is-live=true num-buffers=150 pattern=ball \
                          ! video/x-raw,width=320,height=240,framerate=30/1";
    for (enc, mux) in [
        (
            "x264enc key-int-max=30 threads=1 ! h264parse",
            "h264parse ! mp4mux",
        ),
        ("jpegenc", "image/jpeg ! qtmux"),
    ] {
        let dir = tmpdir();
        // The same stream recorded in one process (its own run: a branch of the producer's
        // pipeline would change how the producer waits).
        let reference = dir.path().join("ref.mp4");
        let (rs, rout) = Proc::spawn(
            gst_launch(&format!(
                "-e {SOURCE} ! {enc} ! {mux} ! filesink location={}",
                reference.display()
            )),
            "reference",
        )
        .finish(Duration::from_secs(60));
        assert!(rs.success(), "{rout:?}");
        let want = muxed_times(&reference);
        assert_eq!(want.len(), 150, "{enc}");
        for run in 0..3 {
            let sock = dir.path().join(format!("rec{run}.sock"));
            let got = dir.path().join(format!("got{run}.mp4"));
            run_pair(
                &sock,
                &format!("{SOURCE} ! {enc} ! gpushmsink socket-path={{sock}} wait-for-connection=true"),
                &format!(
                    "-e gpushmsrc socket-path={{sock}} mode=lossless ! {mux} ! filesink location={}",
                    got.display()
                ),
                Duration::from_secs(1),
            );
            let have = muxed_times(&got);
            assert_eq!(have.len(), 150, "run {run}, {enc}: frames lost");
            let mut pts: Vec<u64> = have.iter().map(|t| t.0).collect();
            pts.sort_unstable();
            pts.dedup();
            assert_eq!(
                pts.len(),
                150,
                "run {run}, {enc}: frames sharing a PTS: {have:?}"
            );
            let rel = |v: &[(u64, u64)]| -> Vec<(i64, i64)> {
                let d0 = v[0].1 as i64;
                v.iter()
                    .map(|&(p, d)| (p as i64 - d0, d as i64 - d0))
                    .collect()
            };
            assert_eq!(
                rel(&have),
                rel(&want),
                "run {run}, {enc}: (pts, dts) through gpushm against in one process"
            );
        }
    }
}

/// The same through a producer pipeline on a clock that starts near 0 (as an audio device's
/// does): x264enc's first DTS, before the base time, keep their times (before, they were
/// published without one). The producer runs here, the consumer is another process.
#[test]
fn b_frames_keep_their_dts_on_a_producer_clock_that_starts_near_zero() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("b0.sock");
    let (reference, got) = (dir.path().join("ref.mp4"), dir.path().join("got.mp4"));
    let producer = gst::parse::launch(&format!(
        "videotestsrc is-live=true num-buffers=60 pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 \
         ! x264enc bframes=2 key-int-max=30 threads=1 ! h264parse ! tee name=t \
         t. ! queue ! gpushmsink socket-path={} wait-for-connection=true \
         t. ! queue ! mp4mux ! filesink location={}",
        sock.display(),
        reference.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    // A system clock that reads about 0 now: a base time near 0.
    let clock = gst::glib::Object::builder::<gst::SystemClock>().build();
    let internal = clock.internal_time();
    clock.set_calibration(internal, gst::ClockTime::from_mseconds(1), 1, 1);
    producer.use_clock(Some(&clock));
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    let c = Proc::spawn(
        gst_launch(&format!(
            "-e gpushmsrc socket-path={} ! h264parse ! mp4mux ! filesink location={}",
            sock.display(),
            got.display()
        )),
        "recorder",
    );
    let bus = producer.bus().unwrap();
    let msg = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    assert!(
        matches!(
            msg.as_ref().map(|m| m.view()),
            Some(gst::MessageView::Eos(_))
        ),
        "{msg:?}"
    );
    let (cs, cout) = c.finish(Duration::from_secs(30));
    producer.set_state(gst::State::Null).unwrap();
    assert!(cs.success(), "{cout:?}");
    let (want, _) = recorded_times(&reference);
    let (have, decoded) = recorded_times(&got);
    assert_eq!(have.len(), 60, "frames lost");
    assert!(
        decoded.is_none_or(|d| d == 60),
        "{decoded:?} of 60 frames decode"
    );
    for (i, (w, h)) in want.iter().zip(&have).enumerate() {
        assert!(
            (w.0 - h.0).abs() <= 1_000_000 && (w.1 - h.1).abs() <= 1_000_000,
            "frame {i}: (pts, dts) {h:?} through gpushm, {w:?} in one process"
        );
    }
}

/// A slow default (`auto`) consumer of a live audio stream is waited for only up to its share
/// (`gpushm::policy::LIVE_HOLD_PERCENT` of real time, a burst of 1 s at most): it cannot
/// slow the live source, and the other default consumer, down to its pace. Live audio at
/// 100 buffers/s for 5 s; the slow consumer takes one buffer per 20 ms (half the rate). Held
/// to its pace, the producer would need 10 s; the fast consumer gets every buffer from its
/// first on, in order.
#[test]
fn a_slow_default_consumer_cannot_hold_a_live_stream_to_its_pace() {
    init();
    let _g = serial();
    let dir = tmpdir();
    let sock = dir.path().join("live-audio.sock");
    let s = sock.to_str().unwrap();
    let pc = gst_launch(&format!(
        "audiotestsrc is-live=true num-buffers=500 samplesperbuffer=441 wave=white-noise \
         ! audio/x-raw,format=S16LE,rate=44100,channels=1 \
         ! tee name=t t. ! queue ! gpushmsink socket-path={s} wait-for-connection=true \
         t. ! queue ! checksumsink"
    ));
    let p = Proc::spawn(pc, "producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let start = Instant::now();
    let slow = Proc::spawn(
        gst_launch(&format!(
            "gpushmsrc socket-path={s} ! identity sleep-time=20000 ! fakesink sync=false"
        )),
        "slow consumer",
    );
    std::thread::sleep(Duration::from_millis(300));
    let fast = Proc::spawn(
        gst_launch(&format!("gpushmsrc socket-path={s} ! checksumsink")),
        "fast consumer",
    );
    let (ps, pout) = p.finish(Duration::from_secs(60));
    let took = start.elapsed();
    let (fs, fout) = fast.finish(Duration::from_secs(30));
    let (ss, sout) = slow.finish(Duration::from_secs(30));
    assert!(ps.success(), "producer: {ps}\n{}", pout.join("\n"));
    assert!(fs.success(), "fast consumer: {fs}\n{}", fout.join("\n"));
    assert!(ss.success(), "slow consumer: {ss}\n{}", sout.join("\n"));
    let (reference, got) = (sums(&pout), sums(&fout));
    assert_eq!(reference.len(), 500);
    assert!(
        got.len() >= 300,
        "the fast consumer got {} buffers",
        got.len()
    );
    let first = reference
        .iter()
        .position(|r| *r == got[0])
        .expect("the fast consumer's first buffer is not the producer's");
    assert_eq!(
        got[..],
        reference[first..],
        "the fast consumer lost or reordered buffers"
    );
    // 5 s of audio, + 1.5 s the slow consumer may hold it up, + start-up.
    assert!(
        took < Duration::from_millis(7500),
        "the live producer was held to the slow consumer's pace: {took:?} for 5 s of audio"
    );
}
