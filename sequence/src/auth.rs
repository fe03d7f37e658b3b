//! Authenticated images (`possum checkpoint --hmac-key FILE`, `possum restore --hmac-key FILE`):
//! an image that crosses hosts carries `DIR/possum.hmac`, the HMAC-SHA256 under a key both hosts
//! share of everything in the image; a restore given the key checks it before it reads anything
//! else of the image, so an image edited anywhere (possum.json, CRIU's images, the GPU images)
//! is refused.
//!
//! What is authenticated: every entry under DIR, in the order of their relative paths (bytes),
//! each as its path, a NUL, a kind byte (`f` a regular file, `d` a directory), and for a file its
//! length (`u64`, little endian) and its bytes. Left out: `possum.hmac` itself, and what a restore
//! writes into the image (CRIU's `criu/restore-*.log` and `criu/stats-restore`). Anything else (a
//! symbolic link, a FIFO) makes the image unauthenticable: sealing and checking both refuse it.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The authentication's file in an image directory.
pub const HMAC_FILE: &str = "possum.hmac";
/// The shortest key accepted (bytes).
pub const MIN_KEY_BYTES: usize = 32;
/// The longest key file read (bytes).
const MAX_KEY_BYTES: u64 = 4096;
/// The context under which the migration wire's key is derived from the shared key.
const WIRE_KEY_CONTEXT: &str = "possum 2026-12 migration wire v2: frame and handshake key";

/// A key for images' HMAC, read from a file ([`HmacKey::read`]).
#[derive(Clone)]
pub struct HmacKey(Vec<u8>);

impl std::fmt::Debug for HmacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HmacKey(..)")
    }
}

