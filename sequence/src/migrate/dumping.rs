//! While CRIU dumps a migrated job: the parts of its pages file already written go to the
//! destination as parts of the final set, not after the dump (part of [`super`]).
//!
//! CRIU writes a process's pages file front to back and never rewrites it (a dump run again
//! writes it again: [`super::SendAhead`] then forgets what was sent); once the dump is over,
//! possum's split renames that file to the process's data file, which the final set sends in
//! parts (`POSSUM_MIGRATE_PART_MIB`). So a part of the pages file already written whole is a
//! part of the final set already: [`DirSender::send_growing`] sends it under that name, and the
//! final set claims it by the file's inode, offset and length (one it does not claim, because
//! the guess of the file or of its name was wrong, is removed at the destination: a wrong guess
//! costs bytes, never a wrong image).
//!
//! Which pages file is the process's: CRIU numbers them as it opens them, and before the
//! process's memory it may dump the contents of its memfd files (each a pages file of its own);
//! the shared memory of the tree comes after. The process's pagemap (`pagemap-PID.img`) is made
//! just before its pages file: the newest pages file once that pagemap is there is the one.
//!
//! Where possum relays CRIU's write ([`possum_criu::PagesBy::Relay`]), a pages file CRIU has not
//! opened yet is a pipe (not listed), and one it writes is filled by several threads at once:
//! only its part written whole, front to back, as the relay tells ([`RelayWatch`]), is sent.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use possum_criu::hostmem::{data_name, namespace_pid};
use possum_criu::images::{image_path, pages_ids};
use possum_criu::relay::RelayWatch;

use crate::wire::{DirSender, Totals, WireError};

/// Parts sent at once: the end of the dump waits for at most these.
const MOST_AT_ONCE: usize = 2;

/// How often the pages file is looked at while nothing new of it is whole.
const POLL: Duration = Duration::from_millis(2);

/// The pages file CRIU writes for the job's one process, followed into the final set as the
/// data file the split makes of it.
#[derive(Debug, Clone)]
pub(super) struct Follow {
    /// The data file's path in the image (`criu/possum-hostmem-PID.pages`).
    name: String,
    /// The size of the parts the final set sends it in.
    part_bytes: u64,
    /// The process's number in its own PID namespace, as CRIU's images name it.
    ns_pid: u32,
    /// Where CRIU's write is relayed: how far each pages file is whole.
    watch: Option<Arc<RelayWatch>>,
}

impl Follow {
    /// For a job (`pid`) of one process, whose memory the split takes out of CRIU's images:
    /// the data file it will be (named by the process's number in its own PID namespace, as
    /// CRIU's process tree names it). None for a tree of several processes: which pages file
    /// is whose is not known before CRIU names them.
    pub(super) fn job(pid: i32, part_bytes: u64, watch: Option<Arc<RelayWatch>>) -> Option<Follow> {
        if part_bytes == 0 || crate::tree::with_descendants(pid).len() != 1 {
            return None;
        }
        let ns = namespace_pid(pid)?;
        Some(Follow {
            name: format!("criu/{}", data_name(ns)),
            part_bytes,
            ns_pid: ns,
            watch,
        })
    }
}

/// The pages files in `criu` (`pages-N.img`), least number first: files only (a relay's pipe is
/// one CRIU has not opened).
fn pages_files(criu: &Path) -> Vec<String> {
    let ids = pages_ids(criu).unwrap_or_default();
    (ids.into_iter())
        .map(|n| format!("pages-{n}.img"))
        .filter(|f| fs::symlink_metadata(criu.join(f)).is_ok_and(|m| m.is_file()))
        .collect()
}

/// The process's pagemap file in `criu`: it is made just before the process's pages file.
fn pagemap(criu: &Path, follow: &Follow) -> PathBuf {
    image_path(criu, "pagemap", follow.ns_pid)
}

