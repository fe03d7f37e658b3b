//! A symbol's address read from the loaded objects' dynamic symbol tables, without `dlsym` or
//! `dlvsym`: this library defines both (see `entry.rs`), so the originals cannot be looked up
//! through either. One of the crate's modules with `unsafe` code: it reads the ELF structures
//! the dynamic loader mapped (program headers through `dl_iterate_phdr`, the dynamic section,
//! the GNU hash table, the symbol and string tables). Also the lookups of the libraries possum
//! wraps beside the driver (HIP, HSA, NCCL): their next definition, and an address's object.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The definition of `name` that possum's export of the same name wraps, looked up once into
/// `slot`; 0 when there is none.
///
/// First `dlsym(RTLD_NEXT)`: the objects of the global scope loaded after this library (a program
/// linked with the library). When that finds nothing, every loaded object but this library, in
/// load order, through its own symbol table ([`first_definition`]): a library that the program
/// loaded with `dlopen(RTLD_LOCAL)`, or that such a library needs, is in no global scope, and
/// `RTLD_NEXT` never sees it. Python loads its extension modules that way, so PyTorch's
/// libtorch_cuda.so and the libnccl.so.2 it links are found only by the second search; yet
/// libtorch_cuda's calls bind to this library's exports, which are in the global scope.
pub fn next_definition(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT searches the objects loaded after this
    // library. possum's own dlsym passes it through to glibc's.
    let mut p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    if p == 0 {
        p = first_definition(name, next_definition as *const () as usize);
    }
    slot.store(p, Ordering::Release);
    p
}

/// The file of the loaded object that holds address `addr`, as the loader names it.
pub fn object_file(addr: usize) -> Option<String> {
    // SAFETY: `Dl_info` is plain data (pointers and integers): all zeroes is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid out-parameter; dladdr only reads the loader's tables.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string owned by the loader.
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// `DT_NULL`, `DT_STRTAB`, `DT_SYMTAB`, `DT_GNU_HASH`, `DT_VERSYM`.
const DT_NULL: i64 = 0;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
const DT_VERSYM: i64 = 0x6fff_fff0;
/// A version index with this bit is hidden (not the symbol's default version).
const VERSYM_HIDDEN: u16 = 0x8000;

/// `Elf64_Dyn`.
#[repr(C)]
struct Dyn {
    tag: i64,
    val: u64,
}

/// What the search is for, and what it found (the callback's data).
struct Search<'a> {
    name: &'a CStr,
    /// An address inside the object to skip (this library).
    skip: usize,
    found: usize,
}

/// The address of the first definition of `name` in the loaded objects, in load order, other
/// than the one containing address `skip` (its default version where the object has several);
/// 0 if none defines it.
pub fn first_definition(name: &CStr, skip: usize) -> usize {
    let mut s = Search {
        name,
        skip,
        found: 0,
    };
    // SAFETY: the callback is a valid `extern "C"` function of that signature; `s` outlives the
    // call, and the callback only reads the loader's structures it is handed.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&mut s as *mut Search<'_>).cast()) };
    s.found
}

