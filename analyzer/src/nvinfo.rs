//! Kernel parameter layouts read from a cubin's `.nv.info.<kernel>` ELF sections: the fallback
//! when the driver's `cuFuncGetParamInfo` / `cuKernelGetParamInfo` give no answer.
//!
//! # Format
//!
//! A cubin is a 64-bit little-endian ELF file. Each kernel `k` has a section `.nv.info.k` holding
//! a sequence of attribute records, each starting with one byte of *format* and one byte of
//! *attribute*:
//!
//! | format            | what follows the two header bytes            |
//! |-------------------|-----------------------------------------------|
//! | `EIFMT_NVAL` 0x01 | 2 bytes, unused (zero)                        |
//! | `EIFMT_BVAL` 0x02 | 2 bytes (the value in the low byte)           |
//! | `EIFMT_HVAL` 0x03 | 2 bytes: a little-endian `u16` value          |
//! | `EIFMT_SVAL` 0x04 | `u16` payload size, then that many bytes      |
//!
//! So every record but `SVAL` is 4 bytes long. The attributes read here:
//!
//! - `EIATTR_KPARAM_INFO` (0x17, SVAL, 12 bytes): `u32` index, `u16` ordinal, `u16` offset in
//!   the parameter buffer, `u32` packed flags: bits 0..7 log-alignment of the pointee, 8..11
//!   space, 12..16 constant bank, bit 17 clear when the parameter lives in a constant bank, and
//!   bits 18..31 the parameter's size in bytes. Records usually come in reverse ordinal order.
//! - `EIATTR_KPARAM_INFO_V2` (0x45, SVAL, 12 bytes), which newer compilers (CUDA 12.1 on) emit
//!   for kernels whose parameters pass the old 4 KiB limit: `u32` index, `u16` ordinal, `u16`
//!   offset, `u16` size in bytes, `u16` attributes.
//! - `EIATTR_CBANK_PARAM_SIZE` (0x19, HVAL): the total parameter size, used as a cross-check:
//!   a parameter ending past it is an error.
//!
//! Every other attribute is skipped by its format's length.
//!
//! Sources (public, read to check the layout, no code taken): the nv.info decoder of CuAssembler
//! (`CuAsm/CuNVInfo.py`, whose test vectors show 4-byte NVAL/BVAL/HVAL records and 12-byte
//! KPARAM_INFO payloads), the `cudaparsers` crate's `src/cubin.rs` (KPARAM_INFO field layout and
//! flag bits), a Python cubin parser that takes the size as the upper `u16` of the flags shifted
//! right by 2, `cuobjdump -elf` listings (`Ordinal`, `Offset`, `Size` per record), and notes of
//! projects patching large-parameter kernels describing `KPARAM_INFO_V2`. The V2 layout rests on
//! fewer sources than the legacy one. Both were checked with `possum-nvinfo` against
//! `cuobjdump -elf` on cubins nvcc built for sm_80 and sm_90 (a kernel with an 8000-byte by-value
//! struct gets V2 records); `tests/real_cubin.rs` keeps the sm_90 one.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::elfbytes::{header, slice, u16_at, u32_at, u64_at, ElfError};
use crate::layout::{Param, ParamLayout};

/// Why a cubin's parameter layouts could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum NvInfoError {
    /// The ELF file itself: not one, or a structure that cannot be so.
    #[error(transparent)]
    Elf(#[from] ElfError),
    /// An attribute record of a `.nv.info.<kernel>` section is cut short or malformed.
    #[error("section {section}: bad record at offset {offset:#x}: {what}")]
    BadRecord {
        /// The section's name.
        section: String,
        /// The record's offset inside the section.
        offset: usize,
        /// What is wrong with it.
        what: String,
    },
    /// The records of one kernel do not make a layout.
    #[error("section {section}: {what}")]
    BadLayout {
        /// The section's name.
        section: String,
        /// What is wrong.
        what: String,
    },
}

