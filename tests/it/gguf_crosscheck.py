#!/usr/bin/env python3
"""Independent cross-check of mla-diff's GGUF reading and writing with gguf-py (PyPI gguf==0.19.0).

Run by tests/it/gguf_crosscheck.rs:  gguf_crosscheck.py FIXTURES_DIR OUT_DIR
                                 or:  gguf_crosscheck.py blocks OUT_DIR
                                 or:  gguf_crosscheck.py fill OUT_JSON FILE...

1. Every FIXTURES_DIR/*.gguf is read with gguf-py's GGUFReader; each tensor is dequantized with
   gguf.quants.dequantize and saved as float32 .npy in numpy (torch) order, and every metadata value
   is recorded, so the Rust side can compare its own reading bit for bit.
2. A deepseek2 GGUF is written with gguf-py's GGUFWriter (new-style MLA keys, YaRN, several tensor
   types, kv_b split and k_b transposed as the converter does); the values a reader must see are
   saved as .npy, plus the kv_b decompression in mla-diff's W_UK [H, P, Lkv] / W_UV [H, Dv, Lkv] form.

3. SPLIT_SOURCE is re-written by GGUFWriter as a split model (split_max_tensors, metadata-only first
   shard as llama.cpp's `gguf-split --no-tensor-first-split` makes it), so the Rust side can check that
   any shard reads as the unsplit file.

OUT_DIR/manifest.json describes all three.

`blocks`: random bytes (random f16/f32 scales, NaN and Inf included) of every type gguf-py dequantizes,
written as OUT_DIR/blocks.gguf with gguf-py's dequantized values as .npy; OUT_DIR/blocks.json lists them.

`fill`: overwrites, in place, every tensor of each FILE whose type only the low-bit dequantizer reads with
random blocks that dequantize to finite values, and writes every tensor's L2 norm (float64) to OUT_JSON.
"""

import importlib.metadata
import json
import pathlib
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T


def meta_value(field):
    """A metadata value as JSON: numbers, strings, bools, (nested) lists."""
    v = field.contents()
    if isinstance(v, (np.generic,)):
        v = v.item()
    return v


def read_fixtures(fixtures, out):
    entries = []
    for path in sorted(fixtures.glob("*.gguf")):
        r = gguf.GGUFReader(path)
        d = out / path.stem
        d.mkdir(parents=True, exist_ok=True)
        meta = []
        for name, field in r.fields.items():
            if name.startswith("GGUF."):  # the reader's pseudo-fields for the header
                continue
            meta.append({"key": name, "type": int(field.types[0]), "value": meta_value(field)})
        tensors = []
        for i, t in enumerate(r.tensors):
            shape = [int(x) for x in reversed(t.shape.tolist())]
            vals = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            vals = vals.reshape(shape)
            npy = f"{path.stem}/{i:04d}.npy"
            np.save(out / npy, vals)
            tensors.append({"name": t.name, "type": t.tensor_type.name, "shape": shape, "npy": npy})
        entries.append({"file": path.name, "metadata": meta, "tensors": tensors})
    return entries


