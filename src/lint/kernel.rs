//! The kernel side of `lint` (`--backend cpu|cuda`): which of our attention kernels a run of this model
//! would launch, and with what page size and rows. No GPU or NVRTC is needed: the choice is a function of
//! the dims, the dtype, the target and its shared memory (`tiles::choice`, which `kernels check`
//! holds to the compiled kernels).

use super::{Findings, Options, Target};
use crate::error::{Error, Result};
use crate::faults::Active;
use crate::model::{MlaConfig, RopePairing};
use crate::precision::Dtype;
use crate::tiles::choice::{self as plan, Plan};
use crate::tiles::Dims;

fn describe(p: &Plan) -> String {
    match p.tile {
        Some(t) if p.kernel == "attn_wgmma" => format!(
            "attn_wgmma ({}; {} rows × {} keys per CTA, {} bytes of shared memory)",
            t.label(),
            p.rows,
            p.keys,
            p.smem
        ),
        Some(t) => format!(
            "attn_mma ({}; {} rows × {} keys per CTA, {} bytes of shared memory)",
            t.label(),
            p.rows,
            p.keys,
            p.smem
        ),
        None => "attn_scalar (4 rows per block, one key at a time, no tensor cores)".to_string(),
    }
}

pub fn lint(cfg: Option<&MlaConfig>, t: Target, opts: &Options, out: &mut Findings) -> Result<()> {
    if t == Target::Cpu {
        out.note(
            "kernel",
            "the CPU mirror",
            "it takes any dims, dtype and page size: it is the specification the CUDA kernels follow (src/backend/cpu)",
        );
        return Ok(());
    }
    let limit = plan::smem_limit(&opts.arch).ok_or_else(|| {
        Error::Usage(format!(
            "--arch {}: unknown target (sm_80, sm_86, sm_87, sm_89, sm_90, sm_90a, sm_100, sm_100a, sm_120, sm_120a)",
            opts.arch
        ))
    })?;
    let Some(c) = cfg else {
        out.note(
            "kernel",
            "not planned",
            "the loader refuses the file, so the kernels' dims are unknown",
        );
        return Ok(());
    };
    let dims = Dims {
        dtype: opts.dtype,
        lkv: c.kv_lora_rank,
        r: c.qk_rope,
        p: c.qk_nope,
        dv: c.v_head_dim,
        h: c.n_head,
        page: opts.page_size,
        neox: c.rope.pairing == RopePairing::Neox,
        debug: false,
        faults: Active::NONE,
    };
    let rows = opts.q_len * c.n_head;
    let dec = plan::plan(&dims, true, rows, &opts.arch, limit);
    let pre = plan::plan(&dims, false, 0, &opts.arch, limit);
    let target = format!("{} ({} bytes of shared memory per block)", opts.arch, limit);
    for (check, p, what) in [
        (
            "kernel.decode",
            &dec,
            format!(
                "decode.cu, absorbed MQA over the paged cache: keys [latent {} | k_pe {}], {} rows per request (q_len {} × {} heads), pages of {} rows (any page size: MLA_PAGE is compiled in), {} storage, rope {}",
                c.kv_lora_rank,
                c.qk_rope,
                rows,
                opts.q_len,
                c.n_head,
                opts.page_size,
                opts.dtype.name(),
                if dims.neox { "NEOX" } else { "NORM" }
            ),
        ),
        (
            "kernel.prefill",
            &pre,
            format!(
                "prefill.cu, decompressed attention per head: q·k over qk_nope {} + rope {}, values {} wide, {} storage",
                c.qk_nope,
                c.qk_rope,
                c.v_head_dim,
                opts.dtype.name()
            ),
        ),
    ] {
        let passed = if p.passed_over.is_empty() {
            String::new()
        } else {
            format!("; passed over: {}", p.passed_over.join("; "))
        };
        let why = format!("{what}, on {target}{passed}");
        // The scalar kernel computes the same model, only slowly: a warning when 16-bit storage
        // asked for the tensor cores and the dims kept them out, a note when f32 storage did.
        if p.kernel == "attn_scalar" && opts.dtype != Dtype::F32 {
            out.warning(check, describe(p), "a tensor-core kernel (attn_mma or attn_wgmma)", why);
        } else {
            out.note(check, describe(p), why);
        }
    }
    Ok(())
}
