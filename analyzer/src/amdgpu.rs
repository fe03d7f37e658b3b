//! Kernel argument layouts read from an AMDGPU code object's metadata note. This is there for
//! the HIP front end, which is not built yet; nothing in possum calls it so far.
//!
//! # Format
//!
//! An AMDGPU code object (`.hsaco`) is a 64-bit little-endian ELF file with `e_machine`
//! `EM_AMDGPU` (224). Code object v3 and later (v4, v5 are what current compilers emit) carry
//! one ELF note (in a `SHT_NOTE` section and a `PT_NOTE` segment) whose owner is `"AMDGPU"` and
//! whose type is `NT_AMDGPU_METADATA` (32). A note is a header of three little-endian `u32`s
//! (owner size, description size, type), then the owner name and the description, each padded
//! to a multiple of 4 bytes.
//!
//! The description is one MessagePack map. The entries read here:
//!
//! - `amdhsa.kernels`: an array with one map per kernel:
//!   - `.name` (string): the kernel's source name; `.symbol` (string): its descriptor symbol,
//!     usually `<name>.kd`;
//!   - `.kernarg_segment_size` (integer): the size of the kernel argument segment in bytes;
//!   - `.args` (array, may be absent for a kernel without arguments): one map per argument, in
//!     argument order: `.offset` and `.size` (integers, bytes into the kernarg segment),
//!     `.value_kind` (string: `by_value`, `global_buffer`, `dynamic_shared_pointer`, `image`,
//!     `sampler`, `pipe`, `queue`, or `hidden_*` for the arguments the runtime fills in itself),
//!     and, optionally, `.name`, `.address_space` (`global`, `constant`, `local`, `private`,
//!     `generic`, `region`), `.is_const` (boolean), `.access` (the declared access qualifier)
//!     and `.actual_access` (what the compiler found the kernel does): `read_only`, `write_only`
//!     or `read_write`.
//!
//! Every other key is ignored. Source: LLVM's "User Guide for AMDGPU Backend" (`AMDGPUUsage`),
//! sections on code object metadata (v3 to v5), read for the format; the code is written here.
//! It was checked against code objects clang 14 built for gfx90a and gfx908 (code object v4)
//! and clang 19 built for gfx942 (code object v5) (`tests/data/amdgpu/`).
//!
//! # Hidden arguments
//!
//! The runtime appends the `hidden_*` arguments after the explicit ones; a launch supplies only
//! the explicit bytes ([`AmdgpuKernel::explicit_size`]). Code object v5 puts more there than v4
//! did: the grid's block counts, the work-group size and remainders (which v4 kernels read from
//! the dispatch packet), the grid dimensions, and pointers to buffers the runtime owns (printf,
//! hostcall, heap, queue; [`KernelArg::is_runtime_pointer`]). A kernel's metadata lists them with
//! gaps between them, and `.kernarg_segment_size` covers them all (for the gfx942 fixtures, 256
//! bytes from the first hidden argument, which starts 8-byte aligned after the explicit ones).
//! Every explicit argument must end before the first hidden one starts.
//!
//! # What is trusted
//!
//! Nothing in the file is trusted to be well formed: every ELF structure, note and MessagePack
//! length is bounds-checked, containers are limited in depth and count, and every argument must
//! lie inside its kernel's kernarg segment; anything else is an [`AmdgpuError`], never a panic.
//!
//! What the metadata *says* is taken as a layout, as `.nv.info` is for cubins: the offsets and
//! sizes give the [`ParamLayout`], whose 8-byte words are the pointer slots (a `global_buffer`
//! argument is one slot; a by-value struct's words are slots too). `.is_const` and a
//! `read_only` access are only **hints**: the pointee may still be written through another
//! pointer, or by a compiler that was wrong or lied, so possum still validates every kernel at
//! run time exactly as it does without them.

use std::collections::BTreeSet;

use thiserror::Error;

use crate::elfbytes::{header, slice, u16_at, u32_at, u64_at, ElfError};
use crate::layout::{Param, ParamLayout};

