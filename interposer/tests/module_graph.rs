//! The interposer's modules form layers: no import cycle spans more than three files of `src/`.
//!
//! Each file of `src/` is a node, and so is each directory of `src/` with a `mod.rs` (all its
//! files one node, named by the directory: `super::` at the top level of one of them names the
//! directory's module itself); an edge `a -> b` is a path in `a` that names `b`:
//! `crate::b::..`, an entry `b` of a `use crate::{..}` group, or an item of the crate root
//! (`crate::log`, `crate::init`: an edge to `lib.rs`). In `lib.rs` a path `b::..` names the module
//! `b` too (its `mod b;` declarations do not count). `super::` inside a file's inline `mod` names
//! that file; at a file's top level it names `lib.rs`. Comments and string literals are skipped.
//! The strongly connected components of that graph are printed, and each must have at most three
//! files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The largest strongly connected component allowed, in files.
const MAX_CYCLE: usize = 3;

/// `src` with comments, string and character literals blanked out (newlines kept).
fn strip(src: &str) -> String {
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
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !is_ident(b[i - 1]))
        {
            // A raw string: r"..", r#".."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c as char);
                i += 1;
                continue;
            }
            j += 1;
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
                    i += 1;
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

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The identifier starting at `i` (after spaces), and the index after it.
fn ident_at(b: &[u8], mut i: usize) -> (String, usize) {
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
fn word_at(b: &[u8], i: usize, word: &str) -> bool {
    let w = word.as_bytes();
    b[i..].starts_with(w)
        && (i == 0 || !is_ident(b[i - 1]))
        && b.get(i + w.len()).is_none_or(|&c| !is_ident(c))
}

/// The first names of the entries of the `{..}` group starting at `b[i] == '{'`.
fn group_heads(b: &[u8], i: usize) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect = true;
    let mut k = i;
    while k < b.len() {
        match b[k] {
            b'{' => {
                depth += 1;
                if depth == 1 {
                    expect = true;
                }
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => expect = true,
            c if depth == 1 && expect && is_ident(c) => {
                let (name, next) = ident_at(b, k);
                heads.push(name);
                expect = false;
                k = next;
                continue;
            }
            _ => {}
        }
        k += 1;
    }
    heads
}

/// The files (stems) that `file` names; `modules` are the stems of `src/*.rs` other than `lib`.
fn references(file: &str, text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    references_in(file, text, modules, false)
}

/// [`references`] of a file of directory module `file` (`nested`): its top-level `super::`
/// names that module.
fn references_in(
    file: &str,
    text: &str,
    modules: &BTreeSet<String>,
    nested: bool,
) -> BTreeSet<String> {
    let code = strip(text);
    let b = code.as_bytes();
    let mut out = BTreeSet::new();
    let mut name_of = |head: &str| {
        if head == "self" || head.is_empty() {
            return;
        }
        out.insert(if modules.contains(head) {
            head.to_string()
        } else {
            "lib".to_string()
        });
    };
    // Inline `mod x {` blocks: the brace depths where they were opened.
    let mut depth = 0usize;
    let mut inline_mods: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' => {
                depth += 1;
                i += 1;
                continue;
            }
            b'}' => {
                if inline_mods.last() == Some(&depth) {
                    inline_mods.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
                continue;
            }
            _ => {}
        }
        if word_at(b, i, "mod") {
            let (_, next) = ident_at(b, i + 3);
            let mut k = next;
            while k < b.len() && b[k].is_ascii_whitespace() {
                k += 1;
            }
            if b.get(k) == Some(&b'{') {
                inline_mods.push(depth + 1);
            }
            i = next;
            continue;
        }
        let prefix = if word_at(b, i, "crate") {
            Some(("crate", 5))
        } else if word_at(b, i, "super") {
            Some(("super", 5))
        } else {
            None
        };
        if let Some((kw, len)) = prefix {
            let after = i + len;
            if !b[after..].starts_with(b"::") {
                i = after;
                continue;
            }
            let at_root = kw == "crate" || inline_mods.is_empty();
            if !at_root || (kw == "super" && nested) {
                // `super::` inside an inline module: this very file.
                i = after + 2;
                continue;
            }
            let mut k = after + 2;
            while k < b.len() && b[k].is_ascii_whitespace() {
                k += 1;
            }
            if b.get(k) == Some(&b'{') {
                for h in group_heads(b, k) {
                    name_of(&h);
                }
            } else if b.get(k) == Some(&b'*') {
                name_of("lib");
            } else {
                let (head, _) = ident_at(b, k);
                name_of(&head);
            }
            i = k;
            continue;
        }
        if file == "lib" && is_ident(b[i]) && (i == 0 || !is_ident(b[i - 1])) {
            // In lib.rs, `module::..` (not after another `::`, which would be a path inside
            // something else).
            let (name, next) = ident_at(b, i);
            let before = code[..i].trim_end();
            if b[next..].starts_with(b"::") && modules.contains(&name) && !before.ends_with("::") {
                name_of(&name);
            }
            i = next;
            continue;
        }
        i += 1;
    }
    out.remove(file);
    out
}

/// Tarjan's strongly connected components of `graph`.
fn components(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    comp.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                comp.sort();
                self.out.push(comp);
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out
}

