// SPDX-License-Identifier: MPL-2.0
//! cudasum and the CUDA path. The GPU tests are `#[ignore = "needs a CUDA GPU"]`: run them with
//! `--include-ignored` on the GPU machine (see README, "GPU"). The others check the CPU backend
//! and the behaviour without a GPU (in a child process with the GPUs hidden), and run
//! everywhere.

mod common;
use common::*;

use gst::prelude::*;
use gstgpushm::sum_planes as sp;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Tests that run gpushm elements in this process take this: one of them counts the
/// process's CUDA registrations.
fn in_process() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// These tests are `#[ignore = "needs a CUDA GPU"]`; run with `--include-ignored` on a machine
/// with one. Without a GPU they fail, saying why, instead of passing vacuously.
fn gpu(test: &str) {
    init();
    if let Err(e) = gstgpushm::cuda::driver() {
        panic!("{test} needs a CUDA GPU: {e}");
    }
}

/// Runs the calling test again in a child process with every GPU hidden
/// (CUDA_VISIBLE_DEVICES=), so that the behaviour without a GPU is tested on GPU machines too.
/// Returns true in the child, where the test body runs.
fn without_gpu(test: &str) -> bool {
    if std::env::var_os("GPUSHM_TEST_NO_GPU").is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--include-ignored"])
        .env("GPUSHM_TEST_NO_GPU", "1")
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("re-running the test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{test} without a GPU:\n{text}");
    assert!(text.contains("1 passed"), "{test} did not run:\n{text}");
    false
}

/// Runs `launch` to EOS; returns every cudasum message and, if it has an `appsink name=out`
/// (with an unbounded queue), the buffers it received with their caps.
fn run(launch: &str) -> (Vec<(gst::Buffer, gst::Caps)>, Vec<gst::Structure>) {
    init();
    let p = gst::parse::launch(launch)
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
    if let Some(out) = p.by_name("out") {
        // Post EOS without waiting for us to pull: the buffers are pulled after EOS below.
        out.set_property("wait-on-eos", false);
    }
    p.set_state(gst::State::Playing).unwrap();
    let mut msgs = Vec::new();
    for m in p
        .bus()
        .unwrap()
        .iter_timed(gst::ClockTime::from_seconds(60))
    {
        match m.view() {
            gst::MessageView::Error(e) => panic!("{launch}: {} {:?}", e.error(), e.debug()),
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Element(_) => {
                if let Some(s) = m.structure().filter(|s| s.name() == "cudasum") {
                    msgs.push(s.to_owned());
                }
            }
            _ => {}
        }
    }
    // A gpushmsrc named `src`: how its frames went out, as a last message.
    if let Some(src) = p.by_name("src") {
        msgs.push(
            gst::Structure::builder("gpushmsrc")
                .field(
                    "frames-cuda-wrapped",
                    src.property::<u64>("frames-cuda-wrapped"),
                )
                .field(
                    "frames-cuda-copied",
                    src.property::<u64>("frames-cuda-copied"),
                )
                .build(),
        );
    }
    let mut bufs = Vec::new();
    if let Some(sink) = p
        .by_name("out")
        .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
    {
        while let Some(s) = sink.try_pull_sample(gst::ClockTime::ZERO) {
            bufs.push((s.buffer_owned().unwrap(), s.caps().unwrap().to_owned()));
        }
    }
    p.set_state(gst::State::Null).unwrap();
    (bufs, msgs)
}

fn array(s: &gst::StructureRef, f: &str) -> Vec<u64> {
    s.get::<gst::Array>(f)
        .unwrap()
        .iter()
        .map(|v| v.get::<u64>().unwrap())
        .collect()
}

/// Every message's plane sums equal a CPU computation over the buffer it describes.
fn assert_sums_match(bufs: &[(gst::Buffer, gst::Caps)], msgs: &[gst::Structure], path: &str) {
    assert_eq!(bufs.len(), msgs.len());
    for ((b, caps), m) in bufs.iter().zip(msgs) {
        let info = gst_video::VideoInfo::from_caps(caps).unwrap();
        let map = b.map_readable().unwrap();
        let planes = sp::buffer_planes(&info, b).unwrap();
        let cpu = sp::cpu_sums(&map, &planes);
        assert_eq!(
            array(m, "plane-sums"),
            sp::plane_totals(&cpu),
            "{caps} frame {}",
            b.offset()
        );
        assert_eq!(
            array(m, "component-sums"),
            sp::component_sums(&info, &cpu),
            "{caps} frame {}",
            b.offset()
        );
        assert_eq!(m.get::<&str>("path").unwrap(), path);
    }
}

#[test]
fn cpu_backend_sums_the_seed_frame_to_136() {
    init();
    let p = gst::parse::launch("appsrc name=in format=time ! cudasum backend=cpu ! fakesink")
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
    let src = p
        .by_name("in")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    src.set_caps(Some(
        &"video/x-raw,format=GRAY8,width=4,height=4,framerate=1/1"
            .parse::<gst::Caps>()
            .unwrap(),
    ));
    p.set_state(gst::State::Playing).unwrap();
    src.push_buffer(gst::Buffer::from_slice((1..=16u8).collect::<Vec<_>>()))
        .unwrap();
    src.end_of_stream().unwrap();
    let bus = p.bus().unwrap();
    let mut got = None;
    for m in bus.iter_timed(gst::ClockTime::from_seconds(5)) {
        match m.view() {
            gst::MessageView::Element(_) => got = m.structure().map(|s| s.to_owned()),
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => panic!("{}", e.error()),
            _ => {}
        }
    }
    p.set_state(gst::State::Null).unwrap();
    let s = got.expect("a cudasum message");
    assert_eq!(array(&s, "plane-sums"), vec![136]);
    assert_eq!(array(&s, "component-sums"), vec![136]);
    assert_eq!(s.get::<&str>("backend").unwrap(), "cpu");
}

#[test]
fn cpu_backend_matches_the_reference_for_every_format() {
    init();
    for format in sp::FORMATS.iter().map(|f| f.to_str()) {
        let (bufs, msgs) = run(&format!(
            "videotestsrc num-buffers=3 pattern=snow ! video/x-raw,format={format},width=333,height=199 ! cudasum backend=cpu ! appsink name=out"
        ));
        assert_eq!(bufs.len(), 3, "{format}");
        assert_sums_match(&bufs, &msgs, "cpu");
    }
}

#[test]
fn without_a_gpu_backend_cuda_is_a_clear_error_at_ready() {
    if !without_gpu("without_a_gpu_backend_cuda_is_a_clear_error_at_ready") {
        return;
    }
    init();
    assert!(
        gstgpushm::cuda::driver().is_err(),
        "CUDA_VISIBLE_DEVICES= hides every GPU"
    );
    let e = gst::ElementFactory::make("cudasum")
        .property_from_str("backend", "cuda")
        .build()
        .unwrap();
    let bus = gst::Bus::new();
    e.set_bus(Some(&bus));
    assert!(e.set_state(gst::State::Ready).is_err());
    let m = bus
        .pop_filtered(&[gst::MessageType::Error])
        .expect("an error message");
    let gst::MessageView::Error(err) = m.view() else {
        unreachable!()
    };
    let text = err.error().to_string();
    assert!(
        text.contains("backend=cuda cannot run") && text.contains("backend=cpu"),
        "{text}"
    );
    e.set_state(gst::State::Null).unwrap();
}

