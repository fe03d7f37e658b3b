//! The plugin's own file in CRIU's images directory, [`RECORD_FILE`]: what it claimed at dump
//! time, read back at restore time to tell its external files (`RESTORE_EXT_FILE` only gets an
//! id) from other plugins'.
//!
//! One record a line, text:
//!
//! ```text
//! vma PID 0xSTART-0xEND PERMS PATH     a claimed mapping (informative; restore goes by PATH)
//! file ID PATH                         a claimed open file, ID in hex as CRIU numbers it
//! cuda PID possum DIR                  a CUDA process the plugin checkpointed, possum's GPU
//!                                      image in DIR (a directory of the images directory)
//! cuda PID driver                      the same, by NVIDIA's driver checkpoint alone
//! ```

use std::fmt;

/// The file's name in the images directory.
pub const RECORD_FILE: &str = "possum-criu-plugin.txt";

/// One line of [`RECORD_FILE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A claimed mapping of `path`.
    Vma {
        /// The dumped process.
        pid: i32,
        /// First address.
        start: u64,
        /// One past the last address.
        end: u64,
        /// `rw-s`-style permissions.
        perms: String,
        /// The device.
        path: String,
    },
    /// A claimed open file (an external file of CRIU's `files.img`, id `id`).
    File {
        /// CRIU's id of the file.
        id: u32,
        /// The device.
        path: String,
    },
    /// A CUDA process the plugin checkpointed ([`crate::live`]): the restore brings it back.
    Cuda {
        /// The dumped process.
        pid: i32,
        /// possum's GPU image directory (a name in the images directory), when possum was loaded.
        gpu_dir: Option<String>,
    },
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Record::Vma {
                pid,
                start,
                end,
                perms,
                path,
            } => write!(f, "vma {pid} {start:#x}-{end:#x} {perms} {path}"),
            Record::File { id, path } => write!(f, "file {id:#x} {path}"),
            Record::Cuda {
                pid,
                gpu_dir: Some(d),
            } => write!(f, "cuda {pid} possum {d}"),
            Record::Cuda { pid, gpu_dir: None } => write!(f, "cuda {pid} driver"),
        }
    }
}

impl Record {
    /// Parses one line written by [`Record`]'s `Display`.
    pub fn parse(line: &str) -> Option<Record> {
        let (kind, rest) = line.split_once(' ')?;
        match kind {
            "vma" => {
                let mut it = rest.splitn(4, ' ');
                let pid = it.next()?.parse().ok()?;
                let (start, end) = it.next()?.split_once('-')?;
                let perms = it.next()?.to_string();
                let path = it.next()?.to_string();
                Some(Record::Vma {
                    pid,
                    start: hex(start)?,
                    end: hex(end)?,
                    perms,
                    path,
                })
            }
            "file" => {
                let (id, path) = rest.split_once(' ')?;
                Some(Record::File {
                    id: u32::try_from(hex(id)?).ok()?,
                    path: path.to_string(),
                })
            }
            "cuda" => {
                let mut it = rest.splitn(3, ' ');
                let pid = it.next()?.parse().ok()?;
                let gpu_dir = match (it.next()?, it.next()) {
                    ("possum", Some(d)) if !d.is_empty() && !d.contains('/') => Some(d.to_string()),
                    ("driver", None) => None,
                    _ => return None,
                };
                Some(Record::Cuda { pid, gpu_dir })
            }
            _ => None,
        }
    }
}

fn hex(s: &str) -> Option<u64> {
    u64::from_str_radix(s.strip_prefix("0x")?, 16).ok()
}

/// The records of one dump.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Records(pub Vec<Record>);

impl Records {
    /// Parses the file's text; lines it cannot read (comments, a newer plugin's) are skipped.
    pub fn parse(text: &str) -> Records {
        Records(text.lines().filter_map(Record::parse).collect())
    }

    /// The device behind the claimed external file `id`, if the plugin claimed it.
    pub fn file(&self, id: u32) -> Option<&str> {
        self.0.iter().find_map(|r| match r {
            Record::File { id: i, path } if *i == id => Some(path.as_str()),
            _ => None,
        })
    }

    /// The CUDA process `pid` the plugin checkpointed: `Some(gpu_dir)` (possum's GPU image
    /// directory, when possum was loaded), `None` when it did not checkpoint it.
    pub fn cuda(&self, pid: i32) -> Option<Option<&str>> {
        self.0.iter().find_map(|r| match r {
            Record::Cuda { pid: p, gpu_dir } if *p == pid => Some(gpu_dir.as_deref()),
            _ => None,
        })
    }

    /// Whether the plugin claimed a mapping of `path`.
    pub fn has_vma_of(&self, path: &str) -> bool {
        self.0
            .iter()
            .any(|r| matches!(r, Record::Vma { path: p, .. } if p == path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_through_their_lines() {
        let recs = [
            Record::Vma {
                pid: 42,
                start: 0x2_0060_0000,
                end: 0x2_0080_0000,
                perms: "rw-s".into(),
                path: "/dev/nvidia-uvm".into(),
            },
            Record::File {
                id: 0x1b,
                path: "/dev/nvidiactl".into(),
            },
            Record::Cuda {
                pid: 42,
                gpu_dir: Some("possum-gpu-42".into()),
            },
            Record::Cuda {
                pid: 43,
                gpu_dir: None,
            },
        ];
        let text: String = recs.iter().map(|r| format!("{r}\n")).collect();
        assert_eq!(
            text,
            "vma 42 0x200600000-0x200800000 rw-s /dev/nvidia-uvm\nfile 0x1b /dev/nvidiactl\n\
             cuda 42 possum possum-gpu-42\ncuda 43 driver\n"
        );
        let parsed = Records::parse(&format!("# a comment\n{text}something else\n"));
        assert_eq!(parsed.0, recs);
        assert_eq!(parsed.file(0x1b), Some("/dev/nvidiactl"));
        assert_eq!(parsed.file(0x1c), None);
        assert!(parsed.has_vma_of("/dev/nvidia-uvm"));
        assert!(!parsed.has_vma_of("/dev/nvidiactl"));
        assert_eq!(parsed.cuda(42), Some(Some("possum-gpu-42")));
        assert_eq!(parsed.cuda(43), Some(None));
        assert_eq!(parsed.cuda(44), None);
        // A directory outside the images directory is not read.
        assert_eq!(Records::parse("cuda 5 possum ../x\ncuda 6 possum\n").0, []);
    }
}
