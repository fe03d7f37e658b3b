//! libpossum.so, the only possum code that runs inside the job.
#![warn(missing_docs)]
