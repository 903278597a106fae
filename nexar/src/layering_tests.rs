//! The map in `docs/ARCHITECTURE.md` kept true: every `crate::` path in the code (not in
//! comments) names a module of the same layer or one below, and never an item through the crate
//! root, which only the crate root itself and its public faces may use.

use std::path::Path;

/// Each top-level module and its layer: a module may use modules of its own layer or lower.
/// The order is `docs/ARCHITECTURE.md`'s: leaves, proto, config beside telemetry, transport,
/// cluster, the flight recorder, comm with RPC and plans (and the crate-wide error that wraps
/// their errors), then data-parallel training, then the public faces.
const LAYERS: &[(&str, u8)] = &[
    ("sync", 0),
    ("affinity", 0),
    ("proto", 1),
    ("config", 2),
    ("telemetry", 2),
    ("transport", 3),
    ("cluster", 4),
    ("trace", 5),
    ("comm", 6),
    ("rpc", 6),
    ("plan", 6),
    ("error", 6),
    ("ddp", 7),
    ("simulate", 7),
    ("backend", 8),
    ("tls", 8),
    ("hostile", 8),
    ("lib", 9),
];

fn layer_of(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(name, _)| *name == module).map(|&(_, layer)| layer)
}

/// The first segment of every `crate::` path on a line of code (`crate::a::b` gives `a`,
/// `crate::{a, b::c}` gives `a` and `b`).
fn crate_paths(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `nexar_crate::`, not ours
        }
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(group.split(',').map(|p| p.trim().split("::").next().unwrap_or("")).filter(|p| !p.is_empty()));
        } else {
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
            out.push(&rest[..end]);
        }
    }
    out
}

fn visit(dir: &Path, src: &Path, found: &mut Vec<String>) {
    let mut entries: Vec<_> =
        std::fs::read_dir(dir).expect("src is readable").map(|e| e.expect("entry").path()).collect();
    entries.sort();
    for path in entries {
        let rel = path.strip_prefix(src).expect("under src").to_string_lossy().replace('\\', "/");
        if path.is_dir() {
            if rel != "bin" {
                visit(&path, src, found);
            }
            continue;
        }
        // This file's strings are full of the paths it looks for.
        if path.extension().is_none_or(|e| e != "rs") || rel == "layering_tests.rs" {
            continue;
        }
        let top = rel.split('/').next().unwrap_or("").trim_end_matches(".rs");
        let Some(own) = layer_of(top) else {
            found.push(format!("{rel}: top-level module `{top}` has no layer in LAYERS (layering_tests.rs)"));
            continue;
        };
        let text = std::fs::read_to_string(&path).expect("readable");
        for (n, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("//") {
                continue;
            }
            let code = trimmed.split(" // ").next().unwrap_or("");
            for target in crate_paths(code) {
                match layer_of(target) {
                    Some(theirs) if theirs > own => found.push(format!(
                        "{rel}:{}: `{top}` (layer {own}) uses `crate::{target}` (layer {theirs}), a layer above it",
                        n + 1
                    )),
                    Some(_) => {}
                    None if top == "lib" || matches!(target, "__private" | "prelude") => {}
                    None => found.push(format!(
                        "{rel}:{}: `crate::{target}` takes an item through the crate root; import it from the module that owns it",
                        n + 1
                    )),
                }
            }
        }
    }
}

#[test]
fn no_module_imports_from_a_layer_above_or_through_the_crate_root() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    visit(&src, &src, &mut found);
    assert!(found.is_empty(), "{} imports break docs/ARCHITECTURE.md's layering:\n{}", found.len(), found.join("\n"));
}

#[test]
fn paths_are_read_as_the_compiler_reads_them() {
    assert_eq!(crate_paths("use crate::comm::{NexarClient};"), ["comm"]);
    assert_eq!(crate_paths("use crate::{config::X, proto::y};"), ["config", "proto"]);
    assert_eq!(crate_paths("f(crate::NexarClient::x(), nexar_crate::a)"), ["NexarClient"]);
    assert_eq!(layer_of("comm"), Some(6));
    assert!(layer_of("proto") < layer_of("transport"));
}
