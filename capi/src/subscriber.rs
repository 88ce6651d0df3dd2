// SPDX-License-Identifier: MPL-2.0
//! Subscribers: `gpushm_subscriber_*`, over the core's [`Link`] (reconnecting when asked).

use super::*;

pub(crate) struct SubObj {
    pub(crate) reconnect: bool,
    /// Interrupts a wait (its connection's too).
    pub(crate) waker: Waker,
    /// Destroyed: waits end, and no new one starts.
    pub(crate) closed: AtomicBool,
    pub(crate) conn: Mutex<ConnState>,
    /// What `gpushm_subscriber_fd` returns: readable when the connection's descriptors are
    /// (once that fd was asked for), or when `retry` fires (no connection: the next call
    /// connects again).
    pub(crate) epoll: Epoll,
    /// Armed every [`RETRY`] while the producer is gone (reconnect on).
    pub(crate) retry: TimerFd,
}

/// How often a subscriber with no producer (reconnect on) makes its fd readable.
pub(crate) const RETRY: Duration = Duration::from_millis(100);

pub(crate) struct ConnState {
    /// The connection (none after the producer went away, until it is reconnected).
    pub(crate) link: Link,
    /// The connection's descriptors in the epoll set (removed before it is dropped: a
    /// connection whose frames are still held keeps its socket open).
    pub(crate) watched: Vec<RawFd>,
    /// gpushm_subscriber_fd was called: watch every connection's descriptors. (Until then
    /// the producer is not asked to ring the frame doorbell for us.)
    pub(crate) watching: bool,
    /// The last frames' caps and layout, and their [`Shape`] (see [`shape`]).
    pub(crate) shape: Option<(ShapeKey, Arc<Shape>)>,
}

impl SubObj {
    #[inline(always)]
    pub(crate) fn watch(&self, st: &mut ConnState) -> Result<(), Fail> {
        if st.link.current().is_none() || !st.watching || !st.watched.is_empty() {
            return Ok(());
        }
        self.add_watches(st)
    }

    /// Puts the connection's descriptors in the epoll set (once per connection).
    #[cold]
    #[inline(never)]
    pub(crate) fn add_watches(&self, st: &mut ConnState) -> Result<(), Fail> {
        let Some(sub) = st.link.current() else {
            return Ok(());
        };
        for fd in sub.poll_fds() {
            // SAFETY: the subscriber keeps `fd` open while it lives; unwatch() removes it
            // before the subscriber goes.
            let b = unsafe { BorrowedFd::borrow_raw(fd) };
            self.epoll
                .add(b, EpollEvent::new(EpollFlags::EPOLLIN, fd as u64))
                .map_err(|e| Fail(GPUSHM_ERROR_SYSTEM, format!("epoll_ctl: {e}")))?;
            st.watched.push(fd);
        }
        Ok(())
    }

    /// Drops the connection, its descriptors out of the epoll set first, and arms the retry
    /// timer.
    pub(crate) fn disconnect(&self, st: &mut ConnState) {
        for fd in st.watched.drain(..) {
            // SAFETY: still open: the subscriber holding it is dropped below.
            let _ = self.epoll.delete(unsafe { BorrowedFd::borrow_raw(fd) });
        }
        st.link.lost(None);
        let _ = self.retry.set(
            Expiration::Interval(TimeSpec::from_duration(RETRY)),
            TimerSetTimeFlags::empty(),
        );
    }

    /// The producer went away: connects again (reconnect is on). Out of the frame's way.
    #[cold]
    #[inline(never)]
    pub(crate) fn reconnect(
        &self,
        st: &mut ConnState,
        deadline: Option<Instant>,
    ) -> Result<(), Fail> {
        let _ = self.retry.wait();
        let limit = st.link.options().timeout;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match st.link.connect(Some(left.map_or(limit, |l| l.min(limit)))) {
            Ok(()) => {}
            Err(Error::Interrupted) => {
                // connect does not take the wake-up back: the next wait must block.
                self.waker.clear();
                return Err(Fail(GPUSHM_INTERRUPTED, "interrupted".into()));
            }
            Err(Error::Timeout(_))
                if deadline.is_some_and(|d| Instant::now() >= d)
                    && st.link.gone_since().is_some_and(|g| g.elapsed() < limit) =>
            {
                return Err(Fail(
                    GPUSHM_TIMEOUT,
                    "no producer came back within the timeout".into(),
                ))
            }
            Err(Error::Timeout(_)) => {
                return Err(Fail(
                    GPUSHM_ERROR_DISCONNECTED,
                    format!(
                        "the producer went away and none came back within connect_timeout_ns at {}",
                        st.link.endpoint()
                    ),
                ))
            }
            Err(e) => return Err(e.into()),
        }
        let _ = self.retry.unset();
        Ok(())
    }

