//! The page server of a lazy dump ([`crate::PagesBy::Possum`]), on a socket pair instead of a
//! TCP port.
//!
//! Once a `--lazy-pages` dump is over, CRIU serves the pages it left in the frozen tree on a
//! page server until told to close. Asked over RPC, CRIU 4.2 ignores the page server's address
//! and descriptor in lazy mode and listens on a TCP port of every interface, with no
//! authentication unless its TLS is set up: anyone who connects first reads the job's memory.
//! But a configuration file may name a connected socket to serve on (`ps-socket N`, applied
//! after the RPC options), and CRIU then listens on nothing. possum has already read the pages
//! when CRIU serves them, so its end of the pair holds CRIU's `PS_IOV_CLOSE` from the start:
//! CRIU reads it first, answers and ends.
//!
//! The configuration file is a memfd, inherited by the worker at the same number and named as
//! `/proc/self/fd/N`: nothing is written to a file system.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};

use crate::swrk::above_stdio;
use crate::CriuError;

/// CRIU's `PS_IOV_CLOSE`.
const PS_IOV_CLOSE: u32 = 0x1023;

/// CRIU's `struct page_server_iov`: `u32 cmd`, then (aligned) `u64 nr_pages, vaddr, dst_id`.
const IOV_BYTES: usize = 32;

/// The socket pair and configuration file of one lazy dump; dropped once the worker ended.
#[derive(Debug)]
pub(crate) struct PageServer {
    /// This end: holds the close, read by nobody (dropped with the pair).
    _ours: OwnedFd,
    /// The worker's end, inherited.
    theirs: OwnedFd,
    /// The configuration file naming `theirs`, inherited.
    config: OwnedFd,
}

fn socket_err(what: &'static str) -> impl FnOnce(nix::Error) -> CriuError {
    move |e| CriuError::Socket {
        what,
        source: e.into(),
    }
}

impl PageServer {
    /// A socket pair with the close queued on this end, and the configuration naming the other.
    pub(crate) fn new() -> Result<PageServer, CriuError> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(socket_err("page server socketpair"))?;
        let theirs = above_stdio(theirs, "page server socket")?;
        let mut close = [0u8; IOV_BYTES];
        close[..4].copy_from_slice(&PS_IOV_CLOSE.to_ne_bytes());
        let mut ours = File::from(ours);
        ours.write_all(&close).map_err(|source| CriuError::Socket {
            what: "queueing the page server's close",
            source,
        })?;
        let config = memfd_create(c"possum-criu-lazy.conf", MemFdCreateFlag::MFD_CLOEXEC)
            .map_err(socket_err("page server configuration memfd"))?;
        let config = above_stdio(config, "page server configuration")?;
        let mut file = File::from(config);
        writeln!(file, "ps-socket {}", theirs.as_raw_fd()).map_err(|source| CriuError::Io {
            what: "writing the page server's configuration".into(),
            source,
        })?;
        Ok(PageServer {
            _ours: ours.into(),
            theirs,
            config: file.into(),
        })
    }

    /// The configuration file as the worker sees it (it inherits it at the same number).
    pub(crate) fn config_path(&self) -> String {
        format!("/proc/self/fd/{}", self.config.as_raw_fd())
    }

    /// The descriptors the worker inherits.
    pub(crate) fn inherit(&self) -> [RawFd; 2] {
        [self.theirs.as_raw_fd(), self.config.as_raw_fd()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    #[test]
    fn the_close_waits_on_the_workers_end_and_the_config_names_it() {
        let ps = PageServer::new().unwrap();
        let [sock, conf] = ps.inherit();
        assert!(sock > 2 && conf > 2);
        let mut text = String::new();
        File::open(ps.config_path())
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, format!("ps-socket {sock}\n"));
        let mut got = [0u8; IOV_BYTES];
        File::from(ps.theirs.try_clone().unwrap())
            .read_exact(&mut got)
            .unwrap();
        assert_eq!(u32::from_ne_bytes(got[..4].try_into().unwrap()), 0x1023);
        assert!(got[4..].iter().all(|&b| b == 0));
    }
}
