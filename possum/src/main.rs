//! The possum command line: a thin dispatcher over the library crates.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod checkpoint;
mod criu_demo;
mod demo;
mod doctor;
mod run;
mod status;
mod trace;

/// possum: concurrent checkpoint and restore of GPU processes.
#[derive(Parser, Debug)]
#[command(name = "possum", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Runs a multi-stream job, checkpoints it concurrently mid-run, releases its memory, restores it
    /// on demand, continues, and checks the result bit for bit against an uninterrupted run.
    Demo(demo::DemoArgs),
    /// Reports CRIU, kernel features, GPU and driver.
    Doctor,
    /// Runs a job with libpossum.so preloaded (and so a control socket); exits with its status.
    Run(run::RunArgs),
    /// Asks a running job for its kernel/buffer trace (JSON, and DOT with --dot).
    Trace(trace::TraceArgs),
    /// Asks a running job what possum manages in it.
    Status(status::StatusArgs),
    /// Checkpoints a running process (CPU side by CRIU, GPU buffers by possum, the rest by
    /// NVIDIA's driver checkpoint) into an image directory.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Restores a process from an image directory; its GPU buffers come back on demand.
    Restore(checkpoint::RestoreArgs),
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    // 0: success; 1: the command's check failed; `run` passes the job's own code through.
    let check = |ok: bool| u8::from(!ok);
    let r = match cli.cmd {
        Cmd::Demo(a) if a.criu => criu_demo::run(&a).map(check),
        Cmd::Demo(a) => demo::run(&a).map(check),
        Cmd::Doctor => doctor::run().map(check),
        Cmd::DemoChild(a) => criu_demo::child(&a).map(check),
        Cmd::Run(a) => run::run(&a),
        Cmd::Trace(a) => trace::run(&a).map(check),
        Cmd::Status(a) => status::run(&a).map(check),
        Cmd::Checkpoint(a) => checkpoint::checkpoint(&a).map(check),
        Cmd::Restore(a) => checkpoint::restore(&a).map(check),
        Cmd::CheckpointGuard(a) => checkpoint::guard(&a).map(check),
        Cmd::Cupti(a) => checkpoint::cupti(&a).map(check),
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
}