def write_deepseek2(out):
    """A new-style deepseek2 file as llama.cpp's converter would lay it out, written by gguf-py."""
    rng = np.random.default_rng(12345)
    E, H, Lq, Lkv, P, R, Dv, V = 256, 4, 64, 64, 32, 16, 32, 64
    path = out / "gguf_py_written.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name("gguf-py cross-check")
    w.add_block_count(1)
    w.add_context_length(163840)
    w.add_embedding_length(E)
    w.add_head_count(H)
    w.add_head_count_kv(1)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(40.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    w.add_q_lora_rank(Lq)
    w.add_kv_lora_rank(Lkv)
    w.add_key_length(Lkv + R)
    w.add_value_length(Lkv)
    w.add_key_length_mla(P + R)
    w.add_value_length_mla(Dv)
    w.add_rope_dimension_count(R)
    w.add_rope_scaling_yarn_log_mul(0.1 * 0.707)
    # Every other value type, so our reader is checked on all of them.
    w.add_array("crosscheck.strings", ["alpha", "", "γ"])
    w.add_array("crosscheck.f32s", [1.5, -2.25, 3.0e-7])
    w.add_array("crosscheck.ints", [1, 2, 3])
    w.add_bool("crosscheck.bool", True)
    w.add_uint8("crosscheck.u8", 250)
    w.add_int8("crosscheck.i8", -7)
    w.add_uint16("crosscheck.u16", 65000)
    w.add_int16("crosscheck.i16", -30000)
    w.add_int32("crosscheck.i32", -2_000_000_000)
    w.add_uint64("crosscheck.u64", 2**63 + 5)
    w.add_int64("crosscheck.i64", -(2**62))
    w.add_float64("crosscheck.f64", 0.1)

    expected = {}

    def add(name, torch, qtype):
        torch = torch.astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, torch)
            seen = torch
        elif qtype == T.F16:
            h = torch.astype(np.float16)
            w.add_tensor(name, h)
            seen = h.astype(np.float32)
        else:
            q = gguf.quants.quantize(torch, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            seen = gguf.quants.dequantize(q, qtype).astype(np.float32).reshape(torch.shape)
        expected[name] = (qtype, seen)
        return seen

    def lin(out_f, in_f):
        return rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)

    def norm(n):
        return np.exp(0.3 * rng.standard_normal(n))

    add("token_embd.weight", rng.standard_normal((V, E)), T.Q8_0)
    add("blk.0.attn_norm.weight", norm(E), T.F32)
    add("blk.0.attn_q_a.weight", lin(Lq, E), T.Q8_0)
    add("blk.0.attn_q_a_norm.weight", norm(Lq), T.F32)
    add("blk.0.attn_q_b.weight", lin(H * (P + R), Lq), T.Q4_0)
    add("blk.0.attn_kv_a_mqa.weight", lin(Lkv + R, E), T.Q5_0)
    add("blk.0.attn_kv_a_norm.weight", norm(Lkv), T.F32)
    # conversion/deepseek.py: kv_b viewed per head as [k_nope | v], k_b transposed to [H, Lkv, P].
    kv_b = lin(H * (P + Dv), Lkv).reshape(H, P + Dv, Lkv)
    k_b = np.ascontiguousarray(kv_b[:, :P, :].transpose(0, 2, 1))
    v_b = np.ascontiguousarray(kv_b[:, P:, :])
    k_seen = add("blk.0.attn_k_b.weight", k_b, T.BF16)
    v_seen = add("blk.0.attn_v_b.weight", v_b, T.F16)
    add("blk.0.attn_output.weight", lin(E, H * Dv), T.Q5_1)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    d = out / "gguf_py_written"
    d.mkdir(exist_ok=True)
    tensors = []
    for i, (name, (qtype, seen)) in enumerate(expected.items()):
        npy = f"gguf_py_written/{i:04d}.npy"
        np.save(out / npy, seen)
        tensors.append({"name": name, "type": qtype.name, "shape": list(seen.shape), "npy": npy})
    np.save(d / "w_uk.npy", np.ascontiguousarray(k_seen.transpose(0, 2, 1)))
    np.save(d / "w_uv.npy", v_seen)
    return {
        "file": path.name,
        "config": {
            "arch": "deepseek2", "n_layer": 1, "hidden": E, "n_head": H, "n_head_kv": 1,
            "q_lora_rank": Lq, "kv_lora_rank": Lkv, "qk_nope": P, "qk_rope": R, "v_head_dim": Dv,
            "yarn_factor": 40.0, "yarn_original_context": 4096, "mscale_all_dim": 0.707,
        },
        "tensors": tensors,
        "w_uk": "gguf_py_written/w_uk.npy",
        "w_uv": "gguf_py_written/w_uv.npy",
    }


