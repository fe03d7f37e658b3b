//! Dumps a running process (left running) with each way of writing its pages, and prints how
//! long CRIU held it: the probe behind `PagesBy`'s choice.
//!
//!     dump-pages PID DIR [ROUNDS] [criu|relay|possum ...]
//!
//! Each round dumps into DIR/<way>-<round> (removed after) with every way named (all three by
//! default), taking turns. Needs root and CRIU (`POSSUM_CRIU`).
use std::time::Duration;

use possum_criu::{Criu, DumpOptions, PagesBy};

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [pid, dir, rest @ ..] = &args[..] else {
        return Err("usage: dump-pages PID DIR [ROUNDS] [criu|relay|possum ...]".into());
    };
    let pid: i32 = pid.parse()?;
    let rounds: u32 = rest.first().map_or(Ok(2), |r| r.parse())?;
    let mut ways: Vec<&str> = rest.iter().skip(1).map(String::as_str).collect();
    if ways.is_empty() {
        ways = vec!["criu", "relay", "possum"];
    }
    let criu = Criu::locate()?;
    for round in 0..rounds {
        for way in &ways {
            let pages = match *way {
                "criu" => PagesBy::Criu,
                "relay" => PagesBy::Relay,
                "possum" => PagesBy::Possum,
                other => return Err(format!("no such way: {other}").into()),
            };
            let images = std::path::Path::new(dir).join(format!("{way}-{round}"));
            let d = criu.dump(&DumpOptions {
                leave_running: true,
                shell_job: true,
                pages,
                ..DumpOptions::new(pid, &images)
            })?;
            let st = d.stats.as_ref();
            println!(
                "{way:6} round {round}: dump {} ms, frozen {} ms, memdump {} ms, memwrite {} ms, \
                 post-dump at {} ms, {} MB of images, relayed {:?}",
                ms(Some(d.time)),
                ms(st.map(|s| s.frozen)),
                ms(st.map(|s| s.memdump)),
                ms(st.map(|s| s.memwrite)),
                ms(d.post_dump_at),
                d.image_bytes / 1_000_000,
                d.pages_relayed
                    .as_ref()
                    .map(|r| (r.bytes(), r.workers, r.time)),
            );
            std::fs::remove_dir_all(&images)?;
        }
    }
    Ok(())
}
