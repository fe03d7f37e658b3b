//! CRIU driven over its RPC interface.
#![warn(missing_docs)]
