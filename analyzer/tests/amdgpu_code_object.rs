//! The AMDGPU code object reader against code objects clang built (`tests/data/amdgpu/`), corrupt
//! variants of them, and hand-made metadata.

use possum_analyzer::amdgpu::{
    self, kernels, Access, AddressSpace, AmdgpuError, AmdgpuKernel, ArgKind, MAX_ARGS,
};
use possum_analyzer::{ElfError, Param, ParamLayout};
use proptest::prelude::*;

const GFX90A: &[u8] = include_bytes!("data/amdgpu/kernels-gfx90a.hsaco");
const GFX908: &[u8] = include_bytes!("data/amdgpu/kernels-gfx908.hsaco");
const GFX942: &[u8] = include_bytes!("data/amdgpu/kernels-gfx942.hsaco");
const GFX942_IMPLICIT: &[u8] = include_bytes!("data/amdgpu/implicit-gfx942.hsaco");

/// `EI_ABIVERSION` of an AMDHSA code object: 2 is code object v4, 3 is v5.
fn abi_version(elf: &[u8]) -> u8 {
    elf[8]
}

fn by_name<'k>(ks: &'k [AmdgpuKernel], name: &str) -> &'k AmdgpuKernel {
    ks.iter()
        .find(|k| k.name == name)
        .unwrap_or_else(|| panic!("no kernel {name}"))
}

fn p(offset: u32, size: u32) -> Param {
    Param { offset, size }
}

/// The offsets of `k`'s pointer-sized parameter slots.
fn slot_offsets(k: &AmdgpuKernel) -> Vec<u32> {
    k.layout()
        .pointer_slots()
        .iter()
        .map(|s| s.offset)
        .collect()
}

/// The offsets of `k`'s arguments the runtime fills with pointers.
fn runtime_pointers(k: &AmdgpuKernel) -> Vec<u32> {
    k.args
        .iter()
        .filter(|a| a.is_runtime_pointer())
        .map(|a| a.offset)
        .collect()
}

/// The read-only hint of each of `k`'s explicit arguments.
fn readonly_hints(k: &AmdgpuKernel) -> Vec<bool> {
    k.explicit_args().map(|a| a.readonly_hint()).collect()
}

/// `out_access`: what the compiler recorded for `scale_copy`'s `out` (clang 14 records nothing,
/// clang 19 finds it write-only).
fn check_fixture(elf: &[u8], out_access: Option<Access>) {
    let ks = kernels(elf).expect("fixture reads");
    let mut names: Vec<&str> = ks.iter().map(|k| k.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["many_pointers", "scale_copy", "with_struct"]);

    // scale_copy(const float* restrict in, float* restrict out, int n, float factor)
    let k = by_name(&ks, "scale_copy");
    assert_eq!(k.symbol, "scale_copy.kd");
    assert_eq!(k.kernarg_size, 24);
    assert_eq!(
        k.layout(),
        ParamLayout::new(vec![p(0, 8), p(8, 8), p(16, 4), p(20, 4)])
    );
    assert_eq!(k.global_buffers(), [0, 1]);
    let args: Vec<_> = k.explicit_args().collect();
    assert_eq!(
        args[0].kind,
        ArgKind::GlobalBuffer {
            address_space: AddressSpace::Global,
            is_const: true,
            access: Some(Access::ReadOnly),
        }
    );
    assert!(args[0].readonly_hint());
    assert_eq!(
        args[1].kind,
        ArgKind::GlobalBuffer {
            address_space: AddressSpace::Global,
            is_const: false,
            access: out_access,
        }
    );
    assert!(!args[1].readonly_hint());
    assert_eq!(args[2].kind, ArgKind::ByValue);
    assert_eq!(args[3].kind, ArgKind::ByValue);
    // Only the two pointers are 8-byte words.
    assert_eq!(slot_offsets(k), [0, 8]);

    // with_struct(float* data, params_t p): the struct { float; int; float* } is 16 bytes by
    // value, and its words are slots too.
    let k = by_name(&ks, "with_struct");
    assert_eq!(k.kernarg_size, 24);
    assert_eq!(k.layout(), ParamLayout::new(vec![p(0, 8), p(8, 16)]));
    assert_eq!(k.global_buffers(), [0]);
    assert_eq!(k.args[1].kind, ArgKind::ByValue);
    assert_eq!(slot_offsets(k), [0, 8, 16]);

    // many_pointers(const int* a, const int* b, int* c, int* d, long len)
    let k = by_name(&ks, "many_pointers");
    assert_eq!(k.kernarg_size, 40);
    assert_eq!(
        k.layout(),
        ParamLayout::new(vec![p(0, 8), p(8, 8), p(16, 8), p(24, 8), p(32, 8)])
    );
    assert_eq!(k.global_buffers(), [0, 1, 2, 3]);
    assert_eq!(readonly_hints(k), [true, true, false, false, false]);
    assert_eq!(k.args[4].kind, ArgKind::ByValue);
    for k in &ks {
        assert!(k.layout().total_size() <= k.kernarg_size as usize);
        assert_eq!(
            k.explicit_size(),
            k.kernarg_size,
            "{}: no hidden arguments",
            k.name
        );
        assert_eq!(k.hidden_args().count(), 0);
    }
}