#[test]
fn without_a_gpu_backend_auto_warns_and_uses_the_cpu() {
    if !without_gpu("without_a_gpu_backend_auto_warns_and_uses_the_cpu") {
        return;
    }
    init();
    assert!(
        gstgpushm::cuda::driver().is_err(),
        "CUDA_VISIBLE_DEVICES= hides every GPU"
    );
    let p = gst::parse::launch("videotestsrc num-buffers=2 ! video/x-raw,format=NV12,width=64,height=48 ! cudasum ! fakesink")
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    let bus = p.bus().unwrap();
    let (mut warned, mut paths) = (false, Vec::new());
    for m in bus.iter_timed(gst::ClockTime::from_seconds(5)) {
        match m.view() {
            gst::MessageView::Warning(w) => warned |= w.error().to_string().contains("on the CPU"),
            gst::MessageView::Element(_) => {
                paths.push(m.structure().unwrap().get::<String>("path").unwrap())
            }
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => panic!("{}", e.error()),
            _ => {}
        }
    }
    p.set_state(gst::State::Null).unwrap();
    assert!(warned, "a warning says the CPU is used");
    assert_eq!(paths, vec!["cpu", "cpu"]);
}

// ---- GPU ----

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_seed_frame_sums_to_136_across_processes() {
    gpu("gpu_seed_frame_sums_to_136_across_processes");
    let dir = tmpdir();
    let sock = dir.path().join("seed.sock");
    let producer = seed_producer(&sock, 5);
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--lossless",
        "--print",
        "--cudasum",
        "cuda",
        "--expect",
        "5",
    ]);
    let (cs, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(60));
    let _ = producer.finish(Duration::from_secs(10));
    assert!(cs.success(), "{}", out.join("\n"));
    let sums: Vec<&String> = out.iter().filter(|l| l.starts_with("CUDASUM ")).collect();
    assert_eq!(sums.len(), 5, "{}", out.join("\n"));
    for l in sums {
        assert!(
            l.contains("path=zero-copy") && l.contains("plane_sums=136 cpu=136 match=true"),
            "{l}"
        );
    }
    println!(
        "{}",
        out.iter()
            .filter(|l| l.starts_with("CUDA"))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_4k_nv12_300_frames_read_in_place_match_the_cpu() {
    gpu("gpu_4k_nv12_300_frames_read_in_place_match_the_cpu");
    let dir = tmpdir();
    let sock = dir.path().join("4k.sock");
    let mut p = example("pattern_producer");
    p.args([
        "--socket",
        sock.to_str().unwrap(),
        "--width",
        "3840",
        "--height",
        "2160",
        "--frames",
        "300",
    ]);
    // 16 slots: frame_checker's appsink and the app keep up to 4 frames, all zero-copy.
    p.args(["--fps", "0", "--wait", "--slots", "16"]);
    let producer = Proc::spawn(p, "pattern_producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut c = example("frame_checker");
    c.args([
        "--socket",
        sock.to_str().unwrap(),
        "--lossless",
        "--verify",
        "--cudasum",
        "cuda",
        "--expect",
        "300",
    ]);
    let (cs, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(300));
    let (ps, pout) = producer.finish(Duration::from_secs(30));
    assert!(
        cs.success() && ps.success(),
        "{}\n{}",
        out.join("\n"),
        pout.join("\n")
    );
    let st = fields(&out, "CUDASTATS ");
    assert_eq!(num(&st, "checked"), 300.0);
    assert_eq!(num(&st, "mismatches"), 0.0);
    assert_eq!(num(&st, "zero_copy"), 300.0, "every frame read in place");
    assert_eq!(num(&st, "staged"), 0.0);
    assert_eq!(
        num(&st, "host_registrations"),
        1.0,
        "one registration for the one ring, none per frame"
    );
    println!(
        "{}",
        out.iter()
            .filter(|l| l.starts_with("CUDASTATS") || l.starts_with("SUMMARY"))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_system_memory_is_staged_and_matches_the_cpu() {
    gpu("gpu_system_memory_is_staged_and_matches_the_cpu");
    let _serial = in_process();
    let before = gstgpushm::cuda::register::registrations();
    for format in sp::FORMATS.iter().map(|f| f.to_str()) {
        let (bufs, msgs) = run(&format!(
            "videotestsrc num-buffers=4 pattern=snow ! video/x-raw,format={format},width=333,height=199 ! cudasum backend=cuda ! appsink name=out"
        ));
        assert_eq!(bufs.len(), 4, "{format}");
        assert_sums_match(&bufs, &msgs, "staged");
    }
    assert_eq!(
        gstgpushm::cuda::register::registrations(),
        before,
        "staging registers nothing"
    );
}

/// Upstream of gpushmsink, buffers come from the ring's pool with a GpuShmCudaMeta: cudasum
/// reads them in place. The same deterministic frames summed on the CPU give the same sums.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_producer_pool_buffers_are_read_in_place() {
    gpu("gpu_producer_pool_buffers_are_read_in_place");
    let dir = tmpdir();
    let frames =
        "videotestsrc num-buffers=20 pattern=ball ! video/x-raw,format=NV12,width=1280,height=720";
    let (_, gpu_msgs) = run(&format!(
        "{frames} ! cudasum backend=cuda ! gpushmsink socket-path={}/pool.sock sync=false",
        dir.path().display()
    ));
    let (_, cpu_msgs) = run(&format!("{frames} ! cudasum backend=cpu ! fakesink"));
    assert_eq!(gpu_msgs.len(), 20);
    assert_eq!(cpu_msgs.len(), 20);
    for (g, c) in gpu_msgs.iter().zip(&cpu_msgs) {
        assert_eq!(
            g.get::<&str>("path").unwrap(),
            "zero-copy",
            "pool buffers carry the device pointer"
        );
        assert_eq!(
            array(g, "plane-sums"),
            array(c, "plane-sums"),
            "frame {}",
            g.get::<u64>("offset").unwrap()
        );
        assert_eq!(array(g, "component-sums"), array(c, "component-sums"));
    }
}

/// Peak RSS (KiB) of a producer and a consumer process, and whether each loaded libcuda.
struct PairRun {
    producer_kib: u64,
    consumer_kib: u64,
    producer_cuda: bool,
    consumer_cuda: bool,
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with(key))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

fn maps_cuda(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains("libcuda"))
}

/// `videotestsrc ! gpushmsink` and `gpushmsrc ! fakesink` (720p NV12, 30 fps, 3 s), sampled
/// until they exit.
fn pair_run(env: &[(&str, &str)], sink_props: &str, src_props: &str) -> PairRun {
    let dir = tmpdir();
    let sock = dir.path().join("rss.sock");
    let mut p = gst_launch(&format!(
        "videotestsrc is-live=true num-buffers=120 ! video/x-raw,format=NV12,width=1280,height=720,framerate=30/1 ! gpushmsink socket-path={} {sink_props}",
        sock.display()
    ));
    let mut c = gst_launch(&format!(
        "gpushmsrc socket-path={} num-buffers=90 {src_props} ! fakesink",
        sock.display()
    ));
    for (k, v) in env {
        p.env(k, v);
        c.env(k, v);
    }
    let mut producer = Proc::spawn(p, "producer");
    wait_for_path(&sock, Duration::from_secs(10));
    let mut consumer = Proc::spawn(c, "consumer");
    let (pp, cp) = (producer.child.id(), consumer.child.id());
    let mut r = PairRun {
        producer_kib: 0,
        consumer_kib: 0,
        producer_cuda: false,
        consumer_cuda: false,
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while (producer.is_running() || consumer.is_running()) && std::time::Instant::now() < deadline {
        if let Some(k) = status_kib(pp, "VmHWM:") {
            r.producer_kib = r.producer_kib.max(k);
            r.producer_cuda |= maps_cuda(pp);
        }
        if let Some(k) = status_kib(cp, "VmHWM:") {
            r.consumer_kib = r.consumer_kib.max(k);
            r.consumer_cuda |= maps_cuda(cp);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (cs, cout) = consumer.finish(Duration::from_secs(10));
    let (ps, pout) = producer.finish(Duration::from_secs(10));
    assert!(
        cs.success() && ps.success(),
        "{}\n{}",
        cout.join("\n"),
        pout.join("\n")
    );
    r
}

/// Only a process that asks for GPU access creates a CUDA context: a producer and a consumer
/// that do not use the GPU load no libcuda and stay within 10 MiB of their RSS with the GPU
/// hidden; cuda-register=always shows what a context costs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_processes_that_do_not_ask_create_no_cuda_context() {
    gpu("gpu_processes_that_do_not_ask_create_no_cuda_context");
    let hidden = pair_run(&[("CUDA_VISIBLE_DEVICES", "")], "", "");
    let auto = pair_run(&[], "", "");
    let always = pair_run(&[], "cuda-register=always", "cuda-register=always");
    for (what, r) in [
        ("GPU hidden", &hidden),
        ("cuda-register=auto (default)", &auto),
        ("cuda-register=always", &always),
    ] {
        println!(
            "RSS {what}: producer {:.1} MiB (libcuda loaded: {}), consumer {:.1} MiB (libcuda loaded: {})",
            r.producer_kib as f64 / 1024.0,
            r.producer_cuda,
            r.consumer_kib as f64 / 1024.0,
            r.consumer_cuda
        );
    }
    assert!(
        !auto.producer_cuda && !auto.consumer_cuda,
        "nothing asked for CUDA"
    );
    assert!(
        always.producer_cuda && always.consumer_cuda,
        "cuda-register=always registers"
    );
    assert!(auto.producer_kib <= hidden.producer_kib + 10 * 1024);
    assert!(auto.consumer_kib <= hidden.consumer_kib + 10 * 1024);
}

/// A GPU that cannot register read-only memory (forced with the test-only switch) gets a
/// writable ring from a producer that allows it, and still reads every frame in place with one
/// registration: asked for at start (cuda-register=always), or when cudasum asks (auto: the
/// consumer reconnects for a writable ring).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_writable_ring_fallback_reads_in_place() {
    gpu("gpu_writable_ring_fallback_reads_in_place");
    for mode in ["always", "auto"] {
        let dir = tmpdir();
        let sock = dir.path().join("w.sock");
        let p = gst_launch(&format!(
            "videotestsrc is-live=true num-buffers=150 pattern=ball ! video/x-raw,format=NV12,width=1280,height=720,framerate=30/1 ! gpushmsink socket-path={} allow-writable-ring=true",
            sock.display()
        ));
        let producer = Proc::spawn(p, "producer");
        wait_for_path(&sock, Duration::from_secs(10));
        let mut c = example("frame_checker");
        c.env(gstgpushm::cuda::TEST_NO_READ_ONLY_REGISTER, "1");
        c.args(["--socket", sock.to_str().unwrap(), "--frames", "60"]);
        c.args([
            "--cudasum",
            "cuda",
            "--src-props",
            &format!("cuda-register={mode}"),
        ]);
        let (cs, out) = Proc::spawn(c, "frame_checker").finish(Duration::from_secs(60));
        let _ = producer.finish(Duration::from_secs(10));
        assert!(cs.success(), "{mode}: {}", out.join("\n"));
        let st = fields(&out, "CUDASTATS ");
        println!(
            "{mode}: {}",
            out.iter()
                .filter(|l| l.starts_with("CUDASTATS"))
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert_eq!(num(&st, "mismatches"), 0.0, "{mode}");
        assert_eq!(
            num(&st, "host_registrations"),
            1.0,
            "{mode}: one registration, of the writable ring"
        );
        if mode == "always" {
            assert_eq!(
                num(&st, "zero_copy"),
                num(&st, "checked"),
                "always: every frame in place"
            );
        } else {
            // Frames before the reconnect are staged; every one after it is read in place.
            assert!(num(&st, "zero_copy") >= 30.0, "auto: {}", out.join("\n"));
        }
    }
}

/// `frames` (buffers with their caps) are those videotestsrc renders with `pattern` in
/// `format` at `w`×`h` into system memory, row for row (strides may differ).
fn assert_same_as_videotestsrc(
    frames: &[(gst::Buffer, gst::Caps)],
    pattern: &str,
    format: &str,
    w: u32,
    h: u32,
) {
    let (reference, _) = run(&format!(
        "videotestsrc num-buffers={} {pattern} ! video/x-raw,format={format},width={w},height={h},framerate=30/1 \
         ! appsink name=out sync=false max-buffers=0",
        frames.len()
    ));
    assert_same_frames(frames, &reference);
}

/// `frames` and `reference` hold the same pictures, row for row (strides may differ), in
/// system memory.
fn assert_same_frames(frames: &[(gst::Buffer, gst::Caps)], reference: &[(gst::Buffer, gst::Caps)]) {
    use gst_video::prelude::*;
    assert_eq!(reference.len(), frames.len());
    for (i, ((a, caps), (b, _))) in frames.iter().zip(reference.iter()).enumerate() {
        assert!(
            caps.features(0)
                .is_none_or(|f| !f.contains("memory:CUDAMemory")),
            "{caps}"
        );
        let info = gst_video::VideoInfo::from_caps(caps).unwrap();
        let fa = gst_video::VideoFrameRef::from_buffer_ref_readable(a.as_ref(), &info).unwrap();
        let fb = gst_video::VideoFrameRef::from_buffer_ref_readable(b.as_ref(), &info).unwrap();
        for p in 0..info.n_planes() {
            let rows = info.comp_height(p as u8) as usize;
            let row_bytes = (info.comp_width(p as u8) * info.comp_pstride(p as u8) as u32) as usize;
            let (da, db) = (fa.plane_data(p).unwrap(), fb.plane_data(p).unwrap());
            let (sa, sb) = (
                fa.plane_stride()[p as usize] as usize,
                fb.plane_stride()[p as usize] as usize,
            );
            for y in 0..rows {
                assert_eq!(
                    &da[y * sa..y * sa + row_bytes],
                    &db[y * sb..y * sb + row_bytes],
                    "frame {i}, plane {p}, row {y}"
                );
            }
        }
    }
}

/// The line a user writes first, `cudaupload ! cudadownload ! gpushmsink` with no capsfilter,
/// works: cudadownload sees that the sink takes system memory only and downloads (it used to
/// pass CUDA memory through, which the sink then refused). Frames arrive intact at a consumer.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudadownload_before_the_sink_gives_it_system_memory_without_a_capsfilter() {
    gpu("cudadownload_before_the_sink_gives_it_system_memory_without_a_capsfilter");
    let _serial = in_process();
    for e in ["cudaupload", "cudadownload"] {
        assert!(
            gst::ElementFactory::find(e).is_some(),
            "{e} is missing: carry Debian's libgstnvcodec.so (scripts/device-pack.sh does)"
        );
    }
    let dir = tmpdir();
    let sock = dir.path().join("dl.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
         ! cudaupload ! cudadownload ! gpushmsink socket-path={} wait-for-connection=true",
        sock.display()
    ))
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    let (frames, _) = run(&format!(
        "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! appsink name=out sync=false max-buffers=0",
        sock.display()
    ));
    let bus = producer.bus().unwrap();
    let end = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(20),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    producer.set_state(gst::State::Null).unwrap();
    match end.as_ref().map(|m| m.view()) {
        Some(gst::MessageView::Eos(_)) => {}
        Some(gst::MessageView::Error(e)) => panic!("producer: {} {:?}", e.error(), e.debug()),
        _ => panic!("the producer did not finish"),
    }
    assert_eq!(frames.len(), 30);
    assert_same_as_videotestsrc(&frames, "pattern=ball", "NV12", 320, 240);
}

/// Issue 28, device rings: a producer process keeps its ring in GPU memory (CUDA virtual
/// memory, exported as a descriptor); four consumer processes map it read-only at once, a CUDA
/// kernel sums each frame in place and the bytes copied back match the pattern, frame for
/// frame; a held frame is not reused while the ring goes round; a write through a consumer's
/// mapping is refused; a consumer that cannot map GPU memory is turned away, told why.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_ring_frames_are_read_in_place_by_other_processes() {
    gpu("device_ring_frames_are_read_in_place_by_other_processes");
    let dir = tmpdir();
    let sock = dir.path().join("dev.sock");
    let s = sock.to_str().unwrap();
    let mut producer = example("device_ring");
    producer.args([
        "produce",
        "--socket",
        s,
        "--frames",
        "40",
        "--clients",
        "4",
        "--slots",
        "8",
    ]);
    let mut producer = Proc::spawn(producer, "device ring producer");
    producer.wait_line("READY", Duration::from_secs(30));
    let refused = example("device_ring")
        .args(["consume", "--socket", s, "--host-only"])
        .output()
        .unwrap();
    let refused = String::from_utf8_lossy(&refused.stdout).to_string();
    assert!(
        refused.contains("ERROR") && refused.contains("GPU memory"),
        "a consumer that cannot map GPU memory: {refused}"
    );
    let consumers: Vec<Proc> = (0..4)
        .map(|i| {
            let mut c = example("device_ring");
            c.args(["consume", "--socket", s, "--frames", "40"]);
            Proc::spawn(c, &format!("device ring consumer {i}"))
        })
        .collect();
    for (i, c) in consumers.into_iter().enumerate() {
        let (status, out) = c.finish(Duration::from_secs(60));
        let text = out.join("\n");
        assert!(status.success(), "consumer {i}:\n{text}");
        let frames: Vec<&String> = out.iter().filter(|l| l.starts_with("FRAME ")).collect();
        assert_eq!(frames.len(), 40, "consumer {i}:\n{text}");
        for (n, l) in frames.iter().enumerate() {
            assert_eq!(
                l.as_str(),
                format!("FRAME {n} device=true ok=true"),
                "consumer {i}:\n{text}"
            );
        }
        assert!(
            out.iter().any(|l| l == "HELD ok=true"),
            "consumer {i}:\n{text}"
        );
        assert!(
            out.iter().any(|l| l.starts_with("WRITE refused=true")),
            "consumer {i}:\n{text}"
        );
    }
    let (status, out) = producer.finish(Duration::from_secs(30));
    assert!(status.success(), "producer:\n{}", out.join("\n"));
}

/// Issue 28: a consumer of a device ring whose producer is killed (-9) keeps the frame it
/// holds readable, and once it lets go its mapping of the ring's GPU memory is gone: the
/// memory comes back (a 4K ring of 8 slots, 66 MiB).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_device_ring_consumer_frees_the_gpu_memory_after_its_producer_is_killed() {
    gpu("a_device_ring_consumer_frees_the_gpu_memory_after_its_producer_is_killed");
    let dir = tmpdir();
    let sock = dir.path().join("dev-kill.sock");
    let s = sock.to_str().unwrap();
    let mut producer = example("device_ring");
    producer.args(["produce", "--socket", s, "--frames", "20"]);
    producer.args(["--width", "3840", "--height", "2160", "--slots", "8"]);
    let mut producer = Proc::spawn(producer, "device ring producer");
    producer.wait_line("READY", Duration::from_secs(30));
    let mut c = example("device_ring");
    c.args(["consume", "--socket", s, "--frames", "20", "--kill-wait"]);
    let mut c = Proc::spawn(c, "device ring consumer");
    c.wait_line("WAITING", Duration::from_secs(60));
    producer.kill9();
    let (status, out) = c.finish(Duration::from_secs(30));
    let text = out.join("\n");
    assert!(status.success(), "{text}");
    assert_eq!(
        out.iter()
            .filter(|l| l.ends_with("device=true ok=true"))
            .count(),
        20,
        "{text}"
    );
    let mem = fields(&out, "MEM ");
    println!("{}", out.last().unwrap());
    assert!(
        num(&mem, "released") >= num(&mem, "holding") + 32.0,
        "the ring's GPU memory stayed allocated after the consumer let go:\n{text}"
    );
}

