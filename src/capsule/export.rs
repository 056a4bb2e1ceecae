//! `mla-diff export`: write one layer of a model as a capsule (see the module above for its layout).
//!
//! The reference stages written into the capsule are computed from the capsule's own `layer.gguf`, the
//! way `replay` will compute them, so that a capsule replays its reference bit for bit; without a head
//! cut they are also exactly the source run's, since the tensor bytes are the same.

use super::manifest::{Conventions, Files, InputInfo, Manifest, Source, StageFile};
use super::{heads, CAPSULE_VERSION, INPUT, MANIFEST, README, REFERENCE_DIR, WEIGHTS};
use crate::error::{Error, Result};
use crate::gguf::write::GgufWriter;
use crate::gguf::{GgmlType, GgufFile, TensorType, Value};
use crate::input::LayerInputs;
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::precision::Dtype;
use crate::rope::RopeTables;
use crate::run::InputSpec;
use crate::schedule::Schedule;
use crate::trace::LayerTrace;
use ndarray::{Array2, ArrayD, IxDyn};
use std::borrow::Cow;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The layers of the run the capsule reproduces; the capsule holds the last one. The earlier ones
    /// only shape its input: a run over all of them feeds the last the reference's residual stream.
    pub layers: Vec<usize>,
    /// Keep only these query heads.
    pub heads: Option<Range<usize>>,
    pub input: InputSpec,
    pub sched: Schedule,
    pub dtype: Dtype,
    /// The capsule directory: absent, empty, or an earlier capsule (whose files are replaced).
    pub dir: PathBuf,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Summary {
    pub layer: usize,
    /// Tensors in `layer.gguf`.
    pub tensors: usize,
    /// (path relative to the capsule, bytes), in the order written.
    pub files: Vec<(String, u64)>,
}

impl Summary {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, n)| n).sum()
    }
}

/// Tensors of the whole model that a layer's attention reads: the LongRoPE / rope frequency factors.
const GLOBAL_TENSORS: [&str; 3] = [
    "rope_freqs.weight",
    "rope_factors_short.weight",
    "rope_factors_long.weight",
];

/// A tensor the capsule takes from the source.
struct Needed {
    info: crate::gguf::TensorInfo,
    ty: GgmlType,
    /// `attn_q_b` for `blk.L.attn_q_b.weight`; a global tensor's full name.
    short: String,
}