#[test]
fn reads_clang_code_objects() {
    for (case, elf, abi, out_access) in [
        ("gfx90a", GFX90A, 2, None),
        ("gfx908", GFX908, 2, None),
        ("gfx942, code object v5", GFX942, 3, Some(Access::WriteOnly)),
    ] {
        assert_eq!(abi_version(elf), abi, "{case}");
        let checked = std::panic::catch_unwind(|| check_fixture(elf, out_access));
        assert!(
            checked.is_ok(),
            "{case}: the fixture's check failed (above)"
        );
    }
}

/// `(value_kind without hidden_, offset, size)` of a kernel's hidden arguments.
fn hidden(k: &AmdgpuKernel) -> Vec<(&str, u32, u32)> {
    k.hidden_args()
        .map(|a| match &a.kind {
            ArgKind::Hidden(h) => (h.as_str(), a.offset, a.size),
            other => panic!("{other:?} is not hidden"),
        })
        .collect()
}

/// The hidden arguments code object v5 gives a kernel that reads its work-group size, from
/// the first (after the explicit ones at `start`) to `hidden_printf_buffer`.
fn v5_hidden_prefix(start: u32) -> Vec<(&'static str, u32, u32)> {
    // Runs of fields of one size, each right after the one before.
    let run = move |names: &[&'static str], at: u32, size: u32| {
        (0..)
            .zip(names.to_vec())
            .map(move |(i, name)| (name, start + at + i * size, size))
    };
    run(&["block_count_x", "block_count_y", "block_count_z"], 0, 4)
        .chain(run(
            &["group_size_x", "group_size_y", "group_size_z"],
            12,
            2,
        ))
        .chain(run(&["remainder_x", "remainder_y", "remainder_z"], 18, 2))
        .chain(run(
            &["global_offset_x", "global_offset_y", "global_offset_z"],
            40,
            8,
        ))
        .chain(run(&["grid_dims"], 64, 2))
        .chain(run(&["printf_buffer"], 72, 8))
        .collect()
}

#[test]
fn reads_gfx942_hidden_arguments() {
    assert_eq!(abi_version(GFX942_IMPLICIT), 3, "code object v5");
    let ks = kernels(GFX942_IMPLICIT).expect("fixture reads");
    let names: Vec<&str> = ks.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(names, ["sized_fill", "whole_implicit", "prints"]);

    // sized_fill(int* out, int value, int n) reads only its work-group size, from the hidden
    // arguments in v5; the metadata lists them up to the printf buffer.
    let k = by_name(&ks, "sized_fill");
    assert_eq!(k.kernarg_size, 272);
    assert_eq!(k.explicit_size(), 16);
    assert_eq!(
        k.layout(),
        ParamLayout::new(vec![p(0, 8), p(8, 4), p(12, 4)])
    );
    assert_eq!(k.global_buffers(), [0]);
    assert_eq!(slot_offsets(k), [0]);
    assert_eq!(hidden(k), v5_hidden_prefix(16));
    assert_eq!(runtime_pointers(k), [88]);

    // whole_implicit(const int* in, ulong* out) reads the whole implicit area: every hidden
    // argument up to the queue pointer.
    let k = by_name(&ks, "whole_implicit");
    assert_eq!(k.kernarg_size, 272);
    assert_eq!(k.explicit_size(), 16);
    assert_eq!(k.layout(), ParamLayout::new(vec![p(0, 8), p(8, 8)]));
    assert_eq!(k.global_buffers(), [0, 1]);
    assert_eq!(readonly_hints(k), [true, false]);
    assert_eq!(
        slot_offsets(k),
        [0, 8],
        "hidden pointers are not parameter slots"
    );
    let mut all = v5_hidden_prefix(16);
    all.extend([
        ("hostcall_buffer", 96, 8),
        ("multigrid_sync_arg", 104, 8),
        ("heap_v1", 112, 8),
        ("default_queue", 120, 8),
        ("completion_action", 128, 8),
        ("queue_ptr", 216, 8),
    ]);
    assert_eq!(hidden(k), all);
    assert_eq!(runtime_pointers(k), [88, 96, 104, 112, 120, 128, 216]);
    assert!(k.explicit_args().all(|a| !a.is_runtime_pointer()));

    // prints(const float* x, int n): 12 explicit bytes, the hidden ones aligned to 16.
    let k = by_name(&ks, "prints");
    assert_eq!(k.kernarg_size, 272);
    assert_eq!(k.explicit_size(), 12);
    assert_eq!(k.layout(), ParamLayout::new(vec![p(0, 8), p(8, 4)]));
    assert_eq!(k.layout().total_size(), 12);
    assert_eq!(hidden(k)[0], ("block_count_x", 16, 4));
    assert_eq!(hidden(k).len(), 20);
}