    #[inline(always)]
    pub(crate) fn closed(&self) -> Result<(), Fail> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Fail(
                GPUSHM_INTERRUPTED,
                "the subscriber was destroyed".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for SubObj {
    fn drop(&mut self) {
        let st = self.conn.get_mut().unwrap_or_else(|e| e.into_inner());
        for fd in st.watched.drain(..) {
            // SAFETY: still open: the subscriber is dropped after this.
            let _ = self.epoll.delete(unsafe { BorrowedFd::borrow_raw(fd) });
        }
    }
}

/// Fills `opts` with the defaults: auto delivery, 5 s to connect, producers of this user (or
/// root) only, no reconnect, host memory only, no name.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_options_init(
    opts: *mut gpushm_subscriber_options,
) -> gpushm_status {
    guard(|| {
        let o = out_ptr(opts, "opts")?;
        // SAFETY: checked non-NULL; the caller's struct.
        unsafe {
            o.write(gpushm_subscriber_options {
                mode: 0,
                connect_timeout_ns: 5_000_000_000,
                producer_uid: -1,
                reconnect: 0,
                device_memory: 0,
                name: std::ptr::null(),
                spin_us: 0,
            })
        };
        Ok(GPUSHM_OK)
    })
}

/// Connects to the producer serving `path` (waiting up to `opts->connect_timeout_ns` for one to
/// appear; NULL `opts`: the defaults). On success `*out` is a subscriber to destroy with
/// `gpushm_subscriber_destroy`. GPUSHM_TIMEOUT when no producer came.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_open(
    path: *const c_char,
    opts: *const gpushm_subscriber_options,
    out: *mut *mut gpushm_subscriber,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let path = PathBuf::from(unsafe { string(path, "path") }?);
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_subscriber(Endpoint::Path(path), opts, out) }
    })
}

/// Connects like `gpushm_subscriber_open` to the producer of stream `name` (gpushmsink
/// stream=NAME, `gpushm_publisher_open_stream`): found in $GPUSHM_RUNTIME_DIR if set, else in
/// this user's directory ($XDG_RUNTIME_DIR/gpushm, or /tmp/gpushm-UID) and then /run/gpushm,
/// looked up again at each attempt while waiting. GPUSHM_ERROR_INVALID for a name that is not
/// 1 to 64 letters, digits and . _ - @ + : (not starting with . or -).
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_open_stream(
    name: *const c_char,
    opts: *const gpushm_subscriber_options,
    out: *mut *mut gpushm_subscriber,
) -> gpushm_status {
    guard(|| {
        // SAFETY: the caller passes a string.
        let name = unsafe { string(name, "name") }?;
        gpushm_core::names::check_name(&name)?;
        // SAFETY: the caller's pointers, as documented.
        unsafe { open_subscriber(Endpoint::Stream(name), opts, out) }
    })
}

/// # Safety
/// `opts` is NULL or the caller's initialised struct; `out` is NULL or writable.
pub(crate) unsafe fn open_subscriber(
    endpoint: Endpoint,
    opts: *const gpushm_subscriber_options,
    out: *mut *mut gpushm_subscriber,
) -> Result<gpushm_status, Fail> {
    {
        let out = out_ptr(out, "out")?;
        let mut o = ConnectOptions::default();
        let mut reconnect = false;
        if !opts.is_null() {
            // SAFETY: non-NULL, the caller's initialised struct.
            let opts = unsafe { &*opts };
            o.mode = match opts.mode {
                0 => Delivery::Auto,
                1 => Delivery::Lossless,
                2 => Delivery::Leaky,
                m => {
                    return Err(invalid(format!(
                        "mode {m}: 0 (auto), 1 (lossless) or 2 (leaky)"
                    )))
                }
            };
            o.timeout = Duration::from_nanos(opts.connect_timeout_ns.max(0) as u64);
            o.producer_uid = match opts.producer_uid {
                -1 => None,
                u if (0..=u32::MAX as i64).contains(&u) => Some(u as u32),
                u => return Err(invalid(format!("producer_uid {u}: a user id, or -1"))),
            };
            reconnect = opts.reconnect != 0;
            o.device_memory = opts.device_memory != 0;
            // Checked when connecting (at most gpushm::policy::MAX_SPIN).
            o.spin = Duration::from_micros(opts.spin_us.into());
            if !opts.name.is_null() {
                // SAFETY: non-NULL, the caller's string.
                o.name = unsafe { string(opts.name, "name") }?;
            }
        }
        let waker = Waker::new()?;
        let mut link = Link::new(endpoint, o, waker.clone());
        link.connect(None)?;
        let sys = |what: &str, e: nix::Error| Fail(GPUSHM_ERROR_SYSTEM, format!("{what}: {e}"));
        let epoll =
            Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(|e| sys("epoll_create", e))?;
        let retry = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_CLOEXEC | TimerFlags::TFD_NONBLOCK,
        )
        .map_err(|e| sys("timerfd_create", e))?;
        epoll
            .add(
                retry.as_fd(),
                EpollEvent::new(EpollFlags::EPOLLIN, u64::MAX),
            )
            .map_err(|e| sys("epoll_ctl", e))?;
        let obj = SubObj {
            reconnect,
            waker,
            closed: AtomicBool::new(false),
            conn: Mutex::new(ConnState {
                link,
                watched: Vec::new(),
                watching: false,
                shape: None,
            }),
            epoll,
            retry,
        };
        let id = insert(&SUBSCRIBERS, Arc::new(obj))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(id as *mut gpushm_subscriber) };
        Ok(GPUSHM_OK)
    }
}

