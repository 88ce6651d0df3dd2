// SPDX-License-Identifier: MPL-2.0
//! Test tool (tests/gpu.rs reads its output; see examples/ for code to copy): a producer whose
//! ring is in GPU memory, and a consumer that maps it.
//!
//!     device_ring produce --socket /tmp/dev --frames 30 [--width 640 --height 480] [--slots 4] [--clients 1]
//!     device_ring consume --socket /tmp/dev --frames 30 [--host-only] [--kill-wait]
//!
//! The producer serves GRAY8 frames of the gpushm test pattern (row y of frame n holds
//! `pattern_value(n, 0, y)`), written into GPU memory, once `--clients` consumers are connected; it prints
//! `READY` when it listens and `SENT n` at the end.
//! The consumer asks for GPU memory (unless --host-only) and prints, per frame,
//! `FRAME n device=<bool> ok=<bool>` (the bytes copied back from the GPU against the pattern,
//! and plane sums of a CUDA kernel reading the frame in place against the CPU's), then
//! `HELD ok=<bool>` (the first frame, kept while the others went round the ring, unchanged),
//! `WRITE refused=<bool> (<driver result>)` (a write through its mapping), `MEM before=..
//! mapped=.. holding=.. released=..` (free GPU memory in MiB: before connecting, while
//! connected, at the end still holding a frame, and once every frame and the subscriber are
//! dropped; with --kill-wait the end is when the producer has gone away, the test kills it).
//! `ERROR <message>` when connecting fails.

use std::time::{Duration, Instant};

use gpushm::format::{pattern_value, FrameLayout, VideoFormat};
use gpushm::publisher::{Config, Publisher};
use gpushm::subscriber::{ConnectOptions, Subscriber};
use gstgpushm::cuda;

