//! The control protocol between the `possum` command line and `libpossum.so` inside a job.
//!
//! Every process that has libpossum.so loaded serves a Unix stream socket at
//! `socket_path(socket_dir(), pid)`, that is `$POSSUM_SOCKET_DIR/possum-<pid>.sock` (default
//! directory `/tmp/possum`). One exchange per connection:
//!
//! ```text
//! client ── {"cmd":"trace"}\n ──▶ server       one line of JSON: a `Request` (at most 64 KiB)
//! client ◀── {...}\n ──────────── server       one line of JSON: any value; then it closes
//! ```
//!
//! A reply that is an object with an `"error"` key is a failure (`{"error": "..."}`): the key is
//! reserved for that. An unknown `cmd`, a line that is not JSON, a request over 64 KiB and a
//! handler that panics all get such a reply.
//!
//! A request may carry a directory descriptor (`SCM_RIGHTS`, the `dir` argument of
//! [`request_at`] and [`send_only`]): its `dir` is then relative to that directory, which the job reaches
//! as `/proc/self/fd/N` even where the path does not exist for it (a job in a container, its
//! images written where the checkpointer put them).
//!
//! Who is trusted (possum's checkpoint runs as root and talks to jobs of any user):
//!
//! - The socket directory must be a real directory, mode 0700, of the user using it
//!   ([`secure_dir`]): the job's server takes only one of the job's own user ([`prepare_dir`]:
//!   created if missing, tightened to 0700 if it lets others in), the client one of the job's
//!   user or its own, and refuses anything else, saying how to fix it.
//! - The client checks, after connecting, that the socket is served by the process asked
//!   (`SO_PEERCRED`: the process that listened, so the job's server thread names the job) as
//!   the job's effective user or root ([`ControlError::WrongProcess`],
//!   [`ControlError::WrongUser`]).
//! - The server answers only its own user and root; others get an error reply, counted
//!   ([`refused_connections`]).
//! - Files possum makes there (a checkpoint's lock: [`SecureDir::open_private_file`]) are
//!   opened through the checked directory's descriptor, never through a symbolic link, and must
//!   be private regular files with one link.
//!
//! The server side ([`Server`]) runs inside arbitrary jobs, so this crate prints nothing and has
//! one piece of global state: the last few directories passed with requests, kept open. The
//! client side is [`request`]; [`reply`] has the replies as types ([`request_typed`]). The one
//! `unsafe` is taking ownership of a received descriptor (`server::read_line`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod client;
mod dir;
mod env;
mod error;
mod procfs;
mod protocol;
pub mod reply;
mod server;

pub use client::{
    has_possum_mapped, request, request_at, request_reply, request_typed, send_only, LIBRARY_FILE,
};
pub use dir::{prepare_dir, process_uid, secure_dir, DirError, SecureDir};
pub use env::{path_var, EnvConfig};
pub use error::ControlError;
pub use procfs::{proc_text, read_maps, remove_files_of_gone_processes};
pub use protocol::{
    error_reply, socket_dir, socket_path, Request, DEFAULT_SOCKET_DIR, MAX_REQUEST_BYTES, PROTOCOL,
    SOCKET_DIR_ENV,
};
pub use reply::Reply;
pub use server::{refused_connections, remove_socket_of_this_process, Handler, Server};
