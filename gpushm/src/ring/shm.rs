// SPDX-License-Identifier: MPL-2.0
//! Shared-memory objects: sealed memfds, read-only descriptors, mappings and fd checks.
//!
//! A memfd lives only as long as some process holds a descriptor or a mapping of it, so nothing
//! is ever left in /dev/shm, whatever way the processes exit (kill -9 included).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use memmap2::{Mmap, MmapMut, MmapOptions};
use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::stat::{fstat, Mode};

use crate::{Error, Result};

/// Creates a memfd of `size` bytes, sealed so that nobody can shrink, grow or reseal it.
pub fn create_sealed_memfd(name: &str, size: u64) -> Result<OwnedFd> {
    let fd = create_memfd(name, size)?;
    seal(fd.as_fd(), false)?;
    Ok(fd)
}

/// Creates a memfd of `size` bytes that can still be sealed ([`seal`]).
pub fn create_memfd(name: &str, size: u64) -> Result<OwnedFd> {
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(|e| Error::os("memfd_create", e))?;
    nix::unistd::ftruncate(&fd, size as i64)
        .map_err(|e| Error::os(format!("ftruncate({size})"), e))?;
    Ok(fd)
}

/// Seals a memfd so that nobody can shrink, grow or reseal it; with `no_new_writers`, also so
/// that nobody can map it writable or write to it any more (F_SEAL_FUTURE_WRITE, Linux 5.1):
/// writable mappings made before stay valid, and a read-only descriptor reopened as
/// /proc/self/fd/N with O_RDWR still cannot write.
pub fn seal(fd: BorrowedFd<'_>, no_new_writers: bool) -> Result<()> {
    let mut seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    if no_new_writers {
        seals |= SealFlag::F_SEAL_FUTURE_WRITE;
    }
    fcntl(fd, FcntlArg::F_ADD_SEALS(seals)).map_err(|e| {
        Error::os(
            if no_new_writers {
                "sealing the ring against writes (F_SEAL_FUTURE_WRITE needs Linux 5.1 or newer)"
            } else {
                "sealing the memfd"
            },
            e,
        )
    })?;
    Ok(())
}

/// A new descriptor for the same memfd, opened read-only: whoever receives it can map the
/// memory only for reading.
pub fn reopen_read_only(fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::os("reopening the ring read-only", e))
}

/// Checks that `fd` is a memfd of at least `min_size` bytes that can no longer shrink, so that
/// a mapping of it can never turn into SIGBUS.
pub fn check_sealed_memfd(fd: BorrowedFd<'_>, min_size: u64, what: &str) -> Result<()> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|_| Error::protocol(format!("{what}: the descriptor is not a sealable memfd")))?;
    let seals = SealFlag::from_bits_truncate(seals);
    if !seals.contains(SealFlag::F_SEAL_SHRINK) {
        return Err(Error::protocol(format!(
            "{what}: the memfd is not sealed against shrinking"
        )));
    }
    let st = fstat(fd).map_err(|e| Error::os("fstat", e))?;
    if (st.st_size as u64) < min_size {
        return Err(Error::protocol(format!(
            "{what}: the memfd holds {} bytes, {min_size} expected",
            st.st_size
        )));
    }
    Ok(())
}

/// One end of a wake-up channel between a producer and one consumer: a unix stream socket
/// of a socketpair, one per direction ("a frame is ready", "a slot was released"). A ring
/// is one byte; one receive takes every byte waiting.
///
/// The two processes share each end's open file description (it travels over the control
/// socket), so its file status flags are the peer's to change: a peer may clear O_NONBLOCK.
/// Every send and receive here is therefore non-blocking by its own flag (`MSG_DONTWAIT`),
/// never by the description's: nothing a peer does to the descriptor can make our thread
/// block. A full receive queue means the peer has wake-ups it has not read yet, which is all
/// a ring is for.
#[derive(Debug)]
pub struct Doorbell(OwnedFd);