/// Offset of the metadata note's header in `elf` (found by its owner name).
fn note_header(elf: &[u8]) -> usize {
    let owner = elf
        .windows(8)
        .position(|w| w == b"AMDGPU\0\0")
        .expect("note owner");
    owner - 12
}

#[test]
fn truncated_code_objects_give_typed_errors() {
    for cut in [
        0,
        10,
        63,
        64,
        200,
        0x20c,
        GFX90A.len() / 2,
        GFX90A.len() - 1,
    ] {
        let err = kernels(&GFX90A[..cut]).unwrap_err();
        if cut < 64 {
            assert_eq!(err, AmdgpuError::Elf(ElfError::NotElf64Le), "cut at {cut}");
        } else {
            // The section header table sits at the end of the file.
            assert!(
                matches!(err, AmdgpuError::Elf(ElfError::OutOfBounds { .. })),
                "cut at {cut}: {err}"
            );
        }
    }
}

#[test]
fn wrong_machine_is_refused() {
    let mut elf = GFX90A.to_vec();
    elf[0x12..0x14].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    assert_eq!(kernels(&elf).unwrap_err(), AmdgpuError::NotAmdgpu(62));
    let mut elf = GFX90A.to_vec();
    elf[4] = 1; // ELFCLASS32
    assert_eq!(
        kernels(&elf).unwrap_err(),
        AmdgpuError::Elf(ElfError::NotElf64Le)
    );
}

#[test]
fn corrupt_notes_give_typed_errors() {
    let at = note_header(GFX90A);
    // A description size larger than the note section.
    let mut elf = GFX90A.to_vec();
    elf[at + 4] ^= 0x80;
    elf[at + 5] ^= 0x40;
    assert!(
        matches!(kernels(&elf), Err(AmdgpuError::BadNote { .. })),
        "{:?}",
        kernels(&elf)
    );
    // Another note type: no metadata.
    let mut elf = GFX90A.to_vec();
    elf[at + 8] = 33;
    assert_eq!(kernels(&elf).unwrap_err(), AmdgpuError::NoMetadata);
    // The description's first byte: a reserved MessagePack tag.
    let desc = at + 12 + 8;
    let mut elf = GFX90A.to_vec();
    elf[desc] = 0xc1;
    assert!(matches!(
        kernels(&elf),
        Err(AmdgpuError::BadMsgpack { offset: 0, .. })
    ));
    // A top-level array instead of a map.
    let mut elf = GFX90A.to_vec();
    elf[desc] = 0x93;
    assert!(kernels(&elf).is_err());
}

fn replace(elf: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at = elf
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in fixture");
    let mut out = elf.to_vec();
    out[at..at + to.len()].copy_from_slice(to);
    out
}

