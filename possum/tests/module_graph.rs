//! The shape of every crate of the workspace: no import cycle between the modules of a crate, no
//! source file over [`MAX_FILE_LINES`] lines, no function over [`MAX_FN_LINES`] lines outside
//! tests.
//!
//! **Import cycles.** Each file of a crate's `src/` is a node, those of its directories included
//! (`hip/front.rs` is the module `hip/front`, `hip/mod.rs` the module `hip`, `wire.rs` beside
//! `wire/` the module `wire`); the crate root (`lib.rs`, else `main.rs`) is `lib` or `main`.
//! Files under `src/bin/` are crates of their own and left out. An edge `a -> b` is a path in
//! `a` that names `b`: `crate::b::..`, each entry of a `use crate::{..}` group
//! (`crate::{b, c::{d, e}}` names `b`, `c/d` and `c/e` where those are modules, `c` where they
//! are its items), or an item of the crate root (`crate::init`: an edge to the root). A path
//! names the longest module it starts with. `super::` at a file's top level starts at its
//! parent module (`super::front::F` in `hip/entry.rs` names `hip/front`; `super::x` in
//! `entry.rs` an item of the root), and inside one of its inline `mod`s names that file. In a
//! file with child modules (the root, a `mod.rs`, `wire.rs` beside `wire/`) a path `child::..`
//! names the child too (its `mod child;` declarations do not count). A name that a module only
//! re-exports (`pub use a::b::X;`, `pub use a::b::{X, Y as Z};` at its top level, `pub(crate)`
//! too) is named where it is defined: `crate::X` is an edge to `a/b`, not to the root, and so is
//! `super::X` in a child of a module that re-exports `X`. A glob re-export (`pub use a::*;`) is
//! not followed, and a glob import (`use super::*;`) names the whole module it imports from.
//! Comments and string literals are skipped. The strongly connected components of each crate's
//! graph and its layers are printed, and every component must be a single file: a module calls
//! only modules below it, and what must call upwards is handed a function.

#[path = "support/source.rs"]
mod source;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use source::{ident_at, is_ident, strip, word_at};

/// The longest a source file may be, in lines (test-only files excepted).
const MAX_FILE_LINES: usize = 1_500;

/// The longest a function may be outside tests, in lines, from its `fn` line to its closing
/// brace.
const MAX_FN_LINES: usize = 120;

/// A module: its file's path under `src/` without `.rs`, a `mod.rs` named by its directory
/// (`lib`, `entry`, `hip`, `hip/front`).
type Module = String;

/// What each module re-exports: for each name of a top-level `pub use`, the path it stands for,
/// from the crate root (`pub use front::Made as M;` in `hip/mod.rs`: `M` -> `hip::front::Made`).
type Reexports = BTreeMap<Module, BTreeMap<String, Vec<String>>>;

/// A path that a `use` tree or an expression spells: its segments from the crate root, and the
/// name it brings into scope (its last segment or its `as` name; none for a glob or `as _`).
type Leaf = (Vec<String>, Option<String>);

/// The segments of module `file`'s own path (none for the root `root`).
fn segments_of<'a>(file: &'a str, root: &str) -> Vec<&'a str> {
    if file == root {
        Vec::new()
    } else {
        file.split('/').collect()
    }
}

