//! The recipes in deploy/, run locally: the Slurm job array's scripts and the Kubernetes Indexed Job's
//! container commands (taken from the files themselves) run as one process per shard with the index
//! the scheduler would set, then their merge step; the merged reports must be byte-identical to one
//! whole run's, and the recipes' shard counts must agree with their array and job sizes.

use super::common;
use super::shard::{five_layers, ARGS};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn text(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap()
}

fn indent(l: &str) -> usize {
    l.len() - l.trim_start().len()
}

/// The script of a Kubernetes container: the `- |` block under `args:`, dedented.
fn k8s_script(yaml: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim() == "args:")
        .expect("a container with args:");
    assert_eq!(lines[at + 1].trim(), "- |", "args: is one block scalar");
    let key = indent(lines[at + 1]);
    let body: Vec<&str> = lines[at + 2..]
        .iter()
        .take_while(|l| l.trim().is_empty() || indent(l) > key)
        .copied()
        .collect();
    let strip = body.iter().map(|l| indent(l)).min().unwrap();
    body.iter()
        .map(|l| &l[strip.min(l.len())..])
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// `- name: K` / `value: "V"` pairs of a container's env.
fn k8s_env(yaml: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut name = None;
    for l in yaml.lines().map(str::trim) {
        if let Some(n) = l.strip_prefix("- name: ") {
            name = Some(n.to_string());
        } else if let (Some(v), Some(n)) = (l.strip_prefix("value: "), name.take()) {
            env.insert(n, v.trim_matches('"').to_string());
        }
    }
    env
}

/// The number after `key:` (a YAML scalar, comment allowed).
fn k8s_number(yaml: &str, key: &str) -> usize {
    let l = yaml
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key}"));
    let v = l
        .split_once(':')
        .unwrap()
        .1
        .split('#')
        .next()
        .unwrap()
        .trim();
    v.parse().unwrap()
}

/// The environment of a job: the built mla-diff first on PATH, the model, the reports directory, the
/// run options.
fn job_env(model: &Path, reports: &Path) -> Vec<(String, String)> {
    let bin = Path::new(env!("CARGO_BIN_EXE_mla-diff")).parent().unwrap();
    let path = std::env::var("PATH").unwrap_or_default();
    vec![
        ("PATH".into(), format!("{}:{path}", bin.display())),
        ("MODEL".into(), model.display().to_string()),
        ("REPORTS".into(), reports.display().to_string()),
        ("MLA_DIFF_ARGS".into(), ARGS.join(" ")),
    ]
}

fn bash(script: &str, dir: &Path, env: &[(String, String)]) -> Command {
    let mut c = Command::new("bash");
    c.arg("-c")
        .arg(script)
        .current_dir(dir)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)));
    c
}

/// One whole run's reports with the recipe's options, in `dir`.
fn whole(model: &Path, dir: &Path) -> [String; 3] {
    let names = ["whole.json", "whole.xml", "whole.md"].map(|n| dir.join(n));
    let mut a = vec!["run", model.to_str().unwrap(), "-q"];
    a.extend_from_slice(&ARGS);
    a.extend_from_slice(&["--json", names[0].to_str().unwrap()]);
    a.extend_from_slice(&["--junit", names[1].to_str().unwrap()]);
    a.extend_from_slice(&["--markdown", names[2].to_str().unwrap()]);
    let o = common::run(&a);
    assert_eq!(o.status.code(), Some(0), "{}", common::stderr(&o));
    names.map(|p| std::fs::read_to_string(p).unwrap())
}

fn merged(reports: &Path) -> [String; 3] {
    ["report.json", "junit.xml", "summary.md"]
        .map(|n| std::fs::read_to_string(reports.join(n)).unwrap())
}

#[test]
fn slurm_array_and_merge_give_the_whole_run() {
    let sbatch = text("deploy/slurm/shard.sbatch");
    // The array's size and SHARDS agree.
    assert!(sbatch.contains("#SBATCH --array=0-3"), "array 0-3");
    assert!(sbatch.contains("SHARDS=${SHARDS:-4}"), "SHARDS default 4");
    let shards = 4;
    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    let reports = dir.path().join("reports");
    let env = job_env(&model, &reports);
    // Every array task at once, as Slurm starts them, each with its SLURM_ARRAY_TASK_ID.
    shards_then_merge(
        (&sbatch, "SLURM_ARRAY_TASK_ID", shards),
        &text("deploy/slurm/merge.sbatch"),
        (dir.path(), &env),
    );
    assert!(
        whole(&model, dir.path()) == merged(&reports),
        "merged ≠ whole run"
    );
    // submit.sh queues the array of SHARDS tasks and the merge after it.
    let submit = text("deploy/slurm/submit.sh");
    assert!(
        submit.contains("--array=0-$((SHARDS - 1))") && submit.contains("--dependency=afterok")
    );
}

/// Run `n` shard tasks at once (each with its index in `index_var`), as the scheduler starts them;
/// then the merge script, which must exit 0.
fn shards_then_merge(
    (script, index_var, n): (&str, &str, usize),
    merge: &str,
    (dir, env): (&Path, &[(String, String)]),
) {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            bash(script, dir, env)
                .env(index_var, i.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut t in tasks {
        assert!(t.wait().unwrap().success());
    }
    let m = bash(merge, dir, env).output().unwrap();
    assert_eq!(m.status.code(), Some(0), "{}", common::stderr(&m));
}

#[test]
fn kubernetes_indexed_job_and_merge_give_the_whole_run() {
    let shards_yaml = text("deploy/k8s/shards.yaml");
    let env_yaml = k8s_env(&shards_yaml);
    let shards: usize = env_yaml["SHARDS"].parse().unwrap();
    assert_eq!(k8s_number(&shards_yaml, "completions"), shards);
    assert_eq!(k8s_number(&shards_yaml, "parallelism"), shards);
    assert!(shards_yaml.contains("completionMode: Indexed"));
    let merge_yaml = text("deploy/k8s/merge.yaml");
    assert_eq!(k8s_env(&merge_yaml)["REPORTS"], env_yaml["REPORTS"]);

    let dir = tempfile::tempdir().unwrap();
    let model = five_layers(dir.path());
    let reports = dir.path().join("reports");
    let mut env = job_env(&model, &reports);
    env.push(("SHARDS".into(), shards.to_string()));
    let script = k8s_script(&shards_yaml);
    shards_then_merge(
        (&script, "JOB_COMPLETION_INDEX", shards),
        &k8s_script(&merge_yaml),
        (dir.path(), &env),
    );
    assert!(
        whole(&model, dir.path()) == merged(&reports),
        "merged ≠ whole run"
    );

    // A missing pod's report: the merge step fails with exit 2, naming it.
    std::fs::remove_file(reports.join("shard-2.json")).unwrap();
    let m = bash(&k8s_script(&merge_yaml), dir.path(), &env)
        .output()
        .unwrap();
    common::assert_clean_error(&m, &format!("missing shards: 2/{shards}"));
}