/// Write the capsule.
pub fn export(file: &GgufFile, opts: &ExportOptions) -> Result<Summary> {
    let cfg = MlaConfig::from_gguf(file)?;
    let &layer = opts
        .layers
        .last()
        .ok_or_else(|| Error::Usage("export needs a layer".into()))?;
    if let Some(&l) = opts.layers.iter().find(|&&l| l >= cfg.n_layer) {
        return Err(Error::Usage(format!(
            "layer {l} does not exist: the model has {} layers (0..{})",
            cfg.n_layer, cfg.n_layer
        )));
    }
    opts.sched.validate()?;
    opts.sched.check_memory(&cfg)?;
    // Every tensor of the layer is read, shape-checked and dequantized before anything is written, so
    // that a file the run could not use gives no capsule.
    LayerWeights::load(file, &cfg, layer)?;
    let tensors = select_tensors(file, layer)?;
    // The head cut's alignment first: it is the error a user can most easily fix.
    if let (Some(h), Some(o)) = (
        &opts.heads,
        tensors.iter().find(|t| t.short == "attn_output"),
    ) {
        heads::check_columns(o.ty, &cfg, h)?;
    }
    let (header, data) = plan_layer(file, &cfg, layer, &tensors, opts.heads.as_ref())?;
    let x = layer_input(file, &cfg, opts)?;
    // Only now, with nothing left that the source could fail, is the directory touched.
    prepare_dir(&opts.dir)?;

    let mut files = Vec::new();
    let weights = opts.dir.join(WEIGHTS);
    write_layer(header, &data, &weights)?;
    files.push((WEIGHTS.to_string(), file_size(&weights)?));

    let input = opts.dir.join(INPUT);
    ndarray_npy::write_npy(&input, &x)
        .map_err(|e| Error::Usage(format!("cannot write {}: {e}", input.display())))?;
    files.push((INPUT.to_string(), file_size(&input)?));

    // The reference from the capsule's own weights, as replay computes it.
    let capsule = GgufFile::open(&weights)?;
    let ccfg = MlaConfig::from_gguf(&capsule)?;
    let reference = reference_of(&capsule, &ccfg, &x, &opts.sched)?;
    let stage_files = write_reference(&opts.dir, &reference)?;
    for s in &stage_files {
        files.push((s.path.clone(), file_size(&opts.dir.join(&s.path))?));
    }

    let manifest = Manifest {
        capsule_version: CAPSULE_VERSION,
        mla_diff_version: env!("CARGO_PKG_VERSION").into(),
        source: Source {
            file: file
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            size: file.file_size,
            architecture: cfg.arch.gguf_name().into(),
            name: file
                .get("general.name")
                .and_then(|v| v.as_str())
                .map(String::from),
            n_layer: cfg.n_layer,
            n_head: cfg.n_head,
        },
        layer,
        heads: opts.heads.as_ref().map(|h| [h.start, h.end]),
        heads_note: opts.heads.as_ref().map(|h| heads_note(h, cfg.n_head)),
        schedule: opts.sched.clone(),
        dtype: opts.dtype,
        input: InputInfo {
            source: crate::run::input_json(&opts.input),
            layers_before: opts.layers[..opts.layers.len() - 1].to_vec(),
            shape: [x.nrows(), x.ncols()],
        },
        config: serde_json::to_value(&ccfg).expect("config serialises"),
        conventions: Conventions::default(),
        files: Files {
            weights: WEIGHTS.into(),
            input: INPUT.into(),
            readme: README.into(),
            reference: stage_files,
        },
    };
    let readme = opts.dir.join(README);
    crate::report::write_file(&readme, &readme_text(&manifest, &tensors_types(&capsule)))?;
    files.push((README.to_string(), file_size(&readme)?));
    // The manifest last: a capsule whose export failed half way has none, and replay refuses it.
    let mpath = opts.dir.join(MANIFEST);
    crate::report::write_file(&mpath, &manifest.to_json())?;
    files.push((MANIFEST.to_string(), file_size(&mpath)?));
    Ok(Summary {
        layer,
        tensors: tensors.len(),
        files,
    })
}

/// What a head cut means, for the manifest and the README.
fn heads_note(h: &Range<usize>, n_head: usize) -> String {
    format!(
        "only query heads {}..{} of {n_head}: a smaller but consistent layer, whose attn_out sums the kept heads only (not the model's attn_out)",
        h.start, h.end
    )
}

/// The layer's tensors (and the global ones attention reads), in file order, with their short names
/// (`attn_q_b`, or the global tensor's full name).
fn select_tensors(file: &GgufFile, layer: usize) -> Result<Vec<Needed>> {
    let prefix = format!("blk.{layer}.");
    let wanted: Vec<String> = crate::model::weights::tensor_names(layer).to_vec();
    let mut out = Vec::new();
    for t in &file.tensors {
        let short = if wanted.contains(&t.name) {
            t.name
                .strip_prefix(&prefix)
                .and_then(|s| s.strip_suffix(".weight"))
                .expect("a layer tensor name")
                .to_string()
        } else if GLOBAL_TENSORS.contains(&t.name.as_str()) {
            t.name.clone()
        } else {
            continue;
        };
        let ty = match t.ty {
            TensorType::Known(ty) => ty,
            TensorType::Unknown(id) => {
                return Err(Error::Unsupported(format!(
                    "tensor {} has unknown ggml type {id}: it cannot be copied",
                    t.name
                )))
            }
        };
        out.push(Needed {
            info: t.clone(),
            ty,
            short,
        });
    }
    Ok(out)
}

