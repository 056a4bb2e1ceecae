//! The selftest's fixtures: small synthetic files with the real models' head dims (from the model
//! catalogue), one per kind of run a fault may need.

use crate::error::{Error, Result};
use crate::fixture;
use crate::gguf::{GgmlType, GgufFile};
use crate::model::catalogue::Preset;
use std::path::Path;

use super::LAYERS;

/// A selftest fixture (its row of `FIXTURES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Model {
    DeepseekV3,
    Minicpm3,
    V2LiteLargeQAbs,
    Glm5,
    Glm5Dsa,
    DeepseekV3Wide,
    /// glm5-next (`GLM5_NEXT`): NoPE MLA with its k-pool indexer; not a row of `FIXTURES`.
    Glm5Next,
    /// DeepSeek-V4 (`V4`): window, CSA and HCA layers; not a row of `FIXTURES` (not MLA).
    DeepseekV4,
}

/// The glm5-next fixture: `fixture --preset glm5-next` at 12 layers (MLA on layers 3, 7 and 11, linear
/// attention elsewhere, which no run compares), hidden 128, 2 heads, q-LoRA 64, f32 weights (as
/// tests/it/kpool_run.rs), top_k 32 (two pools of 16: past it at a few dozen tokens), and layer 11
/// "shared" (`indexer.types` false, its indexer tensors removed): it reuses layer 7's selection.
pub const GLM5_NEXT: GlmNext = GlmNext {
    layers: 12,
    top_k: 32,
    shared: 11,
};

/// The glm5-next fixture's shape (`GLM5_NEXT`).
#[derive(Debug, Clone, Copy)]
pub struct GlmNext {
    pub layers: usize,
    pub top_k: u32,
    /// The shared indexer layer (the two full MLA layers before it: 3 and 7).
    pub shared: usize,
}

/// The DeepSeek-V4 fixture: `fixture --preset deepseek-v4 --layers 3 --hidden 256 --heads 8` (V4-Flash's
/// head dims, window 128 and output groups; layers window, CSA, HCA), bf16, as src/run/v4/tests.rs.
pub fn v4_options() -> crate::fixture::v4::V4Options {
    crate::fixture::v4::V4Options {
        layers: Some(LAYERS),
        hidden: Some(256),
        heads: Some(8),
        quant: GgmlType::from_name("BF16").expect("bf16"),
        seed: 0,
    }
}

/// Query heads of every selftest fixture but `Model::DeepseekV3Wide`.
pub const HEADS: usize = 4;

/// Query heads of `Model::DeepseekV3Wide`: 64 decode rows per query, what the Hopper kernels
/// `attn_wgmma` and `attn_wgmma_pairs` take (the 4-head fixtures reach only `attn_small`).
pub const WIDE_HEADS: usize = 64;

/// One selftest fixture: a catalogue model at hidden 256, `HEADS` heads (`WIDE_HEADS` for one), 3
/// layers, vocab 64, BF16.
#[derive(Debug, Clone, Copy)]
pub struct Fixture {
    pub model: Model,
    /// The fixture's name in the matrix and in its file name.
    pub name: &'static str,
    /// The catalogue model whose attention dims, rope and scaling it has.
    pub preset: Preset,
    /// The q-LoRA rank (`None`: the model has none).
    pub q_lora: Option<usize>,
    /// `Some(K)`: `attn_k_b` and `attn_v_b` × 2^K and `attn_kv_a_norm` × 2^-K after writing.
    pub scale_log2: Option<i32>,
    /// Why the selftest has it.
    pub purpose: &'static str,
    /// `Some(K)`: the DSA indexer's top_k set to K (runs past it exercise the sparse model).
    pub dsa_top_k: Option<u32>,
    /// Query heads.
    pub heads: usize,
}

/// The top_k of `Model::Glm5Dsa`: the indexer faults' runs (`Need::Dsa`) see up to 43 keys.
pub const DSA_TOP_K: u32 = 16;

/// Indexer heads of `Model::Glm5Dsa` (GLM-5 has 32). The selection check's noise margin is a worst-case
/// bound, `8·u·Σ_h |w_h|·‖q_h‖·‖k‖·Di^-0.5`; on random weights the spread of the scores over keys is
/// about `1/√(Hi·Di)` of that sum, so at 32 heads of 128 the whole spread sits inside the bf16 margin and
/// no misreading could show. 2 heads of 128 keep it about twice the margin (docs/dsa.md).
pub const DSA_HEADS: u32 = 2;