/// `e_machine` of AMDGPU code objects.
pub const EM_AMDGPU: u16 = 224;
/// Note type of the code object metadata (v3 and later).
pub const NT_AMDGPU_METADATA: u32 = 32;
/// At most this many kernels are read from one code object.
pub const MAX_KERNELS: usize = 4096;
/// At most this many arguments are read for one kernel.
pub const MAX_ARGS: usize = 1024;
/// The largest kernarg segment accepted, in bytes.
pub const MAX_KERNARG_SIZE: u32 = 1 << 20;
/// The deepest MessagePack nesting accepted (the metadata needs 5).
const MAX_DEPTH: usize = 16;

const SHT_NOTE: u32 = 7;
const PT_NOTE: u32 = 4;
const NOTE_OWNER: &[u8] = b"AMDGPU";

/// Why a code object's kernel metadata could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AmdgpuError {
    /// The ELF file itself: not one, or a structure that cannot be so.
    #[error(transparent)]
    Elf(#[from] ElfError),
    /// The ELF file is for another machine.
    #[error("ELF machine {0} is not AMDGPU ({EM_AMDGPU})")]
    NotAmdgpu(u16),
    /// A note is cut short or malformed.
    #[error("bad ELF note at offset {offset:#x} of its section: {what}")]
    BadNote {
        /// The note's offset inside its section or segment.
        offset: usize,
        /// What is wrong with it.
        what: String,
    },
    /// A clang offload bundle that is cut short or malformed.
    #[error("bad offload bundle: {0}")]
    BadBundle(String),
    /// No `AMDGPU` note of type `NT_AMDGPU_METADATA` (a code object older than v3, or none).
    #[error("no AMDGPU metadata note (NT_AMDGPU_METADATA) in the code object")]
    NoMetadata,
    /// The note's description is not valid MessagePack.
    #[error("bad MessagePack at offset {offset:#x} of the metadata: {what}")]
    BadMsgpack {
        /// Offset inside the note description.
        offset: usize,
        /// What is wrong.
        what: String,
    },
    /// The MessagePack is well formed but not shaped like code object metadata.
    #[error("bad metadata: {0}")]
    BadMetadata(String),
    /// One kernel's entry is wrong.
    #[error("kernel {kernel}: {what}")]
    BadKernel {
        /// The kernel's `.name`, or `#index` before it is known.
        kernel: String,
        /// What is wrong.
        what: String,
    },
    /// One argument of a kernel is wrong.
    #[error("kernel {kernel}, argument {index}: {what}")]
    BadArg {
        /// The kernel's `.name`.
        kernel: String,
        /// The argument's index in `.args`.
        index: usize,
        /// What is wrong.
        what: String,
    },
}

/// The address space a pointer argument points into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddressSpace {
    /// `global`: device memory.
    Global,
    /// `constant`: read-only device memory.
    Constant,
    /// `local`: workgroup-shared memory.
    Local,
    /// `private`: per-work-item scratch.
    Private,
    /// `generic`: a flat pointer into any of them.
    Generic,
    /// `region`: GDS.
    Region,
    /// A name this reader does not know, kept as written.
    Other(String),
}

/// How a kernel accesses an argument's pointee, as the metadata says (a hint only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `read_only`.
    ReadOnly,
    /// `write_only`.
    WriteOnly,
    /// `read_write`.
    ReadWrite,
}

/// What an argument is (its `.value_kind`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// `global_buffer`: a pointer to device memory; a pointer slot.
    GlobalBuffer {
        /// `.address_space`, [`AddressSpace::Global`] when absent.
        address_space: AddressSpace,
        /// `.is_const`: the pointee is declared `const` (a hint, not a promise).
        is_const: bool,
        /// `.actual_access`, else `.access`, when present (a hint, not a promise).
        access: Option<Access>,
    },
    /// `by_value`: bytes copied into the kernarg segment (a struct's words may hold pointers).
    ByValue,
    /// A `hidden_*` argument the runtime fills in; the string is the kind without `hidden_`.
    Hidden(String),
    /// Another explicit kind (`dynamic_shared_pointer`, `image`, `sampler`, `pipe`, `queue`,
    /// or one this reader does not know), kept as written.
    Other(String),
}

/// One argument of a kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelArg {
    /// Byte offset in the kernarg segment.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
    /// What it is.
    pub kind: ArgKind,
    /// Its source name, when the compiler recorded one.
    pub name: Option<String>,
}

impl KernelArg {
    /// Whether this is a hidden argument holding a device address the runtime owns (its printf
    /// or hostcall buffer, device heap, queue, ...): memory the application never allocated.
    pub fn is_runtime_pointer(&self) -> bool {
        matches!(&self.kind, ArgKind::Hidden(h) if RUNTIME_POINTERS.contains(&h.as_str()))
    }