/// Waits up to `timeout_ns` (negative: as long as it takes; 0: only looks) for the next
/// frame. GPUSHM_OK: `*frame` is a frame to release and destroy. GPUSHM_TIMEOUT: none came
/// (with 0, also when another thread is waiting on this subscriber). GPUSHM_EOS: the stream
/// ended. GPUSHM_INTERRUPTED: `gpushm_subscriber_interrupt` was called, or the subscriber
/// destroyed. Calls on one subscriber from several threads take turns.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_subscriber_next_frame(
    sub: *mut gpushm_subscriber,
    timeout_ns: i64,
    frame: *mut *mut gpushm_frame,
) -> gpushm_status {
    // SAFETY: the caller's pointers, as documented.
    guard(|| unsafe { next_frame(sub, timeout_ns, frame, None) })
}

/// `gpushm_subscriber_next_frame` and `gpushm_frame_get_info` in one call: on GPUSHM_OK,
/// `*frame` is the frame (to release and destroy) and `*info` describes it. One handle
/// lookup less per frame: the way to take frames where every microsecond counts.
#[no_mangle]
#[link_section = ".text.hot.gpushm"]
pub unsafe extern "C" fn gpushm_subscriber_next_frame_info(
    sub: *mut gpushm_subscriber,
    timeout_ns: i64,
    frame: *mut *mut gpushm_frame,
    info: *mut gpushm_frame_info,
) -> gpushm_status {
    guard(|| {
        let info = out_ptr(info, "info")?;
        // SAFETY: the caller's pointers, as documented.
        unsafe { next_frame(sub, timeout_ns, frame, Some(info)) }
    })
}

/// # Safety
/// `frame` and `info` are NULL or writable; `sub` is any value.
#[link_section = ".text.hot.gpushm"]
pub(crate) unsafe fn next_frame(
    sub: *mut gpushm_subscriber,
    timeout_ns: i64,
    frame: *mut *mut gpushm_frame,
    info: Option<*mut gpushm_frame_info>,
) -> Result<gpushm_status, Fail> {
    {
        let out = out_ptr(frame, "frame")?;
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        s.closed()?;
        let deadline = timeout(timeout_ns).and_then(|t| Instant::now().checked_add(t));
        let mut st = if timeout_ns == 0 {
            match s.conn.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(Fail(
                        GPUSHM_TIMEOUT,
                        "another thread is waiting on this subscriber".into(),
                    ))
                }
            }
        } else {
            lock(&s.conn)
        };
        loop {
            s.closed()?;
            if st.link.current().is_none() {
                s.reconnect(&mut st, deadline)?;
            }
            s.watch(&mut st)?;
            let Some(c) = st.link.current_mut() else {
                return Err(Fail(GPUSHM_ERROR_DISCONNECTED, "not connected".into()));
            };
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            match c.next_frame(left) {
                Ok(Some(f)) => {
                    let shape = shape(&f, &mut st.shape);
                    if let Some(info) = info {
                        // SAFETY: checked non-NULL by the caller. Described before the frame
                        // moves into its object: its pointers are into the mapping, not into
                        // the Frame.
                        unsafe { describe_frame(&shape, &f, info) };
                    }
                    // A frame object kept from an earlier frame, filled outside the table's
                    // lock (it frees the shape it held, or allocates).
                    let spare = lock(&FRAMES).spare.pop();
                    let obj = match spare {
                        Some(mut obj) => match Arc::get_mut(&mut obj) {
                            // Only the table held it (a spare is unique).
                            Some(o) => {
                                *o.frame.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(f);
                                o.shape = shape;
                                obj
                            }
                            None => Arc::new(FrameObj {
                                frame: Mutex::new(Some(f)),
                                shape,
                            }),
                        },
                        None => Arc::new(FrameObj {
                            frame: Mutex::new(Some(f)),
                            shape,
                        }),
                    };
                    let id = insert(&FRAMES, obj)?;
                    // SAFETY: checked non-NULL.
                    unsafe { out.write(id as *mut gpushm_frame) };
                    return Ok(GPUSHM_OK);
                }
                Ok(None) => {
                    set_error("the producer ended the stream");
                    return Ok(GPUSHM_EOS);
                }
                Err(Error::Disconnected) if s.reconnect => s.disconnect(&mut st),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// A descriptor to wait on with poll/epoll/select (or an event loop such as a ROS executor)
/// instead of blocking in `gpushm_subscriber_next_frame`: it is readable when a frame (or
/// EOS, or news from the producer) may be there; then call `gpushm_subscriber_next_frame` with
/// a timeout of 0. It belongs to the subscriber: do not close it. (From the first call on, the
/// producer rings a doorbell for each frame, which a blocking user does not need.) Ask for it
/// before another thread waits on the subscriber: this call waits while one does.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_fd(
    sub: *mut gpushm_subscriber,
    fd: *mut c_int,
) -> gpushm_status {
    guard(|| {
        let out = out_ptr(fd, "fd")?;
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        {
            let mut st = lock(&s.conn);
            st.watching = true;
            s.watch(&mut st)?;
        }
        let raw: RawFd = s.epoll.0.as_raw_fd();
        // SAFETY: checked non-NULL.
        unsafe { out.write(raw) };
        Ok(GPUSHM_OK)
    })
}

/// How the low-latency mode (`spin_us`) fares on the current connection: frames that came
/// while the ring was polled (`caught`, each saved a wake-up) and polls that ended without one
/// (`missed`, each cost its budget). Both 0 without the mode, before the first frame and after
/// a reconnect. Misses that grow with every frame mean the producer jitters more than the
/// budget covers. Like `gpushm_subscriber_fd`, it waits while another thread waits on the
/// subscriber.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_spin_stats(
    sub: *mut gpushm_subscriber,
    caught: *mut u64,
    missed: *mut u64,
) -> gpushm_status {
    guard(|| {
        let caught = out_ptr(caught, "caught")?;
        let missed = out_ptr(missed, "missed")?;
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        let st = lock(&s.conn)
            .link
            .current()
            .map(|c| c.spin_stats())
            .unwrap_or_default();
        // SAFETY: both checked non-NULL.
        unsafe {
            caught.write(st.caught);
            missed.write(st.missed);
        }
        Ok(GPUSHM_OK)
    })
}

