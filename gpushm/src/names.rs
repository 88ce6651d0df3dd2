// SPDX-License-Identifier: MPL-2.0
//! Stream names: `stream=cam` instead of a socket path.
//!
//! A name is a socket in a runtime directory. Where a name is looked for, in this order:
//!
//! 1. `$GPUSHM_RUNTIME_DIR`, when set: that directory only (services, containers that share a
//!    directory, tests). Producers and consumers must agree on it.
//! 2. The user's own directory: `$XDG_RUNTIME_DIR/gpushm` where XDG_RUNTIME_DIR is set (a
//!    desktop or `systemd --user` session), otherwise `/tmp/gpushm-UID` (root, CI, services,
//!    containers). A producer creates it, mode 0700.
//! 3. The system-wide directory [`SYSTEM_DIR`] (`/run/gpushm`), for services started by the
//!    system (systemd's `RuntimeDirectory=gpushm` makes it), looked in by consumers only:
//!    a service publishes there by setting `GPUSHM_RUNTIME_DIR=/run/gpushm`.
//!
//! A producer creates its socket in the first of 1 and 2. A consumer connects to the first
//! directory of 1, 2 and 3 that holds a socket of that name; while none does, it waits for one
//! to appear in any of them; a name whose socket nobody serves (left by a producer that was
//! killed) is passed over for the next directory that has it. Directories are checked before
//! they are used: the user's own must be a directory (not a link) of this user that nobody
//! else can enter, so two users' streams of the same name never meet and nobody else can put
//! a socket there. The others (`GPUSHM_RUNTIME_DIR`, `/run/gpushm`: shared on purpose, often
//! owned by a service's user) must be directories not writable by everybody unless sticky;
//! there, a socket another user put in place is refused by the consumer's check of who serves
//! it (`producer_uid`: this user or root unless set).

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The environment variable that names the one directory streams are made and looked for in.
pub const ENV_DIR: &str = "GPUSHM_RUNTIME_DIR";
/// Where services started by the system publish streams (consumers look there last).
pub const SYSTEM_DIR: &str = "/run/gpushm";
/// Bytes of a stream name at most.
pub const MAX_NAME: usize = 64;

/// Refuses a name that is not a plain file name: empty, longer than [`MAX_NAME`], with
/// characters other than ASCII letters, digits and `. _ - @ + :`, or starting with `.` or `-`.
pub fn check_name(name: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || "._-@+:".contains(c);
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_NAME {
        Some("it is longer than 64 bytes")
    } else if name.contains('/') {
        Some("it contains '/' (a name is not a path: use socket-path for a path)")
    } else if name.starts_with('.') {
        Some("it starts with '.'")
    } else if name.starts_with('-') {
        Some("it starts with '-'")
    } else if !name.chars().all(ok_char) {
        Some("it holds characters other than letters, digits and . _ - @ + :")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::Invalid(format!(
            "stream name {name:?} is not valid: {why}; a stream name is 1 to {MAX_NAME} letters, digits and . _ - @ + :, not starting with . or -"
        ))),
        None => Ok(()),
    }
}

/// Where this process's streams are made: `$GPUSHM_RUNTIME_DIR`, else
/// `$XDG_RUNTIME_DIR/gpushm`, else `/tmp/gpushm-UID` (not created here).
pub fn user_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(ENV_DIR).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        let d = PathBuf::from(d);
        if d.is_absolute() {
            return d.join("gpushm");
        }
    }
    PathBuf::from(format!("/tmp/gpushm-{}", nix::unistd::geteuid().as_raw()))
}

/// The directories a consumer looks in, in order (see the module's documentation).
pub fn search_dirs() -> Vec<PathBuf> {
    if std::env::var_os(ENV_DIR).is_some_and(|d| !d.is_empty()) {
        return vec![user_dir()];
    }
    vec![user_dir(), PathBuf::from(SYSTEM_DIR)]
}

/// Whether `dir` is one we made ourselves (the user's own directory, not one set by
/// [`ENV_DIR`]): it must then be private.
fn is_private(dir: &Path) -> bool {
    std::env::var_os(ENV_DIR).is_none_or(|d| d.is_empty()) && dir == user_dir()
}

/// Checks that `dir` may be trusted (see the module's documentation). `Ok(false)` when it does
/// not exist.
fn check_dir(dir: &Path) -> Result<bool> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => {
            return Err(Error::Invalid(format!(
                "cannot look at the stream directory {}: {e}",
                dir.display()
            )))
        }
    };
    let me = nix::unistd::geteuid().as_raw();
    let mode = meta.mode() & 0o7777;
    let problem = if !meta.file_type().is_dir() {
        Some("it is not a directory (a link or a file)".to_string())
    } else if is_private(dir) {
        if meta.uid() != me {
            Some(format!(
                "it belongs to uid {}, not to this user (uid {me}): another user made it",
                meta.uid()
            ))
        } else if mode & 0o077 != 0 {
            Some(format!(
                "its mode is {mode:o}: others may enter it (chmod 700 it)"
            ))
        } else {
            None
        }
    } else if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        Some(format!(
            "its mode is {mode:o}: anybody may replace its sockets (no sticky bit)"
        ))
    } else {
        None
    };
    match problem {
        Some(p) => Err(Error::Invalid(format!(
            "refusing the stream directory {}: {p}; fix it, or set {ENV_DIR} to another directory",
            dir.display()
        ))),
        None => Ok(true),
    }
}