/// The process's pages file in `criu`, once its pagemap is there: the newest; where CRIU's write
/// is relayed, the first the relay saw opened once that pagemap was there (a pipe is renamed a
/// file only once the relay sees it opened, so the newest file may be an older one then).
fn process_pages_file(criu: &Path, follow: &Follow) -> Option<String> {
    let pagemap = pagemap(criu, follow);
    if !pagemap.exists() {
        return None;
    }
    match &follow.watch {
        // (A file only: a pipe is not sent; the next look finds it in place.)
        Some(w) => w
            .opened_after(&pagemap.file_name()?.to_string_lossy())
            .filter(|f| fs::symlink_metadata(criu.join(f)).is_ok_and(|m| m.is_file())),
        None => {
            // Not one made before the pagemap (a memfd's, CRIU not yet at the process's file),
            // where the filesystem knows when files were made (to its clock's tick).
            let born = |p: &Path| fs::metadata(p).and_then(|m| m.created()).ok();
            let newest = pages_files(criu).pop()?;
            match (born(&pagemap), born(&criu.join(&newest))) {
                (Some(map), Some(file)) if file < map => None,
                _ => Some(newest),
            }
        }
    }
}

/// What [`send_while_dumping`] did.
#[derive(Debug, Clone, Default)]
pub(super) struct Dumped {
    /// The parts sent.
    pub(super) sent: Totals,
    /// Times the directory was looked at.
    pub(super) looks: u32,
    /// The pages file taken for the process's.
    pub(super) chosen: Option<String>,
    /// Where nothing was sent though a pages file holds a whole part by the end: the pages
    /// files then, with their lengths (none otherwise).
    pub(super) seen: Vec<(String, u64)>,
}

impl Dumped {
    /// What was seen, for a note where nothing was sent.
    pub(super) fn seen(&self) -> String {
        let files: Vec<String> = (self.seen.iter())
            .map(|(f, len)| format!("{f} at {len} bytes"))
            .collect();
        let chosen = self.chosen.as_deref().unwrap_or("none chosen");
        format!(
            "{} looks; the process's: {chosen}; at the end: {}",
            self.looks,
            match files.is_empty() {
                true => "no pages file".to_string(),
                false => files.join(", "),
            }
        )
    }
}

