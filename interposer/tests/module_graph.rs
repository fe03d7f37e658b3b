//! The interposer's modules form layers: no import cycle, between any two modules of `src/`.
//!
//! Each file of `src/` is a node, those of its directories included (`hip/front.rs` is the
//! module `hip/front`, `hip/mod.rs` the module `hip`); an edge `a -> b` is a path in `a` that
//! names `b`: `crate::b::..`, each entry of a `use crate::{..}` group (`crate::{b, c::{d, e}}`
//! names `b`, `c/d` and `c/e` where those are modules, `c` where they are its items), or an item
//! of the crate root (`crate::init`: an edge to `lib.rs`). A path names the longest module it
//! starts with. `super::` at a file's top level starts at its parent module (`super::front::F` in
//! `hip/entry.rs` names `hip/front`; `super::x` in `entry.rs` an item of `lib.rs`), and inside
//! one of its inline `mod`s names that file. In a file with child modules (`lib.rs`, a `mod.rs`)
//! a path `child::..` names the child too (its `mod child;` declarations do not count).
//! Comments and string literals are skipped. The strongly connected components of that graph and
//! the layers are printed, and every component must be a single file: a module calls only
//! modules below it, and what must call upwards is handed a function.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

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

/// The module a file is: its path under `src/` without `.rs`, a `mod.rs` named by its directory
/// (`lib`, `entry`, `hip`, `hip/front`).
type Module = String;

/// The modules that a file of module `file` names; `modules` are every module of `src/` but
/// `lib`. Paths are resolved to the longest module they start with: `crate::hip::front::made`
/// names `hip/front`, `crate::init` names `lib`.
fn references(file: &str, text: &str, modules: &BTreeSet<Module>) -> BTreeSet<Module> {
    let code = strip(text);
    let b = code.as_bytes();
    let mut out = BTreeSet::new();
    // The module whose children bare paths (`front::made` in `hip/mod.rs`) and `super::` name.
    let here: Vec<&str> = if file == "lib" {
        Vec::new()
    } else {
        file.split('/').collect()
    };
    let parent: Vec<&str> = here[..here.len().saturating_sub(1)].to_vec();
    // Whether the file has child modules (`lib.rs`, a `mod.rs`): then `child::..` names one.
    let parent_of_children = {
        let prefix = if here.is_empty() {
            String::new()
        } else {
            format!("{}/", here.join("/"))
        };
        modules
            .iter()
            .any(|x| x.starts_with(&prefix) && x.len() > prefix.len())
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
        let base: Option<(Vec<&str>, usize)> = if word_at(b, i, "crate") {
            Some((Vec::new(), i + 5))
        } else if word_at(b, i, "super") && inline_mods.is_empty() {
            Some((parent.clone(), i + 5))
        } else if word_at(b, i, "self") && inline_mods.is_empty() {
            Some((here.clone(), i + 4))
        } else if word_at(b, i, "super") || word_at(b, i, "self") {
            // `super::` or `self::` inside an inline module: this very file.
            i += 4;
            continue;
        } else if parent_of_children
            && is_ident(b[i])
            && (i == 0 || !is_ident(b[i - 1]))
            && !code[..i].trim_end().ends_with("::")
        {
            // In `lib.rs` or a `mod.rs`, `child::..` (not after another `::`, which would be a
            // path inside something else).
            let (name, next) = ident_at(b, i);
            let child: Vec<&str> = here.iter().copied().chain([name.as_str()]).collect();
            if b[next..].starts_with(b"::") && modules.contains(&child.join("/")) {
                Some((here.clone(), i))
            } else {
                i = next;
                continue;
            }
        } else {
            None
        };
        let Some((base, after)) = base else {
            i += 1;
            continue;
        };
        // `crate` and `super` are followed by `::`; a bare child path starts at its name.
        let at = if b[after..].starts_with(b"::") {
            after + 2
        } else if after == i {
            after
        } else {
            i = after;
            continue;
        };
        let mut found = Vec::new();
        let end = use_tree(b, at, &base, modules, &mut found);
        out.extend(found);
        i = end.max(i + 1);
    }
    out.remove(file);
    out
}