/// The files by layer: a file's layer is one above the highest of the files it names outside its
/// own component (0: names none). For the message only.
fn layers(graph: &BTreeMap<String, BTreeSet<String>>, comps: &[Vec<String>]) -> Vec<Vec<String>> {
    let comp_of: BTreeMap<&str, usize> = comps
        .iter()
        .enumerate()
        .flat_map(|(i, c)| c.iter().map(move |f| (f.as_str(), i)))
        .collect();
    // Tarjan's components come out dependencies first: each one's successors are levelled
    // before it.
    let mut level = vec![0usize; comps.len()];
    for (i, c) in comps.iter().enumerate() {
        level[i] = c
            .iter()
            .flat_map(|f| &graph[f])
            .map(|g| comp_of[g.as_str()])
            .filter(|&j| j != i)
            .map(|j| level[j] + 1)
            .max()
            .unwrap_or(0);
    }
    let mut out: Vec<Vec<String>> = Vec::new();
    for (i, c) in comps.iter().enumerate() {
        if out.len() <= level[i] {
            out.resize(level[i] + 1, Vec::new());
        }
        let name = if c.len() > 1 {
            format!("{{{}}}", c.join(", "))
        } else {
            c[0].clone()
        };
        out[level[i]].push(name);
    }
    for l in &mut out {
        l.sort();
    }
    out
}

/// The file graph of `dir/*.rs`.
fn graph_of(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let rs_files = |d: &Path| -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(d)
            .expect("src/")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        files.sort();
        files
    };
    let files = rs_files(dir);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("src/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("mod.rs").is_file())
        .collect();
    dirs.sort();
    let stem = |p: &Path| p.file_stem().unwrap().to_string_lossy().into_owned();
    let modules: BTreeSet<String> = files
        .iter()
        .chain(&dirs)
        .map(|p| stem(p))
        .filter(|s| s != "lib")
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = files
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).expect("read");
            (stem(p), references(&stem(p), &text, &modules))
        })
        .collect();
    for d in &dirs {
        let name = stem(d);
        let mut refs = BTreeSet::new();
        for f in rs_files(d) {
            let text = std::fs::read_to_string(&f).expect("read");
            refs.extend(references_in(&name, &text, &modules, true));
        }
        graph.insert(name, refs);
    }
    graph
}

/// One cycle through `comp` (for the message): a path from its first file back to it.
fn a_cycle(graph: &BTreeMap<String, BTreeSet<String>>, comp: &[String]) -> Vec<String> {
    let inside: BTreeSet<&str> = comp.iter().map(String::as_str).collect();
    let start = comp[0].as_str();
    // Breadth-first from start's successors back to start, within the component.
    let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::new();
    for w in &graph[start] {
        if inside.contains(w.as_str()) && !prev.contains_key(w.as_str()) {
            prev.insert(w, start);
            queue.push_back(w.as_str());
        }
    }
    while let Some(v) = queue.pop_front() {
        if v == start {
            break;
        }
        for w in &graph[v] {
            if inside.contains(w.as_str()) && !prev.contains_key(w.as_str()) {
                prev.insert(w, v);
                queue.push_back(w.as_str());
            }
        }
    }
    let mut path = vec![start.to_string()];
    let mut v = prev.get(start).copied();
    while let Some(p) = v {
        path.push(p.to_string());
        if p == start {
            break;
        }
        v = prev.get(p).copied();
    }
    path.reverse();
    path
}

#[test]
fn no_import_cycle_spans_more_than_three_files() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = graph_of(&src);
    let comps = components(&graph);
    for (level, files) in layers(&graph, &comps).iter().enumerate() {
        println!("layer {level}: {}", files.join(" "));
    }
    let mut failed = Vec::new();
    for c in comps.iter().filter(|c| c.len() > 1) {
        println!("cycle of {} files: {}", c.len(), c.join(", "));
        if c.len() > MAX_CYCLE {
            let edges: Vec<String> = c
                .iter()
                .flat_map(|a| {
                    graph[a]
                        .iter()
                        .filter(|b| c.contains(b))
                        .map(move |b| format!("{a} -> {b}"))
                })
                .collect();
            failed.push(format!(
                "{} files: {}\n  e.g. {}\n  edges: {}",
                c.len(),
                c.join(", "),
                a_cycle(&graph, c).join(" -> "),
                edges.join(", ")
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "import cycles over {MAX_CYCLE} files in src/:\n{}",
        failed.join("\n")
    );
}

#[test]
fn the_checker_sees_paths_groups_and_root_items() {
    let modules: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    let text = r#"
        //! Docs name [`crate::d`], which does not count.
        use crate::{a::{X, Y}, b};
        fn f() { crate::log("crate::d"); let _ = '"'; }
        mod tests { use super::*; }
    "#;
    let refs = references("c", text, &modules);
    let want: BTreeSet<String> = ["a", "b", "lib"].iter().map(|s| s.to_string()).collect();
    assert_eq!(refs, want);
    let lib = "mod a;\npub use b::Thing;\nfn g() { c::h(); std::a::x(); }";
    let want: BTreeSet<String> = ["b", "c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(references("lib", lib, &modules), want);
    // A file of directory module `d`: its `super::` names `d` itself.
    let nested = "use super::front::F;\nfn g() { crate::a::h(); }";
    let want: BTreeSet<String> = ["a"].iter().map(|s| s.to_string()).collect();
    assert_eq!(references_in("d", nested, &modules, true), want);

    let mut graph = BTreeMap::new();
    for (a, bs) in [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ] {
        graph.insert(a.to_string(), bs.iter().map(|s| s.to_string()).collect());
    }
    let comps = components(&graph);
    assert!(comps.contains(&vec!["a".to_string(), "b".to_string(), "c".to_string()]));
    assert!(comps.contains(&vec!["d".to_string()]));
    assert_eq!(
        a_cycle(&graph, &["a".into(), "b".into(), "c".into()]),
        ["a", "b", "c", "a"]
    );
}