/// `gpushmsink ring=device` where no GPU can be used (hidden, so that this runs the same on
/// GPU machines) is an error that says why, at the first caps.
#[test]
fn ring_device_without_a_gpu_is_a_clear_error() {
    if !without_gpu("ring_device_without_a_gpu_is_a_clear_error") {
        return;
    }
    init();
    let dir = tmpdir();
    let p = gst::parse::launch(&format!(
        "videotestsrc num-buffers=3 ! video/x-raw,format=GRAY8,width=64,height=48 ! gpushmsink ring=device socket-path={}",
        dir.path().join("nogpu.sock").display()
    ))
    .unwrap();
    p.set_state(gst::State::Playing).unwrap();
    let m = p
        .bus()
        .unwrap()
        .timed_pop_filtered(
            gst::ClockTime::from_seconds(10),
            &[gst::MessageType::Error, gst::MessageType::Eos],
        )
        .expect("an error message");
    let gst::MessageView::Error(err) = m.view() else {
        panic!("no error: {m:?}")
    };
    let text = err.error().to_string();
    assert!(text.contains("ring=device needs a CUDA GPU"), "{text}");
    p.set_state(gst::State::Null).unwrap();
}

/// `gpushmsink ring=device` in one process, `gpushmsrc ! appsink` in another pipeline: the
/// frames went through GPU memory (a device ring: one host-to-device copy in the sink; appsink
/// gets gpushmsrc's zero-copy memory over the ring's GPU memory, copied to the host when it is
/// first mapped) and arrive equal to videotestsrc's, row for row, in system memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpushmsrc_reads_a_sinks_device_ring_into_system_memory() {
    gpu("gpushmsrc_reads_a_sinks_device_ring_into_system_memory");
    let _serial = in_process();
    let dir = tmpdir();
    let sock = dir.path().join("sink-dev.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
         ! gpushmsink ring=device socket-path={} wait-for-connection=true",
        sock.display()
    ))
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    // The ring is in GPU memory: a consumer that did not ask for GPU memory is told so (at
    // once, or when the ring comes if it connected before the caps).
    let refused = gpushm::subscriber::Subscriber::connect(&sock, Default::default())
        .and_then(|mut s| s.next_frame(Some(Duration::from_secs(10))).map(|_| ()));
    let why = refused
        .expect_err("a host-only consumer of a device ring")
        .to_string();
    assert!(why.contains("GPU memory"), "{why}");
    let (frames, _) = run(&format!(
        "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! appsink name=out sync=false max-buffers=0",
        sock.display()
    ));
    let end = producer.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(20),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    producer.set_state(gst::State::Null).unwrap();
    match end.as_ref().map(|m| m.view()) {
        Some(gst::MessageView::Eos(_)) => {}
        Some(gst::MessageView::Error(e)) => panic!("producer: {} {:?}", e.error(), e.debug()),
        _ => panic!("the producer did not finish"),
    }
    assert_eq!(frames.len(), 30);
    assert_same_as_videotestsrc(&frames, "pattern=ball", "NV12", 320, 240);
}

