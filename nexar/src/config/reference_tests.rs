//! The configuration reference cannot fall behind the code: every `NEXAR_*` variable that the
//! crates' code reads is listed in the guide's `docs/book/src/configuration.md`, and every
//! variable listed there is still read.
//!
//! The rule, kept simple on purpose:
//! - **Read by the code**: a name `NEXAR_[A-Z0-9_]+` (not ending in `_`) inside a string literal
//!   (plain or raw) in a `.rs` file under `src/` of `nexar`, `nexar-types`, `nexar-macros`,
//!   `nexar-rdma` (and `nexar-candle`, `nexar-burn` where they exist), counting neither
//!   comments (doc comments and their examples included), nor test files (`tests.rs`,
//!   `*_tests.rs`, anything under a `tests/` directory), nor the item that follows a
//!   `#[cfg(test)]` attribute. A name in a message (`"NEXAR_SHM=off"`) counts: it names a
//!   variable the code reads elsewhere.
//! - **Listed by the reference**: a name in the first cell of a table row of the reference.
//!   Names in its prose or in other cells do not count.
//!
//! A crate built from its published package has no guide beside it: the test then has nothing
//! to check and says so.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The source directories scanned, relative to the repository, and whether each must exist
/// (the training crates may not, yet).
const SOURCES: &[(&str, bool)] = &[
    ("nexar/src", true),
    ("nexar-types/src", true),
    ("nexar-macros/src", true),
    ("nexar-rdma/src", true),
    ("nexar-candle/src", false),
    ("nexar-burn/src", false),
];

/// The reference, relative to the repository.
const REFERENCE: &str = "docs/book/src/configuration.md";

const PREFIX: &str = "NEXAR_";
const CFG_TEST: &str = "#[cfg(test)]";

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The repository: the workspace that holds this crate.
fn repo_dir() -> &'static Path {
    manifest_dir().parent().unwrap_or(manifest_dir())
}

/// A path as the failure message shows it: relative to the repository.
fn shown(path: &Path) -> String {
    path.strip_prefix(repo_dir()).unwrap_or(path).display().to_string()
}

/// The `NEXAR_*` names in `text`: `NEXAR_` not preceded by a letter, digit or `_`, followed by
/// upper-case letters, digits and `_`, and not ending in `_` (a prefix such as `NEXAR_LAUNCH_`
/// names no variable).
fn names_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    let mut before: Option<char> = None;
    while let Some(at) = rest.find(PREFIX) {
        let preceding = rest[..at].chars().next_back().or(before);
        let tail = &rest[at + PREFIX.len()..];
        let len =
            tail.find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        let name = &rest[at..at + PREFIX.len() + len];
        let glued = preceding.is_some_and(|c| c.is_alphanumeric() || c == '_');
        if !glued && len > 0 && !name.ends_with('_') {
            names.push(name.to_string());
        }
        before = name.chars().next_back();
        rest = &rest[at + name.len()..];
    }
    names
}

/// The contents of the string literals of Rust source `src` that lie outside comments and
/// outside any item that follows a `#[cfg(test)]` attribute (from the attribute to the end of
/// the item: its `;`, or the `}` that closes its body).
fn code_strings(src: &str) -> Vec<String> {
    let s: Vec<char> = src.chars().collect();
    let n = s.len();
    let starts = |at: usize, pat: &str| pat.chars().enumerate().all(|(k, c)| s.get(at + k) == Some(&c));
    let mut strings = Vec::new();
    let mut depth = 0usize;
    // The brace depth at which the body of a `#[cfg(test)]` item opened, while inside it.
    let mut test_item_at: Option<usize> = None;
    // A `#[cfg(test)]` was seen and its item has neither ended nor opened a body yet.
    let mut test_attr = false;
    let mut i = 0;
    while i < n {
        let c = s[i];
        let keep = test_item_at.is_none() && !test_attr;
        if starts(i, "//") {
            while i < n && s[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if starts(i, "/*") {
            let mut nested = 1;
            i += 2;
            while i < n && nested > 0 {
                if starts(i, "/*") {
                    nested += 1;
                    i += 2;
                } else if starts(i, "*/") {
                    nested -= 1;
                    i += 2;
                } else {
                    i += 1;
                }
            }
            continue;
        }
        let after_ident = i > 0 && (s[i - 1].is_alphanumeric() || s[i - 1] == '_');
        // Raw strings: r"…", r#"…"#, br"…", cr"…".
        let raw_at = match c {
            'r' => Some(i + 1),
            'b' | 'c' if s.get(i + 1) == Some(&'r') => Some(i + 2),
            _ => None,
        };
        if let Some(mut k) = raw_at.filter(|_| !after_ident) {
            let mut hashes = 0;
            while s.get(k) == Some(&'#') {
                hashes += 1;
                k += 1;
            }
            if s.get(k) == Some(&'"') {
                let body = k + 1;
                let mut end = body;
                while end < n && !(s[end] == '"' && (1..=hashes).all(|h| s.get(end + h) == Some(&'#'))) {
                    end += 1;
                }
                if keep {
                    strings.push(s[body..end.min(n)].iter().collect());
                }
                i = end + 1 + hashes;
                continue;
            }
        }
        if c == '"' {
            let mut end = i + 1;
            while end < n && s[end] != '"' {
                end += if s[end] == '\\' { 2 } else { 1 };
            }
            if keep {
                strings.push(s[i + 1..end.min(n)].iter().collect());
            }
            i = end + 1;
            continue;
        }
        if c == '\'' {
            // A character literal ('x', '"', '\'', '\u{…}') or a lifetime ('a).
            if s.get(i + 1) == Some(&'\\') {
                let mut end = i + 3;
                while end < n && s[end] != '\'' {
                    end += 1;
                }
                i = end + 1;
            } else if s.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
            continue;
        }
        if starts(i, CFG_TEST) {
            if test_item_at.is_none() {
                test_attr = true;
            }
            i += CFG_TEST.len();
            continue;
        }
        match c {
            '{' => {
                if test_attr {
                    test_item_at = Some(depth);
                    test_attr = false;
                }
                depth += 1;
            }
            '}' => {
                depth = depth.saturating_sub(1);
                if test_item_at == Some(depth) {
                    test_item_at = None;
                }
            }
            ';' if test_item_at.is_none() => test_attr = false,
            _ => {}
        }
        i += 1;
    }
    strings
}

fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs" || name.ends_with("_tests.rs")
}

/// The `.rs` files under `dir`, in order, leaving out test files and `tests/` directories.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", shown(dir)));
    let mut paths: Vec<PathBuf> = entries.map(|entry| entry.expect("a readable directory entry").path()).collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "tests") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") && !is_test_file(&path) {
            out.push(path);
        }
    }
}

