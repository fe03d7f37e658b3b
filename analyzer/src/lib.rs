//! possum's analyzer: which buffers each operation touches, and in what order they are needed.
#![warn(missing_docs)]