/// Why an image could not be sealed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The key file.
    #[error("reading the HMAC key {}", path.display())]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A key too short or too long.
    #[error(
        "the HMAC key {} holds {len} bytes: a key is {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes \
         (e.g. `head -c 32 /dev/urandom > FILE`)",
        path.display()
    )]
    KeyLength {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// The image has no authentication.
    #[error(
        "{} has no {HMAC_FILE}: it was not checkpointed with --hmac-key, and --hmac-key \
         restores only authenticated images",
        dir.display()
    )]
    Missing {
        /// The image directory.
        dir: PathBuf,
    },
    /// The image is not what was sealed (or another key sealed it).
    #[error(
        "{} does not match its {HMAC_FILE}: the image was changed after it was checkpointed, or \
         sealed with another key; it is refused",
        dir.display()
    )]
    Mismatch {
        /// The image directory.
        dir: PathBuf,
    },
    /// Something in the image that cannot be authenticated.
    #[error("{}: {what}, which an authenticated image cannot hold", path.display())]
    Unsupported {
        /// The entry.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// Reading or writing the image.
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

impl HmacKey {
    /// The key in file `path` (its bytes, as they are).
    pub fn read(path: &Path) -> Result<HmacKey, AuthError> {
        let io = |source| AuthError::KeyFile {
            path: path.to_path_buf(),
            source,
        };
        let mut bytes = Vec::new();
        fs::File::open(path)
            .map_err(io)?
            .take(MAX_KEY_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        HmacKey::from_bytes(bytes).map_err(|len| AuthError::KeyLength {
            path: path.to_path_buf(),
            len,
        })
    }

    /// The key `bytes`; its length if it is not one.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<HmacKey, u64> {
        if !(MIN_KEY_BYTES as u64..=MAX_KEY_BYTES).contains(&(bytes.len() as u64)) {
            return Err(bytes.len() as u64);
        }
        Ok(HmacKey(bytes))
    }

    /// The migration wire's key, derived from this one with BLAKE3's `derive_key` under a
    /// context of the wire's alone: the same key file serves images and the wire, and neither
    /// use's MAC can stand for the other's.
    pub(crate) fn wire_key(&self) -> [u8; 32] {
        blake3::derive_key(WIRE_KEY_CONTEXT, &self.0)
    }

    pub(crate) fn mac(&self) -> Hmac<Sha256> {
        // Any key length is valid for HMAC.
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length")
    }
}

/// Writes `dir/possum.hmac`: the HMAC under `key` of the image `dir`.
pub fn seal(dir: &Path, key: &HmacKey) -> Result<(), AuthError> {
    let tag = image_mac(dir, key)?.finalize().into_bytes();
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join(HMAC_FILE);
    fs::write(&path, format!("{hex}\n")).map_err(|source| AuthError::Io {
        what: "writing",
        path,
        source,
    })
}

/// Checks the image `dir` against its `possum.hmac` under `key` (in constant time).
pub fn verify(dir: &Path, key: &HmacKey) -> Result<(), AuthError> {
    let path = dir.join(HMAC_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(AuthError::Missing {
                dir: dir.to_path_buf(),
            })
        }
        Err(source) => {
            return Err(AuthError::Io {
                what: "reading",
                path,
                source,
            })
        }
    };
    let mismatch = || AuthError::Mismatch {
        dir: dir.to_path_buf(),
    };
    let tag = unhex(text.trim()).ok_or_else(mismatch)?;
    image_mac(dir, key)?
        .verify_slice(&tag)
        .map_err(|_| mismatch())
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// Whether relative path `rel` is left out of the authentication.
fn left_out(rel: &Path) -> bool {
    let Some(s) = rel.to_str() else {
        return false;
    };
    s == HMAC_FILE
        || s == "criu/stats-restore"
        || s.strip_prefix("criu/restore-")
            .is_some_and(|r| r.ends_with(".log") && !r.contains('/'))
}

/// The HMAC of the image `dir`, fed but not finished.
fn image_mac(dir: &Path, key: &HmacKey) -> Result<Hmac<Sha256>, AuthError> {
    let mut entries = Vec::new();
    list(dir, Path::new(""), &mut entries)?;
    entries.sort();
    let mut mac = key.mac();
    let mut buf = vec![0u8; 1 << 20];
    for rel in entries {
        if left_out(&rel) {
            continue;
        }
        let path = dir.join(&rel);
        let io = |what| {
            let path = path.clone();
            move |source| AuthError::Io { what, path, source }
        };
        let meta = fs::symlink_metadata(&path).map_err(io("reading"))?;
        mac.update(rel.as_os_str().as_encoded_bytes());
        mac.update(&[0]);
        if meta.is_dir() {
            mac.update(b"d");
            continue;
        }
        mac.update(b"f");
        mac.update(&meta.len().to_le_bytes());
        let mut f = fs::File::open(&path).map_err(io("reading"))?;
        let mut n = 0u64;
        loop {
            let k = f.read(&mut buf).map_err(io("reading"))?;
            if k == 0 {
                break;
            }
            mac.update(&buf[..k]);
            n += k as u64;
        }
        if n != meta.len() {
            return Err(AuthError::Mismatch {
                dir: dir.to_path_buf(),
            });
        }
    }
    Ok(mac)
}

/// The entries under `dir/rel` (relative to `dir`), recursively; anything but regular files and
/// directories refused.
fn list(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<(), AuthError> {
    let at = dir.join(rel);
    let rd = fs::read_dir(&at).map_err(|source| AuthError::Io {
        what: "reading",
        path: at.clone(),
        source,
    })?;
    for e in rd {
        let e = e.map_err(|source| AuthError::Io {
            what: "reading",
            path: at.clone(),
            source,
        })?;
        let r = rel.join(e.file_name());
        let t = e.file_type().map_err(|source| AuthError::Io {
            what: "reading",
            path: e.path(),
            source,
        })?;
        if t.is_dir() {
            out.push(r.clone());
            list(dir, &r, out)?;
        } else if t.is_file() {
            out.push(r);
        } else if !left_out(&r) {
            let what = if t.is_symlink() {
                "a symbolic link"
            } else {
                "not a regular file or directory"
            };
            return Err(AuthError::Unsupported {
                path: e.path(),
                what,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> HmacKey {
        HmacKey::from_bytes(vec![b; 32]).unwrap()
    }

    /// HMAC-SHA256 as RFC 4231 test case 2 gives it (the primitive under the image's).
    #[test]
    fn the_mac_is_hmac_sha256() {
        let mut m = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        m.update(b"what do ya want for nothing?");
        let hex: String = m
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn an_image_changed_anywhere_or_sealed_with_another_key_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        fs::create_dir_all(d.join("criu")).unwrap();
        fs::create_dir_all(d.join("gpu/gpu-0")).unwrap();
        fs::write(d.join("possum.json"), "{}").unwrap();
        fs::write(d.join("criu/pages-1.img"), vec![3u8; 3 << 20]).unwrap();
        fs::write(d.join("gpu/gpu-0/data-000.bin"), "data").unwrap();
        assert!(matches!(verify(d, &key(1)), Err(AuthError::Missing { .. })));
        seal(d, &key(1)).unwrap();
        verify(d, &key(1)).unwrap();
        assert!(matches!(
            verify(d, &key(2)),
            Err(AuthError::Mismatch { .. })
        ));
        // What a restore writes is left out.
        fs::write(d.join("criu/restore-77.log"), "log").unwrap();
        fs::write(d.join("criu/stats-restore"), "stats").unwrap();
        verify(d, &key(1)).unwrap();
        // One byte changed, a file added, a file renamed: each refused.
        let mut pages = fs::read(d.join("criu/pages-1.img")).unwrap();
        pages[2 << 20] ^= 1;
        fs::write(d.join("criu/pages-1.img"), &pages).unwrap();
        assert!(matches!(
            verify(d, &key(1)),
            Err(AuthError::Mismatch { .. })
        ));
        pages[2 << 20] ^= 1;
        fs::write(d.join("criu/pages-1.img"), &pages).unwrap();
        verify(d, &key(1)).unwrap();
        fs::write(d.join("criu/extra.img"), "x").unwrap();
        assert!(verify(d, &key(1)).is_err());
        fs::remove_file(d.join("criu/extra.img")).unwrap();
        fs::rename(d.join("gpu/gpu-0"), d.join("gpu/gpu-1")).unwrap();
        assert!(verify(d, &key(1)).is_err());
        fs::rename(d.join("gpu/gpu-1"), d.join("gpu/gpu-0")).unwrap();
        verify(d, &key(1)).unwrap();
        // A link in the image cannot be authenticated.
        std::os::unix::fs::symlink("/etc/passwd", d.join("criu/link")).unwrap();
        assert!(matches!(
            verify(d, &key(1)),
            Err(AuthError::Unsupported { .. })
        ));
    }

    #[test]
    fn a_short_key_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let k = tmp.path().join("key");
        fs::write(&k, "short").unwrap();
        let e = HmacKey::read(&k).unwrap_err();
        assert!(e.to_string().contains("holds 5 bytes"), "{e}");
        fs::write(&k, [9u8; 32]).unwrap();
        HmacKey::read(&k).unwrap();
    }
}
