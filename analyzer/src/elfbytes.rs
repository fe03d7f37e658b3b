//! Little-endian reads out of ELF files whose bytes are untrusted: a range is checked before it
//! is read ([`range`], [`slice`]); the fixed-width reads index within a range already checked.
//! What is wrong with a file as ELF, whatever it holds, is an [`ElfError`].

use thiserror::Error;

/// Why a file is not an ELF file that can be read (its contents aside).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ElfError {
    /// The file is not a 64-bit little-endian ELF file.
    #[error("not a 64-bit little-endian ELF file")]
    NotElf64Le,
    /// An ELF structure lies (partly) outside the file.
    #[error("ELF {what} at offset {offset:#x} runs past the end of the file ({len} bytes)")]
    OutOfBounds {
        /// Which structure.
        what: String,
        /// Its file offset.
        offset: u64,
        /// The file's length.
        len: usize,
    },
    /// The ELF header says something that cannot be so.
    #[error("bad ELF header: {0}")]
    BadHeader(String),
}

/// `len` bytes of `data` at `offset`, the ELF structure `what`, which must be inside it.
pub(crate) fn slice<'a>(
    data: &'a [u8],
    offset: u64,
    len: u64,
    what: &str,
) -> Result<&'a [u8], ElfError> {
    range(data, offset, len).ok_or_else(|| ElfError::OutOfBounds {
        what: what.to_string(),
        offset,
        len: data.len(),
    })
}

/// The 64-byte header of a 64-bit little-endian ELF file `elf`.
pub(crate) fn header(elf: &[u8]) -> Result<&[u8], ElfError> {
    let ehdr = slice(elf, 0, 64, "header").map_err(|_| ElfError::NotElf64Le)?;
    if &ehdr[..4] != b"\x7fELF" || ehdr[4] != 2 || ehdr[5] != 1 {
        return Err(ElfError::NotElf64Le);
    }
    Ok(ehdr)
}

/// `len` bytes of `data` at `offset`, or `None` if they are not all inside it (offsets past
/// `usize` and overflowing ends included).
pub(crate) fn range(data: &[u8], offset: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(offset).ok()?;
    let len = usize::try_from(len).ok()?;
    data.get(start..start.checked_add(len)?)
}

/// The little-endian u16 at `at` (inside `b`: the caller checked).
pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian u32 at `at` (inside `b`: the caller checked).
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian u64 at `at` (inside `b`: the caller checked).
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from(u32_at(b, at)) | (u64::from(u32_at(b, at + 4)) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_outside_the_data_are_none() {
        let d = [1u8, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(range(&d, 2, 3), Some(&d[2..5]));
        assert_eq!(range(&d, 8, 0), Some(&d[8..8]));
        assert_eq!(range(&d, 6, 3), None);
        assert_eq!(range(&d, u64::MAX, 1), None);
        assert_eq!(range(&d, 1, u64::MAX), None);
        assert_eq!(u16_at(&d, 0), 0x0201);
        assert_eq!(u32_at(&d, 1), 0x0504_0302);
        assert_eq!(u64_at(&d, 0), 0x0807_0605_0403_0201);
    }
}
