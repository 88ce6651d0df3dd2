// SPDX-License-Identifier: MPL-2.0
//! Plugin version info, and kernels/*.cu compiled to PTX when a CUDA toolkit is found. Without
//! nvcc the build still succeeds: the source is embedded and compiled with NVRTC at run time.
use std::path::{Path, PathBuf};
use std::process::Command;

fn find_nvcc() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("CUDA_PATH") {
        candidates.push(Path::new(&p).join("bin/nvcc"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn main() {
    gst_plugin_version_helper::info();
    println!("cargo::rustc-check-cfg=cfg(gpushm_prebuilt_ptx)");
    println!("cargo::rerun-if-changed=kernels/sum.cu");
    println!("cargo::rerun-if-env-changed=CUDA_PATH");
    println!("cargo::rerun-if-env-changed=GPUSHM_NO_NVCC");
    if std::env::var_os("GPUSHM_NO_NVCC").is_some() {
        return;
    }
    let Some(nvcc) = find_nvcc() else {
        println!("cargo::warning=nvcc not found: kernels will be compiled with NVRTC at run time");
        return;
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("sum.ptx");
    // compute_72 PTX JITs on Jetson Xavier, Orin and every newer GPU; CUDA 13 dropped it, so
    // fall back to compute_75 there.
    for arch in ["compute_72", "compute_75"] {
        let ok = Command::new(&nvcc)
            .args([
                "-ptx",
                "-O3",
                &format!("-arch={arch}"),
                "kernels/sum.cu",
                "-o",
            ])
            .arg(&out)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            println!("cargo::rustc-cfg=gpushm_prebuilt_ptx");
            return;
        }
    }
    println!("cargo::warning=nvcc could not compile kernels/sum.cu: kernels will be compiled with NVRTC at run time");
}
