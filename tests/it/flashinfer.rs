//! `mla-diff flashinfer DIR` on dumps written here in FlashInfer's API-logging layout (as
//! `flashinfer/api_logging.py` writes them at FLASHINFER_LOGLEVEL=10 with FLASHINFER_DUMP_SAFETENSORS=1:
//! one `<time>_pid<pid>_<function>_call<NNNN>/` folder per call with `inputs.safetensors`
//! (`arg_<i>` / `kwarg_<name>`), `outputs.safetensors` (`result` / `result_<i>`) and `metadata.jsonl`,
//! plus `session.jsonl`). No flashinfer here: the calls' outputs are fp64 attention of their inputs,
//! rounded as the kernel returns them, or that with a planted bug.

use crate::common::{assert_clean_error, fixture, run, stderr};
use mla_diff::backend::runner::local;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype as St, TensorView};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const H: usize = 8;
const L: usize = 512;
const R: usize = 64;
const W: usize = L + R;
const PAGE: usize = 16;
const POOL: usize = 12;
const MODEL: &str = "deepseek-v3-yarn-q4_k.gguf";

/// The fixture model's softmax scale (YaRN mscale² included) and mscale.
fn model_scale() -> (f64, f64) {
    let f = mla_diff::gguf::GgufFile::open(fixture(MODEL)).unwrap();
    let c = mla_diff::model::MlaConfig::from_gguf(&f).unwrap();
    assert_eq!((c.n_head, c.kv_lora_rank, c.qk_rope), (H, L, R));
    (c.softmax_scale, c.mscale)
}

/// A tensor argument or a non-tensor one (as `input_metadata` holds it).
enum A {
    T(St, Vec<usize>, Vec<u8>),
    V(Value),
}

fn bf16(v: &[f64]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f64(*x).to_le_bytes())
        .collect()
}
fn f32s(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()
}
fn i32s(v: &[usize]) -> A {
    A::T(
        St::I32,
        vec![v.len()],
        v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
    )
}
fn round_bf16(v: Vec<f64>) -> Vec<f64> {
    v.into_iter()
        .map(|x| half::bf16::from_f64(x).to_f64())
        .collect()
}
fn this(class: &str) -> A {
    A::V(json!({"type": class, "repr": format!("<flashinfer.mla.{class} object>")}))
}

const PLAN_SIG: &str = "(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype, use_profiler: bool = False) -> None";
const RUN_SIG: &str = "(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, return_lse: bool = False, profiler_buffer: Optional[torch.Tensor] = None, kv_len: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None, return_lse_base_on_e: bool = False, o_scale: Optional[float] = None, *, ckv_scale: Optional[float] = None, ckv_scale_arr: Optional[torch.Tensor] = None, kpe_scale: Optional[float] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]";
const DECODE_SIG: &str = "(query: torch.Tensor, kv_cache: torch.Tensor, workspace_buffer: torch.Tensor, qk_nope_head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int, block_tables: torch.Tensor, seq_lens: Optional[torch.Tensor], max_seq_len: int, sparse_mla_top_k: int = 0, out: Optional[torch.Tensor] = None, bmm1_scale: Union[float, torch.Tensor] = 1.0, bmm2_scale: Union[float, torch.Tensor] = 1.0, sinks: Optional[List[torch.Tensor]] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]";

/// Writes call folders as `api_logging.py` does: metadata.jsonl gets the inputs record, then the
/// completed one; session.jsonl gets both.
struct DumpWriter {
    dir: PathBuf,
    seq: HashMap<String, u64>,
    ms: u64,
    pid: u64,
}

impl DumpWriter {
    fn new(dir: &Path) -> DumpWriter {
        std::fs::create_dir_all(dir).unwrap();
        DumpWriter {
            dir: dir.to_path_buf(),
            seq: HashMap::new(),
            ms: 100,
            pid: 4242,
        }
    }

