//! CRIU's own account of a dump or restore: the `stats-dump` and `stats-restore` service images
//! it leaves in the images directory (`images/stats.proto`).
//!
//! They say where CRIU's time went (the tree frozen, its memory collected and written, the
//! processes forked) and how many pages moved, which a caller reports beside its own wall
//! times. They are service images ([`images::SERVICE_MAGIC`] at their head), read like the
//! others. A missing file is `None` (CRIU writes none when the call failed early); a malformed
//! one is an error naming it.

use std::path::Path;
use std::time::Duration;

use crate::images::{self, ImageError, PAGE_SIZE, STATS_MAGIC};

/// `dump_stats_entry`, the fields possum reports (times in microseconds).
#[derive(Clone, PartialEq, prost::Message)]
pub struct DumpStatsEntry {
    /// Time to freeze the tree.
    #[prost(uint32, required, tag = "1")]
    pub freezing_time: u32,
    /// Time the tree stayed frozen.
    #[prost(uint32, required, tag = "2")]
    pub frozen_time: u32,
    /// Time dumping the memory, its writing included.
    #[prost(uint32, required, tag = "3")]
    pub memdump_time: u32,
    /// Time writing it to the pages files.
    #[prost(uint32, required, tag = "4")]
    pub memwrite_time: u32,
    /// Pages looked at.
    #[prost(uint64, required, tag = "5")]
    pub pages_scanned: u64,
    /// Pages left to a parent image.
    #[prost(uint64, required, tag = "6")]
    pub pages_skipped_parent: u64,
    /// Pages written.
    #[prost(uint64, required, tag = "7")]
    pub pages_written: u64,
    /// Pages left for a lazy restore.
    #[prost(uint64, required, tag = "9")]
    pub pages_lazy: u64,
}

/// `restore_stats_entry` (times in microseconds).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreStatsEntry {
    /// Pages compared with a parent's.
    #[prost(uint64, required, tag = "1")]
    pub pages_compared: u64,
    /// Pages shared copy-on-write.
    #[prost(uint64, required, tag = "2")]
    pub pages_skipped_cow: u64,
    /// Time forking the tree.
    #[prost(uint32, required, tag = "3")]
    pub forking_time: u32,
    /// Time restoring it, forking included.
    #[prost(uint32, required, tag = "4")]
    pub restore_time: u32,
    /// Pages CRIU wrote into the processes.
    #[prost(uint64, optional, tag = "5")]
    pub pages_restored: Option<u64>,
}

/// `stats_entry`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsEntry {
    /// Written by a dump.
    #[prost(message, optional, tag = "1")]
    pub dump: Option<DumpStatsEntry>,
    /// Written by a restore.
    #[prost(message, optional, tag = "2")]
    pub restore: Option<RestoreStatsEntry>,
}

/// Where a dump's time went, by CRIU's account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DumpStats {
    /// Freezing the tree.
    pub freezing: Duration,
    /// The tree frozen: from frozen to the dump's end (or the tree's release).
    pub frozen: Duration,
    /// Dumping the memory, its writing included.
    pub memdump: Duration,
    /// Writing it out.
    pub memwrite: Duration,
    /// Bytes of memory written to the pages files.
    pub memory_bytes: u64,
}

/// Where a restore's time went, by CRIU's account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreStats {
    /// Forking the tree.
    pub forking: Duration,
    /// The whole restore, forking included.
    pub restore: Duration,
    /// Bytes of memory CRIU wrote into the processes (not counting what possum's plugin wrote).
    pub memory_bytes: Option<u64>,
}

fn us(v: u32) -> Duration {
    Duration::from_micros(u64::from(v))
}

/// The `stats_entry` of `dir/name`; `None` when the file is not there.
fn read(dir: &Path, name: &str) -> Result<Option<StatsEntry>, ImageError> {
    let path = dir.join(name);
    if !path.exists() {
        return Ok(None);
    }
    let entries: Vec<StatsEntry> = images::read_messages(&path, STATS_MAGIC)?;
    match entries.into_iter().next() {
        Some(e) => Ok(Some(e)),
        None => Err(ImageError::Malformed {
            path,
            detail: "no entry".into(),
        }),
    }
}

