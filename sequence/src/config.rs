//! The sequences' parameters from the environment, read in one place ([`Environment::read`]).

use std::time::Duration;

use possum_criu::{Deadline, LogLevel, PagesBy};
use possum_cuda::checkpoint::{DriverCheckpoint, DriverCkptError, SHORT_DEADLINE};

/// `POSSUM_DRIVER_DEADLINE_MS`: one deadline for every call of the driver's checkpoint API, in
/// place of the sized ones ([`DriverDeadlines`]); for tests and diagnosis.
pub const DRIVER_DEADLINE_ENV: &str = "POSSUM_DRIVER_DEADLINE_MS";

/// How long the sequences wait for each call of the driver's checkpoint API before they stop
/// waiting and fail the phase (possum-cuda's `DriverCkptError::DeadlineExceeded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverDeadlines {
    /// The calls that move no memory (state, unlock; a lock gets its own timeout plus this).
    pub short: Duration,
    /// `cuCheckpointProcessCheckpoint`, by the GPU memory of the process (CRIU's dump's rule).
    pub checkpoint: Deadline,
    /// `cuCheckpointProcessRestore`, by the GPU memory of the process (CRIU's restore's rule).
    pub restore: Deadline,
}

impl Default for DriverDeadlines {
    /// 60 s; 2 minutes plus 30 s per GiB for the checkpoint and the restore.
    fn default() -> Self {
        DriverDeadlines {
            short: SHORT_DEADLINE,
            checkpoint: Deadline::DUMP,
            restore: Deadline::RESTORE,
        }
    }
}

impl DriverDeadlines {
    /// `limit` for every call, whatever the size.
    pub fn fixed(limit: Duration) -> DriverDeadlines {
        DriverDeadlines {
            short: limit,
            checkpoint: Deadline::fixed(limit),
            restore: Deadline::fixed(limit),
        }
    }

    /// The driver `lib` loaded, its short deadline set.
    pub fn load(&self, lib: &str) -> Result<DriverCheckpoint, DriverCkptError> {
        DriverCheckpoint::load_from(lib).map(|d| d.with_short_deadline(self.short))
    }
}

/// Whether a checkpoint takes the bulk of the job's private memory out of CRIU's images
/// (`POSSUM_HOSTMEM_SPLIT`), for possum's CRIU plugin to write back in parallel at restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostmemSplit {
    /// Unless a job left running without a keeper is still held (it would lengthen its stall).
    #[default]
    On,
    /// `0`: never.
    Off,
    /// `always`: also while a job left running without a keeper is held.
    Always,
}

