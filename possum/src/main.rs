//! The possum command line: a thin dispatcher over the library crates.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod criu_demo;
mod demo;
mod doctor;

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
    /// The demo's job as a separate process (used by `demo --criu`).
    #[command(hide = true)]
    DemoChild(criu_demo::ChildArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Demo(a) if a.criu => criu_demo::run(&a),
        Cmd::Demo(a) => demo::run(&a),
        Cmd::Doctor => doctor::run(),
        Cmd::DemoChild(a) => criu_demo::child(&a),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
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
}