/// The names that file `file` re-exports at its top level (see [`Reexports`]): each path of a
/// `pub use` (or `pub(..) use`) that starts with `crate::`, `super::`, `self::` or one of the
/// file's child modules. Globs name nothing; a path to the file's own items is left out.
fn reexports(
    file: &str,
    text: &str,
    modules: &BTreeSet<Module>,
    root: &str,
) -> BTreeMap<String, Vec<String>> {
    let code = strip(text);
    let b = code.as_bytes();
    let here: Vec<String> = segments_of(file, root)
        .into_iter()
        .map(String::from)
        .collect();
    let parent = here[..here.len().saturating_sub(1)].to_vec();
    let skip_space = |mut k: usize| {
        while k < b.len() && b[k].is_ascii_whitespace() {
            k += 1;
        }
        k
    };
    let mut out = BTreeMap::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' => depth += 1,
            b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if depth > 0 || !word_at(b, i, "pub") {
            i += 1;
            continue;
        }
        let mut k = skip_space(i + 3);
        if b.get(k) == Some(&b'(') {
            k = (k..b.len())
                .find(|&j| b[j] == b')')
                .map_or(b.len(), |j| j + 1);
            k = skip_space(k);
        }
        if k >= b.len() || !word_at(b, k, "use") {
            i = k.max(i + 1);
            continue;
        }
        k = skip_space(k + 3);
        let (first, after) = ident_at(b, k);
        let base = match first.as_str() {
            "crate" => Some(Vec::new()),
            "super" => Some(parent.clone()),
            "self" => Some(here.clone()),
            _ => None,
        };
        let (base, at) = match base {
            Some(base) if b[after..].starts_with(b"::") => (base, after + 2),
            Some(_) => {
                i = after;
                continue;
            }
            None => {
                let child: Vec<&str> = here
                    .iter()
                    .map(String::as_str)
                    .chain([first.as_str()])
                    .collect();
                if first.is_empty() || !modules.contains(&child.join("/")) {
                    i = after.max(i + 1);
                    continue;
                }
                (here.clone(), k)
            }
        };
        let mut leaves = Vec::new();
        let end = use_tree(b, at, &base, &mut leaves);
        for (segs, name) in leaves {
            if let Some(name) = name {
                if longest_module(&segs, modules, root) != file {
                    out.insert(name, segs);
                }
            }
        }
        i = end.max(i + 1);
    }
    out
}

/// The modules that file `file` names; `modules` are every module of `src/` but the root `root`
/// (`lib` or `main`), `reexports` what each module re-exports. Paths are resolved by
/// [`resolve`]: `crate::hip::front::made` names `hip/front`, `crate::init` names the root.
fn references(
    file: &str,
    text: &str,
    modules: &BTreeSet<Module>,
    root: &str,
    reexports: &Reexports,
) -> BTreeSet<Module> {
    let code = strip(text);
    let b = code.as_bytes();
    let mut out = BTreeSet::new();
    // The module whose children bare paths (`front::made` in `hip/mod.rs`) and `super::` name.
    let here: Vec<&str> = segments_of(file, root);
    let parent: Vec<&str> = here[..here.len().saturating_sub(1)].to_vec();
    // Whether the file has child modules (the root, a `mod.rs`): then `child::..` names one.
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
            // In the root or a `mod.rs`, `child::..` (not after another `::`, which would be a
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
        let base: Vec<String> = base.into_iter().map(String::from).collect();
        let mut found = Vec::new();
        let end = use_tree(b, at, &base, &mut found);
        out.extend(
            found
                .iter()
                .map(|(segs, _)| resolve(segs, modules, root, reexports)),
        );
        i = end.max(i + 1);
    }
    out.remove(file);
    out
}

