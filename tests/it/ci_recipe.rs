//! The CI recipe in docs/ci/mla-diff-gate.yml, run locally: its shell steps, taken from the workflow
//! file itself, against a shipped fixture with the built binary (write a baseline, gate a clean run,
//! gate a run with a planted bug, gate against a baseline of another problem). And the docs' links:
//! every relative link in the READMEs and docs/ resolves, and nothing points outside the repository.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const WORKFLOW: &str = "docs/ci/mla-diff-gate.yml";
/// The workflow's steps that run shell code, all of which this file runs.
const RUN_STEPS: [&str; 3] = [
    "Install mla-diff",
    "Write a new baseline",
    "Gate against the baseline",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn workflow() -> String {
    std::fs::read_to_string(repo().join(WORKFLOW)).unwrap()
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The top-level `env:` block: `KEY: value` lines, comments and quotes removed.
fn workflow_env(text: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut lines = text.lines().skip_while(|l| *l != "env:").skip(1);
    for line in lines.by_ref() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        if indent(line) == 0 {
            break;
        }
        let (k, v) = line.trim().split_once(':').expect("KEY: value");
        let v = v.split(" #").next().unwrap().trim().trim_matches('"');
        env.insert(k.to_string(), v.to_string());
    }
    env
}

/// Names of the steps that have a `run:` block, in order.
fn run_step_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut current = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(n) = t.strip_prefix("- name: ") {
            current = Some(n.to_string());
        } else if t.starts_with("- ") {
            current = None;
        } else if t == "run: |" {
            names.extend(current.take());
        }
    }
    names
}