fn arg(args: &[String], k: &str) -> Option<String> {
    args.iter()
        .position(|a| a == k)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn num(args: &[String], k: &str, d: u64) -> u64 {
    arg(args, k).and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn free_mib() -> u64 {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; a context is current (cuda::device bound one).
    unsafe { cudarc::driver::sys::cuMemGetInfo_v2(&mut free, &mut total) };
    free as u64 >> 20
}

fn produce(args: &[String], socket: &str) -> Result<(), String> {
    let (w, h) = (
        num(args, "--width", 640) as u32,
        num(args, "--height", 480) as u32,
    );
    let frames = num(args, "--frames", 30);
    let layout = FrameLayout::new(VideoFormat::Gray8, w, h).ok_or("bad size")?;
    let dev = cuda::device(num(args, "--gpu", 0) as i32).map_err(|e| e.to_string())?;
    let publisher = Publisher::new_on_device(
        socket.as_ref(),
        layout.clone(),
        (30, 1),
        num(args, "--slots", 4) as u32,
        Config::default(),
        dev,
    )
    .map_err(|e| e.to_string())?;
    println!("READY");
    let deadline = Instant::now() + Duration::from_secs(30);
    while publisher.num_clients() < num(args, "--clients", 1) as usize {
        if Instant::now() > deadline {
            return Err("no consumer came".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let stride = layout.planes[0].stride as usize;
    let mut frame = vec![0u8; layout.size as usize];
    for n in 0..frames {
        for (y, row) in frame.chunks_mut(stride).enumerate() {
            row.fill(pattern_value(n, 0, y));
        }
        let mut lease = publisher
            .acquire(Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        if !lease.is_on_device() || !lease.bytes_mut().is_empty() {
            return Err("the slot is not in GPU memory".into());
        }
        lease.fill_from_host(&frame).map_err(|e| e.to_string())?;
        publisher.publish(lease, None).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("SENT {frames}");
    publisher.send_eos();
    // Until the consumer is done (or 30 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    while publisher.num_clients() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn consume(args: &[String], socket: &str) -> Result<(), String> {
    let frames = num(args, "--frames", 30);
    let dev = cuda::device(0).map_err(|e| e.to_string())?;
    dev.ctx.bind_to_thread().map_err(|e| e.to_string())?;
    // Kernels are compiled before connecting: a lossless consumer that takes no frame for a
    // frame's duration is marked lagging.
    let mut summer = cuda::kernels::GpuSummer::new(&dev).map_err(|e| e.to_string())?;
    let before = free_mib();
    let opts = ConnectOptions {
        device_memory: !args.iter().any(|a| a == "--host-only"),
        mode: gpushm::policy::Delivery::Lossless,
        timeout: Duration::from_secs(20),
        name: "device_ring".into(),
        ..Default::default()
    };
    let mut sub = match Subscriber::connect(socket.as_ref(), opts) {
        Ok(s) => s,
        Err(e) => {
            println!("ERROR {e}");
            return Ok(());
        }
    };
    let mut held = None;
    let mut mapped = 0;
    for _ in 0..frames {
        let f = match sub.next_frame(Some(Duration::from_secs(10))) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                println!("ERROR {e}");
                return Ok(());
            }
        };
        let n = f.meta.offset;
        let g = f.layout()?;
        let p = &g.planes[0];
        let bytes = f.to_vec();
        let mut ok = bytes.len() == g.size as usize;
        let mut cpu_sum = 0u64;
        for y in 0..p.rows as usize {
            let row = &bytes[y * p.stride as usize..][..p.row_bytes as usize];
            ok &= row.iter().all(|&b| b == pattern_value(n, 0, y));
            cpu_sum += row.iter().map(|&b| b as u64).sum::<u64>();
        }
        // A CUDA kernel reads the frame where it is.
        let (ptr, _) = f.device_ptr().ok_or("no device address")?;
        let (sums, _) = summer
            .sum(&[cuda::kernels::PlaneJob {
                dev_ptr: ptr + p.offset,
                stride: p.stride as u64,
                row_bytes: p.row_bytes,
                rows: p.rows,
                channels: 1,
            }])
            .map_err(|e| e.to_string())?;
        ok &= sums[0][0] == cpu_sum;
        println!("FRAME {n} device={} ok={ok}", f.is_on_device());
        mapped = free_mib();
        if held.is_none() {
            held = Some((f, bytes));
        }
    }
    if let Some((f, first)) = &held {
        println!("HELD ok={}", f.to_vec() == *first);
        let (ptr, _) = f.device_ptr().ok_or("no device address")?;
        dev.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: a one-byte write the driver must refuse (the mapping is read-only); if it
        // did not, it lands in a slot of this consumer's own frame.
        let r = unsafe { cudarc::driver::sys::cuMemsetD8_v2(ptr, 0xAB, 1) };
        let sync = unsafe { cudarc::driver::sys::cuCtxSynchronize() };
        println!(
            "WRITE refused={} ({r:?}, {sync:?})",
            r != cudarc::driver::sys::CUresult::CUDA_SUCCESS
                || sync != cudarc::driver::sys::CUresult::CUDA_SUCCESS
        );
    }
    let mut kept = None;
    if args.iter().any(|a| a == "--kill-wait") {
        println!("WAITING");
        // Until the producer is gone (the test kills it), keeping a frame: its GPU memory
        // stays mapped here until we let go.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match sub.next_frame(Some(Duration::from_millis(200))) {
                Ok(Some(f)) => kept = Some(f),
                Ok(None) | Err(_) => break,
            }
            if Instant::now() > deadline {
                break;
            }
        }
        if kept.is_none() {
            kept = held.map(|h| h.0);
        }
    } else {
        drop(held);
    }
    std::thread::sleep(Duration::from_millis(200));
    dev.ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let holding = free_mib();
    drop(kept);
    drop(sub);
    drop(summer);
    std::thread::sleep(Duration::from_millis(200));
    dev.ctx.bind_to_thread().map_err(|e| e.to_string())?;
    println!(
        "MEM before={before} mapped={mapped} holding={holding} released={}",
        free_mib()
    );
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(socket) = arg(&args, "--socket") else {
        eprintln!("device_ring: --socket PATH is required");
        std::process::exit(2);
    };
    let r = match args.get(1).map(String::as_str) {
        Some("produce") => produce(&args, &socket),
        Some("consume") => consume(&args, &socket),
        _ => Err("produce or consume".into()),
    };
    if let Err(e) = r {
        println!("ERROR {e}");
        std::process::exit(1);
    }
}
