// SPDX-License-Identifier: MPL-2.0
//! One end of the control socket: framing, descriptor passing (every received descriptor
//! owned at once, so none can leak whatever the peer sends), receive buffering, timeouts.

use super::*;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

/// Send-buffer bytes kept free for the messages a consumer cannot do without (see
/// [`Conn::has_room`]). Small messages cost the buffer about a kilobyte each in kernel
/// overhead.
pub const SEND_RESERVE: usize = 32 * 1024;

/// One recvmsg() without blocking: the bytes read, every descriptor that arrived (owned, so
/// none can leak, whatever the peer sent), and whether control data was truncated. nix
/// refuses to walk truncated control data, but the descriptors the kernel did install are
/// in it and must be closed, so the walk is done here.
fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
) -> std::result::Result<(usize, Vec<OwnedFd>, bool), nix::errno::Errno> {
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { nix::libc::CMSG_SPACE((RECV_FDS * std::mem::size_of::<RawFd>()) as u32) };
    // u64 elements: aligned for cmsghdr.
    let mut control = vec![0u64; (space as usize).div_ceil(8) + 1];
    let mut iov = nix::libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut mh: nix::libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control.as_mut_ptr().cast();
    mh.msg_controllen = (control.len() * 8) as _;
    // SAFETY: mh describes valid, writable buffers for the duration of the call.
    let n = unsafe {
        nix::libc::recvmsg(
            fd,
            &mut mh,
            nix::libc::MSG_DONTWAIT | nix::libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        return Err(nix::errno::Errno::last());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel set msg_controllen to the control bytes it wrote; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay within them, and each SCM_RIGHTS payload holds cmsg_len - CMSG_LEN(0)
    // bytes of descriptors it installed for us.
    unsafe {
        let mut c = nix::libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == nix::libc::SOL_SOCKET && (*c).cmsg_type == nix::libc::SCM_RIGHTS {
                let data = nix::libc::CMSG_DATA(c) as *const RawFd;
                let len = ((*c).cmsg_len as usize).saturating_sub(nix::libc::CMSG_LEN(0) as usize);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    if raw >= 0 {
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
            }
            c = nix::libc::CMSG_NXTHDR(&mh, c);
        }
    }
    Ok((n as usize, fds, mh.msg_flags & nix::libc::MSG_CTRUNC != 0))
}

/// One end of the control socket: framing, descriptor passing, and a receive buffer so that
/// partial reads and several messages per read both work.
pub struct Conn {
    stream: UnixStream,
    rbuf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
    eof: bool,
    /// The peer never sends descriptors (a producer's end): any it sends is an error.
    refuse_fds: bool,
}

impl Conn {
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            rbuf: Vec::new(),
            fds: VecDeque::new(),
            eof: false,
            refuse_fds: false,
        }
    }

    /// A connection whose peer must never send descriptors: the first one it sends is an
    /// error (the descriptors stay owned by this Conn until it is dropped, so whoever drops
    /// it decides on which thread they close).
    pub fn refusing_fds(mut self) -> Self {
        self.refuse_fds = true;
        self
    }

    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    pub fn raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Sends `msg`, one the peer can do without (an event, a frame's metas), only if the
    /// socket's send buffer has room for it with [`SEND_RESERVE`] left over: a peer that
    /// stops reading for a while misses such messages instead of being cut when a needed one
    /// (a new ring, EOS) finds the buffer full. `Ok(false)`: not sent, no room.
    pub fn send_if_room(&self, msg: &Message) -> Result<bool> {
        let bytes = msg.encode();
        if !self.has_room(bytes.len()) {
            return Ok(false);
        }
        self.send_encoded(&bytes, &[])?;
        Ok(true)
    }

    /// Whether the send buffer has room for `bytes` more with [`SEND_RESERVE`] left over
    /// (the peer reads what we sent before).
    fn has_room(&self, bytes: usize) -> bool {
        let fd = self.stream.as_raw_fd();
        let mut queued: nix::libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int: the bytes sent and not yet read by the
        // peer (with their kernel overhead).
        if unsafe { nix::libc::ioctl(fd, nix::libc::TIOCOUTQ, &mut queued) } != 0 {
            return false;
        }
        let Ok(size) =
            nix::sys::socket::getsockopt(&self.stream, nix::sys::socket::sockopt::SndBuf)
        else {
            return false;
        };
        (queued.max(0) as usize).saturating_add(bytes + SEND_RESERVE) <= size
    }

    /// Sends `msg` with `fds`; never blocks: a peer whose socket buffer is full (it stopped
    /// reading) gets an error instead of stalling the sender.
    pub fn send(&self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        if fds.len() as u32 != msg.expected_fds() {
            return Err(Error::protocol(format!(
                "{msg:?} needs {} descriptors, {} given",
                msg.expected_fds(),
                fds.len()
            )));
        }
        self.send_encoded(&msg.encode(), fds)
    }

    /// Sends the bytes of an encoded message with `fds` (see [`Self::send`]).
    fn send_encoded(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut sent = 0;
        while sent < bytes.len() {
            let iov = [IoSlice::new(&bytes[sent..])];
            let cmsg = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() {
                &cmsg
            } else {
                &[]
            };
            match sendmsg::<UnixAddr>(
                self.stream.as_raw_fd(),
                &iov,
                cmsgs,
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(n) => sent += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => {
                    // Messages are small and rare: a full socket buffer means the peer stopped
                    // reading. Never wait for it (the sender may hold a lock others need).
                    return Err(Error::Timeout("the peer does not read its socket".into()));
                }
                Err(nix::errno::Errno::EPIPE) | Err(nix::errno::Errno::ECONNRESET) => {
                    return Err(Error::Disconnected)
                }
                Err(e) => return Err(Error::os("sendmsg", e)),
            }
        }
        Ok(())
    }

    fn stream_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.as_fd()
    }

    /// Reads whatever is available without blocking. Returns Ok(false) if nothing was read.
    /// After the peer closed its end, returns `Error::Disconnected` once buffered messages are
    /// parsed.
    pub fn fill(&mut self) -> Result<bool> {
        if self.eof {
            return Ok(false);
        }
        let mut buf = [0u8; 4096];
        let (n, fds, truncated) = match recv_with_fds(self.stream.as_raw_fd(), &mut buf) {
            Ok(r) => r,
            Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => return Ok(false),
            Err(nix::errno::Errno::ECONNRESET) => {
                self.eof = true;
                return Ok(false);
            }
            Err(e) => return Err(Error::os("recvmsg", e)),
        };
        if self.refuse_fds && !fds.is_empty() {
            // Kept (owned) until this Conn is dropped: closing a descriptor can block, and
            // the caller chooses where that happens.
            self.fds.extend(fds);
            return Err(Error::protocol(
                "the peer sent file descriptors; clients never send any",
            ));
        }
        if truncated {
            self.fds.extend(fds);
            return Err(Error::protocol(
                "the peer sent more descriptors than any message carries (control data truncated)",
            ));
        }
        if n == 0 && fds.is_empty() {
            self.eof = true;
            return Ok(false);
        }
        self.rbuf.extend_from_slice(&buf[..n]);
        self.fds.extend(fds);
        if self.fds.len() > 4 * MAX_FDS as usize {
            return Err(Error::protocol(
                "the peer sent descriptors no message announced",
            ));
        }
        if self.rbuf.len() > 2 * (HEADER_LEN + MAX_PAYLOAD as usize) {
            return Err(Error::protocol(
                "the peer sent more data than any message holds",
            ));
        }
        Ok(true)
    }

    /// Descriptors received that no message claimed (yet).
    pub fn stray_fds(&self) -> usize {
        self.fds.len()
    }

    /// Bytes received that no message took yet.
    pub fn buffered(&self) -> usize {
        self.rbuf.len()
    }

    /// Takes one complete message from the receive buffer, if there is one.
    pub fn next_buffered(&mut self) -> Result<Option<(Message, Vec<OwnedFd>)>> {
        match Message::decode(&self.rbuf)? {
            Some((msg, used, nfds)) => {
                if (self.fds.len() as u32) < nfds {
                    return Err(Error::protocol(format!(
                        "{msg:?} arrived without its {nfds} descriptors"
                    )));
                }
                self.rbuf.drain(..used);
                let fds = self.fds.drain(..nfds as usize).collect();
                Ok(Some((msg, fds)))
            }
            None if self.eof => Err(Error::Disconnected),
            None => Ok(None),
        }
    }

    /// Reads without blocking and returns the next complete message, if any.
    pub fn try_recv(&mut self) -> Result<Option<(Message, Vec<OwnedFd>)>> {
        loop {
            if let Some(m) = self.next_buffered()? {
                return Ok(Some(m));
            }
            if !self.fill()? && !self.eof {
                return Ok(None);
            }
        }
    }

    /// Blocks up to `timeout` for the next message. `wake` (if any) aborts the wait when it
    /// becomes readable; then `Ok(None)` is returned.
    pub fn recv_timeout(
        &mut self,
        timeout: Duration,
        wake: Option<BorrowedFd<'_>>,
    ) -> Result<Option<(Message, Vec<OwnedFd>)>> {
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400));
        loop {
            if let Some(m) = self.try_recv()? {
                return Ok(Some(m));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout("no answer from the peer".into()));
            }
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            let mut pfds = vec![PollFd::new(self.stream_fd(), PollFlags::POLLIN)];
            if let Some(w) = wake {
                pfds.push(PollFd::new(w, PollFlags::POLLIN));
            }
            match poll(
                &mut pfds,
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::os("poll", e)),
            }
            if pfds.len() > 1 && pfds[1].any().unwrap_or(false) {
                return Ok(None);
            }
        }
    }
}