const SHT_NOBITS: u32 = 8;
const EIFMT_NVAL: u8 = 0x01;
const EIFMT_BVAL: u8 = 0x02;
const EIFMT_HVAL: u8 = 0x03;
const EIFMT_SVAL: u8 = 0x04;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;
const EIATTR_KPARAM_INFO_V2: u8 = 0x45;
const SECTION_PREFIX: &str = ".nv.info.";

struct Section<'a> {
    name_off: u32,
    data: &'a [u8],
}

/// The section headers of an ELF64 LE file, with their contents (empty for NOBITS).
fn sections(elf: &[u8]) -> Result<(Vec<Section<'_>>, usize), NvInfoError> {
    let ehdr = header(elf)?;
    let shoff = u64_at(ehdr, 0x28);
    let shentsize = u64::from(u16_at(ehdr, 0x3a));
    let shnum = u64::from(u16_at(ehdr, 0x3c));
    let shstrndx = usize::from(u16_at(ehdr, 0x3e));
    if shnum == 0 {
        return Ok((Vec::new(), 0));
    }
    if shentsize < 64 {
        return Err(ElfError::BadHeader(format!("section header size {shentsize} < 64")).into());
    }
    let table = slice(elf, shoff, shentsize * shnum, "section header table")?;
    let mut out = Vec::with_capacity(shnum as usize);
    for i in 0..shnum as usize {
        let sh = &table[i * shentsize as usize..][..64];
        let sh_type = u32_at(sh, 4);
        let (offset, size) = (u64_at(sh, 24), u64_at(sh, 32));
        let data = if sh_type == SHT_NOBITS {
            &[][..]
        } else {
            slice(elf, offset, size, &format!("section {i}"))?
        };
        out.push(Section {
            name_off: u32_at(sh, 0),
            data,
        });
    }
    if shstrndx >= out.len() {
        return Err(ElfError::BadHeader(format!(
            "section name table index {shstrndx} out of {} sections",
            out.len()
        ))
        .into());
    }
    Ok((out, shstrndx))
}

