//! `/proc/PID/maps` and `/proc/PID/fd`, read for the device mappings and open device files of a
//! process the plugin claims.
//!
//! CRIU asks about a device mapping once per *run* of VMAs: `handle_vma` in CRIU 4.1's
//! `criu/proc_parse.c` calls `HANDLE_DEVICE_VMA` for a VMA unless the VMA right before it maps the
//! same file (same device numbers and inode), in which case it "borrows" the previous VMA's
//! verdict. [`runs`] groups the mappings the same way, so the plugin can name the ranges each
//! call covers.

use std::path::{Path, PathBuf};

/// One line of `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// `rwxs`-style permissions, as the kernel prints them (`rw-s`).
    pub perms: String,
    /// `MAJOR:MINOR` of the file system holding the file (not the device's own numbers).
    pub dev: String,
    /// The file's inode, 0 for anonymous memory.
    pub inode: u64,
    /// The path, or a pseudo-name like `[heap]`; `None` for anonymous memory.
    pub path: Option<String>,
}

impl MapEntry {
    /// Whether the mapping is shared (`s`) rather than private (`p`).
    pub fn shared(&self) -> bool {
        self.perms.as_bytes().get(3) == Some(&b's')
    }

    /// `0xSTART-0xEND PERMS`, as the plugin logs a range.
    pub fn range(&self) -> String {
        format!("{:#x}-{:#x} {}", self.start, self.end, self.perms)
    }

    /// Whether `other` maps the same file as this entry (CRIU's `vfi_equal`: device and inode).
    fn same_file(&self, other: &MapEntry) -> bool {
        self.inode != 0 && self.dev == other.dev && self.inode == other.inode
    }
}

/// Parses one line of `/proc/PID/maps` (`start-end perms offset dev inode [path]`).
pub fn parse_line(line: &str) -> Option<MapEntry> {
    let mut it = line.splitn(6, ' ');
    let (start, end) = it.next()?.split_once('-')?;
    let perms = it.next()?.to_string();
    let _offset = it.next()?;
    let dev = it.next()?.to_string();
    let inode = it.next()?.parse().ok()?;
    let path = it
        .next()
        .map(str::trim_start)
        .filter(|p| !p.is_empty())
        .map(str::to_string);
    Some(MapEntry {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        perms,
        dev,
        inode,
        path,
    })
}

/// Parses the text of `/proc/PID/maps`, skipping lines it cannot read.
pub fn parse(text: &str) -> Vec<MapEntry> {
    text.lines().filter_map(parse_line).collect()
}

/// Consecutive mappings of one file, which CRIU asks about with one `HANDLE_DEVICE_VMA` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The mapped file.
    pub path: String,
    /// Its mappings, in address order.
    pub entries: Vec<MapEntry>,
}

/// The runs of mappings in `maps` (all of a process's mappings, in order) whose file `wanted`
/// accepts. A run ends where the next mapping is of another file, as CRIU's borrowing does: any
/// mapping in between, even anonymous, starts a new run.
pub fn runs(maps: &[MapEntry], wanted: impl Fn(&str) -> bool) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    let mut prev: Option<&MapEntry> = None;
    for e in maps {
        if let Some(path) = e.path.as_deref().filter(|p| wanted(p)) {
            // The previous mapping is of the same file, so it was wanted too and ends the last run.
            let borrows = prev.is_some_and(|p| p.same_file(e));
            match out.last_mut() {
                Some(last) if borrows => last.entries.push(e.clone()),
                _ => out.push(Run {
                    path: path.to_string(),
                    entries: vec![e.clone()],
                }),
            }
        }
        prev = Some(e);
    }
    out
}

/// The targets of the open descriptors in `/proc/PID/fd` (best effort: unreadable ones skipped).
pub fn open_files(pid: i32) -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = dir
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .collect();
    files.sort();
    files
}