/// Every variable the code reads, with the files that name it.
fn read_by_code() -> BTreeMap<String, BTreeSet<String>> {
    let mut read: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for &(dir, required) in SOURCES {
        let dir = repo_dir().join(dir);
        if !dir.is_dir() {
            assert!(!required, "the source directory {} is missing", shown(&dir));
            continue;
        }
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        for file in files {
            let src = fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", shown(&file)));
            for literal in code_strings(&src) {
                for name in names_in(&literal) {
                    read.entry(name).or_default().insert(shown(&file));
                }
            }
        }
    }
    read
}

/// Every variable in the first cell of a table row of the reference.
fn listed_by(reference: &str) -> BTreeSet<String> {
    reference
        .lines()
        .filter_map(|line| line.trim().strip_prefix('|'))
        .filter_map(|row| row.split('|').next())
        .flat_map(names_in)
        .collect()
}

#[test]
fn every_variable_the_code_reads_is_in_the_reference_and_nothing_else() {
    let reference_path = repo_dir().join(REFERENCE);
    if !reference_path.exists() && manifest_dir().join("Cargo.toml.orig").exists() {
        eprintln!("built from a published package: no guide beside it, nothing to check");
        return;
    }
    let reference = fs::read_to_string(&reference_path)
        .unwrap_or_else(|e| panic!("cannot read the configuration reference {}: {e}", shown(&reference_path)));
    let read = read_by_code();
    assert!(
        read.contains_key("NEXAR_OP_TIMEOUT_MS") && read.contains_key("NEXAR_SEED_ADDR"),
        "the scan of the sources found too little to be right: {:?}",
        read.keys().collect::<Vec<_>>()
    );
    let listed = listed_by(&reference);
    let mut problems = Vec::new();
    for (name, files) in &read {
        if !listed.contains(name) {
            let files: Vec<&str> = files.iter().map(String::as_str).collect();
            problems.push(format!(
                "{name} is read by the code ({}) but not listed in {}",
                files.join(", "),
                shown(&reference_path)
            ));
        }
    }
    for name in &listed {
        if !read.contains_key(name) {
            problems.push(format!("{name} is listed in {} but no code reads it any more", shown(&reference_path)));
        }
    }
    assert!(problems.is_empty(), "the configuration reference is out of date:\n  {}", problems.join("\n  "));
}

#[test]
fn names_are_whole_and_never_prefixes() {
    assert_eq!(names_in("NEXAR_SHM=off and NEXAR_LANE_CIPHER=aes"), ["NEXAR_SHM", "NEXAR_LANE_CIPHER"]);
    assert!(names_in("NEXAR_LAUNCH_* and XNEXAR_FOO and NEXAR_").is_empty());
    assert_eq!(names_in("(NEXAR_A1_B)"), ["NEXAR_A1_B"]);
}

#[test]
fn comments_and_test_items_are_not_code() {
    let src = concat!(
        "// \"NEXAR_LINE\"\n",
        "/* \"NEXAR_BLOCK\" /* nested */ */\n",
        "/// let x = \"NEXAR_DOC\";\n",
        "const A: &str = \"NEXAR_KEPT\";\n",
        "const Q: char = '\"';\n",
        "fn f<'a>(x: &'a str) -> &'a str { let _ = r#\"NEXAR_RAW \"quoted\"\"#; x }\n",
        "#[cfg(test)]\nmod tests { fn g() { let _ = \"NEXAR_IN_TESTS\"; } }\n",
        "#[cfg(test)]\nconst T: &str = \"NEXAR_TEST_CONST\";\n",
        "#[cfg(test)]\nmod other;\n",
        "fn h() { let _ = \"NEXAR_AFTER\"; let _ = \"escaped \\\" NEXAR_ESCAPED\"; }\n",
    );
    let names: Vec<String> = code_strings(src).iter().flat_map(|s| names_in(s.as_str())).collect();
    assert_eq!(names, ["NEXAR_KEPT", "NEXAR_RAW", "NEXAR_AFTER", "NEXAR_ESCAPED"]);
}

#[test]
fn only_first_cells_of_table_rows_are_listed() {
    let md = "| variable | default | meaning |\n|---|---|---|\n| `NEXAR_A` | 1 | see `NEXAR_B` |\nNEXAR_C in prose\n";
    assert_eq!(listed_by(md), BTreeSet::from(["NEXAR_A".to_string()]));
}