SPLIT_SOURCE = "deepseek-v3-yarn-q4_k.gguf"


def write_split(fixtures, out):
    """SPLIT_SOURCE as gguf-py's own split writer lays out a split model."""
    r = gguf.GGUFReader(fixtures / SPLIT_SOURCE)
    arch = r.fields["general.architecture"].contents()
    d = out / "split"
    d.mkdir(exist_ok=True)
    w = gguf.GGUFWriter(str(d / "model.gguf"), arch, split_max_tensors=7, small_first_shard=True)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(p.name for p in d.glob("model-*-of-*.gguf"))
    return {"source": SPLIT_SOURCE, "shards": [f"split/{n}" for n in shards], "tensors": len(r.tensors)}


def dequantizable_types():
    """Every type gguf.quants.dequantize handles, in id order."""
    return [T.F32, T.F16] + sorted(gguf.quants._type_traits, key=int)


def random_blocks(out, blocks_per_row=32, rows=40):
    """blocks_per_row * rows (1280) random blocks per type, dequantized by gguf-py."""
    rng = np.random.default_rng(20240611)
    path = out / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), "crosscheck")
    entries = []
    for i, qtype in enumerate(dequantizable_types()):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        # Plain types: as many values as the block types have blocks, times 32 (a Q4_0 block's count).
        per_row = blocks_per_row * (32 if block == 1 else 1)
        raw = rng.integers(0, 256, size=(rows, per_row * size), dtype=np.uint8)
        name = f"{qtype.name.lower()}.weight"
        w.add_tensor(name, raw, raw_dtype=qtype)
        with np.errstate(all="ignore"):  # NaN/Inf scales are the point
            vals = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)
        vals = vals.reshape(rows, per_row * block)
        npy = f"blocks/{i:04d}.npy"
        np.save(out / npy, vals)
        entries.append({"name": name, "type": qtype.name, "blocks": rows * per_row, "npy": npy})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": path.name, "tensors": entries}


# Types mla-diff reads through fuel-quantized rather than candle: the ones `fill` randomizes.
LOW_BIT = {T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ1_S, T.IQ4_NL, T.IQ3_S, T.IQ2_S, T.IQ4_XS, T.IQ1_M,
           T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4}


def fill(out_json, files):
    rng = np.random.default_rng(7)
    norms = {}
    for f in files:
        r = gguf.GGUFReader(f, "r+")
        n = {}
        for t in r.tensors:
            if t.tensor_type in LOW_BIT:
                block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
                want = t.data.size // size
                good = np.empty((0, size), dtype=np.uint8)
                while len(good) < want:
                    cand = rng.integers(0, 256, size=(4 * want, size), dtype=np.uint8)
                    with np.errstate(all="ignore"):
                        v = gguf.quants.dequantize(cand, t.tensor_type).reshape(len(cand), block)
                        ok = np.isfinite(v).all(axis=1) & (np.abs(v).max(axis=1) < 1e4)
                    good = np.concatenate([good, cand[ok]])
                t.data.reshape(-1)[:] = good[:want].reshape(-1)
            v = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            n[t.name] = float(np.sqrt(np.sum(v * v)))
        r.data.flush()
        norms[str(f)] = n
    pathlib.Path(out_json).write_text(json.dumps(norms, indent=1))


def main():
    if sys.argv[1] == "blocks":
        out = pathlib.Path(sys.argv[2])
        (out / "blocks").mkdir(parents=True, exist_ok=True)
        manifest = {"gguf_version": importlib.metadata.version("gguf"), **random_blocks(out)}
        (out / "blocks.json").write_text(json.dumps(manifest, indent=1))
        return
    if sys.argv[1] == "fill":
        fill(sys.argv[2], sys.argv[3:])
        return
    fixtures, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "gguf_version": importlib.metadata.version("gguf"),
        "fixtures": read_fixtures(fixtures, out),
        "written": write_deepseek2(out),
        "split": write_split(fixtures, out),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
