//! The floors of docs/ARCHITECTURE.md ("Floors"), enforced: no file under src/ names a module on a
//! higher floor (`crate::NAME` in code, outside comments and the file's `#[cfg(test)] mod tests`), and
//! every top-level module stands on a floor, so a new module must be placed before it lands. The floors
//! are one crate's modules, not workspace crates (ARCHITECTURE.md says why): this test is what holds them.

use std::path::Path;

/// Floor of each top-level module of src/ (ARCHITECTURE.md's table; `cli`, `main` and `lib` stand above
/// all and are not checked). `tiles` (the host model of the CUDA kernel choice and `KeyTiles`) and
/// `judging` (`Judging`, how the judges read a path) stand below the backend that answers with them.
const FLOORS: &[(usize, &[&str])] = &[
    (
        0,
        &["error", "alloc", "precision", "tolerance", "kernel_use"],
    ),
    (
        1,
        &[
            "gguf",
            "model",
            "rope",
            "schedule",
            "batch",
            "faults",
            "linalg",
            "input",
            "trace",
            "kv_format",
        ],
    ),
    (2, &["reference", "tiles", "judging"]),
    (3, &["backend"]),
    (4, &["compare", "coverage"]),
    (5, &["report"]),
    (
        6,
        &[
            "run",
            "tp",
            "shard",
            "gpus",
            "merge",
            "capture",
            "capsule",
            "sweep",
            "calibrate",
            "selftest",
            "lint",
            "fixture",
            "fuzz",
            "inspect",
            "bench",
            "tools",
        ],
    ),
];

fn floor(module: &str) -> Option<usize> {
    FLOORS
        .iter()
        .find(|(_, ms)| ms.contains(&module))
        .map(|(f, _)| *f)
}

/// The code of a file without its comments and its test module.
fn code(src: &str) -> String {
    let src = match src.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &src[..i],
        None => src,
    };
    src.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The upward names in one file of module `top`: `(named module, its floor)`.
fn upward(top: &str, src: &str) -> Vec<String> {
    let Some(own) = floor(top) else {
        return vec![format!(
            "module `{top}` stands on no floor (add it to FLOORS and ARCHITECTURE.md)"
        )];
    };
    let code = code(src);
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if rest.starts_with('{') {
            out.push("a grouped `crate::{…}` import (name each module's path)".to_string());
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if let Some(f) = floor(&name).filter(|f| *f > own) {
            out.push(format!("{top} (floor {own}) names {name} (floor {f})"));
        }
    }
    out.sort();
    out.dedup();
    out
}

fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
}

#[test]
fn the_check_sees_an_upward_name_and_ignores_comments_and_tests() {
    assert_eq!(
        upward("trace", "use crate::precision::Dtype;"),
        Vec::<String>::new()
    );
    assert_eq!(
        upward("trace", "fn f() { crate::run::go() }"),
        ["trace (floor 1) names run (floor 6)"]
    );
    assert!(upward("trace", "// see `crate::run`\nfn f() {}").is_empty());
    assert!(upward(
        "trace",
        "fn f() {}\n#[cfg(test)]\nmod tests {\n use crate::run;\n}"
    )
    .is_empty());
    assert_eq!(upward("newthing", "").len(), 1);
}

#[test]
fn nothing_imports_upward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let mut bad = Vec::new();
    for p in &files {
        let rel = p.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let top = first.trim_end_matches(".rs");
        if matches!(top, "cli" | "main" | "lib") {
            continue;
        }
        let text = std::fs::read_to_string(p).unwrap();
        for b in upward(top, &text) {
            bad.push(format!("src/{}: {b}", rel.display()));
        }
    }
    assert!(
        files.len() > 100,
        "read only {} files under src/",
        files.len()
    );
    assert!(
        bad.is_empty(),
        "imports up a floor (docs/ARCHITECTURE.md, Floors):\n{}",
        bad.join("\n")
    );
}
