//! The job's memory as possum serves it: allocations made by the engine or passed on
//! (`alloc`), stream-ordered pools carved out of engine buffers (`pools`), the job's own
//! virtual-memory mappings (`vmm`), memory other processes shared with this one (`imports`),
//! the snapshot of every known allocation that launches resolve against (`ranges`), and the
//! tables the first three keep, owned by one value (`tables`).

pub(crate) mod alloc;
pub(crate) mod imports;
pub(crate) mod pools;
pub(crate) mod ranges;
pub(crate) mod tables;
pub(crate) mod vmm;