    /// A hint that the kernel does not write through this pointer argument: a `global_buffer`
    /// that is `const` or whose access is `read_only`. Only a hint: possum still validates.
    pub fn readonly_hint(&self) -> bool {
        matches!(
            self.kind,
            ArgKind::GlobalBuffer { is_const: true, .. }
                | ArgKind::GlobalBuffer {
                    access: Some(Access::ReadOnly),
                    ..
                }
        )
    }
}

/// The hidden argument kinds (without `hidden_`) that hold a device address of a buffer or
/// queue the runtime allocated itself.
const RUNTIME_POINTERS: &[&str] = &[
    "printf_buffer",
    "hostcall_buffer",
    "multigrid_sync_arg",
    "heap_v1",
    "default_queue",
    "completion_action",
    "queue_ptr",
];

/// One kernel of a code object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmdgpuKernel {
    /// `.name`: the source name.
    pub name: String,
    /// `.symbol`: the kernel descriptor's symbol (empty when absent).
    pub symbol: String,
    /// `.kernarg_segment_size` in bytes.
    pub kernarg_size: u32,
    /// Every argument, hidden ones included, in metadata order.
    pub args: Vec<KernelArg>,
}

impl AmdgpuKernel {
    /// The explicit (not hidden) arguments, in order: those a launch passes.
    pub fn explicit_args(&self) -> impl Iterator<Item = &KernelArg> {
        self.args
            .iter()
            .filter(|a| !matches!(a.kind, ArgKind::Hidden(_)))
    }

    /// The explicit arguments as a [`ParamLayout`], parameter `i` being explicit argument `i`
    /// at its kernarg offset: its [`ParamLayout::pointer_slots`] are the words possum watches.
    pub fn layout(&self) -> ParamLayout {
        ParamLayout::new(
            self.explicit_args()
                .map(|a| Param {
                    offset: a.offset,
                    size: a.size,
                })
                .collect(),
        )
    }

    /// The bytes of the kernarg segment a launch supplies: the end of the last explicit
    /// argument (0 without any). The hidden arguments lie past it, up to
    /// [`Self::kernarg_size`](AmdgpuKernel::kernarg_size).
    pub fn explicit_size(&self) -> u32 {
        self.explicit_args()
            .map(|a| a.offset + a.size)
            .max()
            .unwrap_or(0)
    }

    /// The hidden arguments, in metadata order.
    pub fn hidden_args(&self) -> impl Iterator<Item = &KernelArg> {
        self.args
            .iter()
            .filter(|a| matches!(a.kind, ArgKind::Hidden(_)))
    }

    /// Indices (into [`Self::explicit_args`]) of the `global_buffer` arguments.
    pub fn global_buffers(&self) -> Vec<usize> {
        self.explicit_args()
            .enumerate()
            .filter(|(_, a)| matches!(a.kind, ArgKind::GlobalBuffer { .. }))
            .map(|(i, _)| i)
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Step 1: the ELF file and its notes.

/// The contents of the note sections (or, with no section headers, the note segments).
fn note_areas<'a>(elf: &'a [u8]) -> Result<Vec<&'a [u8]>, AmdgpuError> {
    let ehdr = header(elf)?;
    let machine = u16_at(ehdr, 0x12);
    if machine != EM_AMDGPU {
        return Err(AmdgpuError::NotAmdgpu(machine));
    }
    // One header table (sections or segments): where its entries' fields are, in the ELF header
    // and in an entry, and which entries are notes.
    struct Table {
        what: &'static str,
        /// Offsets in the ELF header of the table's offset (u64), entry size and count (u16).
        at: (usize, usize, usize),
        /// Least entry size.
        min: u64,
        /// Offset and value of an entry's type (u32) that marks a note.
        note: (usize, u32),
        /// Offsets of an entry's file offset and size (u64).
        range: (usize, usize),
        item: &'static str,
    }
    let notes = |t: &Table, out: &mut Vec<&'a [u8]>| -> Result<u64, AmdgpuError> {
        let (off, entsize, num) = (
            u64_at(ehdr, t.at.0),
            u64::from(u16_at(ehdr, t.at.1)),
            u64::from(u16_at(ehdr, t.at.2)),
        );
        if num > 0 && entsize < t.min {
            return Err(ElfError::BadHeader(format!(
                "{} entry size {entsize} < {}",
                t.what, t.min
            ))
            .into());
        }
        let table = slice(elf, off, entsize * num, t.what)?;
        for i in 0..num as usize {
            let e = &table[i * entsize as usize..][..t.min as usize];
            if u32_at(e, t.note.0) == t.note.1 {
                let (o, n) = (u64_at(e, t.range.0), u64_at(e, t.range.1));
                out.push(slice(elf, o, n, &format!("{} {i}", t.item))?);
            }
        }
        Ok(num)
    };
    let mut out = Vec::new();
    let sections = Table {
        what: "section header table",
        at: (0x28, 0x3a, 0x3c),
        min: 64,
        note: (4, SHT_NOTE),
        range: (24, 32),
        item: "note section",
    };
    if notes(&sections, &mut out)? == 0 {
        let segments = Table {
            what: "program header table",
            at: (0x20, 0x36, 0x38),
            min: 56,
            note: (0, PT_NOTE),
            range: (8, 32),
            item: "note segment",
        };
        notes(&segments, &mut out)?;
    }
    Ok(out)
}