/// Runs `launch` (a producer ending in gpushmsink) until `consumer` (a pipeline with an
/// `appsink name=out`) got its frames and the producer its EOS; checks on the way that the
/// ring is in GPU memory (a consumer that did not ask for GPU memory is told so) and, where
/// `launch` leaves `slots` auto, has 16 slots. Returns the consumer's frames.
fn through_a_device_ring(
    launch: &str,
    sock: &std::path::Path,
    consumer: &str,
) -> (Vec<(gst::Buffer, gst::Caps)>, Vec<gst::Structure>) {
    let (frames, msgs, _) = through_a_device_ring_with_stats(launch, sock, consumer, |_| {});
    (frames, msgs)
}

/// [`through_a_device_ring`], calling `on_sink` with the producer's gpushmsink before it
/// starts, and also returning the sink's `stats` at its EOS.
fn through_a_device_ring_with_stats(
    launch: &str,
    sock: &std::path::Path,
    consumer: &str,
    on_sink: impl FnOnce(&gst::Element),
) -> (
    Vec<(gst::Buffer, gst::Caps)>,
    Vec<gst::Structure>,
    gst::Structure,
) {
    init();
    let producer = gst::parse::launch(launch).unwrap();
    let sink = producer
        .downcast_ref::<gst::Bin>()
        .and_then(|b| b.iterate_sinks().into_iter().flatten().next())
        .expect("the producer's gpushmsink");
    on_sink(&sink);
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(sock, Duration::from_secs(10));
    let refused = gpushm::subscriber::Subscriber::connect(sock, Default::default())
        .and_then(|mut s| s.next_frame(Some(Duration::from_secs(10))).map(|_| ()));
    let sink_caps = producer
        .downcast_ref::<gst::Bin>()
        .and_then(|b| {
            b.iterate_sinks()
                .into_iter()
                .flatten()
                .next()
                .and_then(|s| s.static_pad("sink"))
                .and_then(|p| p.current_caps())
        })
        .map(|c| c.to_string());
    let why = match refused {
        Ok(()) => {
            let bus = producer
                .bus()
                .unwrap()
                .pop_filtered(&[gst::MessageType::Error])
                .map(|m| format!("{m:?}"));
            panic!("the ring is not in GPU memory: the sink has caps {sink_caps:?}; producer error: {bus:?}")
        }
        Err(e) => e.to_string(),
    };
    assert!(
        why.contains("GPU memory"),
        "the ring is not in GPU memory: {why}"
    );
    if !launch.contains("slots=") {
        // slots=0 (auto): a ring in GPU memory gets 16.
        let q = gpushm::subscriber::query(
            &gpushm::names::Endpoint::Path(sock.to_path_buf()),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(q.report.slot_count, 16, "a device ring's auto slot count");
    }
    let (frames, msgs) = run(consumer);
    let end = producer.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    let stats = sink.property::<gst::Structure>("stats");
    producer.set_state(gst::State::Null).unwrap();
    match end.as_ref().map(|m| m.view()) {
        Some(gst::MessageView::Eos(_)) => {}
        Some(gst::MessageView::Error(e)) => panic!("producer: {} {:?}", e.error(), e.debug()),
        _ => panic!("the producer did not finish"),
    }
    (frames, msgs, stats)
}

/// CUDA memory in: `cudaupload ! video/x-raw(memory:CUDAMemory) ! gpushmsink` (ring=auto, the
/// default; without the capsfilter cudaupload passes system memory through) takes
/// video/x-raw(memory:CUDAMemory) into a device ring with one device-to-device copy per frame
/// (no host round trip); gpushmsrc's frames equal videotestsrc's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudaupload_into_gpushmsink_fills_a_device_ring_on_the_gpu() {
    gpu("cudaupload_into_gpushmsink_fills_a_device_ring_on_the_gpu");
    let _serial = in_process();
    let dir = tmpdir();
    let sock = dir.path().join("cuda-in.sock");
    let (frames, _) = through_a_device_ring(
        &format!(
            "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
             ! cudaupload ! video/x-raw(memory:CUDAMemory) ! gpushmsink socket-path={} wait-for-connection=true",
            sock.display()
        ),
        &sock,
        &format!(
            "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! appsink name=out sync=false max-buffers=0",
            sock.display()
        ),
    );
    assert_eq!(frames.len(), 30);
    assert_same_as_videotestsrc(&frames, "pattern=ball", "NV12", 320, 240);
}

