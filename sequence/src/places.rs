//! Where a restore acts on the host for an image, which is untrusted input (edited, or from
//! another host): the host directories `possum.json` names are used for nothing destructive
//! unless they are possum's own.
//!
//! - A stale control socket (`possum-PID.sock`) is removed only from one of possum's socket
//!   directories (`--socket-dir`, `POSSUM_SOCKET_DIR` or `/tmp/possum`; the one the image
//!   records only if it is one of those), and only if it is a socket (not a symbolic link, not a
//!   file), owned by the directory's owner or root.
//! - A directory the image names (a directory of the tree's sockets, the keeper's) is made only
//!   under one of [`Places`]'s roots (those socket directories, `$POSSUM_KEEPER`, the
//!   temporary directories `$TMPDIR`, `/tmp`, `/var/tmp`, `/dev/shm`, and `/run/user`), each
//!   component walked without following a symbolic link: never elsewhere.

use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Why a restore does not act on a host path the image names.
#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    /// A stale socket in a directory that is not possum's.
    #[error(
        "{} is in {}, which is not possum's socket directory ({}): it is not removed \
         (restore with --socket-dir {} if that directory is possum's)",
        path.display(), dir.display(), list(allowed), dir.display()
    )]
    NotSocketDir {
        /// The socket file.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
        /// possum's socket directories.
        allowed: Vec<PathBuf>,
    },
    /// Not a socket where a control socket was.
    #[error("{} is {kind}, not a stale control socket: it is not removed", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// A socket owned by someone else.
    #[error(
        "{} belongs to uid {uid}, not to its directory's owner (uid {dir_uid}) or root: it is \
         not removed",
        path.display()
    )]
    Owner {
        /// The socket.
        path: PathBuf,
        /// Its owner.
        uid: u32,
        /// The directory's owner.
        dir_uid: u32,
    },
    /// A directory the image names that possum does not make.
    #[error(
        "{what} {} does not exist, and possum makes directories an image names only under {}: \
         create it first if it is meant",
        dir.display(), list(roots)
    )]
    NotAllowed {
        /// What it is for.
        what: &'static str,
        /// The directory.
        dir: PathBuf,
        /// Where possum makes directories.
        roots: Vec<PathBuf>,
    },
    /// A component on the way is a symbolic link or not a directory.
    #[error("{what} {}: {} is a symbolic link or not a directory", dir.display(), at.display())]
    Link {
        /// What it is for.
        what: &'static str,
        /// The directory.
        dir: PathBuf,
        /// The component.
        at: PathBuf,
    },
    /// A system call failed.
    #[error("{what} {}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn list(paths: &[PathBuf]) -> String {
    let v: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    v.join(", ")
}

/// possum's own places on this host, for a restore.
#[derive(Debug, Clone)]
pub struct Places {
    /// possum's socket directories.
    sockets: Vec<PathBuf>,
    /// Where directories an image names may be made.
    roots: Vec<PathBuf>,
}

impl Places {
    /// The places of this process's environment, with `--socket-dir` (`socket_dir`) if given.
    pub fn of_environment(socket_dir: Option<&Path>) -> Places {
        let mut sockets: Vec<PathBuf> = socket_dir.map(Path::to_path_buf).into_iter().collect();
        sockets.push(possum_control::socket_dir());
        let mut roots = sockets.clone();
        roots.extend(std::env::var_os(possum_keeper::KEEPER_ENV).map(PathBuf::from));
        roots.push(std::env::temp_dir());
        roots.extend(["/tmp", "/var/tmp", "/dev/shm", "/run/user"].map(PathBuf::from));
        Places::new(sockets, roots)
    }

    /// The places `sockets` (possum's socket directories) and `roots` (where directories an
    /// image names may be made), made absolute; those that are not plain paths are left out.
    pub fn new(sockets: Vec<PathBuf>, roots: Vec<PathBuf>) -> Places {
        let clean = |v: Vec<PathBuf>| {
            let mut out: Vec<PathBuf> = v
                .into_iter()
                .filter_map(|p| std::path::absolute(p).ok())
                .filter(|p| plain_absolute(p))
                .collect();
            out.dedup();
            out
        };
        Places {
            sockets: clean(sockets),
            roots: clean(roots),
        }
    }