/// The description of the first `AMDGPU` / `NT_AMDGPU_METADATA` note in `area`, if any.
fn find_metadata(area: &[u8]) -> Result<Option<&[u8]>, AmdgpuError> {
    let pad4 = |n: usize| n.checked_next_multiple_of(4);
    let mut at = 0;
    while at < area.len() {
        let bad = |what: String| AmdgpuError::BadNote { offset: at, what };
        let Some(hdr) = area.get(at..at + 12) else {
            return Err(bad(format!(
                "{} byte(s) left, a note header needs 12",
                area.len() - at
            )));
        };
        let (namesz, descsz, ty) = (
            u32_at(hdr, 0) as usize,
            u32_at(hdr, 4) as usize,
            u32_at(hdr, 8),
        );
        let name_start = at + 12;
        let desc_start = pad4(namesz)
            .and_then(|n| name_start.checked_add(n))
            .ok_or_else(|| bad(format!("owner size {namesz} overflows")))?;
        let desc_end = desc_start
            .checked_add(descsz)
            .ok_or_else(|| bad(format!("description size {descsz} overflows")))?;
        if desc_end > area.len() {
            return Err(bad(format!(
                "owner of {namesz} and description of {descsz} bytes run past the {} bytes of notes",
                area.len()
            )));
        }
        let name = &area[name_start..name_start + namesz];
        let name = name.strip_suffix(&[0]).unwrap_or(name);
        if name == NOTE_OWNER && ty == NT_AMDGPU_METADATA {
            return Ok(Some(&area[desc_start..desc_end]));
        }
        // The last note's padding may be missing.
        at = pad4(desc_end).unwrap_or(usize::MAX).min(area.len());
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------------
// Step 2: MessagePack.

/// A decoded MessagePack value (extension types are kept as opaque).
#[derive(Debug, PartialEq)]
enum Value {
    Nil,
    Bool(bool),
    UInt(u64),
    Int(i64),
    Float(f64),
    Str(String),
    Bin,
    Ext,
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

struct Decoder<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Decoder<'a> {
    fn err(&self, what: impl Into<String>) -> AmdgpuError {
        AmdgpuError::BadMsgpack {
            offset: self.at,
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], AmdgpuError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return Err(self.err(format!(
                "{n} byte(s) wanted, {} left",
                self.data.len() - self.at
            )));
        };
        let out = &self.data[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn be(&mut self, n: usize) -> Result<u64, AmdgpuError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, AmdgpuError> {
        let v = self.be(n)?;
        usize::try_from(v).map_err(|_| self.err(format!("length {v} too large")))
    }

    /// `count` elements of at least `min` bytes each must fit in what is left.
    fn check_count(&self, count: usize, min: usize) -> Result<(), AmdgpuError> {
        let left = self.data.len() - self.at;
        if count.saturating_mul(min) > left {
            return Err(self.err(format!(
                "{count} element(s) cannot fit in the {left} byte(s) left"
            )));
        }
        Ok(())
    }

    fn str(&mut self, n: usize) -> Result<Value, AmdgpuError> {
        let start = self.at;
        let bytes = self.take(n)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(s.to_string())),
            Err(_) => Err(AmdgpuError::BadMsgpack {
                offset: start,
                what: "string is not UTF-8".into(),
            }),
        }
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, AmdgpuError> {
        self.check_count(n, 1)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(v))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, AmdgpuError> {
        self.check_count(n, 2)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            v.push((k, self.value(depth + 1)?));
        }
        Ok(Value::Map(v))
    }

    fn value(&mut self, depth: usize) -> Result<Value, AmdgpuError> {
        if depth > MAX_DEPTH {
            return Err(self.err(format!("nested deeper than {MAX_DEPTH}")));
        }
        let start = self.at;
        let tag = self.take(1)?[0];
        Ok(match tag {
            0x00..=0x7f => Value::UInt(u64::from(tag)),
            0x80..=0x8f => return self.map(usize::from(tag & 0x0f), depth),
            0x90..=0x9f => return self.array(usize::from(tag & 0x0f), depth),
            0xa0..=0xbf => return self.str(usize::from(tag & 0x1f)),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (tag - 0xc4))?;
                self.take(n)?;
                Value::Bin
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (tag - 0xc7))?;
                self.take(1)?;
                self.take(n)?;
                Value::Ext
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::UInt(self.be(1 << (tag - 0xcc))?),
            0xd0..=0xd3 => {
                let bytes = 1usize << (tag - 0xd0);
                let raw = self.be(bytes)?;
                let shift = 64 - 8 * bytes as u32;
                Value::Int(((raw << shift) as i64) >> shift)
            }
            0xd4..=0xd8 => {
                self.take(1)?;
                self.take(1 << (tag - 0xd4))?;
                Value::Ext
            }
            0xd9..=0xdb => {
                let n = self.len(1 << (tag - 0xd9))?;
                return self.str(n);
            }
            0xdc | 0xdd => {
                let n = self.len(if tag == 0xdc { 2 } else { 4 })?;
                return self.array(n, depth);
            }
            0xde | 0xdf => {
                let n = self.len(if tag == 0xde { 2 } else { 4 })?;
                return self.map(n, depth);
            }
            0xe0..=0xff => Value::Int(i64::from(tag as i8)),
            0xc1 => {
                return Err(AmdgpuError::BadMsgpack {
                    offset: start,
                    what: "reserved tag 0xc1".into(),
                })
            }
        })
    }
}

