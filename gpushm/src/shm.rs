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

use super::{Error, Result};

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

/// Checks that `fd` is an eventfd and wraps it.
pub fn check_eventfd(fd: OwnedFd, what: &str) -> Result<EventFd> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| Error::protocol(format!("{what}: cannot inspect the descriptor: {e}")))?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(Error::protocol(format!(
            "{what}: expected an eventfd, got {}",
            link.display()
        )));
    }
    // SAFETY: the descriptor was just checked to be an eventfd.
    Ok(unsafe { EventFd::from_owned_fd(fd) })
}

pub fn new_eventfd() -> Result<EventFd> {
    EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
        .map_err(|e| Error::os("eventfd", e))
}

/// Wakes whoever polls `efd`.
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
        assert!(check_eventfd(fd, "frame-ready").is_err());
        let efd = new_eventfd().unwrap();
        let owned: OwnedFd = efd.into();
        assert!(check_eventfd(owned, "frame-ready").is_ok());
    }
}
