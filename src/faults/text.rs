//! The catalogue as text: `mla-diff selftest --list`, and the Markdown of `docs/faults.md`.

use super::{Info, CATALOGUE};
use std::fmt::Write;

fn needs(i: &Info) -> String {
    let v: Vec<&str> = i.needs.iter().map(|n| n.name()).collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(", ")
    }
}

/// `mla-diff selftest --list`: every fault with its define, expected stage, needs, sources and CUDA site.
pub fn list_text() -> String {
    let mut s = String::new();
    for i in &CATALOGUE {
        let sources = if i.sources.is_empty() {
            "-".to_string()
        } else {
            i.sources.join(", ")
        };
        writeln!(s, "{}  ({})", i.name, i.define).unwrap();
        writeln!(s, "    {}", i.summary).unwrap();
        writeln!(s, "    expected first failure: {}", i.expected).unwrap();
        writeln!(s, "    needs: {}", needs(i)).unwrap();
        writeln!(s, "    models: {}", i.models).unwrap();
        writeln!(s, "    sources: {sources}").unwrap();
        writeln!(s, "    cuda: {}", i.cuda_site).unwrap();
    }
    s
}

/// A short label for a GitHub issue or pull-request address: `llama.cpp PR #13137`.
fn source_label(url: &str) -> String {
    let parts: Vec<&str> = url.trim_end_matches('/').split('/').collect();
    match parts.as_slice() {
        [.., _owner, repo, kind, n] if *kind == "pull" || *kind == "issues" => {
            let kind = if *kind == "pull" { "PR" } else { "issue" };
            format!("{repo} {kind} #{n}")
        }
        [.., owner, repo] => format!("{owner}/{repo}"),
        _ => url.to_string(),
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// `docs/faults.md`: the catalogue as Markdown tables.
pub fn markdown() -> String {
    let mut s = String::new();
    s.push_str(
        "<!-- Generated from src/faults/catalogue.rs; do not edit. Regenerate with \
         `MLA_DIFF_BLESS=1 cargo test --release --lib faults::text` (the test fails while they disagree). -->\n\n",
    );
    s.push_str("# The fault catalogue\n\n");
    s.push_str(
        "The bugs `mla-diff selftest` plants in the optimized path (and `mla-diff run --inject NAME[@layer=L]` \
         plants in any run). Each one models a real MLA bug or bug class; the selftest proves the comparator \
         catches it in the injected layer, first at the check named here, on a run that has what it needs.\n\n",
    );
    s.push_str(
        "| fault | what goes wrong | the real bug it models | sources | first check | needs |\n",
    );
    s.push_str("|---|---|---|---|---|---|\n");
    for i in &CATALOGUE {
        let sources: Vec<String> = i
            .sources
            .iter()
            .map(|u| format!("[{}]({u})", source_label(u)))
            .collect();
        writeln!(
            s,
            "| `{}` | {} | {} | {} | `{}` | {} |",
            i.name,
            cell(i.summary),
            cell(i.models),
            if sources.is_empty() {
                "-".into()
            } else {
                sources.join(", ")
            },
            i.expected,
            needs(i)
        )
        .unwrap();
    }
    s.push_str("\nWhere each fault sits in the CUDA backend (switched on by its define):\n\n");
    s.push_str("| define | where it sits in the CUDA backend |\n|---|---|\n");
    for i in &CATALOGUE {
        writeln!(s, "| `{}` | {} |", i.define, cell(i.cuda_site)).unwrap();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/faults.md is the table's Markdown; `MLA_DIFF_BLESS=1` rewrites it.
    #[test]
    fn docs_faults_md_matches_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/faults.md");
        let want = markdown();
        if std::env::var_os("MLA_DIFF_BLESS").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{} differs from the fault table: regenerate it with \
             `MLA_DIFF_BLESS=1 cargo test --release --lib faults::text`",
            path.display()
        );
    }

    #[test]
    fn sources_are_public_addresses() {
        for i in &CATALOGUE {
            for u in i.sources {
                assert!(u.starts_with("https://github.com/"), "{}: {u}", i.name);
                assert_ne!(source_label(u), *u, "{}: {u}", i.name);
            }
            // The repository must not point outside itself.
            for t in [i.summary, i.models, i.cuda_site] {
                assert!(!t.contains('§') && !t.contains("../"), "{}: {t}", i.name);
            }
        }
        assert_eq!(
            source_label("https://github.com/ggml-org/llama.cpp/pull/13137"),
            "llama.cpp PR #13137"
        );
    }

    /// Every file a CUDA site names exists (the sites must follow the code when it moves).
    #[test]
    fn cuda_sites_name_existing_files() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for i in &CATALOGUE {
            for word in i.cuda_site.split([' ', '(', ')', ',', ';', ':', '`']) {
                let is_path = word.starts_with("kernels/") || word.starts_with("src/");
                if is_path
                    && (word.ends_with(".cu") || word.ends_with(".cuh") || word.ends_with(".rs"))
                {
                    assert!(
                        root.join(word).exists(),
                        "{}: {word} does not exist",
                        i.name
                    );
                }
            }
        }
    }
}
