//! The possum command line.
fn main() {}
