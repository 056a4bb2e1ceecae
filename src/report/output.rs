//! Where reports go: every output path is checked before the run (a bad one fails in a second, not
//! after an hour of layers), and `-` means stdout for every format (at most one of them).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Stdout,
    File(PathBuf),
}

impl Target {
    pub fn write(&self, contents: &str) -> Result<()> {
        match self {
            Target::Stdout => {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                out.write_all(contents.as_bytes())
                    .and_then(|_| out.flush())
                    .map_err(|e| Error::io("cannot write to stdout", e))
            }
            Target::File(p) => super::write_file(p, contents),
        }
    }
}

/// A directory that exists is probed by creating (and removing) a file in it: permissions alone do not
/// tell (read-only mounts, ACLs).
fn probe_dir(flag: &str, dir: &Path) -> Result<()> {
    let probe = dir.join(format!(".mla-diff-probe-{}", std::process::id()));
    std::fs::File::create(&probe)
        .map_err(|e| Error::io(format!("{flag}: cannot write into {}", dir.display()), e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Check that `path` can be written as a file: not a directory, its directory exists and is writable.
pub fn file_target(flag: &str, path: &Path) -> Result<Target> {
    if path.as_os_str() == "-" {
        return Ok(Target::Stdout);
    }
    if path.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: is a directory (give a file name)",
            path.display()
        )));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: directory {} does not exist",
            path.display(),
            parent.display()
        )));
    }
    if path.exists() {
        // Opening for append changes nothing in an existing file.
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::io(format!("{flag}: cannot write {}", path.display()), e))?;
    } else {
        probe_dir(flag, parent)?;
    }
    Ok(Target::File(path.to_path_buf()))
}

/// Check that `dir` is, or can be created as, a writable directory (nothing is created).
pub fn dir_target(flag: &str, dir: &Path) -> Result<()> {
    let mut existing = dir;
    while !existing.exists() {
        existing = match existing.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
    }
    if !existing.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {}: {} is not a directory",
            dir.display(),
            existing.display()
        )));
    }
    probe_dir(flag, existing)
}

/// Check a set of `(flag, path)` file outputs together: each one, at most one `-`, no path twice.
pub fn file_targets(outputs: &[(&str, Option<&Path>)]) -> Result<Vec<Option<Target>>> {
    let mut seen: Vec<(&str, &Path)> = Vec::new();
    let mut stdout: Option<&str> = None;
    let mut out = Vec::new();
    for &(flag, path) in outputs {
        let Some(p) = path else {
            out.push(None);
            continue;
        };
        let t = file_target(flag, p)?;
        if t == Target::Stdout {
            if let Some(other) = stdout {
                return Err(Error::Usage(format!(
                    "{other} and {flag} both ask for stdout (-): only one output can go there"
                )));
            }
            stdout = Some(flag);
        } else if let Some((other, _)) = seen.iter().find(|(_, q)| *q == p) {
            return Err(Error::Usage(format!(
                "{other} and {flag} both write {}",
                p.display()
            )));
        } else {
            seen.push((flag, p));
        }
        out.push(Some(t));
    }
    Ok(out)
}
