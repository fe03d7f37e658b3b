//! The socket directory's rule, checked wherever possum uses the directory: by the job's server
//! before it binds its socket, by the client before it connects, and by the checkpoint's lock.
//!
//! The directory must be a real directory (not a symbolic link), belong to one of the users
//! allowed for the use at hand ([`secure_dir`]'s `owners`), and give nobody but its owner any
//! access (mode `0700`). Only its last component is checked: its parents are expected to be
//! trusted (`/tmp` with its sticky bit, a home or runtime directory).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt,
};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;

/// Why a socket directory, or a file in it, is refused.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// Looking at or creating the directory failed (a missing directory is `NotFound`).
    #[error("socket directory {}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The path is a symbolic link.
    #[error(
        "socket directory {} is a symbolic link: possum uses only a real directory there; remove the link (`rm {}`)",
        path.display(), path.display()
    )]
    Symlink {
        /// The directory's path.
        path: PathBuf,
    },
    /// The path is something other than a directory.
    #[error("socket directory {} is not a directory: remove it or choose another POSSUM_SOCKET_DIR", path.display())]
    NotDir {
        /// The path.
        path: PathBuf,
    },
    /// The directory belongs to a user who is not allowed for this use.
    #[error(
        "socket directory {} belongs to uid {owner}, not to {}: another user could serve sockets there in a job's name; remove it (`rm -r {}`, as uid {owner} or root) or set POSSUM_SOCKET_DIR to a directory of your own",
        path.display(), uids(allowed), path.display()
    )]
    Owner {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Those it may belong to.
        allowed: Vec<u32>,
    },
    /// The directory is shared (the sticky bit, as /tmp has): it cannot be a socket directory.
    #[error(
        "socket directory {} is a shared directory (mode {mode:04o}, sticky): choose a directory of its own, such as /tmp/possum (POSSUM_SOCKET_DIR or --socket-dir)",
        path.display()
    )]
    Shared {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Others than its owner have access to the directory.
    #[error(
        "socket directory {} has mode {mode:04o}: nobody but its owner may have access to it; `chmod 700 {}` (or remove it: `rm -r {}`)",
        path.display(), path.display(), path.display()
    )]
    Mode {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Opening or creating a file in the directory failed (a symbolic link there is `ELOOP`).
    #[error("{}: {source}", path.display())]
    FileIo {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file in the directory is not what possum made there.
    #[error("{} is {what}, not a regular file of {} with one link: refused (remove it)", path.display(), uids(allowed))]
    NotPrivate {
        /// The file.
        path: PathBuf,
        /// What it is.
        what: String,
        /// Those it may belong to.
        allowed: Vec<u32>,
    },
}

impl DirError {
    /// Whether the directory does not exist.
    pub fn is_missing(&self) -> bool {
        matches!(self, DirError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

fn uids(allowed: &[u32]) -> String {
    let names: Vec<String> = allowed.iter().map(|u| format!("uid {u}")).collect();
    names.join(" or ")
}

/// A socket directory that passed the rule, open: files are made in it through its descriptor,
/// so in the directory that was checked whatever its path has become since.
#[derive(Debug)]
pub struct SecureDir {
    dir: File,
    path: PathBuf,
    owners: Vec<u32>,
}

impl SecureDir {
    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the file `name` in the directory, creating it (mode 0600) if it is missing, never
    /// through a symbolic link; refused unless it is a regular file with one link belonging to
    /// one of the directory's allowed owners. For a lock: it is opened for reading only.
    pub fn open_private_file(&self, name: &str) -> Result<File, DirError> {
        let path = self.path.join(name);
        // Through the descriptor: `/proc/self/fd/N` is the checked directory itself.
        let through = PathBuf::from(format!("/proc/self/fd/{}", self.dir.as_raw_fd())).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(false)
            .create(false)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CREAT | OFlag::O_CLOEXEC).bits())
            .mode(0o600)
            .open(&through)
            .map_err(|source| DirError::FileIo {
                path: path.clone(),
                source,
            })?;
        let meta = file.metadata().map_err(|source| DirError::FileIo {
            path: path.clone(),
            source,
        })?;
        let what = if !meta.file_type().is_file() {
            Some("not a regular file".to_string())
        } else if !self.owners.contains(&meta.uid()) {
            Some(format!("a file of uid {}", meta.uid()))
        } else if meta.nlink() != 1 {
            Some(format!("a file with {} links", meta.nlink()))
        } else {
            None
        };
        match what {
            Some(what) => Err(DirError::NotPrivate {
                path,
                what,
                allowed: self.owners.clone(),
            }),
            None => Ok(file),
        }
    }
}

/// Opens the socket directory `path` and checks it: a real directory (not a symbolic link)
/// belonging to one of `owners`, with no access for group or others. Creates nothing and
/// changes nothing (the client's check before it connects).
pub fn secure_dir(path: &Path, owners: &[u32]) -> Result<SecureDir, DirError> {
    check(path, owners, false, None)
}

/// [`secure_dir`] for the one who makes sockets or files in the directory: a missing directory
/// is created (mode 0700; its missing parents too) and given to `owners[0]`; one of this
/// process's own user whose mode lets others in is tightened to 0700 (anything else is refused
/// as [`secure_dir`] refuses it).
pub fn prepare_dir(path: &Path, owners: &[u32]) -> Result<SecureDir, DirError> {
    let io = |source| DirError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(io)?;
    }
    let me = nix::unistd::geteuid().as_raw();
    let give = match fs::DirBuilder::new().mode(0o700).create(path) {
        // Made by root for a job's user (a checkpoint's lock before the job's socket): the
        // job's, so that the job may serve there.
        Ok(()) => owners.first().copied().filter(|&o| o != me),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => None,
        Err(e) => return Err(io(e)),
    };
    check(path, owners, true, give)
}

fn check(
    path: &Path,
    owners: &[u32],
    tighten: bool,
    give: Option<u32>,
) -> Result<SecureDir, DirError> {
    let io = |source| DirError::Io {
        path: path.to_path_buf(),
        source,
    };
    let link = fs::symlink_metadata(path).map_err(io)?;
    if link.file_type().is_symlink() {
        return Err(DirError::Symlink {
            path: path.to_path_buf(),
        });
    }
    if !link.is_dir() {
        return Err(DirError::NotDir {
            path: path.to_path_buf(),
        });
    }
    // The checks are made on the open directory: what is checked is what is used.
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // Replaced by a link or a file since the look above.
            Some(code) if code == nix::libc::ELOOP => DirError::Symlink {
                path: path.to_path_buf(),
            },
            Some(code) if code == nix::libc::ENOTDIR => DirError::NotDir {
                path: path.to_path_buf(),
            },
            _ => io(e),
        })?;
    let mut meta = dir.metadata().map_err(io)?;
    if let Some(owner) = give.filter(|_| meta.uid() == nix::unistd::geteuid().as_raw()) {
        std::os::unix::fs::fchown(&dir, Some(owner), None).map_err(io)?;
        meta = dir.metadata().map_err(io)?;
    }
    if !owners.contains(&meta.uid()) {
        return Err(DirError::Owner {
            path: path.to_path_buf(),
            owner: meta.uid(),
            allowed: owners.to_vec(),
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        let mine = meta.uid() == nix::unistd::geteuid().as_raw();
        // A shared directory (the sticky bit: /tmp, /var/tmp, /dev/shm) is never tightened: it
        // is everyone's, and cannot be a socket directory.
        if mode & 0o1000 != 0 {
            return Err(DirError::Shared {
                path: path.to_path_buf(),
                mode,
            });
        }
        if !(tighten && mine) {
            return Err(DirError::Mode {
                path: path.to_path_buf(),
                mode,
            });
        }
        dir.set_permissions(fs::Permissions::from_mode(mode & 0o7700))
            .map_err(io)?;
    }
    Ok(SecureDir {
        dir,
        path: path.to_path_buf(),
        owners: owners.to_vec(),
    })
}

/// The effective uid of process `pid` (`/proc/PID/status`): the user its sockets and files
/// belong to.
pub fn process_uid(pid: u32) -> io::Result<u32> {
    let status = crate::proc_text(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|e| e.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/proc/{pid}/status has no Uid line"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn a_shared_sticky_directory_is_refused_and_left_as_it_is() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("shared");
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o1777)).unwrap();
        let e = prepare_dir(&d, &[me()]).unwrap_err();
        assert!(matches!(e, DirError::Shared { mode: 0o1777, .. }), "{e}");
        assert!(!e.to_string().contains("chmod"), "{e}");
        let mode = fs::metadata(&d).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o1777, "a shared directory was changed");
    }

    #[test]
    fn a_new_directory_is_private_and_a_wide_one_of_ours_is_tightened() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("a/b");
        prepare_dir(&d, &[me()]).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        let e = secure_dir(&d, &[me()]).unwrap_err();
        assert!(matches!(e, DirError::Mode { mode: 0o755, .. }), "{e:?}");
        assert!(e.to_string().contains("chmod 700"), "{e}");
        prepare_dir(&d, &[me()]).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        secure_dir(&d, &[me()]).unwrap();
    }

    #[test]
    fn a_missing_directory_is_missing() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(secure_dir(&tmp.path().join("no"), &[me()])
            .unwrap_err()
            .is_missing());
    }

    #[test]
    fn the_uid_of_this_process_is_read() {
        assert_eq!(process_uid(std::process::id()).unwrap(), me());
    }
}