    fn append(path: &Path, v: &Value) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(f, "{v}").unwrap();
    }

    fn save(path: &Path, tensors: &[(String, &St, &Vec<usize>, &Vec<u8>)]) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(**d, (*s).clone(), b).unwrap()))
            .collect();
        safetensors::tensor::serialize_to_file(views, None, path).unwrap();
    }

    /// One call: `args` keyed `arg_<i>` / `kwarg_<name>`; `outputs` keyed `result` / `result_<i>`.
    fn call(
        &mut self,
        function: &str,
        self_id: Option<u64>,
        sig: &str,
        args: Vec<(&str, A)>,
        outputs: Vec<(&str, St, Vec<usize>, Vec<u8>)>,
    ) -> PathBuf {
        let seq = self.seq.entry(function.to_string()).or_insert(0);
        *seq += 1;
        self.ms += 1;
        let ts = format!("20261204_151200_{:03}", self.ms);
        let name = format!("{ts}_pid{}_{function}_call{:04}", self.pid, *seq);
        let d = self.dir.join(&name);
        std::fs::create_dir_all(&d).unwrap();
        let mut meta_in = serde_json::Map::new();
        let mut tensors = Vec::new();
        let mut details = serde_json::Map::new();
        for (k, a) in &args {
            match a {
                A::T(dt, sh, b) => {
                    tensors.push((k.to_string(), dt, sh, b));
                    details.insert(
                        k.to_string(),
                        json!({"shape": sh, "dtype": format!("{dt:?}")}),
                    );
                }
                A::V(v) => {
                    meta_in.insert(k.to_string(), v.clone());
                }
            }
        }
        if !tensors.is_empty() {
            Self::save(&d.join("inputs.safetensors"), &tensors);
        }
        let mut meta = json!({
            "function_name": function,
            "module": "flashinfer.mla._core",
            "call_sequence": *seq,
            "timestamp": ts,
            "process_id": self.pid,
            "input_metadata": meta_in,
            "output_metadata": {},
            "tensor_info": {"input_tensor_keys": tensors.iter().map(|t| t.0.clone()).collect::<Vec<_>>(), "output_tensor_keys": []},
            "tensor_details": details,
            "tensor_format": "safetensors",
            "function_signature": sig,
            "versions": {"torch": "2.9.0", "python": "3.12", "flashinfer": "0.7.2.post1"},
            "execution_status": "inputs_saved",
            "graph_capture": false,
            "dump_dir": format!("flashinfer_dumps/{name}"),
        });
        if let Some(id) = self_id {
            meta["self_id"] = json!(id);
        }
        Self::append(&d.join("metadata.jsonl"), &meta);
        Self::append(&self.dir.join("session.jsonl"), &meta);
        let outs: Vec<(String, &St, &Vec<usize>, &Vec<u8>)> = outputs
            .iter()
            .map(|(k, dt, sh, b)| (k.to_string(), dt, sh, b))
            .collect();
        if !outs.is_empty() {
            Self::save(&d.join("outputs.safetensors"), &outs);
        } else {
            meta["output_metadata"] = json!({"result": null});
        }
        meta["tensor_info"]["output_tensor_keys"] =
            json!(outputs.iter().map(|o| o.0).collect::<Vec<_>>());
        meta["execution_status"] = json!("completed");
        Self::append(&d.join("metadata.jsonl"), &meta);
        Self::append(&self.dir.join("session.jsonl"), &meta);
        d
    }
}

impl DumpWriter {
    /// A call captured in a CUDA graph: its folder and pending record only (no tensors yet).
    fn capture(&mut self, function: &str, self_id: u64, sig: &str) -> PathBuf {
        let seq = self.seq.entry(function.to_string()).or_insert(0);
        *seq += 1;
        self.ms += 1;
        let ts = format!("20261204_151200_{:03}", self.ms);
        let name = format!("{ts}_pid{}_{function}_call{:04}", self.pid, *seq);
        let d = self.dir.join(&name);
        std::fs::create_dir_all(&d).unwrap();
        let meta = json!({
            "function_name": function, "call_sequence": *seq, "timestamp": ts, "process_id": self.pid,
            "self_id": self_id, "input_metadata": {"arg_0": {"type": "BatchMLAPagedAttentionWrapper", "repr": "<…>"}, "kwarg_return_lse": true},
            "tensor_format": "safetensors", "function_signature": sig,
            "execution_status": "graph_capture_pending_flush", "graph_capture": true,
            "dump_dir": format!("flashinfer_dumps/{name}"),
        });
        Self::append(&d.join("metadata.jsonl"), &meta);
        Self::append(&self.dir.join("session.jsonl"), &meta);
        d
    }

