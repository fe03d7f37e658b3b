//! Reading `/proc`'s text files. They are not always UTF-8: a process's name (`comm`, in `stat`
//! and `status`) is whatever bytes it was given, cut at 15 (which can split a character), and a
//! mapped file's or a socket's path is any bytes. Read as `String`, one such byte fails the whole
//! read, and a live process would look gone. These are read as bytes and decoded lossily: the
//! fields looked for are ASCII and come through intact.

use std::io;
use std::path::Path;

/// The text of `/proc` file `path`, decoded lossily (see the module documentation).
pub fn proc_text(path: impl AsRef<Path>) -> io::Result<String> {
    std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// The text of process `pid`'s `/proc/PID/maps`, or `None` if it cannot be read.
pub fn read_maps(pid: u32) -> Option<String> {
    proc_text(format!("/proc/{pid}/maps")).ok()
}
