//! `mla_diff._native`: the `mla-diff` program as a Python extension (python/mla_diff, docs/pytest.md).
//!
//! Two entry points, both the program's own code (src/cli, included as a module) so that a check made
//! from Python gives exactly the verdict `mla-diff run --runner` gives:
//! - `main(argv)`: the command line, in this process;
//! - `run_inproc(argv, name, runner)`: the same, with `--runner inproc:NAME` answered by the Python
//!   object `runner` through memory (`protocol::InProcess`): no subprocess and no tensor files.

use mla_diff::backend::runner::protocol::{self, Describe, InProcess};
use mla_diff::backend::runner::tensors::{self, Named, Outputs};
use mla_diff::error::{one_line, Error, Result, EXIT_ERROR};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

#[path = "../../../src/cli/mod.rs"]
mod cli;

/// A Python object with `describe_json() -> str` and
/// `call(op, layer, meta_json, inputs) -> dict | str` (inputs and outputs: name -> (dtype, shape, bytes);
/// a str is the reason it declines the request).
struct PyRunner {
    obj: Py<PyAny>,
    name: String,
}

impl PyRunner {
    fn failed(&self, py: Python<'_>, what: &str, e: PyErr) -> Error {
        // The traceback on stderr, one line in the error (the protocol's "error" reply).
        e.print(py);
        Error::Environment(format!("runner {} failed {what}: {e}", self.name))
    }
}

impl InProcess for PyRunner {
    fn describe(&mut self) -> Result<Describe> {
        Python::attach(|py| {
            let s: String = self
                .obj
                .bind(py)
                .call_method0("describe_json")
                .and_then(|v| v.extract())
                .map_err(|e| self.failed(py, "to describe itself", e))?;
            serde_json::from_str(&s).map_err(|e| {
                Error::Usage(format!(
                    "runner {} did not give a valid description: {e}",
                    self.name
                ))
            })
        })
    }

    fn call(
        &mut self,
        op: &str,
        layer: usize,
        meta: &serde_json::Value,
        inputs: &[Named],
    ) -> Result<std::result::Result<Outputs, String>> {
        Python::attach(|py| {
            let what = format!("on layer {layer} {op}");
            let answer = (|| -> PyResult<std::result::Result<Vec<_>, String>> {
                let d = PyDict::new(py);
                for t in inputs {
                    d.set_item(
                        t.name,
                        (
                            tensors::wire_name(t.dtype),
                            t.shape.clone(),
                            PyBytes::new(py, &t.bytes),
                        ),
                    )?;
                }
                let r = self
                    .obj
                    .bind(py)
                    .call_method1("call", (op, layer, meta.to_string(), d))?;
                if let Ok(reason) = r.extract::<String>() {
                    return Ok(Err(reason));
                }
                let mut raw = Vec::new();
                for (k, v) in r.cast::<PyDict>()?.iter() {
                    let name: String = k.extract()?;
                    let (dt, shape, bytes): (String, Vec<usize>, Vec<u8>) = v.extract()?;
                    raw.push((name, dt, shape, bytes));
                }
                Ok(Ok(raw))
            })()
            .map_err(|e| self.failed(py, &what, e))?;
            let raw = match answer {
                Ok(r) => r,
                Err(reason) => return Ok(Err(reason)),
            };
            let mut parsed = Vec::new();
            for (name, dt, shape, bytes) in &raw {
                let st = tensors::wire_parse(dt).ok_or_else(|| {
                    Error::Environment(format!(
                        "runner {}: output {name} has dtype {dt}; outputs are BF16, F16, F32 or F64",
                        self.name
                    ))
                })?;
                parsed.push((name.clone(), st, shape.clone(), bytes.as_slice()));
            }
            Outputs::from_raw(parsed, &self.name)
                .map(Ok)
                .map_err(|m| Error::Environment(format!("runner {}: {m}", self.name)))
        })
    }
}

/// The command line as src/main.rs runs it, without leaving the process: (exit code, the error line).
fn run_cli(argv: Vec<String>, print: bool) -> (i32, String) {
    use clap::Parser;
    let c = match cli::Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_ERROR } else { 0 };
            if print {
                let _ = e.print();
            }
            return (code, e.to_string());
        }
    };
    match cli::exec(c) {
        Ok(code) => (code, String::new()),
        Err(e) => {
            let m = format!("mla-diff: error: {}", one_line(&e.to_string()));
            if print {
                eprintln!("{m}");
            }
            (EXIT_ERROR, m)
        }
    }
}

/// `mla-diff ARGV…` in this process; returns the exit code (errors printed as the program prints them).
#[pyfunction]
fn main(argv: Vec<String>) -> i32 {
    run_cli(argv, true).0
}

/// `mla-diff ARGV…` with `--runner inproc:NAME` answered by `runner`; returns (exit code, error line).
#[pyfunction]
fn run_inproc(argv: Vec<String>, name: String, runner: Py<PyAny>) -> (i32, String) {
    protocol::register_in_process(
        &name,
        Box::new(PyRunner {
            obj: runner,
            name: name.clone(),
        }),
    );
    let r = run_cli(argv, false);
    // A run that stopped before opening the runner leaves it registered: drop it.
    drop(protocol::take_in_process(&format!(
        "{}{name}",
        protocol::IN_PROCESS
    )));
    r
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(run_inproc, m)?)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