    /// Whether `dir` is one of possum's socket directories.
    pub fn is_socket_dir(&self, dir: &Path) -> bool {
        std::path::absolute(dir).is_ok_and(|d| self.sockets.contains(&d))
    }

    /// Removes the stale control socket of process `pid` in `dir`, if there is one
    /// ([`Self::stale_socket`]). Whether one was removed.
    pub fn remove_stale_socket(&self, dir: &Path, pid: i32) -> Result<bool, PlaceError> {
        match self.stale_socket(dir, pid)? {
            Some(s) => s.remove().map(|()| true),
            None => Ok(false),
        }
    }

    /// The stale control socket of process `pid` in `dir`, if there is one, checked as one
    /// possum may remove: in one of possum's socket directories (not reached through a
    /// symbolic link), a socket, owned by the directory's owner or root. Anything else there is
    /// refused, naming what it is.
    pub fn stale_socket(&self, dir: &Path, pid: i32) -> Result<Option<StaleSocket>, PlaceError> {
        let path = possum_control::socket_path(dir, pid as u32);
        let dirfd = match open_dir(dir) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(Errno::LOOP | Errno::NOTDIR) => {
                return Err(PlaceError::NotASocket {
                    path: dir.to_path_buf(),
                    kind: "a symbolic link or not a directory",
                })
            }
            Err(e) => return Err(io_error("opening", dir)(e)),
        };
        let stale = StaleSocket {
            dirfd,
            name: format!("possum-{pid}.sock"),
            path,
        };
        if !stale.check()? {
            return Ok(None);
        }
        if !self.is_socket_dir(dir) {
            return Err(PlaceError::NotSocketDir {
                path: stale.path,
                dir: dir.to_path_buf(),
                allowed: self.sockets.clone(),
            });
        }
        Ok(Some(stale))
    }

    /// Checks that possum may make `dir` (for `what`) or use it as made: under one of the
    /// roots, and no component of its existing part a symbolic link.
    pub fn check_dir(&self, what: &'static str, dir: &Path) -> Result<(), PlaceError> {
        self.walk(what, dir, None).map(|_| ())
    }

    /// Makes `dir` (for `what`, mode 0700) and its missing parents, unless it exists: only under
    /// one of the roots, never through a symbolic link. Whether it was made.
    pub fn create_dir(&self, what: &'static str, dir: &Path) -> Result<bool, PlaceError> {
        self.create_dir_for(what, dir, None)
    }

    /// [`create_dir`](Self::create_dir), each directory made given to `owner` (uid, gid) when
    /// one is named: a job's directory is the job's, as the job would have made it.
    pub fn create_dir_for(
        &self,
        what: &'static str,
        dir: &Path,
        owner: Option<(u32, u32)>,
    ) -> Result<bool, PlaceError> {
        if dir.exists() {
            return Ok(false);
        }
        self.walk(what, dir, Some(owner))
    }

    /// Walks from the root `dir` is under to `dir`, component by component, never following a
    /// symbolic link, making those missing if `create` is given (each made one given to its
    /// owner, if it names one). Whether the last one was made.
    fn walk(
        &self,
        what: &'static str,
        dir: &Path,
        create: Option<Option<(u32, u32)>>,
    ) -> Result<bool, PlaceError> {
        let owner = create.flatten();
        let create = create.is_some();
        let not_allowed = || PlaceError::NotAllowed {
            what,
            dir: dir.to_path_buf(),
            roots: self.roots.clone(),
        };
        let abs = std::path::absolute(dir).map_err(|_| not_allowed())?;
        if !plain_absolute(&abs) {
            return Err(not_allowed());
        }
        // The deepest root that exists (the others may not: /run/user, a socket directory not
        // made yet); the root itself is trusted, and may be a link (/tmp to a larger disk).
        let mut under: Vec<(&PathBuf, &Path)> = (self.roots.iter())
            .filter_map(|r| Some((r, abs.strip_prefix(r).ok()?)))
            .filter(|(_, rest)| rest.components().next().is_some())
            .collect();
        if under.is_empty() {
            return Err(not_allowed());
        }
        under.sort_by_key(|(r, _)| std::cmp::Reverse(r.as_os_str().len()));
        let io = io_error;
        let root_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let mut opened = None;
        for (root, rest) in under {
            match rustix::fs::open(root, root_flags, Mode::empty()) {
                Ok(fd) => {
                    opened = Some((fd, root, rest));
                    break;
                }
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(io("opening", root)(e)),
            }
        }
        let Some((mut fd, root, rest)) = opened else {
            if create {
                return Err(not_allowed());
            }
            return Ok(false);
        };
        let mut at = root.clone();
        let mut made = false;
        for c in rest.components() {
            let Component::Normal(name) = c else {
                return Err(not_allowed());
            };
            at.push(name);
            made = false;
            if create {
                match rustix::fs::mkdirat(&fd, name, Mode::from_raw_mode(0o700)) {
                    Ok(()) => made = true,
                    Err(Errno::EXIST) => {}
                    Err(e) => return Err(io("creating", &at)(e)),
                }
            }
            fd = match rustix::fs::openat(&fd, name, dir_flags(), Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::NOENT) if !create => return Ok(false),
                Err(Errno::LOOP | Errno::NOTDIR) => {
                    return Err(PlaceError::Link {
                        what,
                        dir: dir.to_path_buf(),
                        at,
                    })
                }
                Err(e) => return Err(io("opening", &at)(e)),
            };
            if let (true, Some((uid, gid))) = (made, owner) {
                // The directory just made, through its descriptor (never a path that may have
                // changed since).
                let (uid, gid) = (
                    rustix::fs::Uid::from_raw(uid),
                    rustix::fs::Gid::from_raw(gid),
                );
                rustix::fs::fchown(&fd, Some(uid), Some(gid)).map_err(io("giving", &at))?;
            }
        }
        Ok(made)
    }
}