/// Sends the whole parts of the pages file `follow` names under `dir/criu` as CRIU writes it,
/// until `over` (the dump is over, or failed). Once `again` (CRIU dumps again into the same
/// directory), nothing more is sent and what was sent is left for the final set to remove.
pub(super) fn send_while_dumping<S: Read + Write + ?Sized>(
    sender: &mut DirSender,
    mut stream: &mut S,
    dir: &Path,
    follow: &Follow,
    (over, again): (&AtomicBool, &AtomicBool),
) -> Result<Dumped, WireError> {
    let mut d = Dumped::default();
    let mut pagemap_seen = false;
    let criu = dir.join("criu");
    while !over.load(Ordering::Acquire) {
        if again.load(Ordering::Acquire) {
            sender.forget_growing();
            std::thread::sleep(POLL);
            continue;
        }
        d.looks += 1;
        if d.chosen.is_none() {
            // Chosen at the look after the one that found the pagemap: CRIU opens the pages file
            // just after it, so by then the newest file is the process's.
            match pagemap_seen {
                true => d.chosen = process_pages_file(&criu, follow),
                false => pagemap_seen = pagemap(&criu, follow).exists(),
            }
        }
        let t = match &d.chosen {
            Some(file) => sender.send_growing(
                &mut stream,
                dir,
                (&format!("criu/{file}"), &follow.name),
                (follow.watch.as_ref()).and_then(|w| w.whole(file)),
                follow.part_bytes,
                MOST_AT_ONCE,
            )?,
            None => Totals::default(),
        };
        if t.files == 0 {
            std::thread::sleep(POLL);
        }
        d.sent.files += t.files;
        d.sent.bytes += t.bytes;
    }
    if d.sent.files == 0 {
        d.seen = (pages_files(&criu).into_iter())
            .map(|f| {
                let len = fs::metadata(criu.join(&f)).map_or(0, |m| m.len());
                (f, len)
            })
            .collect();
        // Nothing to say where no pages file could have had a whole part.
        if d.seen.iter().all(|(_, len)| *len < follow.part_bytes) {
            d.seen.clear();
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_s_pages_file_is_the_newest_once_its_pagemap_is_there() {
        let d = tempfile::tempdir().unwrap();
        let follow = Follow {
            name: "criu/possum-hostmem-7.pages".into(),
            part_bytes: 1 << 20,
            ns_pid: 7,
            watch: None,
        };
        assert_eq!(process_pages_file(d.path(), &follow), None);
        // A memfd's contents, dumped before the process's memory.
        for name in ["pages-1.img", "pagemap-shmem-99.img", "pages-x.img"] {
            fs::write(d.path().join(name), b"").unwrap();
        }
        assert_eq!(
            process_pages_file(d.path(), &follow),
            None,
            "no pagemap yet"
        );
        // (Made a few file-time ticks later, as CRIU writes the memfd's pages in between.)
        std::thread::sleep(Duration::from_millis(30));
        fs::write(d.path().join("pagemap-7.img"), b"").unwrap();
        if fs::metadata(d.path().join("pages-1.img"))
            .and_then(|m| m.created())
            .is_ok()
        {
            assert_eq!(
                process_pages_file(d.path(), &follow),
                None,
                "the memfd's, made before the pagemap, is not the process's"
            );
        }
        fs::write(d.path().join("pages-2.img"), b"").unwrap();
        assert_eq!(
            process_pages_file(d.path(), &follow).as_deref(),
            Some("pages-2.img")
        );
        fs::write(d.path().join("pages-10.img"), b"").unwrap();
        // A relay's pipe for a file CRIU has not opened.
        nix::unistd::mkfifo(
            &d.path().join("pages-11.img"),
            nix::sys::stat::Mode::S_IRUSR,
        )
        .unwrap();
        assert_eq!(
            pages_files(d.path()),
            ["pages-1.img", "pages-2.img", "pages-10.img"],
            "by number, not by name; no pipe"
        );
    }

    /// Where CRIU's write is relayed, the process's pages file is the one the relay saw opened
    /// once the pagemap was there, and only while a regular file has its name: a pipe there is
    /// never named to the sender (which would refuse it and fail the migration).
    #[test]
    fn a_relayed_pages_file_is_named_only_as_a_file() {
        use possum_criu::relay::Relay;
        use std::os::unix::fs::FileTypeExt;
        let d = tempfile::tempdir().unwrap();
        let watch = Arc::new(RelayWatch::default());
        let relay = Relay::start(d.path(), 2, 1, 1 << 20, Some(watch.clone())).unwrap();
        let follow = Follow {
            name: "criu/possum-hostmem-7.pages".into(),
            part_bytes: 1 << 20,
            ns_pid: 7,
            watch: Some(watch),
        };
        fs::write(d.path().join("pagemap-7.img"), b"").unwrap();
        assert_eq!(process_pages_file(d.path(), &follow), None, "none opened");
        let mut writer = fs::File::options()
            .write(true)
            .open(d.path().join("pages-1.img"))
            .unwrap();
        // (The relay sees a pipe opened by what is written into it.)
        writer.write_all(&[7; 4096]).unwrap();
        let t = std::time::Instant::now();
        let chosen = loop {
            if let Some(f) = process_pages_file(d.path(), &follow) {
                break f;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "never named");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(chosen, "pages-1.img");
        assert!(fs::symlink_metadata(d.path().join(&chosen))
            .unwrap()
            .is_file());
        // A pipe under the name the watch gives is not named.
        fs::remove_file(d.path().join(&chosen)).unwrap();
        nix::unistd::mkfifo(&d.path().join(&chosen), nix::sys::stat::Mode::S_IRUSR).unwrap();
        assert!(fs::symlink_metadata(d.path().join(&chosen))
            .unwrap()
            .file_type()
            .is_fifo());
        assert_eq!(process_pages_file(d.path(), &follow), None, "a pipe named");
        drop(writer);
        drop(relay);
    }
}
