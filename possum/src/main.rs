//! The possum command line: a thin dispatcher over the library crates.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod checkpoint;
mod config;
mod criu_demo;
mod demo;
mod doctor;
mod help;
mod inspect;
mod keeper;
mod migrate;
mod migrate_demo;
mod progress;
mod run;
mod scratch;
mod status;
mod trace;

/// possum: concurrent checkpoint and restore of GPU processes.
///
/// Start a GPU job under possum (`possum run python train.py`), checkpoint it while it runs
/// (`possum checkpoint PID -D DIR`, with `--leave-running` to let it go on), and restore it
/// (`possum restore -D DIR`). `possum doctor` says whether this machine can checkpoint.
#[derive(Parser, Debug)]
#[command(name = "possum", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Shows a concurrent checkpoint and on-demand restore end to end without a GPU: runs a
    /// multi-stream job, checkpoints it mid-run, releases its memory, restores it, continues,
    /// and checks the result bit for bit against an uninterrupted run.
    Demo(demo::DemoArgs),
    /// Checks what a checkpoint needs on this machine (privileges, CRIU, kernel, GPU, NVIDIA's
    /// driver and its checkpoint API, possum's CRIU plugin and libpossum.so); exits 1 if a
    /// checkpoint could not work here.
    ///
    /// Prints one line per check: `ok`, `FAIL` (a checkpoint cannot work: the reason and what to
    /// do) or `warn` (it works, but slower or with less). Exit code 0 only if nothing FAILs.
    Doctor(doctor::DoctorArgs),
    /// Runs a keeper: the process that owns the GPU memory of jobs' buffers, so that a checkpoint
    /// leaves that memory on the GPU; `possum run` starts one for its job.
    ///
    /// It hands the memory to jobs as shareable handles over a Unix socket (clients of its own
    /// user only), with per-client accounting. A job finds it through `POSSUM_KEEPER=DIR`. It
    /// runs until it is killed (SIGTERM), or with --while-alive until that process is gone and
    /// it holds no memory for a restore.
    Keeper(keeper::KeeperArgs),
    /// Runs a job under possum (libpossum.so preloaded, a keeper for its GPU memory); exits with
    /// the job's status.
    ///
    /// libpossum.so serves the job's cudaMalloc from possum's engine and sees every GPU operation
    /// by wrapping the CUDA driver's entry points, so `possum checkpoint` can pre-copy while the
    /// job runs and the restored job resumes before all its buffers are back. Everything from CMD
    /// on belongs to the job; `--` is needed only when CMD starts with `-`.
    Run(run::RunArgs),
    /// Asks a running job for its kernel/buffer trace (JSON, and DOT with --dot).
    Trace(trace::TraceArgs),
    /// Asks a running job what possum manages in it.
    Status(status::StatusArgs),
    /// Checkpoints a running process into an image directory: GPU buffers by possum (pre-copied
    /// while the job runs), the rest by NVIDIA's driver checkpoint, the CPU side by CRIU.
    ///
    /// For a job started with `possum run` (the driver's entry points hooked): possum copies
    /// every GPU buffer into the image while the job runs (pre-copy), then holds the job's next
    /// GPU operation at its op gate (T0), copies only the buffers written since the pre-copy,
    /// releases the buffers' memory, and lets NVIDIA's driver checkpoint the rest and CRIU dump
    /// the process while the job is held. With --leave-running the job then goes on at once, its
    /// buffers coming back on demand; otherwise it is killed once the image is complete.
    ///
    /// A job run with hooks off (`POSSUM_HOOKS=off`) is held by parking its threads and every
    /// buffer is copied while held. A job run with `--cupti` is refused by NVIDIA's driver: only
    /// --gpu-only or --engine driver. A job with managed memory (cuMemAllocManaged) is refused.
    /// If the checkpoint fails, or possum is killed, a guard process undoes it: the job runs on
    /// and no image appears under DIR.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Restores a process from an image directory; it runs on before its GPU buffers are back
    /// (they come back on demand).
    ///
    /// The image is one written by `possum checkpoint`. CRIU restores the process (under its old PID, which must be free), NVIDIA's driver its
    /// GPU state, and for a possum image the job then resumes before its GPU buffers are back:
    /// they come back on demand (an operation waits only for the buffers it touches) while the
    /// rest are prefetched. A job that ran with hooks off (`POSSUM_HOOKS=off`) gets every buffer
    /// back first, then runs on. The GPU must have the free memory the job used (--device picks
    /// another GPU). A job whose memory was a keeper's maps it again if the keeper still holds
    /// it (nothing copied; with --device the keeper copies it GPU to GPU first); otherwise the
    /// keeper loads the image into GPU memory while CRIU restores the process, and the job waits
    /// only for buffers still loading (`POSSUM_RESTORE_STAGE=0`: the job copies them itself).
    /// A move needs room on the new GPU for the buffers the keeper held too.
    Restore(checkpoint::RestoreArgs),
    /// Lets a job whose GPU buffers possum released run on, its buffers coming back on demand
    /// from GPU_DIR: what the CRIU plugin sends a job it checkpointed, when it could not.
    ///
    /// Needed only after a `criu dump`/`criu restore` with possum's plugin whose log says
    /// "possum's resume could not be sent"; `possum checkpoint`/`restore` do it themselves.
    Resume(checkpoint::ResumeArgs),
    /// What an image holds, without restoring it: the job, its processes, each GPU image's
    /// buffers, chunks, fingerprints and bytes (those referenced from a parent image too);
    /// --verify reads every chunk and checks it.
    Inspect(inspect::InspectArgs),
    /// Move a running job to another host: its GPU buffers sent to a `possum receive` there
    /// while it runs, then the job held, the rest of its image sent and the job ended here
    /// meanwhile; it runs there (else it runs on here, restored from its image).
    Migrate(migrate::MigrateArgs),
    /// Receive jobs migrated by `possum migrate` and restore them on this host.
    Receive(migrate::ReceiveArgs),
    /// Detaches CUPTI from a job, or attaches it again (diagnostics).
    #[command(hide = true)]
    Cupti(checkpoint::CuptiArgs),
    /// Undoes a checkpoint whose `possum checkpoint` failed or died (started by it).
    #[command(hide = true)]
    CheckpointGuard(checkpoint::GuardArgs),
    /// The demo's job as a separate process (used by `demo --criu`).
    #[command(hide = true)]
    DemoChild(criu_demo::ChildArgs),
}

