//! A deterministic multi-threaded computation to checkpoint in CRIU round-trip tests.
//!
//! ```text
//! criu-testee OUT [--threads N] [--steps N] [--step-ms MS] [--kib KIB] [--ready FILE]
//! ```
//!
//! Leaves the caller's session (`setsid`) so that CRIU can dump it without `--shell-job`; the
//! caller should give it `/dev/null` or files for stdio. Each of N threads (default 3) fills
//! its own buffer of KIB KiB (default 2048) from a seed, then for each of N steps (default 40)
//! runs a hash chain over the whole buffer, rewriting it as it goes, and sleeps MS milliseconds
//! (default 50). Once every thread has done 2 steps it creates FILE (if given). At the end it
//! writes one line with the digest of all threads' final states and buffers to OUT, through a
//! temporary file and a rename so that OUT never holds a partial result. The result depends only
//! on the parameters, never on timing, PIDs or interruptions.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

struct Params {
    out: PathBuf,
    threads: u64,
    steps: u64,
    step_ms: u64,
    kib: usize,
    ready: Option<PathBuf>,
}

fn parse() -> Result<Params, String> {
    let mut args = std::env::args().skip(1);
    let mut p = Params {
        out: PathBuf::new(),
        threads: 3,
        steps: 40,
        step_ms: 50,
        kib: 2048,
        ready: None,
    };
    let mut out = None;
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--threads" => p.threads = num(&value("--threads")?)?,
            "--steps" => p.steps = num(&value("--steps")?)?,
            "--step-ms" => p.step_ms = num(&value("--step-ms")?)?,
            "--kib" => {
                p.kib = usize::try_from(num(&value("--kib")?)?).map_err(|e| e.to_string())?
            }
            "--ready" => p.ready = Some(value("--ready")?.into()),
            s if s.starts_with("--") => return Err(format!("unknown option {s}")),
            s if out.is_none() => out = Some(PathBuf::from(s)),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    p.out = out.ok_or("usage: criu-testee OUT [--threads N] [--steps N] [--step-ms MS] [--kib KIB] [--ready FILE]")?;
    if p.threads == 0 || p.kib == 0 {
        return Err("--threads and --kib must be positive".into());
    }
    Ok(p)
}

fn num(s: &str) -> Result<u64, String> {
    s.parse().map_err(|e| format!("{s:?}: {e}"))
}

/// splitmix64's finaliser: a cheap, well-mixing bijection on u64.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One thread's work: returns the digest of its final chain state and buffer.
fn work(thread: u64, p: &Params, progress: &AtomicU64) -> u64 {
    let seed = mix(thread.wrapping_add(1));
    let words = p.kib * 1024 / 8;
    let mut buf: Vec<u64> = (0..words as u64).map(|i| mix(seed ^ i)).collect();
    let mut state = seed;
    for step in 0..p.steps {
        for w in buf.iter_mut() {
            state = mix(state ^ *w);
            *w = state.rotate_left(17) ^ step;
        }
        progress.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(p.step_ms));
    }
    buf.iter().fold(state, |acc, &w| mix(acc ^ w))
}

fn run(p: Params) -> Result<(), String> {
    // Fails only when already a session leader, which is as good.
    let _ = nix::unistd::setsid();
    let p = Arc::new(p);
    let progress = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..p.threads)
        .map(|t| {
            let (p, progress) = (Arc::clone(&p), Arc::clone(&progress));
            std::thread::spawn(move || work(t, &p, &progress))
        })
        .collect();
    if let Some(ready) = &p.ready {
        let target = (2 * p.threads).min(p.threads * p.steps);
        while progress.load(Ordering::SeqCst) < target {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(ready, b"ready\n").map_err(|e| format!("{}: {e}", ready.display()))?;
    }
    let mut digest = mix(p.threads ^ (p.steps << 16));
    for (t, h) in handles.into_iter().enumerate() {
        let d = h.join().map_err(|_| format!("thread {t} panicked"))?;
        digest = mix(digest ^ d);
    }
    let line = format!(
        "threads={} steps={} kib={} digest={digest:016x}\n",
        p.threads, p.steps, p.kib
    );
    let mut tmp = p.out.clone().into_os_string();
    tmp.push(".tmp");
    std::fs::write(&tmp, line).map_err(|e| format!("{}: {e}", p.out.display()))?;
    std::fs::rename(&tmp, &p.out).map_err(|e| format!("{}: {e}", p.out.display()))
}

fn main() -> ExitCode {
    match parse().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("criu-testee: {e}");
            ExitCode::from(2)
        }
    }
}