/// GST_CUDA_MEMORY_TRANSFER_NEED_DOWNLOAD (gst/cuda/gstcudamemory.h): set while a
/// GstCudaMemory's host copy is stale; mapping it for the CPU downloads the frame and clears
/// it.
const CUDA_NEED_DOWNLOAD: u32 = gst::ffi::GST_MEMORY_FLAG_LAST;

/// GST_CUDA_MEMORY_TRANSFER_NEED_SYNC (gst/cuda/gstcudamemory.h, 1.24+): set while GPU work
/// that wrote a GstCudaMemory may still be queued on its stream; gst_cuda_memory_sync waits
/// for it and clears it.
const CUDA_NEED_SYNC: u32 = gst::ffi::GST_MEMORY_FLAG_LAST << 2;

/// Whether `mem`, a GstCudaMemory, would be downloaded if mapped for the CPU: nothing mapped
/// it so since it was last written on the GPU. (Read raw: gst::MemoryFlags drops the flags
/// of memory types.)
fn stale_on_host(mem: &gst::Memory) -> bool {
    // SAFETY: a live memory's flags, read.
    unsafe { (*mem.as_ptr()).mini_object.flags & CUDA_NEED_DOWNLOAD != 0 }
}

/// Whether writes to `mem`, a GstCudaMemory, may still be queued on its stream.
fn unsynced(mem: &gst::Memory) -> bool {
    // SAFETY: as in stale_on_host.
    unsafe { (*mem.as_ptr()).mini_object.flags & CUDA_NEED_SYNC != 0 }
}