/// The `run: |` block of the step named `name`, dedented.
fn run_block(text: &str, name: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim_start() == format!("- name: {name}"))
        .unwrap_or_else(|| panic!("no step {name:?} in {WORKFLOW}"));
    let step_indent = indent(lines[start]);
    let run = (start + 1..lines.len())
        .take_while(|&i| lines[i].trim().is_empty() || indent(lines[i]) > step_indent)
        .find(|&i| lines[i].trim() == "run: |")
        .unwrap_or_else(|| panic!("step {name:?} has no `run: |` block"));
    let key_indent = indent(lines[run]);
    let body: Vec<&str> = lines[run + 1..]
        .iter()
        .take_while(|l| l.trim().is_empty() || indent(l) > key_indent)
        .copied()
        .collect();
    let strip = body
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| indent(l))
        .min()
        .unwrap();
    body.iter()
        .map(|l| l.get(strip..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// A checkout of "your repository": the workflow's environment, the shipped fixture as MODEL, the
/// built mla-diff first on PATH, and a job-summary file.
struct Job {
    dir: tempfile::TempDir,
    env: BTreeMap<String, String>,
}

impl Job {
    fn new() -> Job {
        let dir = tempfile::tempdir().unwrap();
        let mut env = workflow_env(&workflow());
        for key in ["MODEL", "BASELINE", "REPORTS", "MLA_DIFF_ARGS"] {
            assert!(env.contains_key(key), "{WORKFLOW} sets no {key}");
        }
        let model = repo().join("fixtures/deepseek-v3-yarn-q4_k.gguf");
        env.insert("MODEL".into(), model.display().to_string());
        let bin = Path::new(env!("CARGO_BIN_EXE_mla-diff")).parent().unwrap();
        let path = std::env::var("PATH").unwrap_or_default();
        env.insert("PATH".into(), format!("{}:{path}", bin.display()));
        let summary = dir.path().join("step_summary.md");
        env.insert("GITHUB_STEP_SUMMARY".into(), summary.display().to_string());
        Job { dir, env }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn reports(&self, file: &str) -> PathBuf {
        self.path(&self.env["REPORTS"]).join(file)
    }

    fn summary(&self) -> String {
        std::fs::read_to_string(&self.env["GITHUB_STEP_SUMMARY"]).unwrap_or_default()
    }

    /// Run one step's shell block as GitHub's `shell: bash` does; its exit code and stderr.
    fn step(&self, name: &str, args: &str) -> (i32, String) {
        let script = self.path("step.sh");
        std::fs::write(&script, run_block(&workflow(), name)).unwrap();
        let out = Command::new("bash")
            .args(["--noprofile", "--norc", "-eo", "pipefail"])
            .arg(&script)
            .current_dir(self.dir.path())
            .env_clear()
            .envs(&self.env)
            .env("MLA_DIFF_ARGS", args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code().expect("exit code"), stderr)
    }
}

fn junit_failures(path: &Path) -> usize {
    let xml = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "testsuites");
    assert!(
        doc.descendants()
            .any(|n| n.has_tag_name("testcase") && n.attribute("name") == Some("baseline gate")),
        "no baseline test case in {}",
        path.display()
    );
    root.attribute("failures").unwrap().parse().unwrap()
}

#[test]
fn every_shell_step_of_the_workflow_is_run_here() {
    assert_eq!(run_step_names(&workflow()), RUN_STEPS);
}

#[test]
fn workflow_publishes_what_the_gate_writes() {
    let w = workflow();
    let gate = run_block(&w, "Gate against the baseline");
    for flag in [
        "--baseline \"$BASELINE\"",
        "--junit \"$REPORTS/junit.xml\"",
        "--markdown \"$REPORTS/summary.md\"",
        "--json \"$REPORTS/report.json\"",
        ">> \"$GITHUB_STEP_SUMMARY\"",
    ] {
        assert!(gate.contains(flag), "the gate step lacks {flag}");
    }
    for published in [
        "path: ${{ env.REPORTS }}/junit.xml",
        "reporter: java-junit",
        "path: ${{ env.REPORTS }}/",
        "uses: actions/upload-artifact@",
        "uses: dorny/test-reporter@",
    ] {
        assert!(w.contains(published), "{WORKFLOW} lacks {published:?}");
    }
}

#[test]
fn gate_recipe_on_a_shipped_fixture() {
    let job = Job::new();

    // mla-diff is on PATH, so the install step only prints its version.
    let (rc, err) = job.step("Install mla-diff", "");
    assert_eq!(rc, 0, "{err}");

    // The baseline, as a person writes it once and commits it.
    let (rc, err) = job.step("Write a new baseline", "");
    assert_eq!(rc, 0, "{err}");
    let written = job.reports("baseline.json");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&written).unwrap()).unwrap();
    assert_eq!(base["schema_version"], 1);
    let committed = job.path(&job.env["BASELINE"]);
    std::fs::create_dir_all(committed.parent().unwrap()).unwrap();
    std::fs::copy(&written, &committed).unwrap();

    // A clean run passes the gate, writes every report and appends the summary.
    let (rc, err) = job.step("Gate against the baseline", "");
    assert_eq!(rc, 0, "clean run: {err}");
    assert_eq!(junit_failures(&job.reports("junit.xml")), 0);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(job.reports("report.json")).unwrap())
            .unwrap();
    assert_eq!(report["verdict"]["pass"], true);
    assert_eq!(report["baseline"]["pass"], true);
    assert!(job.reports("heatmap.svg").exists());
    let clean_md = std::fs::read_to_string(job.reports("summary.md")).unwrap();
    assert!(clean_md.contains("✅"), "{clean_md}");
    assert_eq!(job.summary(), clean_md);

    // A planted bug (the kv_b split read the wrong way round) fails the step with exit 1, and the
    // summary of the failing run is appended all the same.
    let (rc, err) = job.step("Gate against the baseline", "--inject kv_b_swap");
    assert_eq!(rc, 1, "planted bug: {err}");
    assert!(junit_failures(&job.reports("junit.xml")) > 0);
    let bad_md = std::fs::read_to_string(job.reports("summary.md")).unwrap();
    assert!(
        bad_md.contains("❌") && bad_md.contains("BASELINE REGRESSION"),
        "{bad_md}"
    );
    assert_eq!(job.summary(), format!("{clean_md}{bad_md}"));

    // A baseline of another problem (here another dtype) is refused: exit 2 with one error line, no
    // stale report left behind, and the summary says why there is none.
    let (rc, err) = job.step("Gate against the baseline", "--dtype f32");
    assert_eq!(rc, 2, "mismatched baseline: {err}");
    assert!(err.starts_with("mla-diff: error: --baseline"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    for f in ["junit.xml", "summary.md", "report.json"] {
        assert!(!job.reports(f).exists(), "stale {f}");
    }
    assert!(job
        .summary()
        .ends_with("mla-diff exited 2 before writing a report (see the error above)\n"));
}

/// Markdown files whose links must resolve and stay inside the repository.
fn doc_files() -> Vec<PathBuf> {
    let mut v = vec![
        repo().join("README.md"),
        repo().join("fixtures/README.md"),
        repo().join("fixtures/golden/README.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    v.extend(docs);
    v
}

/// Targets of inline Markdown links `[text](target)` outside code spans and fences.
fn link_targets(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans: `[x](y)` inside backticks is not a link.
        let text: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            out.push(rest[..end].trim().to_string());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn relative_links_in_the_docs_resolve() {
    let mut bad = Vec::new();
    let mut checked = 0;
    for file in doc_files() {
        let md = std::fs::read_to_string(&file).unwrap();
        for target in link_targets(&md) {
            if target.contains("://") || target.starts_with("mailto:") || target.starts_with('#') {
                continue;
            }
            let path = target.split('#').next().unwrap();
            checked += 1;
            let resolved = file.parent().unwrap().join(path);
            let inside = resolved
                .canonicalize()
                .is_ok_and(|p| p.starts_with(repo().canonicalize().unwrap()));
            if !inside {
                bad.push(format!("{}: {target}", file.display()));
            }
        }
    }
    assert!(checked >= 10, "only {checked} relative links found");
    assert!(
        bad.is_empty(),
        "links to nothing in the repository:\n{}",
        bad.join("\n")
    );
}

#[test]
fn link_targets_are_found_outside_code_only() {
    let md = "see [a](docs/a.md) and `[b](b.md)`\n```\n[c](c.md)\n```\n[d](https://x.org/d)";
    assert_eq!(link_targets(md), ["docs/a.md", "https://x.org/d"]);
}

#[test]
fn docs_point_only_inside_the_repository() {
    let mut files = doc_files();
    files.push(repo().join(WORKFLOW));
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for needle in ["§", "shared/reference", "../shared", "/work/"] {
            assert!(
                !text.contains(needle),
                "{} refers to {needle:?}, which is not in the repository",
                file.display()
            );
        }
    }
}
