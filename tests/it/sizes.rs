//! No giant functions, no giant files (issue #34): no function under src/ longer than `MAX_FN` lines,
//! no file longer than `MAX_FILE`, except the offenders listed below at their size when listed. A
//! listed one may shrink, never grow; one back within the limit must leave the list (the test says
//! so), and no new one may appear: the count can only go down.
//!
//! A function is found as rustfmt lays it out: a line `fn NAME` (after `pub`, `const`, `async`,
//! `unsafe`, `extern "C"`) whose signature ends in `{`, through the first line that is `}` at the same
//! indentation. Its length counts both lines.

use std::collections::BTreeMap;
use std::path::Path;

const MAX_FN: usize = 120;
const MAX_FILE: usize = 600;

/// Functions over `MAX_FN` lines: (file under src/, function name, its length now).
const LONG_FNS: &[(&str, &str, usize)] = &[];

/// Files over `MAX_FILE` lines: (file under src/, its length now).
const LONG_FILES: &[(&str, usize)] = &[];

/// `(name, first line (1-based), length)` of each function of `src`.
fn functions(src: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let indent = &l[..l.len() - l.trim_start().len()];
        let mut rest = l.trim_start();
        if let Some(r) = rest.strip_prefix("pub") {
            rest = match r.strip_prefix('(') {
                Some(r) => r.split_once(") ").map_or("", |x| x.1),
                None => r.strip_prefix(' ').unwrap_or(""),
            };
        }
        for q in ["const ", "async ", "unsafe ", "extern \"C\" "] {
            rest = rest.strip_prefix(q).unwrap_or(rest);
        }
        let Some(r) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = r
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The signature's last line: `{` opens a body; `;` is a declaration; `}` a one-line body.
        let Some(open) = (i..lines.len()).find(|&j| {
            let t = lines[j].trim_end();
            t.ends_with('{') || t.ends_with(';') || t.ends_with('}')
        }) else {
            continue;
        };
        if !lines[open].trim_end().ends_with('{') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = (open + 1..lines.len()).find(|&j| lines[j] == close) {
            out.push((name, i + 1, end - i + 1));
        }
    }
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
fn functions_are_found_as_rustfmt_lays_them_out() {
    let src = "fn a() {\n    x();\n}\npub(crate) fn b(\n    y: u8,\n) -> u8 {\n    y\n}\n\
               trait T {\n    fn c(&self);\n    fn d(&self) {}\n    pub unsafe fn e() {\n    }\n}\n";
    assert_eq!(
        functions(src),
        [
            ("a".to_string(), 1, 3),
            ("b".to_string(), 4, 5),
            ("e".to_string(), 12, 2)
        ]
    );
}

#[test]
fn no_function_and_no_file_grows_past_the_limits() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let mut fns: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut long_files: BTreeMap<String, usize> = BTreeMap::new();
    for p in &files {
        let rel = p
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(p).unwrap();
        let n = text.lines().count();
        if n > MAX_FILE {
            long_files.insert(rel.clone(), n);
        }
        for (name, _, len) in functions(&text) {
            if len > MAX_FN {
                let e = fns.entry((rel.clone(), name)).or_default();
                *e = (*e).max(len);
            }
        }
    }
    let mut bad = Vec::new();
    for ((file, name), len) in &fns {
        match LONG_FNS.iter().find(|(f, n, _)| f == file && n == name) {
            None => bad.push(format!(
                "src/{file}: fn {name} is {len} lines (at most {MAX_FN}: split it into named steps)"
            )),
            Some((_, _, was)) if len > was => bad.push(format!(
                "src/{file}: fn {name} grew to {len} lines (listed at {was}; at most {MAX_FN})"
            )),
            _ => {}
        }
    }
    for (file, name, was) in LONG_FNS {
        if !fns.contains_key(&(file.to_string(), name.to_string())) {
            bad.push(format!(
                "src/{file}: fn {name} (listed at {was} lines) is now within {MAX_FN} lines or gone: remove its LONG_FNS entry"
            ));
        }
    }
    for (file, n) in &long_files {
        match LONG_FILES.iter().find(|(f, _)| f == file) {
            None => bad.push(format!(
                "src/{file} is {n} lines (at most {MAX_FILE}: split it by concern)"
            )),
            Some((_, was)) if n > was => {
                bad.push(format!("src/{file} grew to {n} lines (listed at {was})"))
            }
            _ => {}
        }
    }
    for (file, was) in LONG_FILES {
        if !long_files.contains_key(*file) {
            bad.push(format!(
                "src/{file} (listed at {was} lines) is now within {MAX_FILE} lines or gone: remove its LONG_FILES entry"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