/// Makes a `gpushm_subscriber_next_frame` waiting on this subscriber (in another thread)
/// return GPUSHM_INTERRUPTED now (or the next one, if none waits).
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_interrupt(sub: *mut gpushm_subscriber) -> gpushm_status {
    guard(|| {
        get(&SUBSCRIBERS, sub as _, "subscriber")?.waker.wake();
        Ok(GPUSHM_OK)
    })
}

/// The producer's caps (a GStreamer caps string), copied into `buf` (`len` bytes, with the
/// terminating NUL; truncated if longer). `*needed` (if not NULL) gets the length with NUL.
/// Waits while another thread waits for a frame on this subscriber.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_caps(
    sub: *mut gpushm_subscriber,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> gpushm_status {
    guard(|| {
        let s = get(&SUBSCRIBERS, sub as _, "subscriber")?;
        let caps = lock(&s.conn)
            .link
            .current()
            .and_then(|c| c.caps())
            .map(|c| c.to_string())
            .unwrap_or_default();
        // SAFETY: the caller's buffer of `len` bytes, or NULL.
        unsafe { copy_string(&caps, buf, len, needed) }
    })
}

/// Closes the connection and frees the subscriber. Frames it gave stay valid until released.
/// Every `gpushm_subscriber_next_frame` waiting on it in other threads returns
/// GPUSHM_INTERRUPTED.
#[no_mangle]
pub unsafe extern "C" fn gpushm_subscriber_destroy(sub: *mut gpushm_subscriber) -> gpushm_status {
    guard(|| {
        let s = lock(&SUBSCRIBERS)
            .remove(sub as u64)
            .ok_or_else(|| bad_handle("subscriber"))?;
        s.closed.store(true, Ordering::Release);
        s.waker.wake();
        drop(s);
        Ok(GPUSHM_OK)
    })
}

/// # Safety
/// `buf` is NULL or `len` writable bytes; `needed` NULL or writable.
pub(crate) unsafe fn copy_string(
    s: &str,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> Result<gpushm_status, Fail> {
    if !needed.is_null() {
        // SAFETY: the caller's contract.
        unsafe { needed.write(s.len() + 1) };
    }
    if buf.is_null() || len == 0 {
        return if needed.is_null() {
            Err(invalid("buf is NULL (or len 0) and needed is NULL"))
        } else {
            Ok(GPUSHM_OK)
        };
    }
    let n = s.len().min(len - 1);
    // SAFETY: `n + 1 <= len` bytes of the caller's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, n);
        buf.add(n).write(0);
    }
    Ok(GPUSHM_OK)
}
