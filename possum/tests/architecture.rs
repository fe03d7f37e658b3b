//! ARCHITECTURE.md and README.md checked against the code, so that the map stays true: their
//! length, the crates named, every count they state that the code can count, the paths they
//! name, and the list of the files that hold `unsafe` code.

#[path = "support/source.rs"]
mod source;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The longest ARCHITECTURE.md may be: a map, not a history.
const MAX_ARCHITECTURE_LINES: usize = 400;

/// The longest README.md may be: a user's guide.
const MAX_README_LINES: usize = 150;

fn read(rel: &str) -> String {
    std::fs::read_to_string(source::workspace_root().join(rel))
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The lines of `doc` from the heading that starts with `heading` to the next heading of the same
/// or a higher level.
fn section<'d>(doc: &'d str, heading: &str) -> Vec<&'d str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = doc.lines().skip_while(|l| !l.starts_with(heading));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no section `{heading}`"));
    let mut out = vec![first];
    for l in lines {
        let hashes = l.chars().take_while(|c| *c == '#').count();
        if hashes > 0 && hashes <= level && l[hashes..].starts_with(' ') {
            break;
        }
        out.push(l);
    }
    out
}

/// The texts between backticks in `text`.
fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Each number written in digits right before `words` in `doc` (`"13 crates"` for `crates`).
fn numbers_before(doc: &str, words: &str) -> Vec<usize> {
    let mut out = Vec::new();
    let mut rest = doc;
    while let Some(at) = rest.find(words) {
        let before = rest[..at].trim_end();
        let digits: String = before
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_digit())
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let whole_word = before.len() == digits.len()
            || !before[..before.len() - digits.len()]
                .ends_with(|c: char| c.is_alphanumeric() || c == '.' || c == ',');
        if !digits.is_empty() && whole_word && rest[..at].ends_with(char::is_whitespace) {
            out.push(digits.parse().expect("digits"));
        }
        rest = &rest[at + words.len()..];
    }
    out
}

/// Asserts that `doc` states the count before `words` at least once, and only as `expected`.
fn states(doc_name: &str, doc: &str, words: &str, expected: usize, what: &str) {
    // Words broken across lines count as one line.
    let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    let found = numbers_before(&doc, words);
    assert!(
        !found.is_empty(),
        "{doc_name} should say how many {what} there are (\"{expected} {words}\")"
    );
    for n in found {
        assert_eq!(
            n, expected,
            "{doc_name} says \"{n} {words}\", but the code has {expected} {what}"
        );
    }
}

/// The variants of `enum name` in `text` (stripped code): its top-level items.
fn enum_variants(text: &str, name: &str) -> Vec<String> {
    let code = source::strip(text);
    let start = code
        .find(&format!("enum {name} {{"))
        .unwrap_or_else(|| panic!("no `enum {name}`"));
    let open = start + code[start..].find('{').expect("a brace");
    let close = source::closing_brace(code.as_bytes(), open).expect("a closing brace");
    let body = &code[open + 1..close];
    // Top-level pieces between commas, skipping what is inside braces, parentheses and
    // attributes.
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut piece = String::new();
    for c in body.chars() {
        match c {
            '{' | '(' | '[' => depth += 1,
            '}' | ')' | ']' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            out.push(std::mem::take(&mut piece));
        } else if depth == 0 && c != '}' && c != ')' && c != ']' {
            piece.push(c);
        }
    }
    out.push(piece);
    out.into_iter()
        .filter_map(|p| {
            let p = p.replace('#', " ");
            let word = p.split_whitespace().next_back()?.to_string();
            word.starts_with(|c: char| c.is_ascii_uppercase())
                .then_some(word)
        })
        .collect()
}

