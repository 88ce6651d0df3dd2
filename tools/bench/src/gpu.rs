// SPDX-License-Identifier: MPL-2.0
//! The GPU modes: the consumer runs cudasum (`bench gpu`), and where a frame is read fastest
//! by a CUDA kernel (`bench device-ring`).

use crate::measure::f;
use crate::procs::{run, run_prerendered};

pub fn gpu_mode() {
    println!("\n## GPU: the consumer runs cudasum (4K NV12, producer flat out, pool mode)\n");
    println!("| consumer | delivered fps | cudasum GB/s (median per frame) |");
    println!("|---|---|---|");
    let mut fps = Vec::new();
    for t in ["gpushm", "shm"] {
        let r = run(t, 3840, 2160, 150, 0, false, true);
        fps.push(f(&r.consumer, "fps"));
        let src = if t == "gpushm" { "gpushmsrc" } else { "shmsrc" };
        println!(
            "| {src} ! cudasum | {:.0} | {:.1} |",
            f(&r.consumer, "fps"),
            f(&r.consumer, "gbps")
        );
    }
    // The bus limit in the same run: a plain read kernel over registered host memory.
    if let Ok(dev) = gstgpushm::cuda::device(-1) {
        if let (Ok(mut gpu), Ok(ring)) = (
            gstgpushm::cuda::kernels::GpuSummer::new(&dev),
            gpushm::ring::producer_end::ProducerRing::create(1, 2, 3840 * 2160 * 3 / 2, false),
        ) {
            let (base, len) = ring.mapping();
            // SAFETY: the ring outlives the registration.
            if let Ok(reg) =
                unsafe { gstgpushm::cuda::register::HostRegistration::new(&dev, base, len, false) }
            {
                let d = reg.device_ptr_of(ring.slot_ptr(0)).unwrap_or(0);
                if let Ok(ns) = gpu.time_read(d, 3840 * 2160 * 3 / 2, 20) {
                    println!("\nBus limit (plain read kernel over registered host memory, one 4K frame): {:.1} GB/s on {}", (3840.0 * 2160.0 * 1.5) / ns as f64, dev.name);
                }
            }
        }
    }
    println!(
        "gpushmsrc ! cudasum reaches {:.1}x the fps of shmsrc ! cudasum (videotestsrc producer)",
        fps[0] / fps[1]
    );
    let g = run_prerendered("gpushm", 600, true);
    let s = run_prerendered("shm", 600, true);
    println!(
        "With the pre-rendered producer: {:.0} vs {:.0} fps, {:.1}x (producers: {:.0} / {:.0} fps)",
        f(&g.consumer, "fps"),
        f(&s.consumer, "fps"),
        f(&g.consumer, "fps") / f(&s.consumer, "fps"),
        f(&g.producer, "fps"),
        f(&s.producer, "fps")
    );
}

/// Where a 4K NV12 frame is read fastest by a CUDA kernel: a device ring (GPU memory shared
/// with the CUDA virtual memory API), the host ring registered with CUDA, and plain device
/// memory (the limit), in one process and one run. The cudasum kernel's per-frame time
/// (median of 50) over the frame's bytes, and a plain read kernel's best time.
pub fn device_ring_mode() {
    use gpushm::ring::producer_end::ProducerRing;
    use gstgpushm::cuda::{self, kernels::PlaneJob};
    println!("\n## Reading a 4K NV12 frame on the GPU: device ring, host ring, device memory\n");
    let dev = match cuda::device(-1) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU: {e}");
            return;
        }
    };
    let (w, h) = (3840u32, 2160u32);
    let len = (w * h * 3 / 2) as usize;
    let mut gpu = match cuda::kernels::GpuSummer::new(&dev) {
        Ok(g) => g,
        Err(e) => {
            println!("cudasum kernels: {e}");
            return;
        }
    };
    let jobs = |base: u64| {
        [
            PlaneJob {
                dev_ptr: base,
                stride: w as u64,
                row_bytes: w,
                rows: h,
                channels: 1,
            },
            PlaneJob {
                dev_ptr: base + (w * h) as u64,
                stride: w as u64,
                row_bytes: w,
                rows: h / 2,
                channels: 2,
            },
        ]
    };
    println!("| frame in | cudasum kernel GB/s (median) | plain read kernel GB/s (best) |");
    println!("|---|---|---|");
    let device_ring = ProducerRing::create(1, 2, len as u64, false).and_then(|r| {
        cuda::vmm::place_ring(&r, &dev).map_err(|e| gpushm::Error::Invalid(e.0))?;
        Ok(r)
    });
    let host_ring = ProducerRing::create(1, 2, len as u64, false);
    let plain = gpu.alloc_device(len);
    let mut measure = |what: &str, base: u64| {
        let mut t: Vec<u64> = (0..50)
            .filter_map(|_| gpu.sum(&jobs(base)).ok().map(|r| r.1))
            .collect();
        t.sort_unstable();
        let sum_ns = t.get(t.len() / 2).copied().unwrap_or(0).max(1);
        let read_ns = gpu.time_read(base, len as u64, 20).unwrap_or(0).max(1);
        let (a, b) = (len as f64 / sum_ns as f64, len as f64 / read_ns as f64);
        println!("| {what} | {a:.1} | {b:.1} |");
        (a, b)
    };
    let (mut d, mut hr, mut p) = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0));
    match &device_ring {
        Ok(r) => match cuda::vmm::device_ptr_of_slot(r, 0) {
            Some(ptr) => d = measure("device ring (GPU memory, VMM)", ptr),
            None => println!("| device ring | no device address | |"),
        },
        Err(e) => println!("| device ring | {e} | |"),
    }
    if let Ok(r) = &host_ring {
        let (base, l) = r.mapping();
        // SAFETY: the ring outlives the registration.
        match unsafe { cuda::register::HostRegistration::new(&dev, base, l, false) } {
            Ok(reg) => match reg.device_ptr_of(r.slot_ptr(0)) {
                Some(ptr) => hr = measure("host ring (registered, over the bus)", ptr),
                None => println!("| host ring | no device address | |"),
            },
            Err(e) => println!("| host ring | {e} | |"),
        }
    }
    if let Ok((_buf, ptr)) = &plain {
        p = measure("plain device memory (the limit)", *ptr);
    }
    println!(
        "\nDevice ring: {:.0} % of plain device memory (cudasum kernel), {:.1}x the host ring; on {}",
        d.0 / p.0.max(1e-9) * 100.0,
        d.0 / hr.0.max(1e-9),
        dev.name
    );
}