/// Keeps the memory of the last buffer that reaches `element`'s sink pad (only the last: a
/// frame held keeps its slot), to look at once the stream ended.
fn keep_last_memory(element: &gst::Element) -> Arc<Mutex<Option<gst::Memory>>> {
    let last: Arc<Mutex<Option<gst::Memory>>> = Arc::default();
    let l = last.clone();
    element
        .static_pad("sink")
        .unwrap()
        .add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if let Some(b) = info.buffer() {
                // The memory itself, shared (peek_memory's to_owned would copy it).
                *l.lock().unwrap() = (b.n_memory() == 1).then(|| b.memory(0)).flatten();
            }
            gst::PadProbeReturn::Ok
        });
    last
}

/// Runs `chain` (CUDA elements ending in CUDA memory of `format`, after videotestsrc's NV12)
/// into gpushmsink's device ring and checks what the CUDA elements upstream did with the
/// GstCudaBufferPool over the ring's slots that gpushmsink proposed them:
/// - on GStreamer 1.24+ they render into the slots, published without a copy
///   (stats: frames-copied 0);
/// - on 1.22, which cannot wrap device memory, each frame is copied on the GPU as before;
/// - either way the frames equal videotestsrc's, and the sink never maps a frame in CUDA
///   memory for the CPU, which downloads it: the memory's NEED_DOWNLOAD flag, set by its
///   writer, is still set once the sink had it.
fn renders_into_device_ring_slots(name: &str, chain: &str, format: &str) {
    let dir = tmpdir();
    let sock = dir.path().join(format!("{name}.sock"));
    let launch = format!(
        "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
         ! {chain} ! gpushmsink socket-path={} wait-for-connection=true",
        sock.display()
    );
    let mut last = None;
    let (frames, _, stats) = through_a_device_ring_with_stats(
        &launch,
        &sock,
        &format!(
            "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! appsink name=out sync=false max-buffers=0",
            sock.display()
        ),
        |sink| last = Some(keep_last_memory(sink)),
    );
    assert_eq!(frames.len(), 30, "{name}");
    assert_same_as_videotestsrc(&frames, "pattern=ball", format, 320, 240);
    assert_eq!(
        stats.get::<u64>("frames-sent").unwrap(),
        30,
        "{name}: {stats}"
    );
    let copied = stats.get::<u64>("frames-copied").unwrap();
    if wraps_cuda_memory() {
        assert_eq!(copied, 0, "{name}: rendered in place on 1.24+: {stats}");
    } else {
        assert_eq!(copied, 30, "{name}: copied on 1.22: {stats}");
    }
    let mem = last
        .and_then(|l| l.lock().unwrap().take())
        .expect("a frame reached the sink");
    assert!(
        stale_on_host(&mem),
        "{name}: the sink mapped a frame in CUDA memory for the CPU (downloaded it)"
    );
}

/// cudaupload renders into gpushmsink's device-ring slots (see
/// [`renders_into_device_ring_slots`]).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudaupload_renders_into_device_ring_slots() {
    gpu("cudaupload_renders_into_device_ring_slots");
    let _serial = in_process();
    renders_into_device_ring_slots(
        "upload",
        "cudaupload ! video/x-raw(memory:CUDAMemory)",
        "NV12",
    );
}

/// cudaconvert renders into gpushmsink's device-ring slots, on its own CUDA stream (the pool
/// hands it to each slot's memory; the sink waits for it before publishing).
#[test]
#[ignore = "needs a CUDA GPU and GStreamer's cudaconvert (nvcodec registers it only where its NVRTC kernels build: not with CUDA 13, whose NVRTC refuses the architecture GStreamer 1.22-1.26 asks for)"]
fn cudaconvert_renders_into_device_ring_slots() {
    gpu("cudaconvert_renders_into_device_ring_slots");
    let _serial = in_process();
    init();
    assert!(
        gst::ElementFactory::find("cudaconvert").is_some(),
        "cudaconvert is missing: GStreamer's nvcodec registers it only where NVRTC (libnvrtc.so) builds its kernels"
    );
    renders_into_device_ring_slots(
        "convert",
        "cudaupload ! cudaconvert ! video/x-raw(memory:CUDAMemory),format=I420",
        "I420",
    );
}