/// What the checkpoint and restore sequences take from the environment. Variables read by the
/// crates below them are not here: `POSSUM_CRIU` and `POSSUM_CRIU_PLUGIN_DIR` (possum-criu's
/// `Criu::locate`), `POSSUM_SOCKET_DIR` (possum-control's `socket_dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// `POSSUM_HOSTMEM_SPLIT`: `0` off, `always`, else on.
    pub hostmem_split: HostmemSplit,
    /// `POSSUM_HOSTMEM_AHEAD=1` (off otherwise): a migration's pre-copy sends the job's private
    /// memory ahead too, and at the cut only what changed of it (`possum_criu::hostmem::ahead`;
    /// decision 30 says why it is not the default).
    pub hostmem_ahead: bool,
    /// `POSSUM_KEEPER_REVIVE` (on unless `0`): during a kept hold, fds of the memory the job
    /// detached are held, and a new keeper takes it over should the job's die.
    pub keeper_revive: bool,
    /// `POSSUM_RESTORE_STAGE` (on unless `0`): the keeper loads the GPU images while CRIU
    /// restores the process.
    pub restore_stage: bool,
    /// `POSSUM_CRIU_LOG_LEVEL` (1 errors .. 4 everything), for a diagnosis.
    pub criu_log_level: Option<LogLevel>,
    /// `POSSUM_DUMP_PAGES` (`relay`, `criu` or `possum`): who writes the job's private memory
    /// into CRIU's images: CRIU into pipes, possum's threads copying into the files (the
    /// default where possum has 4 or more threads for it, decision 45); CRIU from its one thread
    /// (the default with fewer); or possum after CRIU's lazy dump (decision 44).
    pub dump_pages: PagesBy,
    /// `POSSUM_NVIDIA_SMI`, else `nvidia-smi` on PATH.
    pub nvidia_smi: String,
    /// `POSSUM_LIBCUDA`, else `libcuda.so.1`: the driver whose checkpoint API is used.
    pub libcuda: String,
    /// How long each driver checkpoint call may take ([`DriverDeadlines::default`];
    /// `POSSUM_DRIVER_DEADLINE_MS`, above 0: that for every call).
    pub driver_deadlines: DriverDeadlines,
    /// How long the ranks of a multi-process job may take to reach the cut's collective
    /// boundary (`POSSUM_CUT_DEADLINE_MS`, above 0; default [`CUT_DEADLINE`]).
    pub cut_deadline: Duration,
    /// `POSSUM_RESTORE_TCP_CLOSE=1` (or `possum restore --tcp-close`): a restore brings the
    /// image's established TCP connections back closed instead of whole (where they cannot come
    /// back: another host). `possum receive` takes it from the variable.
    pub tcp_close: bool,
    /// `POSSUM_MIGRATE_SLICE_MIB` (default [`FIRST_ROUND_SLICE`]; `0`: one part): a migration
    /// sends its first pre-copy round in parts of so many bytes of each file, so that the
    /// destination loads the GPU images as they come.
    pub first_round_slice: u64,
    /// `POSSUM_MIGRATE_SEND_WHILE_HELD` (on unless `0`): a migration sends the GPU images as
    /// the cut completed them while the driver and CRIU work, not after the commit.
    pub send_while_held: bool,
    /// `POSSUM_MIGRATE_KILL_WHILE_SENDING` (on unless `0`): a migration kills the held job at
    /// the source while it sends the rest of its image, not after; a send that fails then
    /// restores the job at the source from its image instead of letting it go.
    pub kill_while_sending: bool,
    /// `POSSUM_MIGRATE_STREAM_CRIU` (on unless `0`): while CRIU dumps a migrated job of one
    /// process, the parts of its pages file already written go to the destination, not after
    /// the dump.
    pub stream_criu: bool,
    /// `POSSUM_MIGRATE_SEND_WHILE_COPYING` (on unless `0`; with `POSSUM_MIGRATE_SEND_WHILE_HELD`):
    /// while the held job's final copy writes its GPU images, each chunk it completed goes to
    /// the destination, not after the copy.
    pub send_while_copying: bool,
    /// `POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING` (off unless `1`): while the first pre-copy
    /// round writes the GPU images, the job running, each chunk it completed goes to the
    /// destination, not after the round. Off by default: it lengthened a 32 GiB job's downtime
    /// (decision 37).
    pub first_round_while_copying: bool,
    /// `POSSUM_MIGRATE_STAGE_AHEAD` (on unless `0`): a migration's destination stages the
    /// job's GPU images once the final set brought them whole (while the source's CRIU still
    /// dumps), instead of at its restore.
    pub stage_ahead: bool,
    /// `POSSUM_MIGRATE_LOAD_REWRITTEN` (off unless `1`): a migration's destination tells its
    /// keeper which bytes of the GPU images' data files each later part sent ahead brought (a
    /// later pre-copy round, the held job's final copy as it runs), and the keeper loads the
    /// chunks written again as they come, not once the final set brought the images whole.
    /// Off by default: the loads beside the job's pre-copy and final copy lengthened a
    /// training job's downtime (decision 40).
    pub load_rewritten: bool,
    /// `POSSUM_MIGRATE_LOAD_WAIT_MS` (default [`LOAD_WAIT`]; `0`: no wait): before it holds the
    /// job, a migration's source waits at most so long, the job running, for the destination
    /// to load into GPU memory the GPU images sent ahead (it stops as soon as they are loaded,
    /// or once the destination loads nothing more for a while).
    pub load_wait: Duration,
    /// `POSSUM_MIGRATE_PART_MIB` (default 64): a migration sends the job's private memory split
    /// out of CRIU's images in parts of so many bytes, which the destination writes from every
    /// stream at once.
    pub hostmem_part_bytes: u64,
}

/// The first pre-copy round of a migration is sent ahead in parts of this many bytes of each
/// file (of the GPU images' data files, in practice), so that the destination loads the job's
/// GPU images into its keeper's memory as they come (`crate::prestage`), not once the whole
/// round came: with 32 GiB, parts of some 4 GiB of the round's nine data files, each received
/// in well under a second and loaded while the next comes.
pub const FIRST_ROUND_SLICE: u64 = 512 << 20;

/// The default of [`Environment::load_wait`].
pub const LOAD_WAIT: Duration = Duration::from_secs(5);

