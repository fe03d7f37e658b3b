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

/// Removes the files in `dir` that processes now gone left behind: `pid_of` names the process a
/// file belongs to (`None`: not such a file, kept), and `gone` says whether that process is gone.
/// A directory that cannot be read, or a file that cannot be removed, is left as it is.
pub fn remove_files_of_gone_processes(
    dir: &Path,
    pid_of: impl Fn(&str) -> Option<u32>,
    gone: impl Fn(u32) -> bool,
) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_str().and_then(&pid_of).is_some_and(&gone) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