/// Parses the command line, and refuses what clap alone would not (a flag that is gone, with why).
fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = Cli::from_arg_matches(&help::fit(Cli::command()).try_get_matches_from(args)?)?;
    if let Cmd::Run(a) = &cli.cmd {
        if a.no_cupti {
            let mut cmd = help::fit(Cli::command());
            cmd.build();
            let sub = cmd.find_subcommand_mut("run").expect("the run subcommand");
            return Err(sub.error(clap::error::ErrorKind::UnknownArgument, run::NO_CUPTI_GONE));
        }
    }
    Ok(cli)
}

fn main() -> ExitCode {
    let cli = parse(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // 0: success; 1: the command's check failed; `run` passes the job's own code through.
    let check = |ok: bool| u8::from(!ok);
    let r = match cli.cmd {
        Cmd::Demo(a) if a.criu => criu_demo::run(&a).map(check),
        Cmd::Demo(a) if a.migrate => migrate_demo::run(&a).map(check),
        Cmd::Demo(a) => demo::run(&a).map(check),
        Cmd::Doctor(a) => doctor::run(&a).map(check),
        Cmd::Keeper(a) => keeper::run(&a).map(check),
        Cmd::DemoChild(a) => match &a.precopy_to {
            Some(to) => migrate_demo::child(&a, to).map(check),
            None => criu_demo::child(&a).map(check),
        },
        Cmd::Run(a) => run::run(&a),
        Cmd::Trace(a) => trace::run(&a).map(check),
        Cmd::Status(a) => status::run(&a).map(check),
        Cmd::Inspect(a) => inspect::run(&a).map(check),
        Cmd::Checkpoint(a) => checkpoint::checkpoint(&a).map(check),
        Cmd::Restore(a) => checkpoint::restore(&a).map(check),
        Cmd::CheckpointGuard(a) => checkpoint::guard(&a).map(check),
        Cmd::Cupti(a) => checkpoint::cupti(&a).map(check),
        Cmd::Resume(a) => checkpoint::resume(&a).map(check),
        Cmd::Migrate(a) => migrate::migrate(&a).map(check),
        Cmd::Receive(a) => migrate::receive(&a).map(check),
    };
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("possum: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_demo_flags() {
        let c = Cli::try_parse_from(["possum", "demo", "--mib", "64", "--criu"]).unwrap();
        match c.cmd {
            Cmd::Demo(a) => {
                assert!(a.criu);
                assert_eq!(a.mib, 64);
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["possum", "demo", "--steps", "x"]).is_err());
        // `-D` is `--images-dir`, as for checkpoint and restore; `--dir` still works, unshown.
        for flag in ["-D", "--images-dir", "--dir"] {
            match Cli::try_parse_from(["possum", "demo", flag, "/tmp/i"])
                .unwrap()
                .cmd
            {
                Cmd::Demo(a) => assert_eq!(a.dir.as_deref(), Some(std::path::Path::new("/tmp/i"))),
                other => panic!("{other:?}"),
            }
        }
        assert!(Cli::try_parse_from(["possum", "frobnicate"]).is_err());
    }

    #[test]
    fn parses_run_and_trace() {
        let c = Cli::try_parse_from(["possum", "run", "-v", "--", "sh", "-c", "exit 3"]).unwrap();
        match c.cmd {
            Cmd::Run(a) => {
                assert!(a.verbose);
                assert_eq!(a.cmd, ["sh", "-c", "exit 3"]);
            }
            other => panic!("{other:?}"),
        }
        // Without `--`, everything from CMD on is the job's, flags included.
        let c = Cli::try_parse_from(["possum", "run", "--lib", "/l.so", "ls", "-l", "-v"]).unwrap();
        match c.cmd {
            Cmd::Run(a) => {
                assert!(!a.verbose);
                assert_eq!(a.lib.as_deref(), Some(std::path::Path::new("/l.so")));
                assert_eq!(a.cmd, ["ls", "-l", "-v"]);
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["possum", "run"]).is_err());
        // Flags of possum's must come before CMD: an unknown one is an error, not the command.
        assert!(Cli::try_parse_from(["possum", "run", "--bogus", "x"]).is_err());
        let c = Cli::try_parse_from(["possum", "run", "--", "-x", "--y"]).unwrap();
        match c.cmd {
            Cmd::Run(a) => assert_eq!(a.cmd, ["-x", "--y"]),
            other => panic!("{other:?}"),
        }
        let c = Cli::try_parse_from(["possum", "trace", "12", "-o", "t.json", "--dot", "t.dot"])
            .unwrap();
        match c.cmd {
            Cmd::Trace(a) => {
                assert_eq!(a.pid, 12);
                assert!(a.output.is_some() && a.dot.is_some());
                assert_eq!(a.job.timeout, 30.0);
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["possum", "trace", "x"]).is_err());
        assert!(Cli::try_parse_from(["possum", "status", "1", "--json"]).is_ok());
    }

    #[test]
    fn parses_the_hook_flags_of_run() {
        let hooks = |args: &[&str]| match parse(args).unwrap().cmd {
            Cmd::Run(a) => (a.cupti, a.hooks),
            other => panic!("{other:?}"),
        };
        assert_eq!(hooks(&["possum", "run", "python", "t.py"]), (false, None));
        assert_eq!(
            hooks(&["possum", "run", "--cupti", "python", "t.py"]),
            (true, None)
        );
        assert_eq!(
            hooks(&["possum", "run", "--hooks", "off", "python"]),
            (false, Some(run::Hooks::Off))
        );
        // After CMD, `--cupti` is the job's.
        match parse(["possum", "run", "python", "--cupti"]).unwrap().cmd {
            Cmd::Run(a) => assert!(!a.cupti && a.cmd == ["python", "--cupti"]),
            other => panic!("{other:?}"),
        }
        assert!(parse(["possum", "run", "--cupti", "--hooks", "off", "x"]).is_err());
        assert!(parse(["possum", "run", "--hooks", "maybe", "x"]).is_err());
        // `--no-cupti` is gone, and the error says so (not "did you mean --cupti").
        let e = parse(["possum", "run", "--no-cupti", "python", "t.py"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
        let e = e.to_string();
        assert!(e.contains("`--no-cupti` is gone"), "{e}");
        assert!(!e.contains("similar argument"), "{e}");
        // `--help` of checkpoint and restore says what happens now.
        let help = |sub: &str| {
            let mut c = Cli::command();
            c.find_subcommand_mut(sub)
                .unwrap()
                .render_long_help()
                .to_string()
        };
        assert!(help("restore").contains("on demand"), "{}", help("restore"));
        assert!(
            help("checkpoint").contains("op gate"),
            "{}",
            help("checkpoint")
        );
        assert!(!help("run").contains("no-cupti"), "{}", help("run"));
    }

    /// Every line of every command's `-h` and `--help` fits [`help::WIDTH`] columns (the hidden
    /// commands possum runs itself excepted).
    #[test]
    fn every_help_fits_the_terminal() {
        fn check(cmd: &mut clap::Command, path: &str, long: &mut Vec<String>) {
            let short = cmd.render_help().to_string();
            let full = cmd.render_long_help().to_string();
            for (which, text) in [("-h", short), ("--help", full)] {
                for line in text.lines() {
                    if line.chars().count() > help::WIDTH {
                        long.push(format!("{path} {which}: {line}"));
                    }
                }
            }
            let names: Vec<String> = cmd
                .get_subcommands()
                .filter(|s| !s.is_hide_set())
                .map(|s| s.get_name().to_string())
                .collect();
            for name in names {
                let sub = cmd.find_subcommand_mut(&name).expect("a subcommand");
                check(sub, &format!("{path} {name}"), long);
            }
        }
        let mut cmd = help::fit(Cli::command());
        cmd.build();
        let mut long = Vec::new();
        check(&mut cmd, "possum", &mut long);
        assert!(
            long.is_empty(),
            "help lines over {} columns:\n{}",
            help::WIDTH,
            long.join("\n")
        );
    }

    /// The synopsis of docs/cli.md (its first `text` block): per subcommand (`""` for `possum`
    /// itself), the long and short flags its lines name. A line `possum SUB ...` starts a
    /// subcommand's lines; an indented line continues the one before.
    fn synopsis() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/cli.md"))
            .expect("docs/cli.md");
        let block = doc
            .split("```text\n")
            .nth(1)
            .and_then(|b| b.split("```").next())
            .expect("a text block in docs/cli.md");
        let mut subs =
            std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
        let mut current = String::new();
        for line in block.lines() {
            let words = if let Some(rest) = line.strip_prefix("possum ") {
                let sub = rest.split_whitespace().next().unwrap_or_default();
                current = if sub.starts_with('-') {
                    String::new()
                } else {
                    sub.to_string()
                };
                rest
            } else {
                assert!(
                    line.starts_with(' '),
                    "a synopsis line neither `possum ...` nor indented: {line}"
                );
                line
            };
            let flags = subs.entry(current.clone()).or_default();
            for w in words.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
                let long = w.len() > 2 && w.starts_with("--");
                let short = w.len() == 2 && w.starts_with('-') && w != "--";
                if long || short {
                    flags.insert(w.to_string());
                }
            }
        }
        subs
    }

    /// Per subcommand (`""` for `possum` itself), the long and short flags clap knows, and
    /// whether each is shown in --help.
    fn clap_flags() -> std::collections::BTreeMap<String, Vec<(String, bool)>> {
        let mut cmd = Cli::command();
        cmd.build();
        let flags = |c: &clap::Command| {
            let mut v = Vec::new();
            for a in c.get_arguments() {
                let shown = !a.is_hide_set();
                if let Some(l) = a.get_long() {
                    v.push((format!("--{l}"), shown));
                }
                for l in a.get_all_aliases().unwrap_or_default() {
                    v.push((format!("--{l}"), false));
                }
                if let Some(c) = a.get_short() {
                    v.push((format!("-{c}"), shown));
                }
            }
            v
        };
        let mut out = std::collections::BTreeMap::new();
        out.insert(String::new(), flags(&cmd));
        for sub in cmd.get_subcommands() {
            if !sub.is_hide_set() && sub.get_name() != "help" {
                out.insert(sub.get_name().to_string(), flags(sub));
            }
        }
        out
    }

    #[test]
    fn the_synopsis_of_docs_cli_md_matches_the_command_line() {
        let doc = synopsis();
        let clap = clap_flags();
        // Every command and every flag --help shows is in the synopsis.
        for (sub, flags) in &clap {
            let named = doc
                .get(sub)
                .unwrap_or_else(|| panic!("docs/cli.md's synopsis has no `possum {sub}`"));
            for (flag, shown) in flags {
                let help = flag == "--help" || flag == "-h";
                if *shown && (!help || sub.is_empty()) {
                    assert!(
                        named.contains(flag),
                        "docs/cli.md's synopsis of `possum {sub}` lacks {flag}"
                    );
                }
            }
        }
        // Everything the synopsis names exists.
        for (sub, flags) in &doc {
            let known = clap
                .get(sub)
                .unwrap_or_else(|| panic!("docs/cli.md names `possum {sub}`, which is no command"));
            for flag in flags {
                assert!(
                    known.iter().any(|(f, _)| f == flag),
                    "docs/cli.md's synopsis of `possum {sub}` names {flag}, which it does not take"
                );
            }
        }
    }
}