/// The default of [`Environment::cut_deadline`].
pub const CUT_DEADLINE: Duration = Duration::from_secs(30);

impl Environment {
    /// The values of this process's environment.
    pub fn read() -> Environment {
        Environment::from_vars(|name| std::env::var(name).ok())
    }

    /// The values `var` gives (a variable's value, or `None` if unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Environment {
        let off = |name: &str| var(name).is_some_and(|v| v.trim() == "0");
        Environment {
            hostmem_split: match var("POSSUM_HOSTMEM_SPLIT").as_deref() {
                Some("0") => HostmemSplit::Off,
                Some("always") => HostmemSplit::Always,
                _ => HostmemSplit::On,
            },
            hostmem_ahead: var("POSSUM_HOSTMEM_AHEAD").is_some_and(|v| v.trim() == "1"),
            keeper_revive: var("POSSUM_KEEPER_REVIVE").as_deref() != Some("0"),
            restore_stage: !off("POSSUM_RESTORE_STAGE"),
            criu_log_level: match var("POSSUM_CRIU_LOG_LEVEL").as_deref().map(str::trim) {
                Some("1") => Some(LogLevel::Error),
                Some("2") => Some(LogLevel::Warn),
                Some("3") => Some(LogLevel::Info),
                Some("4") => Some(LogLevel::Debug),
                _ => None,
            },
            dump_pages: match var("POSSUM_DUMP_PAGES").as_deref().map(str::trim) {
                Some("possum") => PagesBy::Possum,
                Some("relay") => PagesBy::Relay,
                Some("criu") => PagesBy::Criu,
                _ => PagesBy::for_threads(possum_criu::hostmem::default_threads()),
            },
            nvidia_smi: var("POSSUM_NVIDIA_SMI").unwrap_or_else(|| "nvidia-smi".into()),
            libcuda: var(possum_cuda::checkpoint::LIBCUDA_ENV)
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "libcuda.so.1".into()),
            driver_deadlines: var(DRIVER_DEADLINE_ENV)
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&ms| ms > 0)
                .map_or_else(DriverDeadlines::default, |ms| {
                    DriverDeadlines::fixed(Duration::from_millis(ms))
                }),
            cut_deadline: var("POSSUM_CUT_DEADLINE_MS")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&ms| ms > 0)
                .map_or(CUT_DEADLINE, Duration::from_millis),
            tcp_close: var("POSSUM_RESTORE_TCP_CLOSE").is_some_and(|v| v.trim() == "1"),
            first_round_slice: var("POSSUM_MIGRATE_SLICE_MIB")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(FIRST_ROUND_SLICE, |mib| mib.saturating_mul(1 << 20)),
            send_while_held: !off("POSSUM_MIGRATE_SEND_WHILE_HELD"),
            kill_while_sending: !off("POSSUM_MIGRATE_KILL_WHILE_SENDING"),
            stream_criu: !off("POSSUM_MIGRATE_STREAM_CRIU"),
            send_while_copying: !off("POSSUM_MIGRATE_SEND_WHILE_COPYING"),
            first_round_while_copying: var("POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING")
                .is_some_and(|v| v.trim() == "1"),
            stage_ahead: !off("POSSUM_MIGRATE_STAGE_AHEAD"),
            load_rewritten: var("POSSUM_MIGRATE_LOAD_REWRITTEN").is_some_and(|v| v.trim() == "1"),
            load_wait: var("POSSUM_MIGRATE_LOAD_WAIT_MS")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(LOAD_WAIT, Duration::from_millis),
            hostmem_part_bytes: var("POSSUM_MIGRATE_PART_MIB")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&mib| mib > 0)
                .map_or(possum_criu::hostmem::MIGRATION_PART_BYTES, |mib| {
                    mib.saturating_mul(1 << 20)
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_is_read_with_its_defaults() {
        let none = Environment::from_vars(|_| None);
        assert_eq!(none.hostmem_split, HostmemSplit::On);
        assert!(none.keeper_revive && none.restore_stage);
        assert_eq!(none.criu_log_level, None);
        assert_eq!(none.cut_deadline, CUT_DEADLINE);
        assert!(!none.tcp_close && !none.hostmem_ahead);
        assert_eq!(none.first_round_slice, FIRST_ROUND_SLICE);
        assert!(none.send_while_held && none.kill_while_sending && none.stream_criu);
        assert!(none.send_while_copying && !none.first_round_while_copying);
        let first = Environment::from_vars(|n| {
            (n == "POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING").then(|| "1".into())
        });
        assert!(first.first_round_while_copying && none.stage_ahead);
        let behind =
            Environment::from_vars(|n| (n == "POSSUM_MIGRATE_STAGE_AHEAD").then(|| "0".into()));
        assert!(!behind.stage_ahead && !behind.load_rewritten);
        let told =
            Environment::from_vars(|n| (n == "POSSUM_MIGRATE_LOAD_REWRITTEN").then(|| "1".into()));
        assert!(told.load_rewritten && told.stage_ahead);
        let slice =
            Environment::from_vars(|n| (n == "POSSUM_MIGRATE_SLICE_MIB").then(|| " 3".into()));
        assert_eq!(slice.first_round_slice, 3 << 20);
        assert_eq!(none.hostmem_part_bytes, 64 << 20);
        let part = Environment::from_vars(|n| (n == "POSSUM_MIGRATE_PART_MIB").then(|| "2".into()));
        assert_eq!(part.hostmem_part_bytes, 2 << 20);
        assert_eq!(none.load_wait, LOAD_WAIT);
        let nowait =
            Environment::from_vars(|n| (n == "POSSUM_MIGRATE_LOAD_WAIT_MS").then(|| "0".into()));
        assert_eq!(nowait.load_wait, Duration::ZERO);
        let threads = possum_criu::hostmem::default_threads();
        assert_eq!(none.dump_pages, PagesBy::for_threads(threads));
        assert_eq!(PagesBy::for_threads(16), PagesBy::Relay);
        assert_eq!(PagesBy::for_threads(2), PagesBy::Criu);
        let by = |v: &str| Environment::from_vars(|n| (n == "POSSUM_DUMP_PAGES").then(|| v.into()));
        assert_eq!(by("possum").dump_pages, PagesBy::Possum);
        assert_eq!(by("relay").dump_pages, PagesBy::Relay);
        assert_eq!(by("criu").dump_pages, PagesBy::Criu);
        let ahead = Environment::from_vars(|n| (n == "POSSUM_HOSTMEM_AHEAD").then(|| "1".into()));
        assert!(ahead.hostmem_ahead);
        let close =
            Environment::from_vars(|n| (n == "POSSUM_RESTORE_TCP_CLOSE").then(|| "1".into()));
        assert!(close.tcp_close);
        let set =
            Environment::from_vars(|n| (n == "POSSUM_CUT_DEADLINE_MS").then(|| "1500".into()));
        assert_eq!(set.cut_deadline, Duration::from_millis(1500));
        assert_eq!(none.nvidia_smi, "nvidia-smi");
        assert_eq!(none.libcuda, "libcuda.so.1");
        assert_eq!(none.driver_deadlines, DriverDeadlines::default());
        assert_eq!(
            none.driver_deadlines.checkpoint.for_bytes(2 << 30),
            Duration::from_secs(180)
        );
        assert_eq!(none.driver_deadlines.short, Duration::from_secs(60));
        let set = Environment::from_vars(|n| {
            Some(
                match n {
                    "POSSUM_HOSTMEM_SPLIT" => "always",
                    "POSSUM_CRIU_LOG_LEVEL" => " 4",
                    "POSSUM_LIBCUDA" => "",
                    _ => "0",
                }
                .to_string(),
            )
        });
        assert_eq!(set.hostmem_split, HostmemSplit::Always);
        assert!(!set.keeper_revive && !set.restore_stage && !set.tcp_close && !set.hostmem_ahead);
        assert_eq!(set.first_round_slice, 0, "0: one part");
        assert!(!set.send_while_held && !set.kill_while_sending && !set.stream_criu);
        assert!(!set.send_while_copying && !set.first_round_while_copying);
        assert_eq!(set.criu_log_level, Some(LogLevel::Debug));
        assert_eq!(set.nvidia_smi, "0");
        assert_eq!(set.libcuda, "libcuda.so.1");
        assert_eq!(
            set.driver_deadlines,
            DriverDeadlines::default(),
            "0 is no value"
        );
        let short = Environment::from_vars(|n| (n == DRIVER_DEADLINE_ENV).then(|| "250".into()));
        let d = short.driver_deadlines;
        assert_eq!(d.short, Duration::from_millis(250));
        assert_eq!(d.restore.for_bytes(100 << 30), Duration::from_millis(250));
    }
}
