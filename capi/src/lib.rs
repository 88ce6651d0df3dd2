// SPDX-License-Identifier: MPL-2.0
//! The C API of gpushm (`libgpushm.so`, `gpushm.h`, `gpushm.pc`): a thin layer over the core
//! crate for C, C++ and OpenCV apps.
//!
//! Every function returns a status (`GPUSHM_OK`, a positive outcome such as `GPUSHM_TIMEOUT`,
//! or a negative error) and leaves a message for the calling thread in
//! [`gpushm_last_error`]. No call panics across the boundary (a caught panic is
//! `GPUSHM_ERROR_INTERNAL`). Handles are generation-checked ids, not pointers to memory: a
//! handle used after its destroy call, a NULL handle or one of another kind is
//! `GPUSHM_ERROR_BAD_HANDLE`, never undefined behaviour. The header is generated from this file
//! by cbindgen (`make capi-header`); CI checks it is current.

//!
//! # Safety
//! The contract of every function is the C one, stated once here rather than on each: pointer
//! arguments are NULL (an error code) or point to what their type says, strings are
//! NUL-terminated, buffers are as long as the length passed with them.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("gpushm's C API hands out 64-bit handle ids in pointers: 64-bit targets only");

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use gpushm_core::cpu_latency::CpuLatency;
use gpushm_core::names::Endpoint;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpushm_core::format::{FrameGeometry, FrameLayout, VideoFormat};
use gpushm_core::publisher::{Config, Publisher, Slot};
use gpushm_core::subscriber::{ConnectOptions, Delivery, Frame, Link, Waker};
use gpushm_core::Error;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};

// In the order gpushm.h presents them (cbindgen follows the modules).
mod types;

mod subscriber;

mod frame;

mod publisher;

mod cpu_latency;

mod boundary;

mod handles;

pub use boundary::*;
pub use cpu_latency::*;
pub use frame::*;
use handles::*;
pub use publisher::*;
pub use subscriber::*;
pub use types::*;
