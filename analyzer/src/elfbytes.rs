//! Little-endian reads out of ELF files whose bytes are untrusted: a range is checked before it
//! is read ([`range`]); the fixed-width reads index within a range already checked.

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