/// The socket a producer of stream `name` creates: in [`user_dir`], made (mode 0700) if
/// needed and checked.
pub fn producer_path(name: &str) -> Result<PathBuf> {
    check_name(name)?;
    let dir = user_dir();
    if !check_dir(&dir)? {
        let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        match made {
            Ok(()) => {
                // Whatever the umask took away, it is ours and private.
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
            // Made by another producer at the same moment: checked below.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(Error::Invalid(format!(
                    "cannot create the stream directory {}: {e} (set {ENV_DIR} to a directory of yours)",
                    dir.display()
                )))
            }
        }
        check_dir(&dir)?;
    }
    Ok(dir.join(name))
}

/// The socket a consumer of stream `name` connects to now: the first of [`search_dirs`] that
/// holds an entry of that name, else the place its producer would make it.
/// A directory that cannot be trusted is an error where it is the first one (where our own
/// producers go); a later one (the system's) is passed over.
pub fn consumer_path(name: &str) -> Result<PathBuf> {
    Ok(consumer_candidates(name)?.remove(0))
}

/// Every socket a consumer of stream `name` may connect to now, in lookup order: each of
/// [`search_dirs`] that holds an entry of that name, or, when none does, the place its
/// producer would make it. Never empty.
pub fn consumer_candidates(name: &str) -> Result<Vec<PathBuf>> {
    check_name(name)?;
    let dirs = search_dirs();
    let mut out = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let usable = match check_dir(dir) {
            Ok(exists) => exists,
            Err(e) if i == 0 => return Err(e),
            Err(_) => false,
        };
        if usable && std::fs::symlink_metadata(dir.join(name)).is_ok() {
            out.push(dir.join(name));
        }
    }
    if out.is_empty() {
        out.push(dirs[0].join(name));
    }
    Ok(out)
}

/// Where a consumer connects: a socket path, or a stream name looked up again at each
/// attempt (its producer may appear in any of [`search_dirs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Path(PathBuf),
    Stream(String),
}

impl Endpoint {
    /// Where settings point: a socket path (named `path_setting` in messages) or a stream
    /// name, exactly one of them; a bad name is refused saying why.
    pub fn from_settings(
        path: Option<PathBuf>,
        stream: Option<String>,
        path_setting: &str,
    ) -> Result<Self> {
        match (path, stream) {
            (Some(p), None) => Ok(Endpoint::Path(p)),
            (None, Some(n)) => check_name(&n).map(|()| Endpoint::Stream(n)),
            (Some(_), Some(_)) => Err(Error::Invalid(format!(
                "both {path_setting} and stream are set: set one of them"
            ))),
            (None, None) => Err(Error::Invalid(format!(
                "neither {path_setting} nor stream is set: give the producer's stream name (stream=NAME) or its socket path ({path_setting}=/some/path)"
            ))),
        }
    }

    /// The socket to connect to now (the first of [`Self::candidates`]).
    pub fn resolve(&self) -> Result<PathBuf> {
        Ok(self.candidates()?.remove(0))
    }

    /// The sockets to try now, in order (a stream name may be in several directories, the
    /// first of them stale).
    pub fn candidates(&self) -> Result<Vec<PathBuf>> {
        match self {
            Endpoint::Path(p) => Ok(vec![p.clone()]),
            Endpoint::Stream(n) => consumer_candidates(n),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Path(p) => write!(f, "{}", p.display()),
            Endpoint::Stream(n) => write!(f, "stream {n:?}"),
        }
    }
}

impl From<&Path> for Endpoint {
    fn from(p: &Path) -> Self {
        Endpoint::Path(p.to_owned())
    }
}

/// A socket found in a stream directory.
#[derive(Debug, Clone)]
pub struct Found {
    /// The stream's name (the socket's file name).
    pub name: String,
    pub path: PathBuf,
}

/// Every socket in the directories consumers look in (the user's own, then the system's),
/// in that order, each name once (as a consumer would find it). Hidden entries (a producer's
/// private directory while it binds) are skipped; a directory that cannot be trusted is an
/// error where it is the first one, and passed over otherwise (as [`consumer_path`] does).
pub fn list() -> Result<Vec<Found>> {
    let mut out: Vec<Found> = Vec::new();
    for (i, dir) in search_dirs().into_iter().enumerate() {
        let found = match check_dir(&dir).and_then(|exists| {
            if exists {
                list_dir(&dir)
            } else {
                Ok(Vec::new())
            }
        }) {
            Ok(f) => f,
            Err(e) if i == 0 => return Err(e),
            // A system directory we may not read or trust: not ours to list.
            Err(_) => continue,
        };
        for f in found {
            if !out.iter().any(|o| o.name == f.name) {
                out.push(f);
            }
        }
    }
    Ok(out)
}

/// The sockets in `dir`, sorted by name.
pub fn list_dir(dir: &Path) -> Result<Vec<Found>> {
    use std::os::unix::fs::FileTypeExt;
    let rd = std::fs::read_dir(dir)
        .map_err(|e| Error::Invalid(format!("cannot list {}: {e}", dir.display())))?;
    let mut out: Vec<Found> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            (!name.starts_with('.')).then(|| Found {
                path: e.path(),
                name,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_are_not_plain_file_names_are_refused_saying_why() {
        for ok in ["cam", "front-left.0", "a_b@c+d:e", &"x".repeat(64)] {
            check_name(ok).unwrap();
        }
        for (bad, why) in [
            ("", "empty"),
            ("a/b", "'/'"),
            ("..", "starts with '.'"),
            (".hidden", "starts with '.'"),
            ("-x", "starts with '-'"),
            ("a b", "characters"),
            ("caméra", "characters"),
            (&"x".repeat(65), "longer than 64"),
        ] {
            let e = check_name(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(e.contains("stream name"), "{e}");
        }
    }
}