/// The line from the issue: `nvh264dec ! gpushmsink`, no cudadownload, no capsfilter. The
/// decoded frames stay on the GPU (a device ring) and reach a gpushmsrc consumer equal to
/// a software decoder's, frame for frame.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nvh264dec_into_gpushmsink_decodes_into_a_device_ring() {
    gpu("nvh264dec_into_gpushmsink_decodes_into_a_device_ring");
    let _serial = in_process();
    assert!(
        gst::ElementFactory::find("nvh264dec").is_some(),
        "nvh264dec is missing: carry Debian's libgstnvcodec.so (scripts/device-pack.sh does)"
    );
    let soft = ["avdec_h264", "openh264dec"]
        .into_iter()
        .find(|e| gst::ElementFactory::find(e).is_some())
        .expect("a software H.264 decoder (avdec_h264 or openh264dec)");
    let dir = tmpdir();
    let file = dir.path().join("ball.h264");
    run(&format!(
        "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=I420,width=320,height=240,framerate=30/1 \
         ! x264enc ! video/x-h264,profile=constrained-baseline ! h264parse ! video/x-h264,stream-format=byte-stream,alignment=au ! filesink location={}",
        file.display()
    ));
    let sock = dir.path().join("nvdec.sock");
    let mut last = None;
    let (frames, _, stats) = through_a_device_ring_with_stats(
        &format!(
            "filesrc location={} ! h264parse ! nvh264dec ! gpushmsink socket-path={} wait-for-connection=true",
            file.display(),
            sock.display()
        ),
        &sock,
        &format!(
            "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! videoconvert ! video/x-raw,format=I420 \
             ! appsink name=out sync=false max-buffers=0",
            sock.display()
        ),
        |sink| last = Some(keep_last_memory(sink)),
    );
    // On 1.22 each decoded frame is copied into the ring on the GPU, never through the host
    // (the sink does not map the decoder's memory for the CPU, which would download it). On
    // 1.26 nvh264dec (its defaults) writes into the slots itself, through gpushmsink's CUDA
    // pool, on its own stream: the sink waited for that stream before it published each
    // frame (NEED_SYNC cleared). (1.24, not tested here, may hand its own surfaces instead.)
    let copied = stats.get::<u64>("frames-copied").unwrap();
    let mem = last
        .and_then(|l| l.lock().unwrap().take())
        .expect("a frame reached the sink");
    if gst::version() >= (1, 26, 0, 0) {
        assert_eq!(copied, 0, "nvh264dec renders into the ring: {stats}");
        assert!(
            !unsynced(&mem),
            "a frame was published before the decoder's stream finished writing it"
        );
    } else if !wraps_cuda_memory() {
        assert_eq!(copied, 30, "{stats}");
    }
    assert!(
        stale_on_host(&mem),
        "the sink mapped a decoded frame for the CPU (downloaded it)"
    );
    drop(mem);
    let (reference, _) = run(&format!(
        "filesrc location={} ! h264parse ! {soft} ! videoconvert ! video/x-raw,format=I420 \
         ! appsink name=out sync=false max-buffers=0",
        file.display()
    ));
    assert_eq!(frames.len(), 30);
    assert_same_frames(&frames, &reference);
    // Asked for system memory, nvh264dec hands GstCudaMemory mapped for the CPU: a host ring
    // takes it as system memory.
    let sock = dir.path().join("nvdec-host.sock");
    let producer = gst::parse::launch(&format!(
        "filesrc location={} ! h264parse ! nvh264dec ! video/x-raw ! gpushmsink ring=host socket-path={} wait-for-connection=true",
        file.display(),
        sock.display()
    ))
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    let (host_frames, _) = run(&format!(
        "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! videoconvert ! video/x-raw,format=I420 \
         ! appsink name=out sync=false max-buffers=0",
        sock.display()
    ));
    let end = producer.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    producer.set_state(gst::State::Null).unwrap();
    if let Some(gst::MessageView::Error(e)) = end.as_ref().map(|m| m.view()) {
        panic!("host-ring producer: {} {:?}", e.error(), e.debug());
    }
    assert_same_frames(&host_frames, &reference);
}

/// Whether this GStreamer wraps device memory as CUDA memory (1.24+): gpushmsrc then hands
/// device-ring frames out in place; 1.22 copies them.
fn wraps_cuda_memory() -> bool {
    init();
    gst::version() >= (1, 24, 0, 0)
}

/// How gpushmsrc's frames went out, from the last message of `run`: (wrapped, copied).
fn cuda_out_counts(msgs: &[gst::Structure]) -> (u64, u64) {
    let s = msgs
        .iter()
        .rfind(|m| m.name() == "gpushmsrc")
        .expect("run() reports a gpushmsrc named src");
    (
        s.get("frames-cuda-wrapped").unwrap(),
        s.get("frames-cuda-copied").unwrap(),
    )
}

/// CUDA memory out: a device ring's frames reach `gpushmsrc ! video/x-raw(memory:CUDAMemory)
/// ! cudadownload` in CUDA memory, in the CUDA context the pipeline shares, and equal
/// videotestsrc's. On GStreamer 1.24+ every frame is the ring's GPU memory itself, wrapped
/// (frames-cuda-wrapped); on 1.22 each is copied into a GStreamer CUDA buffer pool
/// (frames-cuda-copied). `gpushmsrc ! cudadownload` without a capsfilter negotiates the same,
/// and an element that takes anything (appsink) still gets system memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpushmsrc_hands_device_ring_frames_to_cuda_elements_in_cuda_memory() {
    gpu("gpushmsrc_hands_device_ring_frames_to_cuda_elements_in_cuda_memory");
    let _serial = in_process();
    let dir = tmpdir();
    let producer = |sock: &std::path::Path| {
        format!(
            "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
             ! cudaupload ! video/x-raw(memory:CUDAMemory) ! gpushmsink socket-path={} wait-for-connection=true",
            sock.display()
        )
    };
    let wraps = wraps_cuda_memory();
    for (i, (consumer, cuda)) in [
        (
            "video/x-raw(memory:CUDAMemory) ! cudadownload ! video/x-raw",
            true,
        ),
        ("cudadownload ! video/x-raw", true),
        ("identity", false),
    ]
    .into_iter()
    .enumerate()
    {
        let sock = dir.path().join(format!("cuda-out-{i}.sock"));
        let (frames, msgs) = through_a_device_ring(
            &producer(&sock),
            &sock,
            &format!(
                "gpushmsrc name=src socket-path={} mode=lossless num-buffers=30 ! {consumer} \
                 ! appsink name=out sync=false max-buffers=0",
                sock.display()
            ),
        );
        assert_eq!(frames.len(), 30, "{consumer}");
        // (Also checks that appsink got system memory.)
        assert_same_as_videotestsrc(&frames, "pattern=ball", "NV12", 320, 240);
        let expected = match (cuda, wraps) {
            (false, _) => (0, 0),
            (true, true) => (30, 0),
            (true, false) => (0, 30),
        };
        assert_eq!(
            cuda_out_counts(&msgs),
            expected,
            "{consumer} (wrapped, copied)"
        );
    }
}

