//! The workspace's Rust sources as the code-shape tests read them: the member crates, their
//! files, the code with comments and literals blanked, and what belongs to tests.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace's root directory (the parent of this crate's).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// The directories of the workspace's member crates, as the root `Cargo.toml` lists them.
pub fn members() -> Vec<String> {
    let toml = std::fs::read_to_string(workspace_root().join("Cargo.toml")).expect("Cargo.toml");
    let list = toml
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("members"))
        .and_then(|l| l.trim_start().strip_prefix('='))
        .expect("a one-line `members = [..]` in Cargo.toml");
    let list = list.trim().trim_start_matches('[').trim_end_matches(']');
    let out: Vec<String> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect();
    assert!(!out.is_empty(), "no members in Cargo.toml");
    out
}

/// Every `.rs` file under `dir`, sorted; none if `dir` does not exist.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, &mut out);
    out.sort();
    out
}

/// `src` with comments, string and character literals blanked out (newlines kept, so line
/// numbers stay); a string becomes `""`.
pub fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
            out.push(' ');
        } else if (c == b'r' || c == b'b')
            && raw_string_at(b, i).is_some()
            && (i == 0 || !is_ident(b[i - 1]))
        {
            // A raw string: r"..", r#".."#, br"..".
            let (hashes, mut j) = raw_string_at(b, i).expect("checked");
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == b'\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    // An escape; a line continuation's newline is kept.
                    i += 1;
                    if b.get(i) == Some(&b'\n') {
                        out.push('\n');
                    }
                } else if b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A character literal ('x', '\n', '\u{..}'), or a lifetime ('a): only the former is
            // skipped.
            let end = if b.get(i + 1) == Some(&b'\\') {
                (i + 2..b.len()).find(|&k| b[k] == b'\'')
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.push_str("' '");
                    i = e + 1;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

/// At `b[i..]`, a raw string's opening (`r"`, `r#"`, `br"`, ...): its number of `#`s and the
/// index after its opening quote.
fn raw_string_at(b: &[u8], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if b[j] == b'b' {
        j += 1;
    }
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while b.get(j) == Some(&b'#') {
        hashes += 1;
        j += 1;
    }
    (b.get(j) == Some(&b'"')).then_some((hashes, j + 1))
}

/// Whether `c` may be part of an identifier.
pub fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The identifier starting at `i` (after spaces), and the index after it.
pub fn ident_at(b: &[u8], mut i: usize) -> (String, usize) {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    let start = i;
    while i < b.len() && is_ident(b[i]) {
        i += 1;
    }
    (String::from_utf8_lossy(&b[start..i]).into_owned(), i)
}

/// Whether `b[i..]` starts with `word` as a whole token.
pub fn word_at(b: &[u8], i: usize, word: &str) -> bool {
    let w = word.as_bytes();
    b[i..].starts_with(w)
        && (i == 0 || !is_ident(b[i - 1]))
        && b.get(i + w.len()).is_none_or(|&c| !is_ident(c))
}

/// The index of the brace that closes the one at `open` in stripped code `b`.
pub fn closing_brace(b: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in b.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// The attribute `#[...]` at `b[i..]`: its text and the index after it.
fn attribute_at(b: &[u8], i: usize) -> Option<(String, usize)> {
    if b.get(i) != Some(&b'#') || b.get(i + 1) != Some(&b'[') {
        return None;
    }
    let mut depth = 0usize;
    for (k, &c) in b.iter().enumerate().skip(i + 1) {
        match c {
            b'[' => depth += 1,
            b']' => {
                depth -= 1;
                if depth == 0 {
                    let text: String = String::from_utf8_lossy(&b[i..=k])
                        .split_whitespace()
                        .collect();
                    return Some((text, k + 1));
                }
            }
            _ => {}
        }
    }
    None
}

/// Whether an attribute (spaces removed) marks test-only code.
fn is_test_attribute(attr: &str) -> bool {
    attr == "#[test]" || attr.starts_with("#[cfg(test") || attr.starts_with("#[cfg(all(test")
}

/// Stripped code `code` with every test-only item blanked (newlines kept): an item after
/// `#[cfg(test)]` or `#[test]`, to its closing brace or semicolon. The names of the modules so
/// declared in files of their own (`#[cfg(test)] mod tests;`) are returned beside.
pub fn without_tests(code: &str) -> (String, Vec<String>) {
    let b = code.as_bytes();
    let mut out = b.to_vec();
    let mut test_files = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let Some((attr, mut after)) = attribute_at(b, i) else {
            i += 1;
            continue;
        };
        if !is_test_attribute(&attr) {
            i = after;
            continue;
        }
        // Further attributes of the same item.
        loop {
            while after < b.len() && b[after].is_ascii_whitespace() {
                after += 1;
            }
            match attribute_at(b, after) {
                Some((_, next)) => after = next,
                None => break,
            }
        }
        // The item ends at the first `;` before any `{`, or at the brace closing that `{`.
        let Some(k) = (after..b.len()).find(|&k| b[k] == b'{' || b[k] == b';') else {
            break;
        };
        let end = if b[k] == b';' {
            let decl = String::from_utf8_lossy(&b[after..k]).into_owned();
            let words: Vec<&str> = decl.split_whitespace().collect();
            if let Some(p) = words.iter().position(|w| *w == "mod") {
                if let Some(name) = words.get(p + 1) {
                    test_files.push(name.to_string());
                }
            }
            k
        } else {
            closing_brace(b, k).unwrap_or(b.len() - 1)
        };
        for c in &mut out[i..=end] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        i = end + 1;
    }
    (String::from_utf8(out).expect("ASCII blanks"), test_files)
}

/// The files of `src` (a crate's `src/`) that hold only tests: those in a `tests` directory, and
/// each module declared `#[cfg(test)] mod name;` (with its own children).
pub fn test_only_files(src: &Path) -> BTreeSet<PathBuf> {
    let files = rust_files(src);
    let mut out: BTreeSet<PathBuf> = files
        .iter()
        .filter(|p| {
            p.strip_prefix(src)
                .expect("under src")
                .components()
                .any(|c| c.as_os_str() == "tests")
        })
        .cloned()
        .collect();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("a source file");
        let (_, names) = without_tests(&strip(&text));
        let dir = children_dir(f);
        for name in names {
            let file = dir.join(format!("{name}.rs"));
            let sub = dir.join(&name);
            out.insert(file);
            out.extend(files.iter().filter(|p| p.starts_with(&sub)).cloned());
        }
    }
    out
}

/// The directory where the child modules of the module in file `f` live: its own directory for
/// `lib.rs`, `main.rs` and `mod.rs`, else `dir/stem/`.
pub fn children_dir(f: &Path) -> PathBuf {
    let dir = f.parent().expect("a directory");
    let stem = f.file_stem().expect("a file name").to_string_lossy();
    match stem.as_ref() {
        "lib" | "main" | "mod" => dir.to_path_buf(),
        s => dir.join(s),
    }
}