fn decode(data: &[u8]) -> Result<Value, AmdgpuError> {
    let mut d = Decoder { data, at: 0 };
    let v = d.value(0)?;
    if d.at != data.len() {
        return Err(d.err(format!(
            "{} byte(s) after the metadata map",
            data.len() - d.at
        )));
    }
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// Step 3: the metadata's shape.

fn get<'v>(map: &'v [(Value, Value)], key: &str) -> Option<&'v Value> {
    map.iter()
        .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
        .map(|(_, v)| v)
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Bool(_) => "a boolean",
        Value::UInt(_) | Value::Int(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Str(_) => "a string",
        Value::Bin => "binary",
        Value::Ext => "an extension value",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
    }
}

fn as_u32(v: &Value, key: &str) -> Result<u32, String> {
    match v {
        Value::UInt(n) => u32::try_from(*n).map_err(|_| format!("{key} {n} is too large")),
        Value::Int(n) => u32::try_from(*n).map_err(|_| format!("{key} {n} is out of range")),
        other => Err(format!("{key} is {}, not an integer", kind_name(other))),
    }
}

fn req<'v>(map: &'v [(Value, Value)], key: &str) -> Result<&'v Value, String> {
    get(map, key).ok_or_else(|| format!("no {key}"))
}

fn opt_str(map: &[(Value, Value)], key: &str) -> Result<Option<String>, String> {
    match get(map, key) {
        None => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("{key} is {}, not a string", kind_name(other))),
    }
}

fn access(map: &[(Value, Value)], key: &str) -> Result<Option<Access>, String> {
    Ok(match opt_str(map, key)?.as_deref() {
        None => None,
        Some("read_only") => Some(Access::ReadOnly),
        Some("write_only") => Some(Access::WriteOnly),
        Some("read_write") => Some(Access::ReadWrite),
        Some(other) => return Err(format!("{key} {other:?} is not an access")),
    })
}

