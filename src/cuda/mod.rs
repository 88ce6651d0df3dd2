// SPDX-License-Identifier: MPL-2.0
//! The CUDA layer of the elements: the core crate's (`gpushm::cuda`: devices, registration,
//! device rings) and the kernels from `kernels/` that cudasum runs.
//!
//! Nothing here runs at plugin load: libcuda is looked up the first time an element asks for
//! it (NULL→READY), so the plugin loads, and the shm elements work, on machines without it.

pub use gpushm::cuda::*;

pub mod gstcuda;
pub mod kernels;
pub mod nvrtc;
pub mod textures;
