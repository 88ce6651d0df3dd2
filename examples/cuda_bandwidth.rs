// SPDX-License-Identifier: MPL-2.0
//! How fast cudasum's kernel reads frames in place, against the bus limit measured in the same
//! run: a plain read kernel over the same registered host memory.
//!
//!     cargo run --release --example cuda_bandwidth -- [--frames 8] [--iterations 20]
//!
//! The host memory is a real gpushm ring (memfd, page-aligned slots) of 4K NV12 frames,
//! registered once with cuMemHostRegister, exactly as gpushmsrc does. Sums are checked against
//! the CPU. Prints a markdown table.

use gpushm::ring::producer_end::ProducerRing;
use gstgpushm::cuda::kernels::{GpuSummer, PlaneJob};
use gstgpushm::cuda::register::HostRegistration;
use gstgpushm::sum_planes as sp;

fn main() {
    let mut frames = 8u32;
    let mut iterations = 20u32;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().and_then(|v| v.parse().ok());
        match (k.as_str(), v) {
            ("--frames", Some(v)) => frames = v,
            ("--iterations", Some(v)) => iterations = v,
            _ => {
                eprintln!("usage: cuda_bandwidth [--frames N] [--iterations N]");
                std::process::exit(2);
            }
        }
    }
    gst::init().expect("gst::init");
    let dev = match gstgpushm::cuda::device(-1) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuda_bandwidth: {e}");
            std::process::exit(2);
        }
    };
    let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, 3840, 2160)
        .build()
        .expect("info");
    let size = info.size();
    let ring = ProducerRing::create(1, frames, size as u64, false).expect("ring");
    for s in 0..frames {
        let p = ring.slot_ptr(s);
        for i in 0..size {
            // SAFETY: inside slot s, which this process owns.
            unsafe { *p.add(i) = (i as u32).wrapping_mul(2654435761).wrapping_add(s) as u8 };
        }
    }
    let (base, len) = ring.mapping();
    // SAFETY: the ring outlives the registration (dropped first below).
    let reg = unsafe { HostRegistration::new(&dev, base, len, false) }.expect("cuMemHostRegister");
    let mut gpu = GpuSummer::new(&dev).expect("kernels");
    let planes = sp::planes(&info, None, size).expect("planes");
    let jobs = |base: u64| -> Vec<PlaneJob> {
        planes
            .iter()
            .map(|p| PlaneJob {
                dev_ptr: base + p.offset as u64,
                stride: p.stride as u64,
                row_bytes: p.row_bytes as u32,
                rows: p.rows as u32,
                channels: p.channels as u32,
            })
            .collect()
    };
    let bytes: u64 = planes.iter().map(|p| (p.row_bytes * p.rows) as u64).sum();
    let gbps = |b: u64, ns: u64| b as f64 / ns.max(1) as f64;

    // Bus limit: the plain read kernel over one frame, and over the whole ring.
    let slot0 = reg
        .device_ptr_of(ring.slot_ptr(0))
        .expect("slot 0 registered");
    let read_frame = gpu.time_read(slot0, size as u64, iterations).expect("read");
    let data_len = ring.slot_size() * frames as u64;
    let read_ring = gpu.time_read(slot0, data_len, iterations).expect("read");

    // cudasum's kernel over every frame, in place; sums checked against the CPU.
    let mut best = u64::MAX;
    let mut mismatches = 0;
    for _ in 0..iterations {
        for s in 0..frames {
            let d = reg.device_ptr_of(ring.slot_ptr(s)).expect("registered");
            let (sums, ns) = gpu.sum(&jobs(d)).expect("sum");
            best = best.min(ns);
            // SAFETY: slot s is mapped and holds `size` bytes.
            let host = unsafe { std::slice::from_raw_parts(ring.slot_ptr(s), size) };
            if sums != sp::cpu_sums(host, &planes) {
                mismatches += 1;
            }
        }
    }

    // The same two kernels over device memory, for reference.
    let (_dbuf, dptr) = gpu.alloc_device(size).expect("device memory");
    let read_dev = gpu.time_read(dptr, size as u64, iterations).expect("read");
    let mut best_dev = u64::MAX;
    for _ in 0..iterations {
        best_dev = best_dev.min(gpu.sum(&jobs(dptr)).expect("sum").1);
    }
    drop(reg);

    println!("GPU: {dev:?}, kernels from {}", gpu.kernel_origin());
    println!(
        "4K NV12 frame: {bytes} bytes; best of {iterations} runs; {frames} frames in the ring\n"
    );
    println!("| kernel | memory | GB/s |");
    println!("|---|---|---|");
    println!(
        "| plain read (bus limit) | registered host, one frame | {:.1} |",
        gbps(size as u64, read_frame)
    );
    println!(
        "| plain read (bus limit) | registered host, whole ring ({} MiB) | {:.1} |",
        data_len >> 20,
        gbps(data_len, read_ring)
    );
    println!(
        "| cudasum (gpushm_sum_plane) | registered host, one frame | {:.1} |",
        gbps(bytes, best)
    );
    println!(
        "| plain read | device | {:.1} |",
        gbps(size as u64, read_dev)
    );
    println!(
        "| cudasum (gpushm_sum_plane) | device | {:.1} |",
        gbps(bytes, best_dev)
    );
    println!(
        "\ncudasum reaches {:.0} % of the bus limit for the same frame; sums checked against the CPU: {} mismatches",
        100.0 * gbps(bytes, best) / gbps(size as u64, read_frame),
        mismatches
    );
    println!(
        "BANDWIDTH sum_gbps={:.2} bus_gbps={:.2} ring_gbps={:.2} mismatches={mismatches}",
        gbps(bytes, best),
        gbps(size as u64, read_frame),
        gbps(data_len, read_ring)
    );
    if mismatches > 0 {
        std::process::exit(1);
    }
}
