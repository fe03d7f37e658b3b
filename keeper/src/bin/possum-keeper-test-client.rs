//! A keeper client for the keeper's tests (`tests/keeper.rs`), run as its own process: connects to
//! the keeper at argv[1], then follows commands on stdin, one per line, answering one line each on
//! stdout:
//!
//! - `alloc N`: allocates N bytes, imports the fd, reserves and maps it, writes the pattern
//!   `(i % 251) ^ id` over all of it, unmaps and drops its handle → `allocated ID SIZE`;
//! - `retain ID` → `retained ID`; `hold ID SECS` → `held ID` (retained with a hold; epoch 7);
//! - `connect PATH`: another keeper from now on; `dup ID` → `duped ID` (the fd kept);
//!   `adopt ID SIZE PID EPOCH HOLD` (with the last fd) → `adopted ID`;
//!   `check ID EPOCH` → reclaims, imports, maps and reads it: `intact ID` or `differs ID`;
//! - `spare_take DIR` → `lent DRAIN PATH` (the keeper's spare, never given back) or
//!   `refused <why>`;
//! - `name HEX`: names the process those bytes (`/proc/self/comm`: any bytes, as a process may
//!   be named) → `named`;
//! - `stats` → the stats' JSON; `exit` (or end of input): exits.
//!
//! A refused connection prints `refused: <why>` and exits 3. Needs the driver (the fake one, in
//! the tests) only for `alloc`.
#![forbid(unsafe_code)]

use std::io::{BufRead, Write};
use std::path::PathBuf;

use possum_cuda::share::ShareDevice;
use possum_keeper::{Keeper, KeeperError};

fn main() {
    let path = PathBuf::from(std::env::args().nth(1).expect("usage: SOCKET"));
    let mut k = match Keeper::connect(&path) {
        Ok(k) => k,
        Err(KeeperError::Refused(why)) => {
            println!("refused: {why}");
            std::process::exit(3);
        }
        Err(e) => panic!("connect: {e}"),
    };
    println!("connected {}", std::process::id());
    let mut dev: Option<ShareDevice> = None;
    let mut held: Vec<std::os::fd::OwnedFd> = Vec::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["alloc", n] => {
                let (a, fd) = k.alloc(n.parse().expect("size")).expect("alloc");
                let dev = dev.get_or_insert_with(|| ShareDevice::open(0).expect("device"));
                with_mapping(dev, &fd, a.size, |m| {
                    m.write(0, &pattern(a.id, a.size)).expect("write")
                });
                println!("allocated {} {}", a.id, a.size);
            }
            ["spare_take", dir] => match k.spare_take(std::path::Path::new(dir)) {
                Ok(l) => println!("lent {} {}", l.drain, l.path),
                Err(e) => println!("refused {e}"),
            },
            ["name", hex] => {
                let bytes: Vec<u8> = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                    .collect();
                std::fs::write("/proc/self/comm", bytes).expect("name");
                println!("named");
            }
            ["retain", id] => {
                let id = id.parse().expect("id");
                k.retain(id, 7, 0).expect("retain");
                println!("retained {id}");
            }
            ["hold", id, secs] => {
                let id = id.parse().expect("id");
                k.retain(id, 7, secs.parse().expect("secs"))
                    .expect("retain");
                println!("held {id}");
            }
            ["reclaim", id, epoch] => {
                let id: u64 = id.parse().expect("id");
                match k.reclaim(id, epoch.parse().expect("epoch")) {
                    Ok(_) => println!("reclaimed {id}"),
                    Err(e) => println!("refused: {e}"),
                }
            }
            ["connect", p] => {
                k = Keeper::connect(std::path::Path::new(p)).expect("connect");
                println!("connected {p}");
            }
            ["dup", id] => {
                let id: u64 = id.parse().expect("id");
                match k.dup(id) {
                    Ok(fd) => {
                        held.push(fd);
                        println!("duped {id}");
                    }
                    Err(e) => println!("refused: {e}"),
                }
            }
            ["adopt", id, size, pid, epoch, hold] => {
                let a = possum_keeper::RetainedAlloc {
                    id: id.parse().expect("id"),
                    size: size.parse().expect("size"),
                    pid: pid.parse().expect("pid"),
                    epoch: epoch.parse().expect("epoch"),
                    hold_secs: hold.parse().expect("hold"),
                    va: None,
                };
                let fd = held.last().expect("dup first");
                match k.adopt(&a, std::os::fd::AsFd::as_fd(fd)) {
                    Ok(()) => println!("adopted {id}"),
                    Err(e) => println!("refused: {e}"),
                }
            }
            ["check", id, epoch] => {
                let id: u64 = id.parse().expect("id");
                match k.reclaim(id, epoch.parse().expect("epoch")) {
                    Ok((a, fd)) => {
                        let dev = dev.get_or_insert_with(|| ShareDevice::open(0).expect("device"));
                        let mut got = vec![0u8; a.size as usize];
                        with_mapping(dev, &fd, a.size, |m| m.read(0, &mut got).expect("read"));
                        let same = got == pattern(id, a.size);
                        println!("{} {id}", if same { "intact" } else { "differs" });
                    }
                    Err(e) => println!("refused: {e}"),
                }
            }
            ["stats"] => println!(
                "{}",
                serde_json::to_string(&k.stats().expect("stats")).unwrap()
            ),
            ["exit"] => break,
            _ => panic!("unknown command {line:?}"),
        }
        std::io::stdout().flush().expect("stdout");
    }
}

/// The test pattern of allocation `id`: byte i is `(i % 251) ^ id`.
fn pattern(id: u64, size: u64) -> Vec<u8> {
    (0..size as usize)
        .map(|i| (i % 251) as u8 ^ id as u8)
        .collect()
}

/// Imports the memory of `fd` (`size` bytes), maps it at a new reservation and runs `f` on the
/// mapping (unmapped and released after).
fn with_mapping(
    dev: &ShareDevice,
    fd: &std::os::fd::OwnedFd,
    size: u64,
    f: impl FnOnce(&possum_cuda::share::Mapped<'_>),
) {
    let mem = dev
        .import(std::os::fd::AsFd::as_fd(fd), size)
        .expect("import");
    let res = dev.reserve(size).expect("reserve");
    let m = mem.map(&res, 0).expect("map");
    f(&m);
}
