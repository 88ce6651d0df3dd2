// SPDX-License-Identifier: MPL-2.0
//! Plugin version info, and kernels/sum.cu built into a fatbin (scripts/build-kernels.sh) when a
//! CUDA toolkit is found. Without
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
    println!("cargo::rustc-check-cfg=cfg(gpushm_prebuilt_fatbin)");
    println!("cargo::rerun-if-changed=kernels/sum.cu");
    println!("cargo::rerun-if-changed=scripts/build-kernels.sh");
    println!("cargo::rerun-if-env-changed=CUDA_PATH");
    println!("cargo::rerun-if-env-changed=GPUSHM_NO_NVCC");
    if std::env::var_os("GPUSHM_NO_NVCC").is_some() {
        return;
    }
    let Some(nvcc) = find_nvcc() else {
        println!("cargo::warning=nvcc not found: kernels will be compiled with NVRTC at run time");
        return;
    };
    // One script builds the fatbin, here and by hand (see its header).
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("sum.fatbin");
    let result = Command::new("sh")
        .arg("scripts/build-kernels.sh")
        .arg(&nvcc)
        .arg(&out)
        .output();
    match result {
        Ok(o) if o.status.success() => {
            let archs = String::from_utf8_lossy(&o.stdout).trim().to_string();
            println!("cargo::rustc-env=GPUSHM_FATBIN_ARCHS={archs}");
            println!("cargo::rustc-cfg=gpushm_prebuilt_fatbin");
        }
        Ok(o) => println!(
            "cargo::warning=nvcc could not build kernels/sum.cu ({}): kernels will be compiled with NVRTC at run time",
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")
        ),
        Err(e) => println!(
            "cargo::warning=cannot run scripts/build-kernels.sh ({e}): kernels will be compiled with NVRTC at run time"
        ),
    }
}