/// How many driver functions libpossum.so wraps: the rows of the `entry_points!` table plus the
/// entries its macro writes out by name (`cuGetProcAddress` and `_v2`).
fn wrapped_driver_functions() -> usize {
    let src = source::workspace_root().join("interposer/src");
    let mut found = Vec::new();
    for f in source::rust_files(&src) {
        let text = std::fs::read_to_string(&f).expect("a source file");
        let Some(at) = text.find("\nentry_points! {") else {
            continue;
        };
        let table = &text[at..];
        let table = &table[..table.find("\n}").expect("the table's end")];
        let rows = table
            .lines()
            .filter(|l| {
                let l = l.trim_start();
                let name: String = l
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                name.starts_with("cu") && l[name.len()..].trim_start().starts_with('=')
            })
            .count();
        let by_name = text.matches("name: \"cu").count();
        found.push(rows + by_name);
    }
    assert_eq!(
        found.len(),
        1,
        "one `entry_points!` table in interposer/src"
    );
    found[0]
}

/// The commands `possum --help` lists (`help` left out).
fn visible_commands() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_possum"))
        .arg("--help")
        .output()
        .expect("possum --help");
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let list = text
        .split("Commands:\n")
        .nth(1)
        .expect("a Commands: list")
        .split("\n\n")
        .next()
        .expect("the list");
    list.lines()
        // A command's line is indented two spaces; its wrapped summary more.
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn the_architecture_document_is_a_map_of_at_most_400_lines() {
    let doc = read("ARCHITECTURE.md");
    let n = doc.lines().count();
    assert!(
        n <= MAX_ARCHITECTURE_LINES,
        "ARCHITECTURE.md has {n} lines, more than {MAX_ARCHITECTURE_LINES}: move detail to docs/"
    );
}

#[test]
fn every_crate_has_its_paragraph() {
    let doc = read("ARCHITECTURE.md");
    let headings: Vec<&str> = doc.lines().filter(|l| l.starts_with("### ")).collect();
    for member in source::members() {
        let name = format!("`{member}/`");
        assert!(
            headings.iter().any(|h| h.contains(&name)),
            "ARCHITECTURE.md has no `### {name}` heading in its code map"
        );
    }
}

#[test]
fn the_counts_it_states_are_the_code_s() {
    let doc = read("ARCHITECTURE.md");
    let root = source::workspace_root();
    states(
        "ARCHITECTURE.md",
        &doc,
        "crates",
        source::members().len(),
        "workspace crates",
    );
    states(
        "ARCHITECTURE.md",
        &doc,
        "driver functions",
        wrapped_driver_functions(),
        "wrapped driver functions",
    );
    let control = std::fs::read_to_string(root.join("control/src/protocol.rs")).expect("control");
    states(
        "ARCHITECTURE.md",
        &doc,
        "control requests",
        enum_variants(&control, "Request").len(),
        "control requests (possum_control::Request)",
    );
    let keeper = std::fs::read_to_string(root.join("keeper/src/protocol.rs")).expect("keeper");
    states(
        "ARCHITECTURE.md",
        &doc,
        "keeper requests",
        enum_variants(&keeper, "Request").len(),
        "keeper requests (possum_keeper::Request)",
    );
    states(
        "ARCHITECTURE.md",
        &doc,
        "commands",
        visible_commands().len(),
        "commands in `possum --help`",
    );
}

#[test]
fn the_counters_count() {
    let text = "/// Doc.\n#[derive(Debug)]\npub enum Request {\n    /// A.\n    Ping,\n    \
                Alloc { size: u64, who: (u8, u8) },\n    #[serde(rename = \"x\")]\n    Free(u64),\n}\n";
    assert_eq!(enum_variants(text, "Request"), ["Ping", "Alloc", "Free"]);
    assert_eq!(
        numbers_before("It has 13 crates; v1.13 crates no", "crates"),
        [13]
    );
    assert_eq!(numbers_before("a (12 commands) b", "commands"), [12]);
}

