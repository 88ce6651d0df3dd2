// SPDX-License-Identifier: MPL-2.0
//! Past one machine: a stream shared through gpushm re-exported with GStreamer's own network
//! engines, over loopback. One H.264 encoder feeds gpushmsink; gpushm consumers record it
//! (Matroska) and send it on (SRT, RTSP); the far end's decoded frames must equal, frame for
//! frame, a local decode of the recording (encoding is lossy: the raw frames would not).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

/// The one encoder: `frames` frames of 320x240 at 30 fps, a keyframe every 15, into gpushm
/// stream `enc`; it waits for its first consumer.
fn encoder(dir: &Path, frames: u32) -> Proc {
    let mut c = gst_launch(&format!(
        "videotestsrc num-buffers={frames} is-live=true pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 \
         ! x264enc key-int-max=15 tune=zerolatency speed-preset=ultrafast ! h264parse config-interval=-1 \
         ! video/x-h264,stream-format=byte-stream,alignment=au ! gpushmsink stream=enc wait-for-connection=true"
    ));
    c.env("GPUSHM_RUNTIME_DIR", dir);
    Proc::spawn(c, "encoder")
}

/// A gpushm consumer of stream `enc`, waiting up to 20 s for it, then `rest`.
fn consumer(dir: &Path, rest: &str, name: &str) -> Proc {
    let mut c = gst_launch(&format!(
        "gpushmsrc stream=enc timeout=20000000000 ! {rest}"
    ));
    c.env("GPUSHM_RUNTIME_DIR", dir);
    Proc::spawn(c, name)
}

fn sha1s(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 2 && f[1].len() == 40).then(|| f[1].to_string())
        })
        .collect()
}

/// The recording decoded here: the frames every far end must match.
fn local_decode(rec: &Path) -> Vec<String> {
    let c = gst_launch(&format!(
        "filesrc location={} ! matroskademux ! h264parse ! avdec_h264 ! checksumsink",
        rec.display()
    ));
    let (status, out) = Proc::spawn(c, "local decode").finish(Duration::from_secs(60));
    assert!(status.success(), "{}", out.join("\n"));
    sha1s(&out)
}

/// `far` is a run of `local` (it may join at a later keyframe), at least `min` frames long.
fn assert_run_of(far: &[String], local: &[String], min: usize) {
    assert!(
        far.len() >= min,
        "the far end decoded {} frames, expected {min} at least",
        far.len()
    );
    let start = local
        .iter()
        .position(|l| *l == far[0])
        .unwrap_or_else(|| panic!("the far end's first frame is no frame of the recording"));
    assert_eq!(
        &local[start..(start + far.len()).min(local.len())],
        far,
        "the far end's frames differ from the local decode (joined at frame {start})"
    );
}

/// Live encoders on two cores: one test at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn free_port(udp: bool) -> u16 {
    if udp {
        std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    } else {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}

#[test]
fn reexport_over_srt_gives_the_far_end_the_frames_of_the_local_recording() {
    let _one = one_at_a_time();
    let dir = tmpdir();
    let rec = dir.path().join("rec.mkv");
    let port = free_port(true);
    // The far end listens; the sender calls it. mpegtsmux alignment=7: SRT carries 1316-byte
    // messages (seven TS packets).
    let far = Proc::spawn(
        {
            let mut c = gst_launch(&format!(
                "srtsrc uri=srt://127.0.0.1:{port}?mode=listener ! tsdemux ! h264parse ! avdec_h264 ! checksumsink"
            ));
            c.env_remove("GPUSHM_RUNTIME_DIR");
            c
        },
        "srt far end",
    );
    let recorder = consumer(
        dir.path(),
        &format!(
            "h264parse ! matroskamux ! filesink location={}",
            rec.display()
        ),
        "recorder",
    );
    // The encoder starts when the recorder connects: the recording has every frame.
    let enc = encoder(dir.path(), 90);
    std::thread::sleep(Duration::from_millis(300));
    // The sender may join a little later, at a keyframe.
    let sender = consumer(
        dir.path(),
        &format!(
            "h264parse ! mpegtsmux alignment=7 ! srtsink uri=srt://127.0.0.1:{port}?mode=caller"
        ),
        "srt sender",
    );
    for p in [enc, recorder, sender] {
        let name = p.name.clone();
        let (status, out) = p.finish(Duration::from_secs(60));
        assert!(status.success(), "{name}: {}", out.join("\n"));
    }
    // The far end sees the caller hang up as the end of its stream.
    let (_, out) = far.finish(Duration::from_secs(20));
    let mut far = sha1s(&out);
    // The last frame may arrive cut (the muxer keeps a last group of fewer than seven
    // packets), and decodes to something else: it is not compared.
    far.pop();
    let local = local_decode(&rec);
    assert_eq!(local.len(), 90, "the recorder lost frames");
    assert_run_of(&far, &local, 60);
}

#[test]
fn reexport_over_rtsp_gives_a_late_client_the_frames_of_the_local_recording() {
    let _one = one_at_a_time();
    let dir = tmpdir();
    let rec = dir.path().join("rec.mkv");
    let port = free_port(false);
    let mut server = example("rtsp_server");
    server.args(["--address", "127.0.0.1", "--port", &port.to_string(), "enc"]);
    server.env("GPUSHM_RUNTIME_DIR", dir.path());
    with_plugin_path(&mut server);
    let mut server = Proc::spawn(server, "rtsp_server");
    server.wait_line("READY rtsp://", Duration::from_secs(20));
    let recorder = consumer(
        dir.path(),
        &format!(
            "h264parse ! matroskamux ! filesink location={}",
            rec.display()
        ),
        "recorder",
    );
    std::thread::sleep(Duration::from_millis(500));
    let enc = encoder(dir.path(), 150);
    // The client comes a second into the stream: it starts at the next keyframe.
    std::thread::sleep(Duration::from_secs(1));
    let client = Proc::spawn(
        gst_launch(&format!(
            "rtspsrc location=rtsp://127.0.0.1:{port}/enc protocols=tcp latency=0 ! rtph264depay ! h264parse ! avdec_h264 ! checksumsink"
        )),
        "rtsp client",
    );
    for p in [enc, recorder] {
        let name = p.name.clone();
        let (status, out) = p.finish(Duration::from_secs(60));
        assert!(status.success(), "{name}: {}", out.join("\n"));
    }
    let (_, out) = client.finish(Duration::from_secs(20));
    let far = sha1s(&out);
    let local = local_decode(&rec);
    assert_eq!(local.len(), 150, "the recorder lost frames");
    assert_run_of(&far, &local, 60);
    drop(server);
}