/// `dl_iterate_phdr`'s callback: looks `name` up in one object; non-zero stops the iteration.
unsafe extern "C" fn visit(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: `data` is the `Search` `first_definition` passed, alive for the iteration; `info`
    // is the loader's description of one loaded object, valid during the callback.
    let (s, info) = unsafe { (&mut *data.cast::<Search<'_>>(), &*info) };
    if info.dlpi_phdr.is_null() || info.dlpi_phnum == 0 {
        return 0;
    }
    // SAFETY: `dlpi_phdr` points at `dlpi_phnum` program headers of the object.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    let base = info.dlpi_addr as usize;
    let contains = |a: usize| {
        phdrs.iter().any(|p| {
            let start = base.wrapping_add(p.p_vaddr as usize);
            p.p_type == libc::PT_LOAD && a >= start && a < start + p.p_memsz as usize
        })
    };
    if contains(s.skip) {
        return 0;
    }
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == libc::PT_DYNAMIC) else {
        return 0;
    };
    // SAFETY: the object's dynamic section, mapped by the loader, ends with DT_NULL.
    let found = unsafe { lookup(base, base.wrapping_add(dynamic.p_vaddr as usize), s.name) };
    if found != 0 {
        s.found = found;
        return 1;
    }
    0
}

/// `name`'s defined symbol in the object loaded at `base` whose dynamic section is at `dynamic`
/// (its GNU hash table searched; its default version preferred): its address, or 0.
///
/// # Safety
/// `dynamic` is a mapped dynamic section ending with `DT_NULL`, of an object loaded at `base`.
unsafe fn lookup(base: usize, dynamic: usize, name: &CStr) -> usize {
    let (mut strtab, mut symtab, mut gnu_hash, mut versym) = (0usize, 0usize, 0usize, 0usize);
    let mut d = dynamic as *const Dyn;
    loop {
        // SAFETY: within the dynamic section, which ends with DT_NULL (the contract).
        let e = unsafe { &*d };
        if e.tag == DT_NULL {
            break;
        }
        // The loader may have relocated the entries in place (glibc does on x86_64): an address
        // below the object's base is still an offset from it.
        let at = if (e.val as usize) < base {
            base + e.val as usize
        } else {
            e.val as usize
        };
        match e.tag {
            DT_STRTAB => strtab = at,
            DT_SYMTAB => symtab = at,
            DT_GNU_HASH => gnu_hash = at,
            DT_VERSYM => versym = at,
            _ => {}
        }
        // SAFETY: the next entry; DT_NULL was not reached.
        d = unsafe { d.add(1) };
    }
    if strtab == 0 || symtab == 0 || gnu_hash == 0 {
        return 0;
    }
    let want = name.to_bytes();
    let h = want.iter().fold(5381u32, |h, &c| {
        h.wrapping_mul(33).wrapping_add(u32::from(c))
    });
    // The GNU hash table: nbuckets, symoffset, bloom words (64-bit), bloom shift, then the bloom
    // filter, the buckets and the hash chains.
    let words = gnu_hash as *const u32;
    // SAFETY: the table's four header words.
    let (nbuckets, symoffset, bloom_size) =
        unsafe { (*words, *words.add(1), *words.add(2) as usize) };
    if nbuckets == 0 {
        return 0;
    }
    // SAFETY: the buckets follow the header (4 words) and the bloom filter (u64 words).
    let buckets = unsafe { words.add(4 + bloom_size * 2) };
    // SAFETY: the chains follow the buckets.
    let chains = unsafe { buckets.add(nbuckets as usize) };
    // SAFETY: bucket `h % nbuckets` is inside the buckets.
    let mut i = unsafe { *buckets.add((h % nbuckets) as usize) };
    if i < symoffset {
        return 0;
    }
    let syms = symtab as *const libc::Elf64_Sym;
    let mut fallback = 0usize;
    loop {
        // SAFETY: symbol `i`'s chain word (i ≥ symoffset: it has one).
        let ch = unsafe { *chains.add((i - symoffset) as usize) };
        if (ch | 1) == (h | 1) {
            // SAFETY: symbol `i` of the symbol table, which the hash table indexes.
            let sym = unsafe { &*syms.add(i as usize) };
            // SAFETY: `st_name` is an offset into the string table, of a NUL-terminated name.
            let n = unsafe { CStr::from_ptr((strtab + sym.st_name as usize) as *const _) };
            if n.to_bytes() == want && sym.st_shndx != 0 && sym.st_value != 0 {
                let addr = base + sym.st_value as usize;
                let hidden = versym != 0
                    // SAFETY: the version table has an entry per symbol.
                    && unsafe { *(versym as *const u16).add(i as usize) } & VERSYM_HIDDEN != 0;
                if !hidden {
                    return addr;
                }
                if fallback == 0 {
                    fallback = addr;
                }
            }
        }
        if ch & 1 != 0 {
            return fallback;
        }
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libc's `getpid`, read from its symbol table, is the function the program calls.
    #[test]
    fn finds_a_libc_function() {
        let p = first_definition(c"getpid", finds_a_libc_function as *const () as usize);
        assert_eq!(p, libc::getpid as *const () as usize);
        assert_eq!(first_definition(c"possum_no_such_symbol", 0), 0);
    }
}