/// The `.rs` files of a crate's `src/` that hold `unsafe` code outside tests, or allow the
/// `unsafe_code` lint.
fn files_with_unsafe(src: &Path) -> BTreeSet<String> {
    let tests_only = source::test_only_files(src);
    source::rust_files(src)
        .into_iter()
        .filter(|p| !tests_only.contains(p))
        .filter(|p| {
            let text = std::fs::read_to_string(p).expect("a source file");
            let (code, _) = source::without_tests(&source::strip(&text));
            let b = code.as_bytes();
            // `unsafe` itself, or the lint allowed for what it catches without the keyword
            // (`#[no_mangle]`, `#[link_section]`).
            (0..b.len()).any(|i| source::word_at(b, i, "unsafe"))
                || code.contains("allow(unsafe_code")
        })
        .map(|p| {
            p.strip_prefix(src)
                .expect("under src")
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// The unsafe list of ARCHITECTURE.md: per crate directory (`cuda`), the files it names under
/// `src/`; a crate whose bullet names no file maps to an empty set (it has none).
fn unsafe_list(doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let text = section(doc, "## Where `unsafe` is").join("\n");
    // Without the HTML comment that says how the list is checked.
    let mut text = text.as_str().to_string();
    while let (Some(a), Some(b)) = (text.find("<!--"), text.find("-->")) {
        if b < a {
            break;
        }
        text.replace_range(a..b + 3, "");
    }
    let lines = text.lines();
    // Bullets, with their continuation lines.
    let mut bullets: Vec<String> = Vec::new();
    for l in lines {
        if let Some(b) = l.strip_prefix("- ") {
            bullets.push(b.to_string());
        } else if l.starts_with("  ") && bullets.last().is_some_and(|b| !b.is_empty()) {
            bullets.last_mut().expect("a bullet").push_str(l);
        } else if !l.starts_with("  ") {
            // A paragraph ends the bullet before it.
            bullets.push(String::new());
        }
    }
    let mut out = BTreeMap::new();
    for b in bullets.iter().filter(|b| !b.is_empty()) {
        let ticks = backticked(b);
        let crates: Vec<&str> = ticks
            .iter()
            .copied()
            .filter_map(|t| t.strip_suffix("/src/"))
            .collect();
        let files: BTreeSet<String> = ticks
            .iter()
            .filter(|t| t.ends_with(".rs"))
            .map(|t| t.to_string())
            .collect();
        assert!(
            !crates.is_empty(),
            "a bullet of ARCHITECTURE.md's unsafe list names no `CRATE/src/`: {b}"
        );
        assert!(
            files.is_empty() || crates.len() == 1,
            "a bullet of ARCHITECTURE.md's unsafe list names files and several crates: {b}"
        );
        for c in crates {
            let prev = out.insert(c.to_string(), files.clone());
            assert!(
                prev.is_none(),
                "`{c}/src/` has two bullets in the unsafe list"
            );
        }
    }
    out
}

#[test]
fn the_unsafe_list_names_exactly_the_files_with_unsafe() {
    let doc = read("ARCHITECTURE.md");
    let root = source::workspace_root();
    let listed = unsafe_list(&doc);
    let mut problems = Vec::new();
    for member in source::members() {
        let src = root.join(&member).join("src");
        let actual = files_with_unsafe(&src);
        let named = listed.get(&member).cloned().unwrap_or_default();
        for f in named.difference(&actual) {
            if src.join(f).exists() {
                problems.push(format!("{member}/src/{f} is listed but has no `unsafe`"));
            } else {
                problems.push(format!("{member}/src/{f} is listed but does not exist"));
            }
        }
        for f in actual.difference(&named) {
            problems.push(format!("{member}/src/{f} has `unsafe` but is not listed"));
        }
        if listed.get(&member).is_some_and(BTreeSet::is_empty) {
            let root_file = ["lib.rs", "main.rs"]
                .iter()
                .map(|f| src.join(f))
                .find(|p| p.exists())
                .expect("a crate root");
            let text = std::fs::read_to_string(&root_file).expect("the crate root");
            if !text.contains("#![forbid(unsafe_code)]") {
                problems.push(format!(
                    "{member} is listed without unsafe, but its root does not say \
                     #![forbid(unsafe_code)]"
                ));
            }
        }
    }
    for c in listed.keys() {
        if !source::members().contains(c) {
            problems.push(format!(
                "the unsafe list names `{c}/src/`, which is no crate"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md's \"Where `unsafe` is\" disagrees with the code:\n{}",
        problems.join("\n")
    );
}

/// The repository paths `doc` names: backticked words and link targets that start with a
/// top-level directory of the repository (`engine/src/gate.rs`, `scripts/test.sh`, `docs/`).
fn named_paths(doc: &str) -> BTreeSet<String> {
    let root = source::workspace_root();
    let top: BTreeSet<String> = std::fs::read_dir(&root)
        .expect("the root")
        .filter_map(|e| {
            let e = e.ok()?;
            e.path()
                .is_dir()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .filter(|n| n != "target" && n != ".git")
        .collect();
    // Outside code blocks, and without the unsafe list (its paths are relative to a crate's
    // `src/`, and checked on their own).
    let prose: String = doc.split("```").step_by(2).collect::<Vec<_>>().join("\n");
    let unsafe_list = if prose.contains("## Where `unsafe` is") {
        section(&prose, "## Where `unsafe` is").join("\n")
    } else {
        String::new()
    };
    let prose = prose.replace(&unsafe_list, "");
    let links = prose
        .split("](")
        .skip(1)
        .filter_map(|s| s.split(')').next());
    backticked(&prose)
        .into_iter()
        .filter_map(|t| t.split_whitespace().next())
        .chain(links)
        .map(|t| t.split('#').next().unwrap_or_default())
        .filter(|t| !t.contains(['*', '<', '{', '$']) && !t.starts_with("http"))
        .filter(|t| {
            t.split_once('/')
                .is_some_and(|(first, _)| top.contains(first))
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn the_paths_it_names_exist() {
    let root = source::workspace_root();
    for doc_name in ["ARCHITECTURE.md", "README.md"] {
        let doc = read(doc_name);
        let missing: Vec<String> = named_paths(&doc)
            .into_iter()
            .filter(|p| !root.join(p).exists())
            .collect();
        assert!(
            missing.is_empty(),
            "{doc_name} names paths that do not exist: {}",
            missing.join(", ")
        );
    }
}

#[test]
fn the_readme_is_a_short_guide_whose_command_count_is_right() {
    let doc = read("README.md");
    let n = doc.lines().count();
    assert!(
        n <= MAX_README_LINES,
        "README.md has {n} lines, more than {MAX_README_LINES}"
    );
    // The commands its examples run: `possum SUB` in its code blocks.
    let mut used = BTreeSet::new();
    for block in doc.split("```").skip(1).step_by(2) {
        for line in block.lines() {
            // Without the shell comment.
            let code = line.split(" #").next().unwrap_or_default();
            let words: Vec<&str> = code.split_whitespace().collect();
            for w in words.windows(2) {
                if w[0] == "possum" && !w[1].starts_with('-') {
                    used.insert(w[1].to_string());
                }
            }
        }
    }
    let all = visible_commands();
    for c in &used {
        assert!(
            all.contains(c),
            "README.md runs `possum {c}`, which is no command"
        );
    }
    states(
        "README.md",
        &doc,
        "of possum's",
        used.len(),
        "commands its examples run",
    );
    states(
        "README.md",
        &doc,
        "commands",
        all.len(),
        "commands in `possum --help`",
    );
    // Root-only machines have no sudo: the guide says "as root (or with sudo)", never runs it.
    for block in doc.split("```").skip(1).step_by(2) {
        assert!(
            !block.split_whitespace().any(|w| w == "sudo"),
            "README.md runs sudo in a code block:\n{block}"
        );
    }
}