fn section_name(strtab: &[u8], off: u32) -> Option<&str> {
    let rest = strtab.get(off as usize..)?;
    let end = rest.iter().position(|&b| b == 0)?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The parameter layouts of every kernel of a cubin, by kernel (mangled) name.
///
/// A kernel whose section has no KPARAM records gets an empty layout (a kernel without
/// parameters). Parameter ordinals must run 0, 1, ... without gaps or repeats.
pub fn param_layouts(elf: &[u8]) -> Result<BTreeMap<String, ParamLayout>, NvInfoError> {
    let (secs, shstrndx) = sections(elf)?;
    let mut out = BTreeMap::new();
    if secs.is_empty() {
        return Ok(out);
    }
    let strtab = secs[shstrndx].data;
    for s in &secs {
        let Some(name) = section_name(strtab, s.name_off) else {
            continue;
        };
        let Some(kernel) = name.strip_prefix(SECTION_PREFIX) else {
            continue;
        };
        if kernel.is_empty() {
            continue;
        }
        out.insert(kernel.to_string(), section_layout(name, s.data)?);
    }
    Ok(out)
}

/// The layout described by one `.nv.info.<kernel>` section's records.
fn section_layout(section: &str, data: &[u8]) -> Result<ParamLayout, NvInfoError> {
    let bad = |offset: usize, what: String| NvInfoError::BadRecord {
        section: section.to_string(),
        offset,
        what,
    };
    let mut by_ordinal: BTreeMap<u16, Param> = BTreeMap::new();
    let mut cbank_size: Option<u16> = None;
    let mut at = 0;
    while at < data.len() {
        if data.len() - at < 4 {
            return Err(bad(
                at,
                format!(
                    "{} byte(s) left, a record needs at least 4",
                    data.len() - at
                ),
            ));
        }
        let (format, attr) = (data[at], data[at + 1]);
        let value = u16_at(data, at + 2);
        match format {
            EIFMT_NVAL | EIFMT_BVAL => at += 4,
            EIFMT_HVAL => {
                if attr == EIATTR_CBANK_PARAM_SIZE {
                    cbank_size = Some(value);
                }
                at += 4;
            }
            EIFMT_SVAL => {
                let size = usize::from(value);
                let Some(payload) = data.get(at + 4..at + 4 + size) else {
                    return Err(bad(
                        at,
                        format!("attribute {attr:#x} payload of {size} bytes runs past the section's {} bytes", data.len()),
                    ));
                };
                if attr == EIATTR_KPARAM_INFO || attr == EIATTR_KPARAM_INFO_V2 {
                    if size != 12 {
                        return Err(bad(
                            at,
                            format!("KPARAM_INFO record of {size} bytes, expected 12"),
                        ));
                    }
                    let ordinal = u16_at(payload, 4);
                    let offset = u32::from(u16_at(payload, 6));
                    let psize = if attr == EIATTR_KPARAM_INFO {
                        (u32_at(payload, 8) >> 18) & 0x3fff
                    } else {
                        u32::from(u16_at(payload, 8))
                    };
                    if by_ordinal
                        .insert(
                            ordinal,
                            Param {
                                offset,
                                size: psize,
                            },
                        )
                        .is_some()
                    {
                        return Err(bad(
                            at,
                            format!("parameter ordinal {ordinal} described twice"),
                        ));
                    }
                }
                at += 4 + size;
            }
            other => {
                return Err(bad(
                    at,
                    format!("unknown record format {other:#x} (attribute {attr:#x})"),
                ))
            }
        }
    }
    let count = by_ordinal.len();
    if let Some((&last, _)) = by_ordinal.last_key_value() {
        if usize::from(last) + 1 != count {
            return Err(NvInfoError::BadLayout {
                section: section.to_string(),
                what: format!("{count} parameter records but ordinals up to {last}"),
            });
        }
    }
    let layout = ParamLayout::new(by_ordinal.into_values().collect());
    if let Some(total) = cbank_size {
        if layout.total_size() > usize::from(total) {
            return Err(NvInfoError::BadLayout {
                section: section.to_string(),
                what: format!(
                    "parameters end at {} past CBANK_PARAM_SIZE {total}",
                    layout.total_size()
                ),
            });
        }
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Builds an ELF64 LE file with a null section, the given sections and `.shstrtab`.
    fn elf(sections: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let mut shstrtab = vec![0u8];
        let mut names = Vec::new();
        for (n, _) in sections {
            names.push(shstrtab.len() as u32);
            shstrtab.extend_from_slice(n.as_bytes());
            shstrtab.push(0);
        }
        let shstrtab_name = shstrtab.len() as u32;
        shstrtab.extend_from_slice(b".shstrtab\0");

        let mut file = vec![0u8; 64];
        let mut placed = Vec::new(); // (name, type, offset, size)
        for ((_, data), &name) in sections.iter().zip(&names) {
            placed.push((name, 0x7000_0000u32, file.len() as u64, data.len() as u64));
            file.extend_from_slice(data);
        }
        placed.push((shstrtab_name, 3, file.len() as u64, shstrtab.len() as u64));
        file.extend_from_slice(&shstrtab);
        file.resize(file.len().next_multiple_of(8), 0);
        let shoff = file.len() as u64;
        file.extend_from_slice(&[0u8; 64]); // null section
        for (name, ty, off, size) in &placed {
            let mut sh = [0u8; 64];
            sh[0..4].copy_from_slice(&name.to_le_bytes());
            sh[4..8].copy_from_slice(&ty.to_le_bytes());
            sh[24..32].copy_from_slice(&off.to_le_bytes());
            sh[32..40].copy_from_slice(&size.to_le_bytes());
            file.extend_from_slice(&sh);
        }
        let shnum = placed.len() as u16 + 1;
        file[0..4].copy_from_slice(b"\x7fELF");
        file[4] = 2;
        file[5] = 1;
        file[6] = 1;
        file[0x10..0x12].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        file[0x12..0x14].copy_from_slice(&190u16.to_le_bytes()); // EM_CUDA
        file[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        file[0x34..0x36].copy_from_slice(&64u16.to_le_bytes());
        file[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        file[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
        file[0x3e..0x40].copy_from_slice(&(shnum - 1).to_le_bytes());
        file
    }

    fn kparam(ordinal: u16, offset: u16, size: u32) -> Vec<u8> {
        // In a constant bank (bit 17 clear), bank 0x1f, bit 16 set as compilers do.
        let packed = (size << 18) | (1 << 16) | (0x1f << 12);
        let mut r = vec![EIFMT_SVAL, EIATTR_KPARAM_INFO, 12, 0];
        r.extend_from_slice(&0u32.to_le_bytes());
        r.extend_from_slice(&ordinal.to_le_bytes());
        r.extend_from_slice(&offset.to_le_bytes());
        r.extend_from_slice(&packed.to_le_bytes());
        r
    }

    fn kparam_v2(ordinal: u16, offset: u16, size: u16) -> Vec<u8> {
        let mut r = vec![EIFMT_SVAL, EIATTR_KPARAM_INFO_V2, 12, 0];
        r.extend_from_slice(&0u32.to_le_bytes());
        r.extend_from_slice(&ordinal.to_le_bytes());
        r.extend_from_slice(&offset.to_le_bytes());
        r.extend_from_slice(&size.to_le_bytes());
        r.extend_from_slice(&0x0500u16.to_le_bytes());
        r
    }

    fn records(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }

    fn p(offset: u32, size: u32) -> Param {
        Param { offset, size }
    }

    /// A kernel `(int n, float* x, struct{void* a; int b;} s)` as a compiler lays it out:
    /// records in reverse ordinal order among other attributes.
    fn kernel_a() -> Vec<u8> {
        records(&[
            vec![EIFMT_SVAL, 0x37, 4, 0, 0x80, 0, 0, 0], // CUDA_API_VERSION
            vec![EIFMT_NVAL, 0x35, 0, 0],                // SW2861232_WAR
            vec![EIFMT_SVAL, 0x0a, 8, 0, 5, 0, 0, 0, 0x60, 1, 32, 0], // PARAM_CBANK
            vec![EIFMT_HVAL, EIATTR_CBANK_PARAM_SIZE, 32, 0],
            kparam(2, 16, 16),
            kparam(1, 8, 8),
            kparam(0, 0, 4),
            vec![EIFMT_HVAL, 0x1b, 0xff, 0], // MAXREG_COUNT
            vec![EIFMT_BVAL, 0x15, 1, 0],
            vec![EIFMT_SVAL, 0x1c, 8, 0, 0x60, 0, 0, 0, 0x70, 1, 0, 0], // EXIT_INSTR_OFFSETS
        ])
    }

    #[test]
    fn reads_layouts_of_several_kernels() {
        let file = elf(&[
            (".text._Z1aiPf", vec![0u8; 32]),
            (".nv.info", vec![EIFMT_NVAL, 0x01, 0, 0]),
            (".nv.info._Z1aiPf", kernel_a()),
            (
                ".nv.info.noparams",
                records(&[vec![EIFMT_HVAL, 0x1b, 0xff, 0]]),
            ),
            (
                ".nv.info.big",
                records(&[kparam_v2(1, 4096, 8), kparam_v2(0, 0, 4096)]),
            ),
        ]);
        let got = param_layouts(&file).unwrap();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(
            got["_Z1aiPf"],
            ParamLayout::new(vec![p(0, 4), p(8, 8), p(16, 16)])
        );
        assert_eq!(got["noparams"], ParamLayout::default());
        assert_eq!(got["big"], ParamLayout::new(vec![p(0, 4096), p(4096, 8)]));
        assert_eq!(got["_Z1aiPf"].pointer_slots().len(), 3);
    }

    #[test]
    fn no_sections_is_empty() {
        assert!(param_layouts(&elf(&[])).unwrap().is_empty());
    }

    #[test]
    fn rejects_non_elf() {
        assert_eq!(
            param_layouts(b"hello"),
            Err(NvInfoError::Elf(ElfError::NotElf64Le))
        );
        let mut f = elf(&[]);
        f[4] = 1; // 32-bit
        assert_eq!(
            param_layouts(&f),
            Err(NvInfoError::Elf(ElfError::NotElf64Le))
        );
        let mut f = elf(&[]);
        f[5] = 2; // big-endian
        assert_eq!(
            param_layouts(&f),
            Err(NvInfoError::Elf(ElfError::NotElf64Le))
        );
    }

    #[test]
    fn truncated_record_names_section_and_offset() {
        let mut recs = kernel_a();
        let keep = recs.len() - 3;
        recs.truncate(keep);
        let e = param_layouts(&elf(&[(".nv.info.k", recs)])).unwrap_err();
        match &e {
            NvInfoError::BadRecord {
                section, offset, ..
            } => {
                assert_eq!(section, ".nv.info.k");
                assert_eq!(*offset, kernel_a().len() - 12);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(e.to_string().contains(".nv.info.k"), "{e}");

        let e = param_layouts(&elf(&[(".nv.info.k", vec![EIFMT_HVAL, 0x1b])])).unwrap_err();
        assert!(
            matches!(e, NvInfoError::BadRecord { offset: 0, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn rejects_bad_layouts() {
        let gap = records(&[kparam(0, 0, 8), kparam(2, 16, 8)]);
        assert!(matches!(
            param_layouts(&elf(&[(".nv.info.k", gap)])),
            Err(NvInfoError::BadLayout { .. })
        ));
        let twice = records(&[kparam(0, 0, 8), kparam(0, 0, 8)]);
        assert!(matches!(
            param_layouts(&elf(&[(".nv.info.k", twice)])),
            Err(NvInfoError::BadRecord { offset: 16, .. })
        ));
        let past = records(&[
            vec![EIFMT_HVAL, EIATTR_CBANK_PARAM_SIZE, 8, 0],
            kparam(0, 0, 16),
        ]);
        assert!(matches!(
            param_layouts(&elf(&[(".nv.info.k", past)])),
            Err(NvInfoError::BadLayout { .. })
        ));
        let short = records(&[vec![EIFMT_SVAL, EIATTR_KPARAM_INFO, 8, 0], vec![0; 8]]);
        assert!(matches!(
            param_layouts(&elf(&[(".nv.info.k", short)])),
            Err(NvInfoError::BadRecord { .. })
        ));
        let fmt = records(&[vec![0x09, 0x17, 0, 0]]);
        assert!(matches!(
            param_layouts(&elf(&[(".nv.info.k", fmt)])),
            Err(NvInfoError::BadRecord { .. })
        ));
    }

    #[test]
    fn section_past_end_of_file() {
        let mut f = elf(&[(".nv.info.k", kernel_a())]);
        let shoff = u64::from_le_bytes(f[0x28..0x30].try_into().unwrap()) as usize;
        // Section 1's size field.
        f[shoff + 64 + 32..shoff + 64 + 40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            param_layouts(&f),
            Err(NvInfoError::Elf(ElfError::OutOfBounds { .. }))
        ));
        let mut f = elf(&[(".nv.info.k", kernel_a())]);
        f[0x28..0x30].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
        assert!(matches!(
            param_layouts(&f),
            Err(NvInfoError::Elf(ElfError::OutOfBounds { .. }))
        ));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = param_layouts(&bytes);
        }

        #[test]
        fn mutated_cubins_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), cut in any::<prop::sample::Index>()) {
            let mut f = elf(&[(".nv.info._Z1aiPf", kernel_a()), (".nv.info.big", records(&[kparam_v2(0, 0, 4096)]))]);
            for (i, b) in flips {
                let at = i.index(f.len());
                f[at] = b;
            }
            let _ = param_layouts(&f);
            let n = cut.index(f.len());
            let _ = param_layouts(&f[..n]);
        }
    }
}