/// A stale control socket possum may remove ([`Places::stale_socket`]), held by its directory.
#[derive(Debug)]
pub struct StaleSocket {
    dirfd: OwnedFd,
    name: String,
    path: PathBuf,
}

impl StaleSocket {
    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether it is there: a socket owned by its directory's owner or root (anything else is
    /// refused).
    fn check(&self) -> Result<bool, PlaceError> {
        let path = &self.path;
        let st =
            match rustix::fs::statat(&self.dirfd, self.name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => return Ok(false),
                Err(e) => return Err(io_error("reading", path)(e)),
            };
        let kind = match FileType::from_raw_mode(st.st_mode) {
            FileType::Socket => None,
            FileType::Symlink => Some("a symbolic link"),
            FileType::RegularFile => Some("a regular file"),
            FileType::Directory => Some("a directory"),
            _ => Some("not a socket"),
        };
        if let Some(kind) = kind {
            return Err(PlaceError::NotASocket {
                path: path.clone(),
                kind,
            });
        }
        let dir_uid = rustix::fs::fstat(&self.dirfd)
            .map_err(io_error("reading", path))?
            .st_uid;
        if st.st_uid != dir_uid && st.st_uid != 0 {
            return Err(PlaceError::Owner {
                path: path.clone(),
                uid: st.st_uid,
                dir_uid,
            });
        }
        Ok(true)
    }

    /// Removes it, checked once more.
    pub fn remove(self) -> Result<(), PlaceError> {
        if self.check()? {
            rustix::fs::unlinkat(&self.dirfd, self.name.as_str(), AtFlags::empty())
                .map_err(io_error("removing", &self.path))?;
        }
        Ok(())
    }
}

/// A failed system call on `path`, doing `what`.
fn io_error(what: &'static str, path: &Path) -> impl FnOnce(Errno) -> PlaceError {
    let path = path.to_path_buf();
    move |e| PlaceError::Io {
        what,
        path,
        source: e.into(),
    }
}

/// Opening a directory, never through a symbolic link at its last component.
fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Opens directory `dir` (its last component not a symbolic link).
fn open_dir(dir: &Path) -> Result<OwnedFd, Errno> {
    rustix::fs::open(dir, dir_flags(), Mode::empty())
}

