// SPDX-License-Identifier: MPL-2.0
//! The producer's socket file: bound so that nobody can connect before it has its final
//! permissions (in a private directory, then moved into place), replacing only a stale socket
//! nobody serves, and removed at the end only if it is still ours.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::policy::LISTEN_BACKLOG;
use crate::{Error, Result};

/// The bound socket and the file it is known by.
pub(super) struct Socket {
    pub listener: UnixListener,
    path: PathBuf,
    /// The file's inode when bound: a producer that replaced it later keeps its own.
    inode: u64,
}

impl Socket {
    /// Binds `path` with `perms` (see [`bind`]).
    pub fn bind(path: &Path, perms: u32) -> Result<Self> {
        let listener = bind(path, perms)?;
        let inode = std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0);
        Ok(Self {
            listener,
            path: path.to_owned(),
            inode,
        })
    }

    /// Removes the socket file, if it is still ours (a new producer may have replaced it).
    pub fn remove(&self) {
        if std::fs::metadata(&self.path).map(|m| m.ino()).ok() == Some(self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds `path`, replacing a stale socket file nobody listens on. A live producer on the path
/// is an error, and so is a socket whose owner cannot be checked.
///
/// The socket is bound and given `perms` inside a private directory (mode 0700) next to
/// `path`, then moved into place: nobody can connect to it before it has its final
/// permissions, whatever the umask.
fn bind(path: &Path, perms: u32) -> Result<UnixListener> {
    use std::os::unix::ffi::OsStrExt;
    let len = path.as_os_str().as_bytes().len();
    if len > crate::MAX_SOCKET_PATH {
        return Err(Error::Invalid(format!(
            "socket-path {} is {len} bytes long: unix socket paths hold at most {} bytes",
            path.display(),
            crate::MAX_SOCKET_PATH
        )));
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Error::Invalid(format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            )));
        }
        match UnixStream::connect(path) {
            Ok(_) => {
                return Err(Error::Invalid(format!(
                    "another producer is already serving {}; stop it or pick another socket-path",
                    path.display()
                )))
            }
            // Only "nobody listens" means stale: left by a producer that died.
            Err(e) if errno(&e) == nix::errno::Errno::ECONNREFUSED => {
                let _ = std::fs::remove_file(path);
            }
            Err(e) => {
                return Err(Error::os(
                    format!(
                        "{} exists and cannot be checked (is another user's producer serving it?)",
                        path.display()
                    ),
                    errno(&e),
                ))
            }
        }
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if path.file_name().is_none() {
        return Err(Error::Invalid(format!(
            "socket-path {} names no file",
            path.display()
        )));
    }
    // mkdtemp makes it with mode 0700. In a shared directory (0777, no sticky bit) another
    // user can rename it away and put one of theirs in its place before we open it, whose
    // `s` links to a file of ours: everything below works through the descriptor of the
    // directory we checked is ours (O_NOFOLLOW, owned by us, 0700: nobody else can add,
    // remove or swap entries in it), never by its path.
    // A swapped directory is refused; another is made, a few times, before giving up.
    let mut attempt = 0;
    let private = loop {
        let made = nix::unistd::mkdtemp(&dir.join(".gpushm-XXXXXX")).map_err(|e| {
            Error::os(
                format!("cannot create a directory next to {}", path.display()),
                e,
            )
        })?;
        match PrivateDir::open(&made) {
            Ok(p) => break p,
            Err(e) => {
                // Ours or not, an empty directory of that name goes; a full one stays.
                let _ = std::fs::remove_dir(&made);
                attempt += 1;
                if attempt == 5 {
                    return Err(e);
                }
            }
        }
    };
    // Bind through the directory's descriptor: the temporary path is short, whatever the
    // length of the final one.
    let short = PathBuf::from(format!("/proc/self/fd/{}/s", private.fd.as_raw_fd()));
    let listener = UnixListener::bind(&short).map_err(|e| {
        Error::os(
            format!("cannot create socket {}", path.display()),
            errno(&e),
        )
    })?;
    let created = (|| -> nix::Result<()> {
        use nix::sys::stat::{fchmodat, FchmodatFlags, Mode};
        // A shorter queue than the system's (often 4096): connections beyond ACCEPT_RATE
        // wait there, and a consumer that connects during a flood waits behind at most
        // this many (a quarter of a second).
        nix::sys::socket::listen(
            &listener,
            nix::sys::socket::Backlog::new(LISTEN_BACKLOG)
                .unwrap_or(nix::sys::socket::Backlog::MAXCONN),
        )?;
        // Inside a directory only we can change: `s` is the socket just bound.
        fchmodat(
            &private.fd,
            "s",
            Mode::from_bits_truncate(perms & 0o777),
            FchmodatFlags::FollowSymlink,
        )?;
        nix::fcntl::renameat(&private.fd, "s", nix::fcntl::AT_FDCWD, path)
    })();
    created.map_err(|e| Error::os(format!("cannot create socket {}", path.display()), e))?;
    drop(private);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::os("fcntl", errno(&e)))?;
    Ok(listener)
}

/// The private directory `bind` makes, opened and checked to be the one it made.
struct PrivateDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl PrivateDir {
    /// Opens `path` without following a link, and refuses it unless it is a directory of
    /// ours that nobody else can write (what mkdtemp made).
    fn open(path: &Path) -> Result<Self> {
        use nix::fcntl::{open, OFlag};
        use nix::sys::stat::{fstat, Mode, SFlag};
        let fd = open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Error::os(format!("open {}", path.display()), e))?;
        let st = fstat(&fd).map_err(|e| Error::os("fstat", e))?;
        let me = nix::unistd::geteuid().as_raw();
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind != SFlag::S_IFDIR || st.st_uid != me || st.st_mode & 0o077 != 0 {
            return Err(Error::Invalid(format!(
                "{} is not the private directory just made (owner uid {}, mode {:o}): another user swapped it; refusing to create the socket through it",
                path.display(),
                st.st_uid,
                st.st_mode & 0o7777
            )));
        }
        Ok(Self {
            fd,
            path: path.to_owned(),
        })
    }
}

impl Drop for PrivateDir {
    /// Removes what is left in it (a socket not renamed, on an error) and then the directory
    /// under its name (which fails, harmlessly, for anything but an empty directory).
    fn drop(&mut self) {
        let _ = nix::unistd::unlinkat(&self.fd, "s", nix::unistd::UnlinkatFlags::NoRemoveDir);
        let _ = std::fs::remove_dir(&self.path);
    }
}

pub(super) fn errno(e: &std::io::Error) -> nix::errno::Errno {
    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0))
}