/// The input the run feeds `layer` in shadow mode: the source's input for the first layer of the run
/// (or a per-layer capture's own), then the reference's residual stream through the run's layers.
fn layer_input(file: &GgufFile, cfg: &MlaConfig, opts: &ExportOptions) -> Result<Array2<f64>> {
    let inputs = crate::run::load_inputs(file, cfg, &opts.input, &opts.sched)?;
    let &layer = opts.layers.last().expect("checked");
    if let LayerInputs::PerLayer(_) | LayerInputs::Captured(_) = inputs {
        // Per-layer captures restart the reference at every layer (shadow mode).
        return inputs.layer(layer);
    }
    let mut h = inputs.layer(opts.layers[0])?;
    let before = &opts.layers[..opts.layers.len() - 1];
    if before.is_empty() {
        return Ok(h);
    }
    let factors = RopeFactors::load(file, cfg)?;
    let rope = RopeTables::for_run(
        cfg,
        factors.as_ref(),
        opts.sched.pos_offset,
        opts.sched.total_tokens(),
    )?;
    for &l in before {
        let w = LayerWeights::load(file, cfg, l)?;
        let r = crate::reference::run_layer(cfg, &w, &rope, &h, &opts.sched)?;
        h = crate::run::residual_after(&h, &r)?;
    }
    Ok(h)
}

/// The fp64 reference of a capsule's layer (blk.0) on `x`, exactly as a run on the capsule computes it.
pub fn reference_of(
    capsule: &GgufFile,
    cfg: &MlaConfig,
    x: &Array2<f64>,
    sched: &Schedule,
) -> Result<LayerTrace> {
    let w = LayerWeights::load(capsule, cfg, 0)?;
    let factors = RopeFactors::load(capsule, cfg)?;
    let rope = RopeTables::for_run(
        cfg,
        factors.as_ref(),
        sched.pos_offset,
        sched.total_tokens(),
    )?;
    crate::reference::run_layer(cfg, &w, &rope, x, sched)
}

/// `dir` ready for a capsule: created if absent; an earlier capsule's files removed (the manifest first,
/// so that an interrupted export never leaves a capsule that looks whole); anything else refused.
fn prepare_dir(dir: &Path) -> Result<()> {
    let shown = dir.display();
    if !dir.exists() {
        return std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("cannot create capsule directory {shown}"), e));
    }
    if !dir.is_dir() {
        return Err(Error::Usage(format!(
            "-o {shown}: exists and is not a directory"
        )));
    }
    let mut entries =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("cannot read {shown}"), e))?;
    if entries.next().is_none() {
        return Ok(());
    }
    if !dir.join(MANIFEST).is_file() {
        return Err(Error::Usage(format!(
            "-o {shown}: the directory is not empty and holds no capsule ({MANIFEST}); pick a new or empty directory"
        )));
    }
    let remove = |p: &Path| match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(
            format!("cannot replace {} of the earlier capsule", p.display()),
            e,
        )),
        _ => Ok(()),
    };
    for name in [MANIFEST, WEIGHTS, INPUT, README] {
        remove(&dir.join(name))?;
    }
    let refdir = dir.join(REFERENCE_DIR);
    if refdir.is_dir() {
        let listing = std::fs::read_dir(&refdir)
            .map_err(|e| Error::io(format!("cannot read {}", refdir.display()), e))?;
        for e in listing.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "npy") {
                remove(&p)?;
            }
        }
    }
    Ok(())
}