/// Whether `p` is `/` followed by plain names (no `..`, no `.`).
fn plain_absolute(p: &Path) -> bool {
    let mut c = p.components();
    c.next() == Some(Component::RootDir) && c.all(|c| matches!(c, Component::Normal(_)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn places(tmp: &Path) -> Places {
        Places::new(vec![tmp.join("sockets")], vec![tmp.join("root")])
    }

    /// A stale socket is removed from possum's directory; a file, a link, a socket elsewhere
    /// are not, each refused by name.
    #[test]
    fn only_a_stale_socket_in_possums_directory_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let p = places(tmp.path());
        let sockets = tmp.path().join("sockets");
        std::fs::create_dir(&sockets).unwrap();
        // Nothing there: nothing to do.
        assert!(!p.remove_stale_socket(&sockets, 42).unwrap());
        let sock = sockets.join("possum-42.sock");
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        assert!(p.remove_stale_socket(&sockets, 42).unwrap());
        assert!(!sock.exists());
        // A regular file in its place stays.
        std::fs::write(&sock, "precious").unwrap();
        let e = p.remove_stale_socket(&sockets, 42).unwrap_err();
        assert!(e.to_string().contains("a regular file"), "{e}");
        assert_eq!(std::fs::read_to_string(&sock).unwrap(), "precious");
        // A link to a file elsewhere: neither followed nor removed.
        std::fs::remove_file(&sock).unwrap();
        let target = tmp.path().join("target");
        std::fs::write(&target, "elsewhere").unwrap();
        symlink(&target, &sock).unwrap();
        let e = p.remove_stale_socket(&sockets, 42).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(std::fs::symlink_metadata(&sock).is_ok() && target.is_file());
        // A socket in a directory that is not possum's stays.
        let other = tmp.path().join("other");
        std::fs::create_dir(&other).unwrap();
        let there = other.join("possum-42.sock");
        drop(std::os::unix::net::UnixListener::bind(&there).unwrap());
        let e = p.remove_stale_socket(&other, 42).unwrap_err();
        assert!(
            e.to_string().contains("not possum's socket directory"),
            "{e}"
        );
        assert!(there.exists());
        // A socket directory that is a link to another directory is not entered.
        let linked = tmp.path().join("linked");
        symlink(&other, &linked).unwrap();
        let p2 = Places::new(vec![linked.clone()], vec![]);
        assert!(p2.remove_stale_socket(&linked, 42).is_err());
        assert!(there.exists());
    }

    /// Directories are made only under a root, never through a link; elsewhere refused.
    #[test]
    fn directories_are_made_only_under_a_root_and_never_through_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let p = places(tmp.path());
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let d = root.join("a/b");
        assert!(p.create_dir("the socket directory", &d).unwrap());
        assert!(d.is_dir());
        assert!(!p.create_dir("the socket directory", &d).unwrap());
        let outside = tmp.path().join("elsewhere/x");
        let e = p.create_dir("the socket directory", &outside).unwrap_err();
        assert!(
            e.to_string()
                .contains("makes directories an image names only under"),
            "{e}"
        );
        assert!(!outside.exists());
        // A link under the root to a directory outside: not followed.
        let away = tmp.path().join("away");
        std::fs::create_dir(&away).unwrap();
        symlink(&away, root.join("l")).unwrap();
        let e = p
            .create_dir("the socket directory", &root.join("l/new"))
            .unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(!away.join("new").exists());
        assert!(p
            .check_dir("the keeper's directory", &root.join("l/k"))
            .is_err());
        assert!(p
            .check_dir("the keeper's directory", &root.join("k/l"))
            .is_ok());
        assert!(p
            .check_dir("the keeper's directory", Path::new("/etc/k"))
            .is_err());
        // Under a root that does not exist yet, inside another: walked from the one that does.
        let nested = Places::new(vec![], vec![root.join("later"), root.clone()]);
        let d = root.join("later/x");
        assert!(nested.create_dir("the socket directory", &d).unwrap());
        assert!(d.is_dir());
    }
}