/// CRIU's account of the dump into `dir`, from its `stats-dump`.
pub fn dump_stats(dir: &Path) -> Result<Option<DumpStats>, ImageError> {
    Ok(read(dir, "stats-dump")?
        .and_then(|s| s.dump)
        .map(|d| DumpStats {
            freezing: us(d.freezing_time),
            frozen: us(d.frozen_time),
            memdump: us(d.memdump_time),
            memwrite: us(d.memwrite_time),
            memory_bytes: d.pages_written.saturating_mul(PAGE_SIZE),
        }))
}

/// CRIU's account of the restore from `dir`, from its `stats-restore`.
pub fn restore_stats(dir: &Path) -> Result<Option<RestoreStats>, ImageError> {
    Ok(read(dir, "stats-restore")?
        .and_then(|s| s.restore)
        .map(|r| RestoreStats {
            forking: us(r.forking_time),
            restore: us(r.restore_time),
            memory_bytes: r.pages_restored.map(|p| p.saturating_mul(PAGE_SIZE)),
        }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    fn write(dir: &Path, name: &str, head: u32, entry: &StatsEntry) {
        let mut data = head.to_le_bytes().to_vec();
        data.extend_from_slice(&STATS_MAGIC.to_le_bytes());
        let body = entry.encode_to_vec();
        data.extend_from_slice(&(body.len() as u32).to_le_bytes());
        data.extend_from_slice(&body);
        std::fs::write(dir.join(name), data).unwrap();
    }

    #[test]
    fn a_dump_s_and_a_restore_s_accounts_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let dump = DumpStatsEntry {
            freezing_time: 1_500,
            frozen_time: 600_000,
            memdump_time: 250_000,
            memwrite_time: 120_000,
            pages_scanned: 400_000,
            pages_skipped_parent: 0,
            pages_written: 262_144,
            pages_lazy: 0,
        };
        write(
            dir.path(),
            "stats-dump",
            images::SERVICE_MAGIC,
            &StatsEntry {
                dump: Some(dump),
                restore: None,
            },
        );
        let d = dump_stats(dir.path()).unwrap().unwrap();
        assert_eq!(d.frozen, Duration::from_millis(600));
        assert_eq!(d.memdump, Duration::from_millis(250));
        assert_eq!(d.memwrite, Duration::from_millis(120));
        assert_eq!(d.memory_bytes, 1 << 30);
        assert_eq!(restore_stats(dir.path()).unwrap(), None);

        let restore = RestoreStatsEntry {
            pages_compared: 0,
            pages_skipped_cow: 0,
            forking_time: 20_000,
            restore_time: 700_000,
            pages_restored: Some(10),
        };
        write(
            dir.path(),
            "stats-restore",
            images::SERVICE_MAGIC,
            &StatsEntry {
                dump: None,
                restore: Some(restore),
            },
        );
        let r = restore_stats(dir.path()).unwrap().unwrap();
        assert_eq!(r.forking, Duration::from_millis(20));
        assert_eq!(r.restore, Duration::from_millis(700));
        assert_eq!(r.memory_bytes, Some(10 * 4096));
    }

    #[test]
    fn a_stats_file_with_another_head_or_cut_short_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "stats-dump",
            images::COMMON_MAGIC,
            &StatsEntry::default(),
        );
        let err = dump_stats(dir.path()).unwrap_err().to_string();
        assert!(err.contains("stats-dump"), "{err}");
        std::fs::write(
            dir.path().join("stats-restore"),
            images::SERVICE_MAGIC.to_le_bytes(),
        )
        .unwrap();
        let err = restore_stats(dir.path()).unwrap_err().to_string();
        assert!(err.contains("stats-restore"), "{err}");
    }
}