    /// Replay `n`'s flush of a captured call: `graph_flushes/flush_<n>/` (and the call folder's
    /// copy of the latest), as `_flush_graph_dumps` writes them.
    fn flush(
        &mut self,
        base: &Path,
        n: u64,
        inputs: Vec<(&str, A)>,
        outputs: Vec<(&str, St, Vec<usize>, Vec<u8>)>,
    ) {
        let snap = base.join("graph_flushes").join(format!("flush_{n:04}"));
        std::fs::create_dir_all(&snap).unwrap();
        let ins: Vec<(String, &St, &Vec<usize>, &Vec<u8>)> = inputs
            .iter()
            .filter_map(|(k, a)| match a {
                A::T(d, s, b) => Some((k.to_string(), d, s, b)),
                A::V(_) => None,
            })
            .collect();
        let outs: Vec<(String, &St, &Vec<usize>, &Vec<u8>)> = outputs
            .iter()
            .map(|(k, d, s, b)| (k.to_string(), d, s, b))
            .collect();
        for dir in [base, &snap] {
            Self::save(&dir.join("inputs.safetensors"), &ins);
            Self::save(&dir.join("outputs.safetensors"), &outs);
        }
        let mut last: Value = serde_json::from_str(
            std::fs::read_to_string(base.join("metadata.jsonl"))
                .unwrap()
                .lines()
                .last()
                .unwrap(),
        )
        .unwrap();
        last["execution_status"] = json!("completed");
        last["graph_capture_flushed"] = json!(true);
        last["graph_capture_flush_index"] = json!(n);
        Self::append(&base.join("metadata.jsonl"), &last);
        Self::append(&self.dir.join("session.jsonl"), &last);
        last["dump_dir"] = json!(format!(
            "flashinfer_dumps/{}/graph_flushes/flush_{n:04}",
            base.file_name().unwrap().to_str().unwrap()
        ));
        Self::append(&snap.join("metadata.jsonl"), &last);
        Self::append(&self.dir.join("session.jsonl"), &last);
    }
}

/// The paged latent cache pool (bf16 values), `[POOL, PAGE, W]` as `[ckv | kpe]` rows.
struct Pool {
    rows: Vec<f64>,
}

impl Pool {
    fn new(seed: u64) -> Pool {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Pool {
            rows: round_bf16(
                (0..POOL * PAGE * W)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect(),
            ),
        }
    }
    fn ckv(&self) -> Vec<f64> {
        self.rows.chunks(W).flat_map(|r| r[..L].to_vec()).collect()
    }
    fn kpe(&self) -> Vec<f64> {
        self.rows.chunks(W).flat_map(|r| r[L..].to_vec()).collect()
    }
}

/// Requests: (query count, keys, pages in the pool).
struct Batch {
    reqs: Vec<(usize, usize, Vec<usize>)>,
    /// `[Nq, H, L]` and `[Nq, H, R]`, bf16 values.
    q_nope: Vec<f64>,
    q_pe: Vec<f64>,
}

impl Batch {
    fn new(seed: u64, reqs: Vec<(usize, usize, Vec<usize>)>) -> Batch {
        let n: usize = reqs.iter().map(|r| r.0).sum();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut gen = |k: usize| round_bf16((0..k).map(|_| rng.random_range(-1.0..1.0)).collect());
        Batch {
            q_nope: gen(n * H * L),
            q_pe: gen(n * H * R),
            reqs,
        }
    }
    fn n(&self) -> usize {
        self.reqs.iter().map(|r| r.0).sum()
    }
    /// fp64 attention, causal within each request's queries; `shift`: every page read one page on
    /// (the planted off-by-one). Out `[Nq, H, L]`, lse natural `[Nq, H]`.
    fn attention(&self, pool: &Pool, scale: f64, shift: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut out, mut lse) = (Vec::new(), Vec::new());
        let mut q0 = 0;
        for (s_q, len, pages) in &self.reqs {
            for i in 0..*s_q {
                let visible = len - s_q + i + 1;
                for h in 0..H {
                    let row = (q0 + i) * H + h;
                    let qa = &self.q_nope[row * L..(row + 1) * L];
                    let qp = &self.q_pe[row * R..(row + 1) * R];
                    let slot = |j: usize| ((pages[j / PAGE] + shift) % POOL) * PAGE + j % PAGE;
                    let key = |j: usize| &pool.rows[slot(j) * W..(slot(j) + 1) * W];
                    let score = |j: usize| {
                        (local::dot(qa, &key(j)[..L]) + local::dot(qp, &key(j)[L..])) * scale
                    };
                    let (o, l) = local::attend(0..visible, L, score, |j| &key(j)[..L]);
                    out.extend(o);
                    lse.push(l);
                }
            }
            q0 += s_q;
        }
        (out, lse)
    }
}

/// A planted bug in one call.
#[derive(Clone, Copy, PartialEq)]
enum Bug {
    None,
    /// The kernel read every page one page on from the table the call holds.
    TableOffByOne,
    /// The LSE returned in natural log where the call asked for log2.
    LseNatural,
}

