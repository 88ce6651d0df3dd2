// SPDX-License-Identifier: MPL-2.0
#![allow(clippy::new_without_default)]
//! gpushm: share live video between processes through a shared-memory ring that CUDA can read
//! in place.

pub mod ring;