/// Metadata of the one-layer file: the source's, with `block_count` 1 (and no NextN/MTP blocks after it),
/// no split keys, and the head counts of a head cut.
fn metadata(
    file: &GgufFile,
    cfg: &MlaConfig,
    heads: Option<&Range<usize>>,
) -> Result<Vec<(String, Value)>> {
    let arch = cfg.arch.gguf_name();
    let key = |k: &str| format!("{arch}.{k}");
    let kept = heads.map(|h| h.end - h.start);
    let mut out = Vec::with_capacity(file.metadata.len() + 2);
    for (k, v) in &file.metadata {
        if k.starts_with("split.") {
            continue;
        }
        let v = if *k == key("block_count") {
            same_int_type(v, 1)
        } else if *k == key("nextn_predict_layers") {
            same_int_type(v, 0)
        } else if let (Some(n), true) = (kept, *k == key("attention.head_count")) {
            same_int_type(v, n as u64)
        } else if let (Some(n), true) = (kept, *k == key("attention.head_count_kv")) {
            // Legacy files store one kv head per query head; new-style MLA files one latent (MQA).
            match v.as_u64() {
                Some(kv) if kv as usize == cfg.n_head => same_int_type(v, n as u64),
                Some(1) => v.clone(),
                _ => {
                    return Err(Error::Unsupported(format!(
                        "{k} is {}, neither 1 nor head_count {}: cannot cut heads",
                        v.display_short(),
                        cfg.n_head
                    )))
                }
            }
        } else {
            v.clone()
        };
        out.push((k.clone(), v));
    }
    // Without the *_mla keys the head dims may default to hidden / head_count (MiniCPM3): a head cut
    // changes head_count, so the dims are written out.
    if heads.is_some() && !cfg.mla_keys {
        for (k, v) in [
            ("attention.key_length", cfg.qk_head_dim()),
            ("attention.value_length", cfg.v_head_dim),
        ] {
            if file.get(&key(k)).is_none() {
                out.push((key(k), Value::U32(v as u32)));
            }
        }
    }
    Ok(out)
}

/// `n` in the integer type of `v` (the source's type is kept, as the converter wrote it).
fn same_int_type(v: &Value, n: u64) -> Value {
    match v {
        Value::U8(_) => Value::U8(n as u8),
        Value::I8(_) => Value::I8(n as i8),
        Value::U16(_) => Value::U16(n as u16),
        Value::I16(_) => Value::I16(n as i16),
        Value::I32(_) => Value::I32(n as i32),
        Value::U64(_) => Value::U64(n),
        Value::I64(_) => Value::I64(n as i64),
        _ => Value::U32(n as u32),
    }
}

/// The header of `layer.gguf` (the metadata; the tensors renamed to blk.0 and cut to the heads if asked)
/// and each tensor's bytes as the source stores them, borrowed from its memory map where uncut.
fn plan_layer<'a>(
    file: &'a GgufFile,
    cfg: &MlaConfig,
    layer: usize,
    tensors: &[Needed],
    heads: Option<&Range<usize>>,
) -> Result<(GgufWriter, Vec<Cow<'a, [u8]>>)> {
    let prefix = format!("blk.{layer}.");
    let mut w = GgufWriter::new();
    for (k, v) in metadata(file, cfg, heads)? {
        w.add(k, v)?;
    }
    let mut data = Vec::with_capacity(tensors.len());
    for t in tensors {
        let bytes = file.tensor_bytes(&t.info)?;
        let (ne, bytes) = match heads {
            Some(h) => heads::cut(&t.short, &t.info, bytes, cfg, h)?,
            None => (t.info.ne.clone(), Cow::Borrowed(bytes)),
        };
        let name = match t.info.name.strip_prefix(&prefix) {
            Some(rest) => format!("blk.0.{rest}"),
            None => t.info.name.clone(),
        };
        w.add_tensor(name, &ne, t.ty)?;
        data.push(bytes);
    }
    Ok((w, data))
}