/// Receives at most per [`Doorbell::drain`]: a peer that rings without end cannot keep us in
/// it.
const DRAIN_MAX: usize = 16;

impl Doorbell {
    /// A connected pair: ring one, the other becomes readable.
    pub fn pair() -> Result<(Doorbell, Doorbell)> {
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let (a, b) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        )
        .map_err(|e| Error::os("socketpair", e))?;
        Ok((Doorbell(a), Doorbell(b)))
    }

    /// Takes a doorbell end received from the peer, after checking that it is one: a unix
    /// stream socket.
    pub fn from_peer(fd: OwnedFd, what: &str) -> Result<Doorbell> {
        use nix::sys::socket::{getsockopt, sockopt, SockType};
        match getsockopt(&fd, sockopt::SockType) {
            Ok(SockType::Stream) => {}
            Ok(t) => {
                return Err(Error::protocol(format!(
                    "{what}: expected a stream socket, got a {t:?} socket"
                )))
            }
            Err(_) => {
                let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                    .map(|l| l.display().to_string())
                    .unwrap_or_else(|e| e.to_string());
                return Err(Error::protocol(format!(
                    "{what}: expected a stream socket, got {link}"
                )));
            }
        }
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|e| Error::protocol(format!("{what}: cannot inspect the descriptor: {e}")))?;
        if !link.to_string_lossy().starts_with("socket:") {
            return Err(Error::protocol(format!(
                "{what}: expected a socket, got {}",
                link.display()
            )));
        }
        Ok(Doorbell(fd))
    }

    /// Wakes whoever polls the other end. Never blocks; a full queue already wakes it.
    pub fn ring(&self) {
        use nix::sys::socket::{send, MsgFlags};
        let _ = send(
            self.0.as_raw_fd(),
            &[1],
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        );
    }

    /// Reads the wake-ups waiting: one receive, unless more were waiting than it holds
    /// (at most `DRAIN_MAX`). Never blocks. False if the peer closed its end (or broke it):
    /// the doorbell then stays readable for good, and whoever polls it must stop, or spin.
    #[must_use = "a closed doorbell is readable for good: stop polling it"]
    pub fn drain(&self) -> bool {
        use nix::sys::socket::{recv, MsgFlags};
        let mut buf = [0u8; 256];
        for _ in 0..DRAIN_MAX {
            match recv(self.0.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(0) => return false,
                Ok(n) if n == buf.len() => {}
                Ok(_) | Err(nix::errno::Errno::EAGAIN) => return true,
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => return false,
            }
        }
        true
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for Doorbell {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// A wake-up for threads of this process only (never handed to a peer): an eventfd.
pub fn new_eventfd() -> Result<EventFd> {
    EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
        .map_err(|e| Error::os("eventfd", e))
}

/// Wakes whoever polls `efd` (an eventfd of this process: nobody else can clear its
/// O_NONBLOCK).
pub fn notify(efd: &EventFd) {
    // Cannot block: the counter only overflows after 2^64 - 2 unread wake-ups.
    let _ = efd.write(1);
}

/// Clears `efd` (non-blocking).
pub fn drain(efd: &EventFd) {
    let _ = efd.read();
}

pub fn map_rw(fd: &OwnedFd, len: u64) -> Result<MmapMut> {
    let file = File::from(fd.try_clone().map_err(|e| Error::os("dup", errno_of(&e)))?);
    // SAFETY: the memfd is sealed against shrinking, so the mapping stays backed.
    unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }
        .map_err(|e| Error::os("mmap", errno_of(&e)))
}

pub fn map_ro(fd: &OwnedFd, len: u64) -> Result<Mmap> {
    let file = File::from(fd.try_clone().map_err(|e| Error::os("dup", errno_of(&e)))?);
    // SAFETY: checked to be sealed against shrinking before mapping (check_sealed_memfd).
    unsafe { MmapOptions::new().len(len as usize).map(&file) }
        .map_err(|e| Error::os("mmap", errno_of(&e)))
}

fn errno_of(e: &std::io::Error) -> nix::errno::Errno {
    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0))
}

