//! The runner backend's own state: the page notice comes from its options, not from a process-wide
//! record of the last page choice.

use super::protocol::{self, Describe, InProcess};
use super::tensors::{Named, Outputs};
use super::RunnerBackend;
use crate::backend::cpu::CpuMirror;
use crate::backend::Backend;
use crate::error::Result;
use crate::precision::Dtype;

struct Pages64;

fn describe_64() -> Describe {
    serde_json::from_value(serde_json::json!({
        "protocol": 1, "name": "pages64", "version": "0",
        "ops": {"decode": {"outputs": ["attn_latent", "lse"]}},
        "supports": {"page_sizes": [64]}, "conventions": {}
    }))
    .unwrap()
}

impl InProcess for Pages64 {
    fn describe(&mut self) -> Result<Describe> {
        Ok(describe_64())
    }
    fn call(
        &mut self,
        _op: &str,
        _layer: usize,
        _meta: &serde_json::Value,
        _inputs: &[Named],
    ) -> Result<std::result::Result<Outputs, String>> {
        Ok(Err("not called".into()))
    }
}

fn notices(name: &str, page_moved: Option<(usize, usize)>) -> Vec<String> {
    protocol::register_in_process(name, Box::new(Pages64));
    let inner = Box::new(CpuMirror::new(Dtype::Bf16));
    let cmd = format!("{}{name}", protocol::IN_PROCESS);
    let mut b = RunnerBackend::open(&cmd, inner, Dtype::Bf16, page_moved).unwrap();
    // As after a reply (a backend that ran nothing says nothing).
    b.out_dtypes.insert("attn_latent".into(), "bf16");
    b.notices()
}

#[test]
fn page_notice_is_the_backends_own() {
    // Another run's page choice (a move) leaves this backend's notices alone.
    assert_eq!(protocol::page_for(&describe_64(), 16), 64);
    let page = |v: &[String]| v.iter().any(|n| n.starts_with("page size "));
    assert!(!page(&notices("pages64_unmoved", None)));
    let moved = notices("pages64_moved", Some((16, 64)));
    assert!(
        moved.iter().any(|n| n.starts_with(
            "page size 64: runner pages64 does not take the schedule's page 16 (its supports.page_sizes: [64])"
        )),
        "{moved:?}"
    );
}