/// Write `layer.gguf` from its planned header and tensor bytes.
fn write_layer(header: GgufWriter, data: &[Cow<[u8]>], path: &Path) -> Result<()> {
    let out = std::fs::File::create(path)
        .map_err(|e| Error::io(format!("cannot create {}", path.display()), e))?;
    let mut sink = header.start(std::io::BufWriter::with_capacity(8 << 20, out))?;
    for d in data {
        sink.write(d)?;
    }
    sink.finish()?
        .into_inner()
        .map_err(|e| Error::io(format!("writing {}", path.display()), e.into_error()))?
        .sync_all()
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// `reference/STAGE.npy` for every stage (float64, the stage's shape).
fn write_reference(dir: &Path, reference: &LayerTrace) -> Result<Vec<StageFile>> {
    let d = dir.join(REFERENCE_DIR);
    std::fs::create_dir_all(&d)
        .map_err(|e| Error::io(format!("cannot create {}", d.display()), e))?;
    let mut out = Vec::new();
    for t in &reference.stages {
        let rel = format!("{REFERENCE_DIR}/{}.npy", t.stage.name());
        let a = ArrayD::from_shape_vec(IxDyn(&t.shape), t.data.clone())
            .expect("stage shape matches data");
        let p = dir.join(&rel);
        ndarray_npy::write_npy(&p, &a)
            .map_err(|e| Error::Usage(format!("cannot write {}: {e}", p.display())))?;
        out.push(StageFile {
            stage: t.stage.name().into(),
            path: rel,
            shape: t.shape.clone(),
            axes: t.stage.axes().iter().map(|s| s.to_string()).collect(),
        });
    }
    Ok(out)
}

fn file_size(p: &Path) -> Result<u64> {
    Ok(std::fs::metadata(p)
        .map_err(|e| Error::io(format!("cannot stat {}", p.display()), e))?
        .len())
}

/// `Q4_K ×5, F32 ×3`: the tensor types of the capsule's GGUF.
fn tensors_types(f: &GgufFile) -> String {
    let mut types: Vec<(String, usize)> = Vec::new();
    for t in &f.tensors {
        let name = t.ty.to_string();
        match types.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => types.push((name, 1)),
        }
    }
    let v: Vec<String> = types.iter().map(|(n, c)| format!("{n} ×{c}")).collect();
    v.join(", ")
}

fn readme_text(m: &Manifest, types: &str) -> String {
    let s = &m.schedule;
    let heads = match &m.heads_note {
        Some(n) => format!("\n**Heads cut**: {n}.\n"),
        None => String::new(),
    };
    let before = match m.input.layers_before.as_slice() {
        [] => String::new(),
        l => format!(", after the reference's attention-only residual stream through layers {l:?}"),
    };
    format!(
        "# mla-diff capsule: layer {layer} of {file}\n\n\
One MLA attention layer, self-contained, to reproduce a divergence without the model (mla-diff {ver}).\n\n\
- `{w}`: the model's metadata (block_count 1) and layer {layer}'s attention tensors as `blk.0.*`, bytes copied unchanged ({types}).\n\
- `{i}`: the layer input x `[{t}, {e}]`, float64 (input {src}{before}).\n\
- `{r}/STAGE.npy`: the fp64 reference of every stage on that input (float64; shapes and axes in `{man}`).\n\
- `{man}`: schedule (prompt {p}, chunk {c}, {d} decode steps × {q}, page {pg}, {sp} splits), dtype {dt}, config, conventions (natural-log LSE, cache rows `[latent | k_pe]`, unwritten rows NaN).\n\
{heads}\n\
Replay (checks the weights against the reference, then runs the layer): `mla-diff replay DIR --backend cpu|cuda [--json report.json]`\n",
        layer = m.layer,
        file = m.source.file,
        ver = m.mla_diff_version,
        w = m.files.weights,
        i = m.files.input,
        r = REFERENCE_DIR,
        man = MANIFEST,
        t = m.input.shape[0],
        e = m.input.shape[1],
        src = m.input.source,
        p = s.prompt_len,
        c = s.chunk,
        d = s.decode_steps,
        q = s.q_len,
        pg = s.page_size,
        sp = s.num_splits,
        dt = m.dtype.name(),
    )
}