/// GStreamer's CUDA converter reads gpushmsrc's CUDA memory as textures: `gpushmsrc !
/// cudaconvert ! I420` gives the same bytes as converting videotestsrc's frames in one
/// process. 320×240 NV12 frames (planes aligned for textures) are wrapped on 1.24+; 200×120
/// ones (stride 200, not a multiple of the 32-byte pitch alignment) are copied, with a
/// warning, and convert the same. On 1.22 both are copied.
#[test]
#[ignore = "needs a CUDA GPU and GStreamer's cudaconvert (nvcodec registers it only where its NVRTC kernels build: not with CUDA 13, whose NVRTC refuses the architecture GStreamer 1.22-1.26 asks for)"]
fn cudaconvert_reads_gpushmsrc_cuda_memory_in_place() {
    gpu("cudaconvert_reads_gpushmsrc_cuda_memory_in_place");
    let _serial = in_process();
    assert!(
        gst::ElementFactory::find("cudaconvert").is_some(),
        "cudaconvert is missing: GStreamer's nvcodec registers it only where NVRTC (libnvrtc.so) builds its kernels"
    );
    let dir = tmpdir();
    let wraps = wraps_cuda_memory();
    for (w, h, aligned) in [(320, 240, true), (200, 120, false)] {
        let caps = format!("video/x-raw,format=NV12,width={w},height={h},framerate=30/1");
        let convert = "cudaconvert ! video/x-raw(memory:CUDAMemory),format=I420 ! cudadownload \
                       ! video/x-raw,format=I420 ! appsink name=out sync=false max-buffers=0";
        let sock = dir.path().join(format!("convert-{w}.sock"));
        let (frames, msgs) = through_a_device_ring(
            &format!(
                "videotestsrc num-buffers=20 pattern=ball ! {caps} ! cudaupload \
                 ! video/x-raw(memory:CUDAMemory) ! gpushmsink socket-path={} wait-for-connection=true",
                sock.display()
            ),
            &sock,
            &format!(
                "gpushmsrc name=src socket-path={} mode=lossless num-buffers=20 ! {convert}",
                sock.display()
            ),
        );
        let (reference, _) = run(&format!(
            "videotestsrc num-buffers=20 pattern=ball ! {caps} ! cudaupload ! video/x-raw(memory:CUDAMemory) ! {convert}"
        ));
        assert_eq!(frames.len(), 20, "{w}x{h}");
        assert_same_frames(&frames, &reference);
        let expected = if wraps && aligned { (20, 0) } else { (0, 20) };
        assert_eq!(
            cuda_out_counts(&msgs),
            expected,
            "{w}x{h} (wrapped, copied)"
        );
    }
}

/// The GstCudaContext a CUDA element next to `pad` (a pad of it) runs in, from a context
/// query on the pad.
fn cuda_context_of(pad: &gst::Pad) -> gst::Object {
    let mut q = gst::query::Context::new("gst.cuda.context");
    assert!(pad.query(&mut q), "{} answers no context query", pad.name());
    q.context()
        .expect("a context")
        .structure()
        .get::<gst::Object>("gst.cuda.context")
        .expect("a GstCudaContext")
}

/// One CUDA context per process: `cudaupload ! gpushmsink` and `gpushmsrc ! cudadownload` run
/// GStreamer's CUDA elements in the context gpushm itself works in (the GPU's primary context,
/// wrapped), not in one of their own beside it (each costs hundreds of MiB of GPU memory and
/// a few hundred ms to make). The frames still arrive intact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_elements_next_to_gpushm_run_in_its_cuda_context() {
    gpu("cuda_elements_next_to_gpushm_run_in_its_cuda_context");
    let _serial = in_process();
    let dir = tmpdir();
    let sock = dir.path().join("ctx.sock");
    let producer = gst::parse::launch(&format!(
        "videotestsrc num-buffers=30 pattern=ball ! video/x-raw,format=NV12,width=320,height=240,framerate=30/1 \
         ! cudaupload name=up ! video/x-raw(memory:CUDAMemory) ! gpushmsink socket-path={} wait-for-connection=true",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    producer.set_state(gst::State::Playing).unwrap();
    wait_for_path(&sock, Duration::from_secs(10));
    let consumer = gst::parse::launch(&format!(
        "gpushmsrc name=src socket-path={} mode=lossless num-buffers=30 \
         ! video/x-raw(memory:CUDAMemory) ! cudadownload name=dl ! video/x-raw \
         ! appsink name=out sync=false max-buffers=0 wait-on-eos=false",
        sock.display()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    consumer.set_state(gst::State::Playing).unwrap();
    let end = consumer.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    assert!(
        matches!(
            end.as_ref().map(|m| m.view()),
            Some(gst::MessageView::Eos(_))
        ),
        "{end:?}"
    );
    let dev = gstgpushm::cuda::device(0).unwrap();
    let ours = gstgpushm::cuda::gstcuda::process_context(&dev).unwrap();
    let up = producer.by_name("up").unwrap().static_pad("src").unwrap();
    let dl = consumer.by_name("dl").unwrap().static_pad("sink").unwrap();
    assert_eq!(&cuda_context_of(&up), ours.object(), "cudaupload's context");
    assert_eq!(
        &cuda_context_of(&dl),
        ours.object(),
        "cudadownload's context"
    );
    let sink = consumer
        .by_name("out")
        .unwrap()
        .downcast::<gst_app::AppSink>()
        .unwrap();
    let mut frames = Vec::new();
    while let Some(s) = sink.try_pull_sample(gst::ClockTime::ZERO) {
        frames.push((s.buffer_owned().unwrap(), s.caps().unwrap().to_owned()));
    }
    consumer.set_state(gst::State::Null).unwrap();
    producer.set_state(gst::State::Null).unwrap();
    assert_eq!(frames.len(), 30);
    assert_same_as_videotestsrc(&frames, "pattern=ball", "NV12", 320, 240);
}

/// cudasum reads a device ring's frames in place: gpushmsrc hands them zero-copy (a memory
/// over the ring's GPU memory, with its GpuShmCudaMeta), and the sums equal the CPU
/// backend's over the same pictures, frame for frame.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudasum_reads_device_ring_frames_in_place() {
    gpu("cudasum_reads_device_ring_frames_in_place");
    let _serial = in_process();
    let dir = tmpdir();
    let sock = dir.path().join("cudasum-dev.sock");
    let caps = "video/x-raw,format=NV12,width=320,height=240,framerate=30/1";
    let (_, msgs) = through_a_device_ring(
        &format!(
            "videotestsrc num-buffers=30 pattern=ball ! {caps} ! gpushmsink ring=device socket-path={} wait-for-connection=true",
            sock.display()
        ),
        &sock,
        &format!(
            "gpushmsrc socket-path={} mode=lossless num-buffers=30 ! cudasum ! fakesink sync=false",
            sock.display()
        ),
    );
    let (_, reference) = run(&format!(
        "videotestsrc num-buffers=30 pattern=ball ! {caps} ! cudasum backend=cpu ! fakesink"
    ));
    assert_eq!(msgs.len(), 30);
    for (i, (m, r)) in msgs.iter().zip(&reference).enumerate() {
        assert_eq!(
            m.get::<&str>("path").unwrap(),
            "zero-copy",
            "frame {i}: {m}"
        );
        assert_eq!(array(m, "plane-sums"), array(r, "plane-sums"), "frame {i}");
        assert_eq!(
            array(m, "component-sums"),
            array(r, "component-sums"),
            "frame {i}"
        );
    }
}