/// Reads the path or `use` tree at `b[at..]` (after `base::`), adding each of its paths to
/// `out` (see [`Leaf`]); the index after it.
fn use_tree(b: &[u8], at: usize, base: &[String], out: &mut Vec<Leaf>) -> usize {
    let mut segs: Vec<String> = base.to_vec();
    let mut k = at;
    let mut glob = false;
    loop {
        while k < b.len() && b[k].is_ascii_whitespace() {
            k += 1;
        }
        if b.get(k) == Some(&b'{') {
            // A group: each entry a tree of its own under the path so far.
            k += 1;
            loop {
                while k < b.len() && (b[k].is_ascii_whitespace() || b[k] == b',') {
                    k += 1;
                }
                if k >= b.len() || b[k] == b'}' {
                    return k + 1;
                }
                let next = use_tree(b, k, &segs, out);
                if next <= k {
                    return k + 1;
                }
                k = next;
            }
        }
        if b.get(k) == Some(&b'*') {
            k += 1;
            glob = true;
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
    let mut bound = if glob { None } else { segs.last().cloned() };
    // `.. as name`: the name is no path, but the one brought into scope.
    let mut j = k;
    while j < b.len() && b[j].is_ascii_whitespace() {
        j += 1;
    }
    if j < b.len() && word_at(b, j, "as") {
        let (alias, next) = ident_at(b, j + 2);
        bound = (alias != "_").then_some(alias);
        k = next;
    }
    out.push((segs, bound));
    k
}

/// The module that path `segs` (from the crate root) names: the longest module it starts with
/// (`root` if none), unless the segment after that module is a name the module re-exports; then
/// the module that the re-exported path names, followed re-export by re-export.
fn resolve(
    segs: &[String],
    modules: &BTreeSet<Module>,
    root: &str,
    reexports: &Reexports,
) -> Module {
    let mut segs = segs.to_vec();
    // A chain of `pub use`s longer than this loops; it stops where it is.
    for _ in 0..16 {
        let m = longest_module(&segs, modules, root);
        let n = if m == root { 0 } else { m.split('/').count() };
        let Some(path) = segs.get(n).and_then(|name| reexports.get(&m)?.get(name)) else {
            return m;
        };
        segs = path.iter().chain(&segs[n + 1..]).cloned().collect();
    }
    longest_module(&segs, modules, root)
}

/// The longest module that path `segs` (from the crate root) starts with; `root` if none.
fn longest_module(segs: &[String], modules: &BTreeSet<Module>, root: &str) -> Module {
    (1..=segs.len())
        .rev()
        .map(|n| segs[..n].join("/"))
        .find(|m| modules.contains(m))
        .unwrap_or_else(|| root.to_string())
}

/// Tarjan's strongly connected components of `graph`, dependencies first.
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
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().expect("on the stack");
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

/// The modules of a crate's `src/` (see [`Module`]) and their files, those of its directories
/// included, `bin/` left out; and the root's name (`lib`, else `main`).
fn modules_of(src: &Path) -> (BTreeMap<Module, PathBuf>, Module) {
    let root = if src.join("lib.rs").exists() {
        "lib"
    } else {
        "main"
    };
    let mut out = BTreeMap::new();
    for p in source::rust_files(src) {
        let rel = p.strip_prefix(src).expect("under src");
        let rel = rel.to_string_lossy().replace('\\', "/");
        if rel.starts_with("bin/") || (root == "lib" && rel == "main.rs") {
            continue;
        }
        let stem = rel.strip_suffix(".rs").expect("a .rs file");
        let module = match stem.strip_suffix("/mod") {
            Some(dir) => dir.to_string(),
            None => stem.to_string(),
        };
        out.insert(module, p);
    }
    (out, root.to_string())
}

/// The module graph of a crate's `src/`: each module's set of the modules it names.
fn graph_of(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let (files, root) = modules_of(src);
    let modules: BTreeSet<Module> = files.keys().filter(|m| **m != root).cloned().collect();
    let texts: BTreeMap<&Module, String> = files
        .iter()
        .map(|(m, p)| (m, std::fs::read_to_string(p).expect("read")))
        .collect();
    let reexported: Reexports = texts
        .iter()
        .map(|(m, text)| ((*m).clone(), reexports(m, text, &modules, &root)))
        .collect();
    texts
        .iter()
        .map(|(m, text)| {
            let names = references(m, text, &modules, &root, &reexported);
            ((*m).clone(), names)
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

/// The import cycles of one crate's graph, each described for the failure message.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let comps = components(graph);
    for (level, files) in layers(graph, &comps).iter().enumerate() {
        println!("  layer {level}: {}", files.join(" "));
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
            a_cycle(graph, c).join(" -> "),
            edges.join(", ")
        ));
    }
    failed
}

#[test]
fn no_crate_has_an_import_cycle() {
    let root = source::workspace_root();
    let mut failed = Vec::new();
    for member in source::members() {
        let src = root.join(&member).join("src");
        println!("{member}/src:");
        let graph = graph_of(&src);
        for c in cycles(&graph) {
            failed.push(format!("{member}/src: {c}"));
        }
    }
    assert!(failed.is_empty(), "import cycles:\n{}", failed.join("\n"));
}

#[test]
fn the_checker_sees_paths_groups_and_root_items() {
    let set = |xs: &[&str]| -> BTreeSet<String> { xs.iter().map(|s| s.to_string()).collect() };
    let modules = set(&["a", "b", "c", "d", "d/front", "d/back"]);
    let none = Reexports::new();
    let text = r#"
        //! Docs name [`crate::d`], which does not count.
        use crate::{a::{X, Y}, b, d::{self as dd, front::F}};
        fn f() { crate::log("crate::d"); let _ = '"'; }
        mod tests { use super::*; }
    "#;
    assert_eq!(
        references("c", text, &modules, "lib", &none),
        set(&["a", "b", "d", "d/front", "lib"])
    );
    let lib = "mod a;\npub use b::Thing;\nfn g() { c::h(); std::a::x(); d::back::y(); }";
    assert_eq!(
        references("lib", lib, &modules, "lib", &none),
        set(&["b", "c", "d/back"])
    );
    // A binary's root is `main`: its items are named as `main`'s.
    let other = "fn g() { crate::run(); crate::a::h(); }";
    assert_eq!(
        references("c", other, &modules, "main", &none),
        set(&["a", "main"])
    );
    // A file of directory module `d`: its `super::` starts at `d`.
    let nested = "use super::front::F;\nfn g() { crate::a::h(); super::helper(); }";
    assert_eq!(
        references("d/back", nested, &modules, "lib", &none),
        set(&["a", "d", "d/front"])
    );
    // `d/mod.rs` (or `d.rs` beside `d/`): its children by bare paths, its `super::` the root.
    let dir = "pub mod front;\nfn g() { front::h(); super::init(); self::back::x(); }";
    assert_eq!(
        references("d", dir, &modules, "lib", &none),
        set(&["d/back", "d/front", "lib"])
    );
}

#[test]
fn a_reexported_name_is_named_where_it_is_defined() {
    let set = |xs: &[&str]| -> BTreeSet<String> { xs.iter().map(|s| s.to_string()).collect() };
    let modules = set(&["a", "b", "c", "d", "d/front", "d/back"]);
    let lib = "pub mod a;\npub use a::X;\npub(crate) use d::{F, front::{G, H as J}};\n\
               pub use b::*;\npub use std::fmt::Debug;\nfn f() { pub use c::Hidden; }";
    let dir =
        "mod front;\npub use self::front::{F, G, H};\npub use super::a::Y;\npub use crate::Z;";
    let mut reexported = Reexports::new();
    for (m, text) in [("lib", lib), ("d", dir)] {
        reexported.insert(m.to_string(), reexports(m, text, &modules, "lib"));
    }
    let names: Vec<&str> = reexported["lib"].keys().map(String::as_str).collect();
    assert_eq!(
        names,
        ["F", "G", "J", "X"],
        "globs, other crates and inner items are no names"
    );
    assert_eq!(reexported["lib"]["J"], ["d", "front", "H"]);
    assert_eq!(reexported["d"]["Y"], ["a", "Y"]);
    // `crate::X` names `a`; `crate::F` goes through `d` to `d/front`; a name only a glob brings
    // (`crate::W`) and an item of the root (`crate::init`) name the root.
    let child = "use crate::{X, J};\nfn f() { crate::F::new(); crate::W; crate::init(); }";
    assert_eq!(
        references("c", child, &modules, "lib", &reexported),
        set(&["a", "d/front", "lib"])
    );
    // In a child of `d`, `super::G` names `d/front` and `super::Y` names `a`; a glob import
    // names all of `d`.
    let nested = "use super::{G, Y};\nmod tests { use super::*; }";
    assert_eq!(
        references("d/back", nested, &modules, "lib", &reexported),
        set(&["a", "d/front"])
    );
    let glob = "use super::*;\nfn f() { super::Z; }";
    assert_eq!(
        references("d/back", glob, &modules, "lib", &reexported),
        set(&["d", "lib"])
    );
}

#[test]
fn the_checker_finds_cycles() {
    let set = |xs: &[&str]| -> BTreeSet<String> { xs.iter().map(|s| s.to_string()).collect() };
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
    assert_eq!(cycles(&graph).len(), 1);
}

/// The files whose length and functions count: every `.rs` file of each member crate (its
/// `src/`, `benches/`, `examples/` and `build.rs`), test-only files left out. Paths are relative
/// to the workspace root.
fn code_files() -> Vec<(String, String)> {
    let root = source::workspace_root();
    let mut out = Vec::new();
    for member in source::members() {
        let dir = root.join(&member);
        let src = dir.join("src");
        let tests_only = source::test_only_files(&src);
        let mut files = source::rust_files(&src);
        files.retain(|p| !tests_only.contains(p));
        for sub in ["benches", "examples"] {
            files.extend(source::rust_files(&dir.join(sub)));
        }
        if dir.join("build.rs").exists() {
            files.push(dir.join("build.rs"));
        }
        for p in files {
            let text = std::fs::read_to_string(&p).expect("a source file");
            let rel = p.strip_prefix(&root).expect("under the root");
            out.push((rel.to_string_lossy().into_owned(), text));
        }
    }
    out
}

/// Each function of `text` outside tests: its name, the line of its `fn` (from 1) and its
/// length in lines, to its closing brace. Declarations without a body are left out, and so are
/// functions whose name a macro supplies (`fn $name`).
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let (code, _) = source::without_tests(&strip(text));
    let b = code.as_bytes();
    let line_of = |i: usize| b[..i].iter().filter(|&&c| c == b'\n').count() + 1;
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !word_at(b, i, "fn") {
            i += 1;
            continue;
        }
        let (name, after) = ident_at(b, i + 2);
        if name.is_empty() {
            // `fn(..)`, a function pointer type; `fn $name`, a macro's.
            i += 2;
            continue;
        }
        let Some(k) = (after..b.len()).find(|&k| b[k] == b'{' || b[k] == b';') else {
            break;
        };
        if b[k] == b'{' {
            if let Some(end) = source::closing_brace(b, k) {
                out.push((name, line_of(i), line_of(end) - line_of(i) + 1));
            }
        }
        i = after;
    }
    out
}