/// A wrapper's plan over `b`'s requests (positional arguments, as the docs' example calls it).
fn plan(w: &mut DumpWriter, id: u64, b: &Batch, scale: f64) {
    let mut qo = vec![0];
    let mut kvp = vec![0];
    let mut idx = Vec::new();
    let mut lens = Vec::new();
    for (s_q, len, pages) in &b.reqs {
        qo.push(qo.last().unwrap() + s_q);
        idx.extend(pages.iter().copied());
        kvp.push(idx.len());
        lens.push(*len);
    }
    let bf = json!({"type": "torch.dtype", "value": "torch.bfloat16"});
    w.call(
        "BatchMLAPagedAttentionWrapper.plan",
        Some(id),
        PLAN_SIG,
        vec![
            ("arg_0", this("BatchMLAPagedAttentionWrapper")),
            ("arg_1", i32s(&qo)),
            ("arg_2", i32s(&kvp)),
            ("arg_3", i32s(&idx)),
            ("arg_4", i32s(&lens)),
            ("arg_5", A::V(json!(H))),
            ("arg_6", A::V(json!(L))),
            ("arg_7", A::V(json!(R))),
            ("arg_8", A::V(json!(PAGE))),
            ("arg_9", A::V(json!(true))),
            ("arg_10", A::V(json!(scale))),
            ("arg_11", A::V(bf.clone())),
            ("arg_12", A::V(bf)),
        ],
        vec![],
    );
}

/// A wrapper's run of `b` with the LSE (log2, the default), computed at `scale` with `bug`.
fn wrapper_run(
    w: &mut DumpWriter,
    id: u64,
    b: &Batch,
    pool: &Pool,
    scale: f64,
    bug: Bug,
) -> PathBuf {
    let shift = (bug == Bug::TableOffByOne) as usize;
    let (out, lse) = b.attention(pool, scale, shift);
    let k = match bug {
        Bug::LseNatural => 1.0,
        _ => 1.0 / std::f64::consts::LN_2,
    };
    let lse: Vec<f64> = lse.iter().map(|v| v * k).collect();
    let n = b.n();
    w.call(
        "BatchMLAPagedAttentionWrapper.run",
        Some(id),
        RUN_SIG,
        vec![
            ("arg_0", this("BatchMLAPagedAttentionWrapper")),
            ("arg_1", A::T(St::BF16, vec![n, H, L], bf16(&b.q_nope))),
            ("arg_2", A::T(St::BF16, vec![n, H, R], bf16(&b.q_pe))),
            (
                "arg_3",
                A::T(St::BF16, vec![POOL, PAGE, L], bf16(&pool.ckv())),
            ),
            (
                "arg_4",
                A::T(St::BF16, vec![POOL, PAGE, R], bf16(&pool.kpe())),
            ),
            ("kwarg_return_lse", A::V(json!(true))),
        ],
        vec![
            ("result_0", St::BF16, vec![n, H, L], bf16(&out)),
            ("result_1", St::F32, vec![n, H], f32s(&lse)),
        ],
    )
}

/// A trtllm-gen decode of `b` (every request `s_q` queries), 4-D cache, LSE natural log.
fn trtllm(w: &mut DumpWriter, b: &Batch, pool: &Pool, scale: f64, bug: Bug) -> PathBuf {
    let shift = (bug == Bug::TableOffByOne) as usize;
    let (out, lse) = b.attention(pool, scale, shift);
    let s_q = b.reqs[0].0;
    let nb = b.reqs.len();
    let maxp = b.reqs.iter().map(|r| r.2.len()).max().unwrap();
    let mut table = Vec::new();
    for r in &b.reqs {
        table.extend(r.2.iter().copied());
        table.extend(std::iter::repeat_n(0, maxp - r.2.len()));
    }
    let query: Vec<f64> = b
        .q_nope
        .chunks(L)
        .zip(b.q_pe.chunks(R))
        .flat_map(|(a, p)| a.iter().chain(p).copied().collect::<Vec<_>>())
        .collect();
    let lens: Vec<usize> = b.reqs.iter().map(|r| r.1).collect();
    let A::T(_, _, tb) = i32s(&table) else {
        unreachable!()
    };
    w.call(
        "trtllm_batch_decode_with_kv_cache_mla",
        None,
        DECODE_SIG,
        vec![
            ("arg_0", A::T(St::BF16, vec![nb, s_q, H, W], bf16(&query))),
            (
                "arg_1",
                A::T(St::BF16, vec![POOL, 1, PAGE, W], bf16(&pool.rows)),
            ),
            ("arg_2", A::T(St::U8, vec![64], vec![0; 64])),
            ("arg_3", A::V(json!(128))),
            ("arg_4", A::V(json!(L))),
            ("arg_5", A::V(json!(R))),
            ("arg_6", A::T(St::I32, vec![nb, maxp], tb)),
            ("arg_7", i32s(&lens)),
            ("arg_8", A::V(json!(lens.iter().max()))),
            ("kwarg_bmm1_scale", A::V(json!(scale))),
            ("kwarg_bmm2_scale", A::V(json!(1.0))),
            ("kwarg_return_lse", A::V(json!(true))),
        ],
        vec![
            ("result_0", St::BF16, vec![nb, s_q, H, L], bf16(&out)),
            ("result_1", St::F32, vec![nb * s_q, H], f32s(&lse)),
        ],
    )
}

