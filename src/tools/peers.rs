//! `mla-diff bench decode|prefill|table --peers …`: other projects' kernels, run through their runners
//! (docs/runners.md) on the very inputs our kernels were timed on — the same queries, the same paged
//! cache and block table, read back from the device — timed by the runner with CUDA events (`meta.bench`),
//! their outputs checked against our scalar kernel and our fastest tile.

use crate::backend::runner::protocol::{self, Describe, Outcome, Process, Timing};
use crate::backend::runner::tensors::{Named, Outputs};
use crate::error::{Error, Result};

/// The shipped runners by the names `--peers` takes.
pub const KNOWN: [(&str, &str); 3] = [
    ("flashmla", "runners/flashmla.py"),
    ("vllm-triton", "runners/vllm_triton.py"),
    // Its SDPA kernel: MLA_DIFF_SDPA_BACKEND (flash, efficient, cudnn; default flash).
    ("torch", "runners/torch_sdpa.py"),
];

/// A peer name (`flashmla`, `vllm-triton`) or a runner command line, as a command line. The shipped
/// runners run under `MLA_DIFF_PYTHON` (or `python3`), from the current directory's `runners/`.
pub fn command(peer: &str) -> Result<String> {
    if peer.contains(' ') {
        return Ok(peer.to_string());
    }
    let Some((_, file)) = KNOWN.iter().find(|(n, _)| *n == peer) else {
        return Err(Error::Usage(format!(
            "--peers: unknown peer '{peer}' (known: {}; or give a runner command line with its arguments)",
            KNOWN.map(|(n, _)| n).join(", ")
        )));
    };
    if !std::path::Path::new(file).is_file() {
        return Err(Error::Usage(format!(
            "--peers {peer}: {file} not found (run from the repository root, or give the runner's command line)"
        )));
    }
    let py = std::env::var("MLA_DIFF_PYTHON").unwrap_or_else(|_| "python3".into());
    Ok(format!("{py} {file}"))
}

/// One peer's serving process.
pub struct Peer {
    pub desc: Describe,
    proc: Process,
}

impl Peer {
    pub fn start(peer: &str) -> Result<Peer> {
        let cmd = command(peer)?;
        let desc = protocol::describe(&cmd)?;
        let proc = Process::start(&cmd, &desc.name, false)?;
        Ok(Peer { desc, proc })
    }

    /// Whether it implements `op` (`decode`, `prefill`).
    pub fn has(&self, op: &str) -> bool {
        match op {
            "decode" => self.desc.ops.decode.is_some(),
            "prefill" => self.desc.ops.prefill.is_some(),
            _ => false,
        }
    }

    /// Time the peer's `op` on `inputs` (the runner protocol's tensors of that op); returns its timing
    /// and its output `name` (of `shape`, as f64).
    pub fn time_op(
        &mut self,
        op: &'static str,
        inputs: &[Named],
        meta: &serde_json::Value,
        name: &str,
        shape: &[usize],
    ) -> Result<(Timing, Vec<f64>)> {
        let ex = self.proc.request(op, 0, inputs, meta)?;
        let (outcome, output) = (ex.outcome, ex.output);
        let _ = std::fs::remove_file(&ex.input);
        let timing = match outcome? {
            Outcome::Ok(Some(t)) => t,
            Outcome::Ok(None) => {
                return Err(Error::Environment(format!(
                    "peer {} did not report a time (meta.bench)",
                    self.desc.name
                )))
            }
            Outcome::Unsupported(why) => return Err(Error::Unsupported(why)),
        };
        let mut out = Outputs::read(&output, &self.desc.name)?;
        let _ = std::fs::remove_file(&output);
        Ok((timing, out.take(name, shape, op)?.data))
    }
}