#[test]
fn the_function_counter_sees_bodies_not_tests() {
    let text = "fn a() {\n    let s = \"}\\\n    x\";\n    b('{');\n}\n\
                trait T { fn decl(&self); }\n\
                pub(crate) unsafe extern \"C\" fn c(f: fn(u32) -> u32) -> u32 {\n    f(1)\n}\n\
                #[cfg(test)]\nmod tests {\n    fn long() {\n\n\n    }\n}\n\
                #[test]\nfn t() {\n}\n\
                macro_rules! m { ($n:ident) => { fn $n() {} }; }\n";
    let found = functions(text);
    assert_eq!(
        found,
        [("a".to_string(), 1, 5), ("c".to_string(), 7, 3)],
        "{found:?}"
    );
}

#[test]
fn no_source_file_is_over_1500_lines() {
    let long: Vec<String> = code_files()
        .into_iter()
        .map(|(p, text)| (p, text.lines().count()))
        .filter(|(_, n)| *n > MAX_FILE_LINES)
        .map(|(p, n)| format!("{p}: {n} lines"))
        .collect();
    assert!(
        long.is_empty(),
        "source files over {MAX_FILE_LINES} lines (split them along their sections):\n{}",
        long.join("\n")
    );
}

#[test]
fn no_function_is_over_120_lines() {
    let mut long: Vec<(usize, String)> = Vec::new();
    for (path, text) in code_files() {
        for (name, line, n) in functions(&text) {
            if n > MAX_FN_LINES {
                long.push((n, format!("{path}:{line} {name}: {n} lines")));
            }
        }
    }
    long.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let long: Vec<String> = long.into_iter().map(|(_, s)| s).collect();
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines outside tests (make each a sequence of named \
         steps):\n{}",
        long.join("\n")
    );
}