/// A call of another function (skipped).
fn other(w: &mut DumpWriter) {
    w.call(
        "rmsnorm",
        None,
        "(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-06) -> torch.Tensor",
        vec![
            ("arg_0", A::T(St::BF16, vec![2, 4], bf16(&[0.5; 8]))),
            ("arg_1", A::T(St::BF16, vec![4], bf16(&[1.0; 4]))),
        ],
        vec![("result", St::BF16, vec![2, 4], bf16(&[1.0; 8]))],
    );
}

/// Two wrappers (a prefill-like one, causal over 3 queries, and a decode one), interleaved, and two
/// trtllm decodes with 2 queries (MTP); `bugs`: per MLA call in that order (run A, run B, run B
/// again, trtllm 1, trtllm 2).
fn write_dump(dir: &Path, scale: f64, bugs: [Bug; 5]) {
    let mut w = DumpWriter::new(dir);
    let pool = Pool::new(7);
    w.call(
        "BatchMLAPagedAttentionWrapper.__init__",
        Some(0xA),
        "(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False, backend: str = 'auto') -> None",
        vec![("arg_0", this("BatchMLAPagedAttentionWrapper")), ("arg_1", A::T(St::U8, vec![64], vec![0; 64]))],
        vec![],
    );
    let a = Batch::new(1, vec![(3, 37, vec![5, 2, 9]), (1, 5, vec![0])]);
    let b = Batch::new(
        2,
        vec![(1, 20, vec![3, 11]), (1, 16, vec![8]), (1, 1, vec![6])],
    );
    plan(&mut w, 0xA, &a, scale);
    plan(&mut w, 0xB, &b, scale);
    other(&mut w);
    wrapper_run(&mut w, 0xA, &a, &pool, scale, bugs[0]);
    wrapper_run(&mut w, 0xB, &b, &pool, scale, bugs[1]);
    let b2 = Batch::new(3, vec![(1, 33, vec![1, 4, 10]), (1, 2, vec![7])]);
    plan(&mut w, 0xB, &b2, scale);
    wrapper_run(&mut w, 0xB, &b2, &pool, scale, bugs[2]);
    let t = Batch::new(4, vec![(2, 40, vec![9, 0, 3]), (2, 2, vec![11])]);
    trtllm(&mut w, &t, &pool, scale, bugs[3]);
    trtllm(&mut w, &t, &pool, scale, bugs[4]);
}

fn check(dir: &Path, extra: &[&str]) -> (std::process::Output, Value, String) {
    let d = dir.to_str().unwrap();
    let mut a = vec!["flashinfer", d, "--json", "-"];
    a.extend(extra);
    let o = run(&a);
    let j: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    let text = stderr(&o);
    (o, j, text)
}