pub fn borrow(fd: &impl AsFd) -> BorrowedFd<'_> {
    fd.as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_is_sealed_and_read_only_reopen_cannot_map_writable() {
        let fd = create_sealed_memfd("test", 8192).unwrap();
        check_sealed_memfd(fd.as_fd(), 8192, "ring").unwrap();
        assert!(check_sealed_memfd(fd.as_fd(), 8193, "ring").is_err());
        assert!(
            nix::unistd::ftruncate(&fd, 4096).is_err(),
            "shrinking must be refused"
        );
        let ro = reopen_read_only(fd.as_fd()).unwrap();
        let file = File::from(ro.try_clone().unwrap());
        assert!(unsafe { MmapOptions::new().len(8192).map_mut(&file) }.is_err());
        let map = map_ro(&ro, 8192).unwrap();
        assert_eq!(map.len(), 8192);
    }

    /// A consumer holding the read-only descriptor of a ring sealed against writes cannot
    /// write to it, not even by reopening it read-write through /proc, and cannot stop the
    /// producer's own mapping from working.
    #[test]
    fn future_write_seal_stops_every_writer_but_the_producer() {
        let fd = create_memfd("ring", 8192).unwrap();
        let mut mine = map_rw(&fd, 8192).unwrap();
        let ro = reopen_read_only(fd.as_fd()).unwrap();
        seal(fd.as_fd(), true).unwrap();
        // The producer's mapping still writes.
        mine[0] = 42;
        // A consumer reopens its read-only descriptor read-write...
        let rw = nix::fcntl::open(
            format!("/proc/self/fd/{}", ro.as_raw_fd()).as_str(),
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .expect("open itself is allowed");
        let file = File::from(rw);
        // ...but can neither map it writable nor write to it.
        assert!(unsafe { MmapOptions::new().len(8192).map_mut(&file) }.is_err());
        use std::io::Write;
        assert!((&file).write(b"x").is_err());
        // fchmod through the read-only descriptor changes nothing for the producer: it keeps
        // the descriptor it hands out from the start.
        let _ = nix::sys::stat::fchmod(&ro, Mode::empty());
        assert!(ro.try_clone().is_ok());
        let map = map_ro(&ro, 8192).unwrap();
        assert_eq!(map[0], 42);
    }

    #[test]
    fn unsealed_files_and_wrong_fd_types_are_refused() {
        let tmp = tempfile::tempfile().unwrap();
        let fd: OwnedFd = tmp.into();
        assert!(check_sealed_memfd(fd.as_fd(), 0, "ring").is_err());
        assert!(Doorbell::from_peer(fd, "frame-ready").is_err());
        let efd: OwnedFd = new_eventfd().unwrap().into();
        assert!(Doorbell::from_peer(efd, "frame-ready").is_err());
        let (stream, _) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Datagram,
            None,
            nix::sys::socket::SockFlag::empty(),
        )
        .unwrap();
        assert!(Doorbell::from_peer(stream, "frame-ready").is_err());
        let (a, b) = Doorbell::pair().unwrap();
        let b = Doorbell::from_peer(b.0, "frame-ready").unwrap();
        a.ring();
        assert!(b.drain());
    }

    /// The peer shares each end's file description and may clear O_NONBLOCK on it: ringing a
    /// full doorbell and draining an empty one still return at once.
    #[test]
    fn a_doorbell_never_blocks_whatever_the_peer_does_to_its_flags() {
        let (a, b) = Doorbell::pair().unwrap();
        for end in [&a, &b] {
            fcntl(end, FcntlArg::F_SETFL(OFlag::empty())).unwrap();
        }
        let start = std::time::Instant::now();
        // Far more than any queue holds.
        for _ in 0..100_000 {
            a.ring();
        }
        assert!(b.drain());
        for _ in 0..1000 {
            assert!(b.drain());
        }
        assert!(a.drain());
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
    }
}
