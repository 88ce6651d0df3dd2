// SPDX-License-Identifier: MPL-2.0
//! Errors and the boundary: every call runs in [`guard`], which turns errors and panics into
//! a status and the calling thread's message ([`gpushm_last_error`]).

use super::*;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Set once any thread was given a message: until then, a successful call has none to clear
/// and does not touch its thread-local (a per-frame cost in a library: its thread-locals are
/// reached through the dynamic linker).
pub(crate) static ANY_ERROR: AtomicBool = AtomicBool::new(false);

pub(crate) fn set_error(msg: &str) {
    if msg.is_empty() {
        if !ANY_ERROR.load(Ordering::Relaxed) {
            return;
        }
    } else {
        ANY_ERROR.store(true, Ordering::Relaxed);
    }
    // try_with: a call from a thread-local destructor must not abort.
    let _ = LAST_ERROR.try_with(|e| {
        let mut e = e.borrow_mut();
        // Every successful call clears the message: without allocating when it is clear.
        if msg.is_empty() && e.as_bytes().is_empty() {
            return;
        }
        *e = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    });
}

/// A status and its message.
pub(crate) struct Fail(pub(crate) gpushm_status, pub(crate) String);

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Timeout(_) => GPUSHM_TIMEOUT,
            Error::Interrupted => GPUSHM_INTERRUPTED,
            Error::Disconnected => GPUSHM_ERROR_DISCONNECTED,
            Error::Refused(_) | Error::WrongPeer(_) | Error::Busy(_) => GPUSHM_ERROR_REFUSED,
            Error::Protocol(_) | Error::Corrupt(_) => GPUSHM_ERROR_PROTOCOL,
            Error::Invalid(_) => GPUSHM_ERROR_INVALID_ARGUMENT,
            _ => GPUSHM_ERROR_SYSTEM,
        };
        Fail(code, e.to_string())
    }
}

pub(crate) fn invalid(msg: impl Into<String>) -> Fail {
    Fail(GPUSHM_ERROR_INVALID_ARGUMENT, msg.into())
}

/// Runs `f` at the boundary: its status, its message for gpushm_last_error, panics caught.
#[inline(always)]
pub(crate) fn guard(f: impl FnOnce() -> Result<gpushm_status, Fail>) -> gpushm_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => {
            if code == GPUSHM_OK {
                set_error("");
            }
            code
        }
        Ok(Err(Fail(code, msg))) => {
            set_error(&msg);
            code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_error(&format!("internal error (a bug in gpushm): {what}"));
            GPUSHM_ERROR_INTERNAL
        }
    }
}

#[inline(always)]
pub(crate) fn out_ptr<T>(p: *mut T, what: &str) -> Result<*mut T, Fail> {
    if p.is_null() {
        Err(invalid(format!("{what} is NULL")))
    } else {
        Ok(p)
    }
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn string(s: *const c_char, what: &str) -> Result<String, Fail> {
    if s.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map(str::to_owned)
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

#[inline(always)]
pub(crate) fn timeout(ns: i64) -> Option<Duration> {
    (ns >= 0).then(|| Duration::from_nanos(ns as u64))
}

/// The calling thread's message for the last call that did not return GPUSHM_OK (empty after
/// one that did). Valid until this thread's next gpushm call.
#[no_mangle]
pub extern "C" fn gpushm_last_error() -> *const c_char {
    static GONE: &[u8] = b"(this thread is exiting)\0";
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(GONE.as_ptr() as *const c_char)
}

/// The library's version, "MAJOR.MINOR.PATCH".
#[no_mangle]
pub extern "C" fn gpushm_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}