/// The exponent K of `Model::V2LiteLargeQAbs`: puts the rms of q_absorbed above 65504 (checked on the
/// reference values of every run that needs it).
pub const LARGE_QABS_LOG2: i32 = 18;

/// Every selftest fixture, in `Model` order.
pub const FIXTURES: [Fixture; 6] = [
    Fixture {
        model: Model::DeepseekV3,
        name: "deepseek-v3",
        preset: Preset::DeepseekV3,
        q_lora: Some(128),
        scale_log2: None,
        purpose: "NORM rope, YaRN factor 40 (mscale² 1.87), P+R ≠ Dv: the default",
        dsa_top_k: None,
        heads: HEADS,
    },
    Fixture {
        model: Model::Minicpm3,
        name: "minicpm3",
        preset: Preset::Minicpm3,
        q_lora: Some(128),
        scale_log2: None,
        purpose: "NEOX rope, LongRoPE factors",
        dsa_top_k: None,
        heads: HEADS,
    },
    // No q-LoRA, the model of llama.cpp #13137. The scaling makes q_absorbed = W_UKᵀ·q_nope leave the
    // fp16 range (and the latent shrink by 2^-K), while scores, k_nope, v, the heads, attn_out and so every
    // layer's input stay what they were. Power-of-two scaling is exact in bf16 and f32, so every relative
    // error is unchanged too (fp16 cannot hold the small latent: this fixture is for bf16 runs).
    Fixture {
        model: Model::V2LiteLargeQAbs,
        name: "v2-lite-large-qabs",
        preset: Preset::DeepseekV2Lite,
        q_lora: None,
        scale_log2: Some(LARGE_QABS_LOG2),
        purpose: "q_absorbed beyond the fp16 range",
        dsa_top_k: None,
        heads: HEADS,
    },
    Fixture {
        model: Model::Glm5,
        name: "glm-5",
        preset: Preset::Glm5,
        q_lora: Some(64),
        scale_log2: None,
        purpose: "no YaRN, P+R = Dv: for the controls",
        dsa_top_k: None,
        heads: HEADS,
    },
    // GLM-5's indexer (heads of 128, interleaved rope) with a small top_k, so that sparsity bites at a
    // few dozen tokens, and 2 heads (`DSA_HEADS`): the indexer faults' fixture.
    Fixture {
        model: Model::Glm5Dsa,
        name: "glm-5-dsa",
        preset: Preset::Glm5,
        q_lora: Some(64),
        scale_log2: None,
        purpose: "DSA indexer, 2 heads of 128, top_k 16: for the indexer faults",
        dsa_top_k: Some(DSA_TOP_K),
        heads: HEADS,
    },
    // DeepSeek-V3's 576/512 at 64 heads: its production decode variants (sm_90a) are every Hopper
    // kernel, attn_wgmma and attn_wgmma_pairs by TMA (pages of one and of two 64-key tiles) and
    // attn_small from a TP slice, which a run at page 16 reaches through batches aimed at them: the
    // kernel-variant faults' fixture. No q-LoRA keeps it small (q: 256 → 64 × 192).
    Fixture {
        model: Model::DeepseekV3Wide,
        name: "deepseek-v3-64h",
        preset: Preset::DeepseekV3,
        q_lora: None,
        scale_log2: None,
        purpose: "576/512 at 64 heads: every Hopper decode kernel, for the kernel-variant faults",
        dsa_top_k: None,
        heads: WIDE_HEADS,
    },
];