#[test]
fn misshapen_metadata_names_the_problem() {
    let elf = replace(GFX90A, b"amdhsa.kernels", b"amdhsa.kernelz");
    assert_eq!(
        kernels(&elf).unwrap_err(),
        AmdgpuError::BadMetadata("no amdhsa.kernels".into())
    );
    let elf = replace(GFX90A, b".kernarg_segment_size", b".kernarg_segment_sizz");
    let err = kernels(&elf).unwrap_err();
    assert!(
        matches!(&err, AmdgpuError::BadKernel { kernel, what }
            if kernel == "scale_copy" && what.contains(".kernarg_segment_size")),
        "{err}"
    );
    let elf = replace(GFX90A, b".value_kind", b".value_kinx");
    let err = kernels(&elf).unwrap_err();
    assert!(
        matches!(&err, AmdgpuError::BadArg { kernel, index: 0, what }
            if kernel == "scale_copy" && what.contains(".value_kind")),
        "{err}"
    );
    let elf = replace(GFX90A, b"read_only", b"read_oops");
    assert!(matches!(
        kernels(&elf),
        Err(AmdgpuError::BadArg { index: 0, .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Hand-made metadata in a minimal code object.

/// A tiny MessagePack encoder for the shapes the tests need.
enum M {
    U(u64),
    S(&'static str),
    B(bool),
    A(Vec<M>),
    Map(Vec<(&'static str, M)>),
    Raw(Vec<u8>),
}

fn enc(m: &M, out: &mut Vec<u8>) {
    match m {
        M::U(n) => {
            out.push(0xcf);
            out.extend_from_slice(&n.to_be_bytes());
        }
        M::S(s) => {
            out.push(0xd9);
            out.push(s.len() as u8);
            out.extend_from_slice(s.as_bytes());
        }
        M::B(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        M::A(v) => {
            out.push(0xdd);
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            v.iter().for_each(|x| enc(x, out));
        }
        M::Map(v) => {
            out.push(0xdf);
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            for (k, x) in v {
                enc(&M::S(k), out);
                enc(x, out);
            }
        }
        M::Raw(b) => out.extend_from_slice(b),
    }
}

/// An ELF64 LE AMDGPU file with one `.note` section holding one AMDGPU metadata note.
fn code_object(desc: &[u8]) -> Vec<u8> {
    let mut note = Vec::new();
    note.extend_from_slice(&7u32.to_le_bytes());
    note.extend_from_slice(&(desc.len() as u32).to_le_bytes());
    note.extend_from_slice(&32u32.to_le_bytes());
    note.extend_from_slice(b"AMDGPU\0\0");
    note.extend_from_slice(desc);
    note.resize(note.len().next_multiple_of(4), 0);
    let mut f = vec![0u8; 64];
    f[..6].copy_from_slice(b"\x7fELF\x02\x01");
    f[0x12..0x14].copy_from_slice(&224u16.to_le_bytes());
    let note_off = f.len() as u64;
    f.extend_from_slice(&note);
    f.resize(f.len().next_multiple_of(8), 0);
    let shoff = f.len() as u64;
    f.extend_from_slice(&[0u8; 64]); // null section
    let mut sh = [0u8; 64];
    sh[4..8].copy_from_slice(&7u32.to_le_bytes()); // SHT_NOTE
    sh[24..32].copy_from_slice(&note_off.to_le_bytes());
    sh[32..40].copy_from_slice(&(note.len() as u64).to_le_bytes());
    f.extend_from_slice(&sh);
    f[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    f[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes());
    f
}

/// Asserts that the code object around metadata `desc` is refused with an error matching
/// `pattern`.
macro_rules! assert_refused {
    ($desc:expr, $pattern:pat) => {{
        let read = kernels(&code_object(&$desc));
        assert!(matches!(read, Err($pattern)), "{read:?}");
    }};
}

/// Metadata whose `amdhsa.kernels` is `kernels`, encoded.
fn meta_of(kernels: M) -> Vec<u8> {
    let mut out = Vec::new();
    enc(&M::Map(vec![("amdhsa.kernels", kernels)]), &mut out);
    out
}

fn meta(kernels: Vec<M>) -> Vec<u8> {
    meta_of(M::A(kernels))
}

/// Metadata of one kernel `k` of `size` kernarg bytes with arguments `(offset, size, kind)`.
fn one_kernel(size: u64, args: &[(u64, u64, &'static str)]) -> Vec<u8> {
    let args = args.iter().map(|&(at, len, kind)| arg(at, len, kind));
    meta(vec![kernel("k", size, args.collect())])
}

fn kernel(name: &'static str, size: u64, args: Vec<M>) -> M {
    M::Map(vec![
        (".name", M::S(name)),
        (".symbol", M::S("k.kd")),
        (".kernarg_segment_size", M::U(size)),
        (".args", M::A(args)),
    ])
}

fn arg(offset: u64, size: u64, kind: &'static str) -> M {
    M::Map(vec![
        (".offset", M::U(offset)),
        (".size", M::U(size)),
        (".value_kind", M::S(kind)),
    ])
}

#[test]
fn hidden_arguments_are_not_parameters() {
    let desc = meta(vec![kernel(
        "k",
        64,
        vec![
            M::Map(vec![
                (".offset", M::U(0)),
                (".size", M::U(8)),
                (".value_kind", M::S("global_buffer")),
                (".address_space", M::S("constant")),
                (".is_const", M::B(false)),
                (".access", M::S("read_write")),
                (".actual_access", M::S("write_only")),
                (".name", M::S("out")),
            ]),
            arg(8, 4, "by_value"),
            arg(16, 8, "hidden_global_offset_x"),
            arg(24, 8, "hidden_hostcall_buffer"),
        ],
    )]);
    let ks = kernels(&code_object(&desc)).unwrap();
    let k = &ks[0];
    assert_eq!(k.args.len(), 4);
    assert_eq!(k.explicit_args().count(), 2);
    assert_eq!(k.layout(), ParamLayout::new(vec![p(0, 8), p(8, 4)]));
    assert_eq!(k.args[0].name.as_deref(), Some("out"));
    assert_eq!(
        k.args[0].kind,
        ArgKind::GlobalBuffer {
            address_space: AddressSpace::Constant,
            is_const: false,
            access: Some(Access::WriteOnly),
        }
    );
    assert_eq!(k.args[2].kind, ArgKind::Hidden("global_offset_x".into()));
}

#[test]
fn explicit_arguments_overlapping_the_hidden_ones_are_refused() {
    let desc = one_kernel(
        64,
        &[
            (0, 8, "global_buffer"),
            (8, 8, "hidden_block_count_x"),
            (12, 8, "by_value"),
        ],
    );
    match kernels(&code_object(&desc)) {
        Err(AmdgpuError::BadArg {
            kernel,
            index,
            what,
        }) => {
            assert_eq!(kernel, "k");
            assert_eq!(index, 2);
            assert!(what.contains("hidden"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    // Explicit arguments that end where the hidden ones start are fine, in any order.
    let desc = one_kernel(
        64,
        &[
            (16, 8, "hidden_block_count_x"),
            (0, 8, "global_buffer"),
            (8, 8, "by_value"),
        ],
    );
    let ks = kernels(&code_object(&desc)).unwrap();
    assert_eq!(ks[0].explicit_size(), 16);
}

#[test]
fn arguments_past_the_kernarg_segment_are_refused() {
    let desc = one_kernel(16, &[(0, 8, "by_value"), (12, 8, "by_value")]);
    let err = kernels(&code_object(&desc)).unwrap_err();
    assert!(
        matches!(&err, AmdgpuError::BadArg { kernel, index: 1, what }
            if kernel == "k" && what.contains("past the kernarg segment")),
        "{err}"
    );
    // An offset that overflows u32 arithmetic.
    let desc = one_kernel(16, &[(u32::MAX as u64, 8, "by_value")]);
    assert_refused!(desc, AmdgpuError::BadArg { index: 0, .. });
    // An offset beyond u32.
    let desc = one_kernel(16, &[(1 << 40, 8, "by_value")]);
    assert_refused!(desc, AmdgpuError::BadArg { index: 0, .. });
    // A pointer argument that is not 8 bytes.
    let desc = one_kernel(16, &[(0, 4, "global_buffer")]);
    assert_refused!(desc, AmdgpuError::BadArg { index: 0, .. });
}

#[test]
fn absurd_counts_are_refused() {
    // An array claiming 2^32-1 elements in a few bytes.
    let desc = meta_of(M::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0x80]));
    assert_refused!(desc, AmdgpuError::BadMsgpack { .. });
    // A string longer than what is left.
    let desc = vec![0x81, 0xdb, 0x7f, 0xff, 0xff, 0xff, b'a'];
    assert_refused!(desc, AmdgpuError::BadMsgpack { .. });
    // Too many arguments (each well formed).
    let args = (0..=MAX_ARGS as u64)
        .map(|i| arg(i, 1, "by_value"))
        .collect();
    let desc = meta(vec![kernel("k", 4096, args)]);
    let err = kernels(&code_object(&desc)).unwrap_err();
    assert!(
        matches!(&err, AmdgpuError::BadKernel { what, .. } if what.contains("more than")),
        "{err}"
    );
    // Nesting deeper than any metadata needs.
    let mut desc = vec![0x91; 10_000];
    desc.push(0xc0);
    assert_refused!(desc, AmdgpuError::BadMsgpack { .. });
    // A kernarg segment larger than any launch passes.
    let desc = one_kernel(1 << 30, &[]);
    assert_refused!(desc, AmdgpuError::BadKernel { .. });
    // Two kernels of one name.
    let desc = meta(vec![kernel("k", 8, vec![]), kernel("k", 8, vec![])]);
    assert_refused!(desc, AmdgpuError::BadMetadata(_));
}

#[test]
fn a_kernel_without_arguments_has_an_empty_layout() {
    let desc = meta_of(M::A(vec![M::Map(vec![
        (".name", M::S("noargs")),
        (".kernarg_segment_size", M::U(0)),
    ])]));
    let ks = kernels(&code_object(&desc)).unwrap();
    assert_eq!(ks[0].layout(), ParamLayout::default());
    assert_eq!(ks[0].symbol, "");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Flipped, replaced or cut bytes of a real code object give a result or a typed error,
    /// never a panic; a result still keeps every argument inside its kernarg segment.
    #[test]
    fn mutated_code_objects_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
        in_note in any::<bool>(),
    ) {
        let mut elf = GFX90A.to_vec();
        let note = note_header(GFX90A);
        let (lo, hi) = if in_note { (note, note + 0x750) } else { (0, elf.len()) };
        for (i, b) in edits {
            let at = lo + i.index(hi - lo);
            elf[at] = b;
        }
        if truncate {
            elf.truncate(cut.index(elf.len()));
        }
        if let Ok(ks) = kernels(&elf) {
            for k in ks {
                for a in &k.args {
                    prop_assert!(a.offset as u64 + a.size as u64 <= k.kernarg_size as u64);
                }
            }
        }
    }

    /// Random bytes as the note description never panic.
    #[test]
    fn random_metadata_never_panics(desc in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = kernels(&code_object(&desc));
    }
}

/// A clang offload bundle of `entries` (id, bytes), laid out as clang-offload-bundler writes
/// one: the magic, the count, each entry's (offset, size, id length, id), then the contents.
fn bundle(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let header: usize = 24 + 8 + entries.iter().map(|(id, _)| 24 + id.len()).sum::<usize>();
    let mut out = amdgpu::BUNDLE_MAGIC.to_vec();
    out.extend((entries.len() as u64).to_le_bytes());
    let mut at = header;
    for (id, bytes) in entries {
        out.extend((at as u64).to_le_bytes());
        out.extend((bytes.len() as u64).to_le_bytes());
        out.extend((id.len() as u64).to_le_bytes());
        out.extend(id.as_bytes());
        at += bytes.len();
    }
    for (_, bytes) in entries {
        out.extend(*bytes);
    }
    out
}

#[test]
fn an_offload_bundle_gives_its_code_objects_kernels_once() {
    let b = bundle(&[
        ("host-x86_64-unknown-linux-gnu-", &[]),
        ("hipv4-amdgcn-amd-amdhsa--gfx90a", GFX90A),
        ("hipv4-amdgcn-amd-amdhsa--gfx942", GFX942),
    ]);
    let objects = amdgpu::bundle_code_objects(&b).unwrap();
    assert_eq!(objects, vec![GFX90A, GFX942]);
    let ks = amdgpu::image_kernels(&b).unwrap();
    assert_eq!(ks, amdgpu::kernels(GFX90A).unwrap(), "each kernel once");
    // A code object is read as itself.
    assert_eq!(
        amdgpu::image_kernels(GFX942).unwrap(),
        amdgpu::kernels(GFX942).unwrap()
    );
}

#[test]
fn a_corrupt_offload_bundle_is_refused_naming_the_fault() {
    let b = bundle(&[("hipv4-amdgcn-amd-amdhsa--gfx942", GFX942)]);
    // Cut inside the code object: its entry lies past the end.
    let e = amdgpu::image_kernels(&b[..b.len() - 100]).unwrap_err();
    assert!(e.to_string().contains("past the bundle's end"), "{e}");
    // Cut inside the header.
    let e = amdgpu::bundle_code_objects(&b[..40]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    // A corrupt code object inside a well-formed bundle: the code object's own error.
    let mut bad = GFX942.to_vec();
    bad[0] = 0;
    let e =
        amdgpu::image_kernels(&bundle(&[("hipv4-amdgcn-amd-amdhsa--gfx942", &bad)])).unwrap_err();
    assert!(e.to_string().contains("ELF"), "{e}");
}