fn verdicts(j: &Value) -> Vec<(String, u64, String)> {
    j["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["function"].as_str().unwrap().to_string(),
                c["call"].as_u64().unwrap(),
                c["verdict"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

const RUN: &str = "BatchMLAPagedAttentionWrapper.run";
const TRT: &str = "trtllm_batch_decode_with_kv_cache_mla";

#[test]
fn clean_dump_passes_every_call() {
    let t = tempfile::tempdir().unwrap();
    let (scale, _) = model_scale();
    write_dump(t.path(), scale, [Bug::None; 5]);
    let (o, j, text) = check(t.path(), &["--model", fixture(MODEL).to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{text}");
    let v = verdicts(&j);
    assert_eq!(v.len(), 5, "{text}");
    assert!(v.iter().all(|c| c.2 == "pass"), "{v:?}\n{text}");
    assert_eq!(j["plans"], 3);
    assert_eq!(j["skipped"]["rmsnorm"], 1);
    assert_eq!(j["skipped"]["BatchMLAPagedAttentionWrapper.__init__"], 1);
    assert_eq!(j["order"], "session");
    // Run B #3 is paired with B's second plan (#3), not A's or B's first.
    assert!(
        j["calls"][2]["plan"]
            .as_str()
            .unwrap()
            .ends_with("plan_call0003"),
        "{}",
        j["calls"][2]
    );
    assert!(j["calls"][0]["plan"]
        .as_str()
        .unwrap()
        .ends_with("plan_call0001"));
    // One line per call, naming function, call number, shapes and the bound.
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(
        lines[0].starts_with(&format!(
            "{RUN} #1 (pid 4242): 2 requests, q 1–3 × 8 heads × 512+64"
        )),
        "{}",
        lines[0]
    );
    assert!(
        lines[0].contains("PASS") && lines[0].contains("bound"),
        "{}",
        lines[0]
    );
    assert!(lines[5].starts_with("PASS: 5 MLA calls"), "{}", lines[5]);
    // Without the time order of session.jsonl, the folders' timestamps give the same pairing.
    std::fs::remove_file(t.path().join("session.jsonl")).unwrap();
    let (o, j, text) = check(t.path(), &[]);
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert_eq!(j["order"], "timestamps");
    assert!(j["calls"][2]["plan"]
        .as_str()
        .unwrap()
        .ends_with("plan_call0003"));
}

#[test]
fn planted_kernel_bugs_fail_named_by_call() {
    let t = tempfile::tempdir().unwrap();
    let (scale, _) = model_scale();
    write_dump(
        t.path(),
        scale,
        [
            Bug::None,
            Bug::TableOffByOne,
            Bug::LseNatural,
            Bug::None,
            Bug::TableOffByOne,
        ],
    );
    let junit = t.path().join("calls.xml");
    let md = t.path().join("calls.md");
    let (o, j, text) = check(
        t.path(),
        &[
            "--junit",
            junit.to_str().unwrap(),
            "--markdown",
            md.to_str().unwrap(),
        ],
    );
    // The report as a reader sees it (`--nocapture`).
    eprintln!("{text}");
    assert_eq!(o.status.code(), Some(1), "{text}");
    let v = verdicts(&j);
    let want = [
        (RUN, 1, "pass"),
        (RUN, 2, "fail"),
        (RUN, 3, "fail"),
        (TRT, 1, "pass"),
        (TRT, 2, "fail"),
    ];
    for (got, w) in v.iter().zip(want) {
        assert_eq!((got.0.as_str(), got.1, got.2.as_str()), w, "{text}");
    }
    let failing = |i: usize| -> Vec<String> {
        j["calls"][i]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["status"] == "fail")
            .map(|c| c["what"].as_str().unwrap().to_string())
            .collect()
    };
    // The table off by one page changes the output (and the LSE); the natural-log LSE only the LSE.
    assert!(failing(1).contains(&"out".to_string()), "{}", j["calls"][1]);
    assert_eq!(failing(2), ["lse"], "{}", j["calls"][2]);
    assert!(failing(4).contains(&"out".to_string()));
    assert!(
        text.contains(&format!("{RUN} #2 (pid 4242)")) && text.contains("FAIL — out: rel-L2"),
        "{text}"
    );
    assert!(
        text.contains(&format!("{RUN} #3 (pid 4242)"))
            && text.contains("FAIL — lse (base 2, compared as natural log): rel-L2"),
        "{text}"
    );
    assert!(
        text.lines().last().unwrap().starts_with(&format!(
            "FLASHINFER CALL FAILED: 3 of 5 MLA calls (first: {RUN} #2"
        )),
        "{text}"
    );
    let x = std::fs::read_to_string(&junit).unwrap();
    let doc = roxmltree::Document::parse(&x).unwrap();
    let failures = doc
        .descendants()
        .filter(|n| n.has_tag_name("failure"))
        .count();
    assert_eq!(failures, 3, "{x}");
    let m = std::fs::read_to_string(&md).unwrap();
    assert!(
        m.contains("FLASHINFER CALL FAILED")
            && m.contains("| 2 | `BatchMLAPagedAttentionWrapper.run` |"),
        "{m}"
    );
}

#[test]
fn scale_without_mscale_squared_fails_against_the_model() {
    let t = tempfile::tempdir().unwrap();
    let (scale, mscale) = model_scale();
    assert!(mscale > 1.2, "the fixture has YaRN's mscale");
    // The engine hands the kernel the scale without mscale²; the kernel computes with it faithfully.
    write_dump(t.path(), scale / (mscale * mscale), [Bug::None; 5]);
    let (o, _, text) = check(t.path(), &[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "a kernel-level check alone cannot see it: {text}"
    );
    let (o, j, text) = check(t.path(), &["--model", fixture(MODEL).to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(verdicts(&j).iter().all(|c| c.2 == "fail"), "{text}");
    let c = &j["calls"][0]["checks"];
    let s = c
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["what"] == "softmax_scale")
        .unwrap();
    assert_eq!(s["status"], "fail");
    assert!(
        s["detail"]
            .as_str()
            .unwrap()
            .contains("YaRN's mscale² left out"),
        "{s}"
    );
    assert!(
        text.contains(&format!("{RUN} #1 (pid 4242)"))
            && text.contains("FAIL — softmax_scale: the call's 0.07"),
        "{text}"
    );
}

#[test]
fn bad_dumps_exit_2_with_one_line() {
    let t = tempfile::tempdir().unwrap();
    let (scale, _) = model_scale();
    // Not a dump.
    let empty = t.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert_clean_error(
        &run(&["flashinfer", empty.to_str().unwrap()]),
        "is not a FlashInfer API-logging dump",
    );
    // A run whose plan is not in the dump.
    let noplan = t.path().join("noplan");
    let mut w = DumpWriter::new(&noplan);
    let pool = Pool::new(7);
    let b = Batch::new(2, vec![(1, 20, vec![3, 11])]);
    wrapper_run(&mut w, 0xB, &b, &pool, scale, Bug::None);
    assert_clean_error(
        &run(&["flashinfer", noplan.to_str().unwrap()]),
        "has no BatchMLAPagedAttentionWrapper.plan of the same wrapper before it",
    );
    // A run missing a tensor.
    let missing = t.path().join("missing");
    write_dump(&missing, scale, [Bug::None; 5]);
    let run_dir = std::fs::read_dir(&missing)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_str().unwrap().ends_with("run_call0002"))
        .unwrap();
    let f = run_dir.join("inputs.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let keep: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "arg_2")
        .collect();
    safetensors::tensor::serialize_to_file(keep, None, &f).unwrap();
    assert_clean_error(
        &run(&["flashinfer", missing.to_str().unwrap()]),
        "has no tensor 'q_pe' in inputs.safetensors",
    );
    // A plan whose page table is shorter than its lengths need.
    let short = t.path().join("short");
    let mut w = DumpWriter::new(&short);
    plan(&mut w, 0xB, &Batch::new(2, vec![(1, 20, vec![3])]), scale);
    let b = Batch::new(2, vec![(1, 20, vec![3, 4])]);
    wrapper_run(&mut w, 0xB, &b, &pool, scale, Bug::None);
    assert_clean_error(
        &run(&["flashinfer", short.to_str().unwrap()]),
        "kv_len_arr 20 needs 2 pages of 16",
    );
}

#[test]
fn cuda_graph_replays_pair_with_the_plan_before_each() {
    let t = tempfile::tempdir().unwrap();
    let (scale, _) = model_scale();
    let mut w = DumpWriter::new(t.path());
    let pool = Pool::new(7);
    // The graph is captured once (a pending record, no tensors), then replayed after each plan.
    let b1 = Batch::new(1, vec![(1, 20, vec![3, 11]), (1, 7, vec![2])]);
    let b2 = Batch::new(2, vec![(1, 33, vec![1, 4, 10]), (1, 9, vec![5])]);
    plan(&mut w, 0xC, &b1, scale);
    let base = w.capture("BatchMLAPagedAttentionWrapper.run", 0xC, RUN_SIG);
    for (n, b, bug) in [
        (1, &b1, Bug::None),
        (2, &b2, Bug::None),
        (3, &b2, Bug::TableOffByOne),
    ] {
        if n == 2 {
            plan(&mut w, 0xC, b, scale);
        }
        let (out, lse) = b.attention(&pool, scale, (bug == Bug::TableOffByOne) as usize);
        let lse: Vec<f64> = lse.iter().map(|v| v / std::f64::consts::LN_2).collect();
        let nq = b.n();
        w.flush(
            &base,
            n,
            vec![
                ("arg_1", A::T(St::BF16, vec![nq, H, L], bf16(&b.q_nope))),
                ("arg_2", A::T(St::BF16, vec![nq, H, R], bf16(&b.q_pe))),
                (
                    "arg_3",
                    A::T(St::BF16, vec![POOL, PAGE, L], bf16(&pool.ckv())),
                ),
                (
                    "arg_4",
                    A::T(St::BF16, vec![POOL, PAGE, R], bf16(&pool.kpe())),
                ),
            ],
            vec![
                ("result_0", St::BF16, vec![nq, H, L], bf16(&out)),
                ("result_1", St::F32, vec![nq, H], f32s(&lse)),
            ],
        );
    }
    let (o, j, text) = check(t.path(), &[]);
    assert_eq!(o.status.code(), Some(1), "{text}");
    let calls = j["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 3, "{text}");
    let got: Vec<(u64, &str, &str)> = calls
        .iter()
        .map(|c| {
            (
                c["replay"].as_u64().unwrap(),
                c["plan"].as_str().unwrap(),
                c["verdict"].as_str().unwrap(),
            )
        })
        .collect();
    assert!(
        got[0].1.ends_with("plan_call0001") && got[0].2 == "pass",
        "{got:?}"
    );
    assert!(
        got[1].1.ends_with("plan_call0002") && got[1].2 == "pass",
        "{got:?}"
    );
    assert!(
        got[2].1.ends_with("plan_call0002") && got[2].2 == "fail",
        "{got:?}"
    );
    assert!(
        text.contains(&format!("{RUN} #1 replay 3 (pid 4242)")),
        "{text}"
    );
    // Without session.jsonl, replays cannot be placed among the plans: not checked, and nothing is.
    std::fs::remove_file(t.path().join("session.jsonl")).unwrap();
    assert_clean_error(
        &run(&["flashinfer", t.path().to_str().unwrap()]),
        "no MLA call to check",
    );
}

/// Append a changed copy of a call folder's last metadata record (the reader takes the last).
fn edit_meta(call: &Path, f: impl Fn(&mut Value)) {
    let p = call.join("metadata.jsonl");
    let text = std::fs::read_to_string(&p).unwrap();
    let mut last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    f(&mut last);
    DumpWriter::append(&p, &last);
}

#[test]
fn unmodelled_calls_are_not_checked_and_bad_scalars_exit_2() {
    let t = tempfile::tempdir().unwrap();
    let (scale, _) = model_scale();
    let mut w = DumpWriter::new(t.path());
    let pool = Pool::new(7);
    let b = Batch::new(4, vec![(2, 40, vec![9, 0, 3]), (2, 2, vec![11])]);
    trtllm(&mut w, &b, &pool, scale, Bug::None);
    let sparse = trtllm(&mut w, &b, &pool, scale, Bug::TableOffByOne);
    edit_meta(&sparse, |m| {
        m["input_metadata"]["kwarg_sparse_mla_top_k"] = json!(64)
    });
    let (o, j, text) = check(t.path(), &[]);
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert_eq!(j["calls"][1]["verdict"], "not_checked", "{text}");
    assert!(j["calls"][1]["reason"]
        .as_str()
        .unwrap()
        .contains("sparse MLA"));
    assert!(
        text.lines()
            .last()
            .unwrap()
            .contains("1 MLA calls within the fp64 bound, 1 not checked"),
        "{text}"
    );
    // A plan with page_size 0: one line, no panic.
    let zero = t.path().join("zero");
    let mut w = DumpWriter::new(&zero);
    let b = Batch::new(2, vec![(1, 20, vec![3, 11])]);
    plan(&mut w, 0xB, &b, scale);
    let p = std::fs::read_dir(&zero)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap();
    edit_meta(&p, |m| m["input_metadata"]["arg_8"] = json!(0));
    wrapper_run(&mut w, 0xB, &b, &pool, scale, Bug::None);
    assert_clean_error(&run(&["flashinfer", zero.to_str().unwrap()]), "page_size 0");
}

#[test]
fn trtllm_lse_base_follows_return_lse_base() {
    let t = tempfile::tempdir().unwrap();
    let (scale, _) = model_scale();
    let mut w = DumpWriter::new(t.path());
    let pool = Pool::new(7);
    let b = Batch::new(4, vec![(2, 40, vec![9, 0, 3]), (2, 2, vec![11])]);
    // Both return natural-log LSEs: right when the base is left to the backend, wrong for "base2".
    trtllm(&mut w, &b, &pool, scale, Bug::None);
    let c2 = trtllm(&mut w, &b, &pool, scale, Bug::None);
    edit_meta(&c2, |m| {
        m["input_metadata"]["kwarg_return_lse_base"] = json!("base2")
    });
    let (o, j, text) = check(t.path(), &[]);
    assert_eq!(o.status.code(), Some(1), "{text}");
    let lse = |i: usize| -> Value {
        j["calls"][i]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["what"] == "lse")
            .unwrap()
            .clone()
    };
    assert_eq!(lse(0)["status"], "pass", "{text}");
    assert!(
        lse(0)["detail"]
            .as_str()
            .unwrap()
            .contains("nearer natural log"),
        "{}",
        lse(0)
    );
    assert_eq!(lse(1)["status"], "fail", "{text}");
    assert!(
        lse(1)["detail"]
            .as_str()
            .unwrap()
            .starts_with("lse (base 2"),
        "{}",
        lse(1)
    );
}