impl Model {
    /// The fixture's row of `FIXTURES` (the MLA fixtures of 3 layers; `Glm5Next` and `DeepseekV4` have none).
    pub fn fixture(self) -> &'static Fixture {
        &FIXTURES[self as usize]
    }
    pub fn name(self) -> &'static str {
        match self {
            Model::Glm5Next => "glm5-next",
            Model::DeepseekV4 => "deepseek-v4",
            _ => self.fixture().name,
        }
    }
    /// Whether its runs are DeepSeek-V4's (`run::v4`), not MLA's.
    pub fn is_v4(self) -> bool {
        self == Model::DeepseekV4
    }
    /// Whether its runs attend sparsely past top_k (`Judging::sparse`).
    pub fn is_sparse(self) -> bool {
        matches!(self, Model::Glm5Dsa | Model::Glm5Next)
    }
    pub fn file_name(self) -> String {
        format!("selftest-{}.gguf", self.name())
    }
    fn spec(self) -> Result<fixture::Spec> {
        let f = self.fixture();
        let mut s = fixture::Spec::from_options(&fixture::Options {
            preset: f.preset,
            layers: Some(LAYERS),
            quant: GgmlType::from_name("BF16").expect("bf16"),
            seed: 0,
            legacy_kv_b: false,
            hidden: Some(256),
            heads: Some(f.heads),
            // 0: no q-LoRA.
            q_lora_rank: Some(f.q_lora.unwrap_or(0)),
            vocab: Some(64),
        })?;
        if let Some(k) = f.dsa_top_k {
            s.indexer = s.indexer.map(|(_, d, _)| (DSA_HEADS, d, k));
        }
        Ok(s)
    }
    /// Write the fixture to `path`.
    pub fn write(self, path: &Path) -> Result<()> {
        match self {
            Model::DeepseekV4 => return fixture::v4::write(&v4_options(), path).map(|_| ()),
            Model::Glm5Next => return write_glm5_next(path),
            _ => {}
        }
        fixture::write(&self.spec()?, path)?;
        if let Some(k) = self.fixture().scale_log2 {
            let mut scales = Vec::new();
            for l in 0..LAYERS {
                scales.push((format!("blk.{l}.attn_k_b.weight"), 2f32.powi(k)));
                scales.push((format!("blk.{l}.attn_v_b.weight"), 2f32.powi(k)));
                scales.push((format!("blk.{l}.attn_kv_a_norm.weight"), 2f32.powi(-k)));
            }
            scale_tensors(path, &scales)?;
        }
        Ok(())
    }
}

/// Write `GLM5_NEXT` to `path`: the preset's file with its shared layer shared (`indexer.types` false
/// there, no indexer tensors: as llama.cpp's converter writes such a layer, `Spec::indexer_types`).
fn write_glm5_next(path: &Path) -> Result<()> {
    let g = GLM5_NEXT;
    let mut spec = fixture::Spec::from_options(&fixture::Options {
        preset: Preset::Glm5Next,
        layers: Some(g.layers),
        quant: GgmlType::from_name("F32").expect("f32"),
        seed: 0,
        legacy_kv_b: false,
        hidden: Some(128),
        heads: Some(2),
        q_lora_rank: Some(64),
        vocab: Some(64),
    })?;
    spec.indexer = spec.indexer.map(|(h, d, _)| (h, d, g.top_k));
    spec.indexer_types = Some((0..g.layers).map(|l| l != g.shared).collect());
    fixture::write(&spec, path).map(|_| ())
}

/// Multiply tensors of a GGUF file in place (F32, F16 or BF16 data).
pub fn scale_tensors(path: &Path, scales: &[(String, f32)]) -> Result<()> {
    let bytes = {
        let f = GgufFile::open(path)?;
        let mut bytes = std::fs::read(path)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        for (name, s) in scales {
            let t = f.tensor(name).ok_or_else(|| {
                Error::Tensor(format!("{}: no tensor {name} to scale", path.display()))
            })?;
            let start = (f.data_offset + t.offset) as usize;
            let n = t.n_elements() as usize;
            let ty = t.ty.to_string();
            let data = bytes.get_mut(start..).unwrap_or_default();
            match ty.as_str() {
                "F32" => data.chunks_exact_mut(4).take(n).for_each(|c| {
                    let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * s;
                    c.copy_from_slice(&v.to_le_bytes());
                }),
                "BF16" => data.chunks_exact_mut(2).take(n).for_each(|c| {
                    let v = half::bf16::from_le_bytes([c[0], c[1]]).to_f32() * s;
                    c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }),
                "F16" => data.chunks_exact_mut(2).take(n).for_each(|c| {
                    let v = half::f16::from_le_bytes([c[0], c[1]]).to_f32() * s;
                    c.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }),
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: cannot scale {name} of type {other}",
                        path.display()
                    )))
                }
            }
        }
        bytes
    };
    // Write through a temporary file: the mapping above is closed, the original stays intact on error.
    let tmp = path.with_extension("scaled.tmp");
    std::fs::write(&tmp, &bytes)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_in_model_order() {
        for (i, f) in FIXTURES.iter().enumerate() {
            assert_eq!(f.model as usize, i, "{}", f.name);
        }
    }
}