fn arg(v: &Value, kernarg_size: u32) -> Result<KernelArg, String> {
    let Value::Map(m) = v else {
        return Err(format!("is {}, not a map", kind_name(v)));
    };
    let offset = as_u32(req(m, ".offset")?, ".offset")?;
    let size = as_u32(req(m, ".size")?, ".size")?;
    match offset.checked_add(size) {
        Some(end) if end <= kernarg_size => {}
        _ => {
            return Err(format!(
                "offset {offset} + size {size} runs past the kernarg segment's {kernarg_size} bytes"
            ))
        }
    }
    let value_kind = match req(m, ".value_kind")? {
        Value::Str(s) => s.as_str(),
        other => return Err(format!(".value_kind is {}, not a string", kind_name(other))),
    };
    let kind = match value_kind {
        "global_buffer" => {
            if size != 8 {
                return Err(format!("global_buffer of {size} bytes, not 8"));
            }
            let address_space = match opt_str(m, ".address_space")?.as_deref() {
                None | Some("global") => AddressSpace::Global,
                Some("constant") => AddressSpace::Constant,
                Some("local") => AddressSpace::Local,
                Some("private") => AddressSpace::Private,
                Some("generic") => AddressSpace::Generic,
                Some("region") => AddressSpace::Region,
                Some(other) => AddressSpace::Other(other.to_string()),
            };
            let is_const = match get(m, ".is_const") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => return Err(format!(".is_const is {}", kind_name(other))),
            };
            let access = match access(m, ".actual_access")? {
                Some(a) => Some(a),
                None => access(m, ".access")?,
            };
            ArgKind::GlobalBuffer {
                address_space,
                is_const,
                access,
            }
        }
        "by_value" => ArgKind::ByValue,
        k => match k.strip_prefix("hidden_") {
            Some(h) => ArgKind::Hidden(h.to_string()),
            None => ArgKind::Other(k.to_string()),
        },
    };
    Ok(KernelArg {
        offset,
        size,
        kind,
        name: opt_str(m, ".name")?,
    })
}