/// The process whose `/proc/PID/map_files` directory one of `links` (the targets of this
/// process's descriptors) is: while CRIU parses a process's mappings it holds that directory
/// open (`parse_smaps`), and `HANDLE_DEVICE_VMA` itself does not say which process it asks about.
/// `None` unless exactly one such process is found.
pub fn pid_parsing_maps<'a>(links: impl IntoIterator<Item = &'a Path>) -> Option<i32> {
    let mut found: Option<i32> = None;
    for link in links {
        let Some(s) = link.to_str() else { continue };
        let Some(rest) = s.strip_suffix("/map_files") else {
            continue;
        };
        let Some(pid) = rest.rsplit('/').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        match found {
            Some(f) if f != pid => return None,
            _ => found = Some(pid),
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
200000000-200200000 ---p 00000000 00:00 0 
200400000-200600000 rw-s 00000000 00:05 1032                             /dev/nvidia-uvm
200600000-200800000 rw-s 00000000 00:05 1032                             /dev/nvidia-uvm
200800000-200a00000 rw-s 00000000 00:05 1030                             /dev/nvidiactl
200a00000-200c00000 rw-s 00000000 00:05 1032                             /dev/nvidia-uvm
7f0000000000-7f0000001000 rw-s 00000000 00:05 1030                       /dev/nvidiactl
7f0000001000-7f0000002000 r--p 00000000 00:00 0 
7f0000002000-7f0000003000 rw-s 00000000 00:05 1030                       /dev/nvidiactl
7f1000000000-7f1000021000 r-xp 00000000 fe:00 4242                       /usr/lib/x86_64-linux-gnu/libc.so.6
";

    #[test]
    fn parses_maps_lines() {
        let m = parse(MAPS);
        assert_eq!(m.len(), 10);
        assert_eq!(m[0].path.as_deref(), Some("[heap]"));
        assert_eq!(m[1].path, None);
        assert_eq!(m[2].start, 0x2_0040_0000);
        assert_eq!(m[2].end, 0x2_0060_0000);
        assert_eq!(m[2].perms, "rw-s");
        assert!(m[2].shared());
        assert!(!m[0].shared());
        assert_eq!(m[2].inode, 1032);
        assert_eq!(m[2].path.as_deref(), Some("/dev/nvidia-uvm"));
        assert_eq!(m[2].range(), "0x200400000-0x200600000 rw-s");
        assert_eq!(parse_line("garbage"), None);
        let spaced = parse_line("1000-2000 r--p 00000000 fe:00 7 /tmp/a b").unwrap();
        assert_eq!(spaced.path.as_deref(), Some("/tmp/a b"));
    }

    #[test]
    fn runs_group_consecutive_mappings_of_one_file_as_criu_borrows() {
        let m = parse(MAPS);
        let r = runs(&m, |p| p.starts_with("/dev/nvidia"));
        let shape: Vec<(&str, usize)> = r
            .iter()
            .map(|r| (r.path.as_str(), r.entries.len()))
            .collect();
        assert_eq!(
            shape,
            [
                ("/dev/nvidia-uvm", 2),
                ("/dev/nvidiactl", 1),
                ("/dev/nvidia-uvm", 1),
                ("/dev/nvidiactl", 1),
                // An anonymous mapping in between starts a new run.
                ("/dev/nvidiactl", 1),
            ]
        );
        assert!(runs(&m, |_| false).is_empty());
    }

    #[test]
    fn the_process_being_parsed_is_found_from_its_map_files_directory() {
        let links = [
            Path::new("/dev/null"),
            Path::new("/proc/4242/map_files"),
            Path::new("/tmp/images"),
        ];
        assert_eq!(pid_parsing_maps(links), Some(4242));
        assert_eq!(
            pid_parsing_maps([Path::new("/tmp/.criu.proc/17/map_files")]),
            Some(17)
        );
        assert_eq!(
            pid_parsing_maps([
                Path::new("/proc/1/map_files"),
                Path::new("/proc/2/map_files")
            ]),
            None
        );
        assert_eq!(pid_parsing_maps([Path::new("/proc/self/maps")]), None);
    }
}
