//! The serving runner process (`CMD --serve`): one JSON-line request at a time, its tensors in
//! safetensors files in a scratch directory, each answer awaited within the runner timeout.

use super::protocol::{
    spawn_error, split_command, tail, timeout, Reply, Request, Timing, EXIT_UNSUPPORTED,
};
use super::tensors::{self, Named};
use crate::error::{Error, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};

/// The serving process and its scratch directory.
pub struct Process {
    cmd: String,
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    /// Reply lines, read on a thread so that a silent runner can be timed out.
    replies: Receiver<std::io::Result<String>>,
    stderr: Arc<Mutex<String>>,
    pub scratch: PathBuf,
    keep_scratch: bool,
    next_id: u64,
}

/// One request's files and how it ended ([`Process::request`]).
pub struct Exchange {
    pub outcome: Result<Outcome>,
    pub input: PathBuf,
    pub output: PathBuf,
}

/// How one request ended.
pub enum Outcome {
    /// Done, with the kernel's time when it was asked for.
    Ok(Option<Timing>),
    Unsupported(String),
}

impl Process {
    /// Start `CMD --serve`; tensors go through `scratch` (made here, removed on drop unless `keep`).
    pub fn start(cmd: &str, name: &str, keep: bool) -> Result<Process> {
        let words = split_command(cmd)?;
        let scratch = std::env::temp_dir().join(format!(
            "mla-diff-runner-{}-{}",
            std::process::id(),
            name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        ));
        std::fs::create_dir_all(&scratch)
            .map_err(|e| Error::io(format!("creating {}", scratch.display()), e))?;
        if keep {
            eprintln!(
                "mla-diff: note: MLA_DIFF_KEEP_RUNNER_IO: runner {name}'s requests stay in {} (N.in.safetensors, N.out.safetensors)",
                scratch.display()
            );
        }
        let mut child = Command::new(&words[0])
            .args(&words[1..])
            .arg("--serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| spawn_error(cmd, e))?;
        // Drain stderr on a thread so that a chatty runner never blocks on a full pipe.
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().expect("piped");
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        let (tx, replies) = channel();
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        std::thread::spawn(move || loop {
            let mut line = String::new();
            let r = stdout.read_line(&mut line);
            let end = !matches!(r, Ok(n) if n > 0);
            if tx.send(r.map(|_| line)).is_err() || end {
                break;
            }
        });
        Ok(Process {
            cmd: cmd.to_string(),
            name: name.to_string(),
            stdin: child.stdin.take(),
            replies,
            child,
            stderr,
            scratch,
            keep_scratch: keep,
            next_id: 0,
        })
    }

    fn stderr_tail(&self, n: usize) -> String {
        // Give the drain thread a moment to collect what a dying runner printed last.
        std::thread::sleep(std::time::Duration::from_millis(50));
        self.stderr.lock().map(|s| tail(&s, n)).unwrap_or_default()
    }

    /// The runner stopped answering: unsupported (exit 3) or an error with its stderr.
    fn died(&mut self, what: &str) -> Error {
        let status = self.child.wait().ok();
        let err = self.stderr_tail(12);
        match status.and_then(|s| s.code()) {
            Some(EXIT_UNSUPPORTED) => Error::Unsupported(format!(
                "runner {} cannot take this case: {}",
                self.name,
                tail(&err, 1)
            )),
            _ => Error::Environment(format!(
                "runner {} ({}) {what} ({}): {err}",
                self.name,
                self.cmd,
                status
                    .map(|s| s.to_string())
                    .unwrap_or("unknown status".into())
            )),
        }
    }

    /// Paths of the next request's input and output files.
    pub fn next_paths(&mut self) -> (u64, PathBuf, PathBuf) {
        self.next_id += 1;
        let id = self.next_id;
        (
            id,
            self.scratch.join(format!("{id}.in.safetensors")),
            self.scratch.join(format!("{id}.out.safetensors")),
        )
    }

    /// One request: `inputs` written to the next input file, `op` on them sent, the reply awaited.
    /// The files stay for the caller (the output to read, both to remove or keep).
    pub fn request(
        &mut self,
        op: &str,
        layer: usize,
        inputs: &[Named],
        meta: &serde_json::Value,
    ) -> Result<Exchange> {
        let (id, input, output) = self.next_paths();
        tensors::write(&input, inputs)?;
        let req = Request {
            id,
            op,
            layer,
            input: &input,
            output: &output,
            meta,
        };
        let outcome = self.call(&req);
        Ok(Exchange {
            outcome,
            input,
            output,
        })
    }

    /// Send one request (its input file already written) and wait for the reply.
    pub fn call(&mut self, req: &Request) -> Result<Outcome> {
        let line = serde_json::to_string(req).expect("request serializes");
        let sent = match self.stdin.as_mut() {
            Some(w) => writeln!(w, "{line}").and_then(|_| w.flush()),
            None => Err(std::io::Error::other("stdin closed")),
        };
        if sent.is_err() {
            return Err(self.died("stopped before a request"));
        }
        let reply = match self.replies.recv_timeout(timeout()) {
            Ok(Ok(line)) if !line.is_empty() => line,
            Err(RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(Error::Environment(format!(
                    "runner {} did not answer layer {} {} within {} s (--runner-timeout); killed",
                    self.name,
                    req.layer,
                    req.op,
                    timeout().as_secs()
                )));
            }
            _ => return Err(self.died("exited without replying")),
        };
        let r: Reply = serde_json::from_str(reply.trim()).map_err(|e| {
            Error::Environment(format!(
                "runner {} printed a line that is not a reply ({e}): {} (stdout carries only replies; print logs to stderr)",
                self.name,
                reply.trim()
            ))
        })?;
        if r.id != req.id {
            return Err(Error::Environment(format!(
                "runner {} answered request {} while {} was asked",
                self.name, r.id, req.id
            )));
        }
        match r.status.as_str() {
            "ok" => Ok(Outcome::Ok(r.time_us)),
            "unsupported" => Ok(Outcome::Unsupported(
                r.reason.unwrap_or_else(|| "no reason given".into()),
            )),
            "error" => Err(Error::Environment(format!(
                "runner {} failed on layer {} {}: {} | {}",
                self.name,
                req.layer,
                req.op,
                r.message.unwrap_or_default(),
                self.stderr_tail(8)
            ))),
            other => Err(Error::Environment(format!(
                "runner {} replied status '{other}' (expected ok, unsupported or error)",
                self.name
            ))),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // Closing stdin ends the serve loop; a runner that ignores it is killed.
        drop(self.stdin.take());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        if !self.keep_scratch {
            let _ = std::fs::remove_dir_all(&self.scratch);
        }
    }
}