fn kernel(index: usize, v: &Value) -> Result<AmdgpuKernel, AmdgpuError> {
    let bad_at = |kernel: &str, what: String| AmdgpuError::BadKernel {
        kernel: kernel.to_string(),
        what,
    };
    let Value::Map(m) = v else {
        return Err(bad_at(
            &format!("#{index}"),
            format!("is {}, not a map", kind_name(v)),
        ));
    };
    let name = match get(m, ".name") {
        Some(Value::Str(s)) => s.clone(),
        Some(other) => {
            return Err(bad_at(
                &format!("#{index}"),
                format!(".name is {}, not a string", kind_name(other)),
            ))
        }
        None => return Err(bad_at(&format!("#{index}"), "no .name".into())),
    };
    let bad = |what: String| bad_at(&name, what);
    let symbol = opt_str(m, ".symbol").map_err(bad)?.unwrap_or_default();
    let kernarg_size = req(m, ".kernarg_segment_size")
        .and_then(|v| as_u32(v, ".kernarg_segment_size"))
        .map_err(bad)?;
    if kernarg_size > MAX_KERNARG_SIZE {
        return Err(bad(format!(
            "kernarg segment of {kernarg_size} bytes, more than {MAX_KERNARG_SIZE}"
        )));
    }
    let raw_args: &[Value] = match get(m, ".args") {
        None => &[],
        Some(Value::Array(a)) => a,
        Some(other) => return Err(bad(format!(".args is {}, not an array", kind_name(other)))),
    };
    if raw_args.len() > MAX_ARGS {
        return Err(bad(format!(
            "{} arguments, more than {MAX_ARGS}",
            raw_args.len()
        )));
    }
    let args = raw_args
        .iter()
        .enumerate()
        .map(|(index, a)| {
            arg(a, kernarg_size).map_err(|what| AmdgpuError::BadArg {
                kernel: name.clone(),
                index,
                what,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let first_hidden = args
        .iter()
        .filter(|a| matches!(a.kind, ArgKind::Hidden(_)))
        .map(|a| a.offset)
        .min();
    if let Some(first_hidden) = first_hidden {
        if let Some((index, a)) = args.iter().enumerate().find(|(_, a)| {
            !matches!(a.kind, ArgKind::Hidden(_)) && a.offset + a.size > first_hidden
        }) {
            return Err(AmdgpuError::BadArg {
                kernel: name,
                index,
                what: format!(
                    "explicit argument at {}..{} reaches the hidden arguments at {first_hidden}",
                    a.offset,
                    a.offset + a.size
                ),
            });
        }
    }
    Ok(AmdgpuKernel {
        name,
        symbol,
        kernarg_size,
        args,
    })
}

fn kernels_of(meta: &Value) -> Result<Vec<AmdgpuKernel>, AmdgpuError> {
    let bad = |what: String| AmdgpuError::BadMetadata(what);
    let Value::Map(top) = meta else {
        return Err(bad(format!("is {}, not a map", kind_name(meta))));
    };
    let list = match get(top, "amdhsa.kernels") {
        None => return Err(bad("no amdhsa.kernels".into())),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(bad(format!(
                "amdhsa.kernels is {}, not an array",
                kind_name(other)
            )))
        }
    };
    if list.len() > MAX_KERNELS {
        return Err(bad(format!(
            "{} kernels, more than {MAX_KERNELS}",
            list.len()
        )));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let k = kernel(i, v)?;
        if !seen.insert(k.name.clone()) {
            return Err(bad(format!("kernel {} described twice", k.name)));
        }
        out.push(k);
    }
    Ok(out)
}

/// The magic a clang offload bundle starts with (a program's device code: one code object per
/// target, and the host's entry).
pub const BUNDLE_MAGIC: &[u8; 24] = b"__CLANG_OFFLOAD_BUNDLE__";

/// The AMDGPU code objects of a clang offload bundle (entries whose id names an `amdgcn`
/// target), in order.
pub fn bundle_code_objects(bundle: &[u8]) -> Result<Vec<&[u8]>, AmdgpuError> {
    let bad = |why: &str| AmdgpuError::BadBundle(why.to_string());
    let rest = bundle
        .strip_prefix(BUNDLE_MAGIC.as_slice())
        .ok_or_else(|| bad("no magic"))?;
    let word = |at: usize| -> Result<u64, AmdgpuError> {
        rest.get(at..at + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .ok_or_else(|| bad("truncated header"))
    };
    let n = word(0)?;
    if n > 1024 {
        return Err(bad("more than 1024 entries"));
    }
    let mut at = 8usize;
    let mut out = Vec::new();
    for _ in 0..n {
        let (off, size, id_len) = (word(at)?, word(at + 8)?, word(at + 16)?);
        let id_len = usize::try_from(id_len).map_err(|_| bad("entry id too long"))?;
        let id = rest
            .get(at + 24..at + 24 + id_len)
            .ok_or_else(|| bad("truncated entry id"))?;
        at += 24 + id_len;
        if !id.windows(6).any(|w| w == b"amdgcn") || size == 0 {
            continue;
        }
        let (off, size) = (
            usize::try_from(off).map_err(|_| bad("entry offset"))?,
            usize::try_from(size).map_err(|_| bad("entry size"))?,
        );
        let object = off
            .checked_add(size)
            .and_then(|end| bundle.get(off..end))
            .ok_or_else(|| bad("an entry lies past the bundle's end"))?;
        out.push(object);
    }
    Ok(out)
}

/// Every kernel of a code object, or of each code object of an offload bundle
/// ([`bundle_code_objects`]; a kernel in several, for several targets, once).
pub fn image_kernels(image: &[u8]) -> Result<Vec<AmdgpuKernel>, AmdgpuError> {
    if !image.starts_with(BUNDLE_MAGIC) {
        return kernels(image);
    }
    let mut out: Vec<AmdgpuKernel> = Vec::new();
    for object in bundle_code_objects(image)? {
        for k in kernels(object)? {
            if !out.iter().any(|o| o.name == k.name) {
                out.push(k);
            }
        }
    }
    Ok(out)
}

/// Every kernel of an AMDGPU code object (v3 or later), in metadata order, with its arguments.
pub fn kernels(elf: &[u8]) -> Result<Vec<AmdgpuKernel>, AmdgpuError> {
    let mut meta = None;
    for area in note_areas(elf)? {
        if let Some(desc) = find_metadata(area)? {
            meta = Some(desc);
            break;
        }
    }
    let desc = meta.ok_or(AmdgpuError::NoMetadata)?;
    kernels_of(&decode(desc)?)
}