/// Reads the path or `use` tree at `b[at..]` (after `base::`), adding the module each of its
/// paths names to `out`; the index after it.
fn use_tree(
    b: &[u8],
    at: usize,
    base: &[&str],
    modules: &BTreeSet<Module>,
    out: &mut Vec<Module>,
) -> usize {
    let mut segs: Vec<String> = base.iter().map(|s| s.to_string()).collect();
    let mut k = at;
    loop {
        while k < b.len() && b[k].is_ascii_whitespace() {
            k += 1;
        }
        if b.get(k) == Some(&b'{') {
            // A group: each entry a tree of its own under the path so far.
            let prefix: Vec<&str> = segs.iter().map(String::as_str).collect();
            k += 1;
            loop {
                while k < b.len() && (b[k].is_ascii_whitespace() || b[k] == b',') {
                    k += 1;
                }
                if k >= b.len() || b[k] == b'}' {
                    return k + 1;
                }
                let next = use_tree(b, k, &prefix, modules, out);
                if next <= k {
                    return k + 1;
                }
                k = next;
            }
        }
        if b.get(k) == Some(&b'*') {
            k += 1;
            break;
        }
        let (name, next) = ident_at(b, k);
        if name.is_empty() {
            break;
        }
        if name != "self" {
            segs.push(name);
        }
        k = next;
        if b[k..].starts_with(b"::") {
            k += 2;
        } else {
            break;
        }
    }
    out.push(longest_module(&segs, modules));
    // `.. as name`: the name is no path.
    let mut j = k;
    while j < b.len() && b[j].is_ascii_whitespace() {
        j += 1;
    }
    if j < b.len() && word_at(b, j, "as") {
        k = ident_at(b, j + 2).1;
    }
    k
}

/// The longest module that path `segs` (from the crate root) starts with; `lib` if none.
fn longest_module(segs: &[String], modules: &BTreeSet<Module>) -> Module {
    (1..=segs.len())
        .rev()
        .map(|n| segs[..n].join("/"))
        .find(|m| modules.contains(m))
        .unwrap_or_else(|| "lib".to_string())
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

/// The modules of `src/` (see [`Module`]) and their files, those of its directories included.
fn modules_of(src: &Path) -> BTreeMap<Module, PathBuf> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<Module, PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .expect("src/")
            .map(|e| e.expect("entry").path())
            .collect();
        entries.sort();
        for p in entries {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                walk(&p, &format!("{prefix}{name}/"), out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let module = match stem {
                    "mod" => prefix.trim_end_matches('/').to_string(),
                    _ => format!("{prefix}{stem}"),
                };
                out.insert(module, p);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, "", &mut out);
    out
}

/// The module graph of `src/`: each module's set of the modules it names.
fn graph_of(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let files = modules_of(src);
    let modules: BTreeSet<Module> = files.keys().filter(|m| *m != "lib").cloned().collect();
    files
        .iter()
        .map(|(m, p)| {
            let text = std::fs::read_to_string(p).expect("read");
            (m.clone(), references(m, &text, &modules))
        })
        .collect()
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
fn no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = graph_of(&src);
    let comps = components(&graph);
    for (level, files) in layers(&graph, &comps).iter().enumerate() {
        println!("layer {level}: {}", files.join(" "));
    }
    let mut failed = Vec::new();
    for c in comps.iter().filter(|c| c.len() > 1) {
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
            "{} modules: {}\n  e.g. {}\n  edges: {}",
            c.len(),
            c.join(", "),
            a_cycle(&graph, c).join(" -> "),
            edges.join(", ")
        ));
    }
    assert!(
        failed.is_empty(),
        "import cycles in src/:\n{}",
        failed.join("\n")
    );
}

#[test]
fn the_checker_sees_paths_groups_and_root_items() {
    let set = |xs: &[&str]| -> BTreeSet<String> { xs.iter().map(|s| s.to_string()).collect() };
    let modules = set(&["a", "b", "c", "d", "d/front", "d/back"]);
    let text = r#"
        //! Docs name [`crate::d`], which does not count.
        use crate::{a::{X, Y}, b, d::{self as dd, front::F}};
        fn f() { crate::log("crate::d"); let _ = '"'; }
        mod tests { use super::*; }
    "#;
    assert_eq!(
        references("c", text, &modules),
        set(&["a", "b", "d", "d/front", "lib"])
    );
    let lib = "mod a;\npub use b::Thing;\nfn g() { c::h(); std::a::x(); d::back::y(); }";
    assert_eq!(references("lib", lib, &modules), set(&["b", "c", "d/back"]));
    // A file of directory module `d`: its `super::` starts at `d`.
    let nested = "use super::front::F;\nfn g() { crate::a::h(); super::helper(); }";
    assert_eq!(
        references("d/back", nested, &modules),
        set(&["a", "d", "d/front"])
    );
    // `d/mod.rs`: its children by bare paths, its `super::` the crate root.
    let dir = "pub mod front;\nfn g() { front::h(); super::init(); self::back::x(); }";
    assert_eq!(
        references("d", dir, &modules),
        set(&["d/back", "d/front", "lib"])
    );

    let mut graph = BTreeMap::new();
    for (a, bs) in [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ] {
        graph.insert(a.to_string(), set(&bs));
    }
    let comps = components(&graph);
    assert!(comps.contains(&vec!["a".to_string(), "b".to_string(), "c".to_string()]));
    assert!(comps.contains(&vec!["d".to_string()]));
    assert_eq!(
        a_cycle(&graph, &["a".into(), "b".into(), "c".into()]),
        ["a", "b", "c", "a"]
    );
}
