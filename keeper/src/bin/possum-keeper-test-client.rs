//! A keeper client for the keeper's tests (`tests/keeper.rs`), run as its own process: connects to
//! the keeper at argv[1], then follows commands on stdin, one per line, answering one line each on
//! stdout:
//!
//! - `alloc N`: allocates N bytes, imports the fd, reserves and maps it, writes the pattern
//!   `(i % 251) ^ id` over all of it, unmaps and drops its handle → `allocated ID SIZE`;
//! - `retain ID` → `retained ID`; `stats` → the stats' JSON; `exit` (or end of input): exits.
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
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["alloc", n] => {
                let (a, fd) = k.alloc(n.parse().expect("size")).expect("alloc");
                let dev = dev.get_or_insert_with(|| ShareDevice::open(0).expect("device"));
                let mem = dev
                    .import(std::os::fd::AsFd::as_fd(&fd), a.size)
                    .expect("import");
                let res = dev.reserve(a.size).expect("reserve");
                let m = mem.map(&res, 0).expect("map");
                let data: Vec<u8> = (0..a.size as usize)
                    .map(|i| (i % 251) as u8 ^ a.id as u8)
                    .collect();
                m.write(0, &data).expect("write");
                println!("allocated {} {}", a.id, a.size);
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
