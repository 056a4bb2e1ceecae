//! The shipped fixtures: reproducible from fixtures/regenerate.sh, within the size budget, and what
//! `inspect --json` says about each of them (dims, rope, YaRN, softmax scale, every attention tensor's
//! name, type, ne and size), plus the raw metadata keys the llama.cpp converter would write.

use crate::common;
use approx::{assert_abs_diff_eq, assert_relative_eq};

use common::{fixture, fixtures_dir, inspect_json, run, stderr};
use mla_diff::gguf::{GgufFile, Value};
use serde_json::Value as J;

const SHIPPED: [&str; 5] = [
    "deepseek-v3-yarn-q4_k.gguf",
    "glm-5-q4_0.gguf",
    "deepseek-v3-legacy-kv-b-q8_0.gguf",
    "deepseek-v2-lite-bf16.gguf",
    "minicpm3-f32.gguf",
];

/// The `fixture` command lines of regenerate.sh, as argument lists.
fn regenerate_commands() -> Vec<Vec<String>> {
    let script = std::fs::read_to_string(fixtures_dir().join("regenerate.sh")).unwrap();
    script
        .lines()
        .filter(|l| l.starts_with("\"$MLA_DIFF\" fixture "))
        .map(|l| l.split_whitespace().skip(1).map(String::from).collect())
        .collect()
}

#[test]
fn every_shipped_fixture_is_reproduced_exactly_by_regenerate_sh() {
    let cmds = regenerate_commands();
    let mut made = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    for mut args in cmds {
        let o = args.iter().position(|a| a == "-o").expect("-o FILE");
        let name = std::path::Path::new(&args[o + 1])
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        let out = dir.path().join(&name);
        args[o + 1] = out.to_str().unwrap().into();
        // One worker thread here: the shipped bytes must not depend on the thread count.
        let res = common::bin()
            .args(&args)
            .env("MLA_DIFF_FIXTURE_THREADS", "1")
            .output()
            .unwrap();
        assert!(res.status.success(), "{args:?}: {}", stderr(&res));
        let shipped = std::fs::read(fixture(&name)).unwrap_or_default();
        assert!(
            std::fs::read(&out).unwrap() == shipped,
            "fixtures/{name} differs from what regenerate.sh makes (run fixtures/regenerate.sh)"
        );
        made.push(name);
    }
    made.sort();
    let mut shipped: Vec<String> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    shipped.sort();
    assert_eq!(
        made, shipped,
        "every shipped .gguf comes from regenerate.sh"
    );
    let mut expected: Vec<String> = SHIPPED.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(shipped, expected);
}

#[test]
fn shipped_fixtures_fit_the_size_budget() {
    let total: u64 = SHIPPED
        .iter()
        .map(|n| std::fs::metadata(fixture(n)).unwrap().len())
        .sum();
    assert!(total <= 20_000_000, "fixtures take {total} bytes");
}

/// What a fixture must look like, stated from the conventions (docs/conventions.md, "The file"), not from
/// the generator.
struct Expect {
    file: &'static str,
    arch: &'static str,
    layers: u64,
    hidden: u64,
    heads: u64,
    heads_kv: u64,
    q_lora: Option<u64>,
    kv_lora: u64,
    nope: u64,
    rope: u64,
    v: u64,
    mla_keys: bool,
    pairing: &'static str,
    base: f64,
    /// factor, original context, mscale_all_dim, beta_fast, beta_slow
    yarn: Option<(f64, u64, f64, f64, f64)>,
    rms_eps: f64,
    softmax: &'static str,
    split: bool,
    /// Type of 2-D/3-D weights, and of attn_k_b when it differs (K-quant fallback).
    ty: &'static str,
    k_b_ty: &'static str,
    longrope: bool,
}

/// (bytes per block, block size)
fn type_size(t: &str) -> (u64, u64) {
    match t {
        "F32" => (4, 1),
        "BF16" | "F16" => (2, 1),
        "Q8_0" => (34, 32),
        "Q4_0" => (18, 32),
        "Q5_0" => (22, 32),
        "Q4_K" => (144, 256),
        other => panic!("{other}"),
    }
}

fn check(e: &Expect) {
    let j = inspect_json(&fixture(e.file));
    let c = &j["config"];
    assert_eq!(c["arch"], e.arch);
    assert_eq!(c["n_layer"], e.layers);
    assert_eq!(c["hidden"], e.hidden);
    assert_eq!(c["n_head"], e.heads);
    assert_eq!(c["n_head_kv"], e.heads_kv);
    assert_eq!(c["q_lora_rank"].as_u64(), e.q_lora);
    assert_eq!(c["kv_lora_rank"], e.kv_lora);
    assert_eq!(c["qk_nope"], e.nope);
    assert_eq!(c["qk_rope"], e.rope);
    assert_eq!(c["v_head_dim"], e.v);
    assert_eq!(c["mla_keys"], e.mla_keys);
    assert_eq!(j["qk_head_dim"], e.nope + e.rope);
    assert_eq!(j["cache_row"], e.kv_lora + e.rope);
    assert_eq!(c["rope"]["pairing"], e.pairing);
    assert_eq!(c["rope"]["dim"], e.rope);
    assert_eq!(c["rope"]["base"], e.base);
    assert_relative_eq!(
        c["rms_eps"].as_f64().unwrap(),
        e.rms_eps,
        epsilon = 0.0,
        max_relative = 1e-6
    );
    match e.yarn {
        None => assert!(c["rope"]["yarn"].is_null()),
        Some((factor, orig, mscale_all_dim, fast, slow)) => {
            let y = &c["rope"]["yarn"];
            assert_eq!(y["factor"], factor);
            assert_eq!(y["original_context"], orig);
            assert_abs_diff_eq!(
                y["mscale_all_dim"].as_f64().unwrap(),
                mscale_all_dim,
                epsilon = 1e-6
            );
            // The file holds the converter's 0.1·mscale_all_dim.
            assert_abs_diff_eq!(
                y["log_multiplier_raw"].as_f64().unwrap(),
                0.1 * mscale_all_dim,
                epsilon = 1e-7
            );
            assert_eq!(y["beta_fast"], fast);
            assert_eq!(y["beta_slow"], slow);
        }
    }
    let softmax = c["softmax_scale"].as_f64().unwrap();
    assert_eq!(format!("{softmax:.6}"), e.softmax);
    assert_eq!(c["vocab_size"], 512);
    assert_eq!(c["rope"]["freq_factors_long"].is_string(), e.longrope);
    assert_eq!(c["rope"]["freq_factors_short"].is_string(), e.longrope);

    // Every layer's attention tensors: names in order, types, ne and byte sizes.
    let (ex, h, lkv, r, p, v) = (e.hidden, e.heads, e.kv_lora, e.rope, e.nope, e.v);
    let layers = j["layers"].as_array().unwrap();
    assert_eq!(layers.len() as u64, e.layers);
    for (l, layer) in layers.iter().enumerate() {
        let mut want: Vec<(&str, Vec<u64>)> = vec![("attn_norm", vec![ex])];
        match e.q_lora {
            Some(lq) => want.extend([
                ("attn_q_a", vec![ex, lq]),
                ("attn_q_a_norm", vec![lq]),
                ("attn_q_b", vec![lq, h * (p + r)]),
            ]),
            None => want.push(("attn_q", vec![ex, h * (p + r)])),
        }
        want.push(("attn_kv_a_mqa", vec![ex, lkv + r]));
        want.push(("attn_kv_a_norm", vec![lkv]));
        if e.split {
            want.push(("attn_k_b", vec![p, lkv, h]));
            want.push(("attn_v_b", vec![lkv, v, h]));
        } else {
            want.push(("attn_kv_b", vec![lkv, h * (p + v)]));
        }
        want.push(("attn_output", vec![h * v, ex]));
        let got = layer["tensors"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "layer {l} tensors: {got:?}");
        for (t, (name, ne)) in got.iter().zip(&want) {
            assert_eq!(t["name"], format!("blk.{l}.{name}.weight"));
            assert_eq!(t["ne"], J::from(ne.clone()), "{name}");
            let ty = match (ne.len(), *name) {
                (1, _) => "F32",
                (_, "attn_k_b") => e.k_b_ty,
                _ => e.ty,
            };
            assert_eq!(t["type"], ty, "{name}");
            let (bytes, block) = type_size(ty);
            assert_eq!(
                t["bytes"],
                ne.iter().product::<u64>() / block * bytes,
                "{name}"
            );
        }
    }
}

#[test]
fn inspect_deepseek_v3_yarn() {
    check(&Expect {
        file: "deepseek-v3-yarn-q4_k.gguf",
        arch: "deepseek2",
        layers: 2,
        hidden: 512,
        heads: 8,
        heads_kv: 1,
        q_lora: Some(256),
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        mla_keys: true,
        pairing: "norm",
        base: 10000.0,
        yarn: Some((40.0, 4096, 1.0, 32.0, 1.0)),
        rms_eps: 1e-6,
        softmax: "0.135234",
        split: true,
        ty: "Q4_K",
        k_b_ty: "Q5_0",
        longrope: false,
    });
}

#[test]
fn inspect_glm5() {
    check(&Expect {
        file: "glm-5-q4_0.gguf",
        arch: "glm-dsa",
        layers: 1,
        hidden: 128,
        heads: 64,
        heads_kv: 1,
        q_lora: Some(64),
        kv_lora: 512,
        nope: 192,
        rope: 64,
        v: 256,
        mla_keys: true,
        pairing: "norm",
        base: 1e6,
        yarn: None,
        rms_eps: 1e-5,
        softmax: "0.062500",
        split: true,
        ty: "Q4_0",
        k_b_ty: "Q4_0",
        longrope: false,
    });
}

#[test]
fn inspect_deepseek_v3_legacy_kv_b() {
    check(&Expect {
        file: "deepseek-v3-legacy-kv-b-q8_0.gguf",
        arch: "deepseek2",
        layers: 1,
        hidden: 256,
        heads: 4,
        heads_kv: 4,
        q_lora: Some(256),
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        mla_keys: false,
        pairing: "norm",
        base: 10000.0,
        // The pre-#12801 converter wrote no betas: the loader's defaults.
        yarn: Some((40.0, 4096, 1.0, 32.0, 1.0)),
        rms_eps: 1e-6,
        softmax: "0.135234",
        split: false,
        ty: "Q8_0",
        k_b_ty: "Q8_0",
        longrope: false,
    });
}

#[test]
fn inspect_deepseek_v2_lite_no_q_lora() {
    check(&Expect {
        file: "deepseek-v2-lite-bf16.gguf",
        arch: "deepseek2",
        layers: 1,
        hidden: 256,
        heads: 4,
        heads_kv: 1,
        q_lora: None,
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        mla_keys: true,
        pairing: "norm",
        base: 10000.0,
        yarn: Some((40.0, 4096, 0.707, 32.0, 1.0)),
        rms_eps: 1e-6,
        softmax: "0.114721",
        split: true,
        ty: "BF16",
        k_b_ty: "BF16",
        longrope: false,
    });
}

#[test]
fn inspect_minicpm3() {
    check(&Expect {
        file: "minicpm3-f32.gguf",
        arch: "minicpm3",
        layers: 1,
        hidden: 256,
        heads: 4,
        heads_kv: 4,
        q_lora: Some(128),
        kv_lora: 256,
        nope: 64,
        rope: 32,
        v: 64,
        mla_keys: false,
        pairing: "neox",
        base: 10000.0,
        yarn: None,
        rms_eps: 1e-5,
        softmax: "0.102062",
        split: false,
        ty: "F32",
        k_b_ty: "F32",
        longrope: true,
    });
}

fn meta(file: &str) -> Vec<(String, Value)> {
    GgufFile::open(fixture(file)).unwrap().metadata
}

fn keys(m: &[(String, Value)]) -> Vec<&str> {
    m.iter().map(|(k, _)| k.as_str()).collect()
}

fn get<'a>(m: &'a [(String, Value)], k: &str) -> &'a Value {
    &m.iter()
        .find(|(key, _)| key == k)
        .unwrap_or_else(|| panic!("{k}"))
        .1
}

#[test]
fn new_style_metadata_is_what_the_converter_writes() {
    let m = meta("deepseek-v3-yarn-q4_k.gguf");
    let a = |k: &str| format!("deepseek2.{k}");
    assert_eq!(
        m[0],
        (
            "general.architecture".into(),
            Value::String("deepseek2".into())
        )
    );
    let want: Vec<String> = [
        "block_count",
        "context_length",
        "embedding_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scaling.original_context_length",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
    ]
    .iter()
    .map(|k| a(k))
    .collect();
    let got = keys(&m);
    let pos = got.iter().position(|k| *k == want[0]).unwrap();
    assert_eq!(
        &got[pos..pos + want.len()],
        want.iter().map(|s| s.as_str()).collect::<Vec<_>>()
    );
    assert_eq!(get(&m, &a("attention.head_count_kv")), &Value::U32(1));
    assert_eq!(get(&m, &a("attention.key_length")), &Value::U32(576));
    assert_eq!(get(&m, &a("attention.value_length")), &Value::U32(512));
    assert_eq!(get(&m, &a("attention.key_length_mla")), &Value::U32(192));
    assert_eq!(get(&m, &a("attention.value_length_mla")), &Value::U32(128));
    assert_eq!(get(&m, &a("attention.q_lora_rank")), &Value::U32(256));
    assert_eq!(get(&m, &a("attention.kv_lora_rank")), &Value::U32(512));
    assert_eq!(get(&m, &a("rope.dimension_count")), &Value::U32(64));
    assert_eq!(
        get(&m, &a("rope.scaling.type")),
        &Value::String("yarn".into())
    );
    assert_eq!(get(&m, &a("rope.scaling.factor")), &Value::F32(40.0));
    assert_eq!(
        get(&m, &a("rope.scaling.yarn_log_multiplier")),
        &Value::F32(0.1)
    );
    assert_eq!(get(&m, "general.file_type"), &Value::U32(15));

    let g = meta("glm-5-q4_0.gguf");
    assert_eq!(
        get(&g, "glm-dsa.attention.key_length_mla"),
        &Value::U32(256)
    );
    assert_eq!(
        get(&g, "glm-dsa.attention.value_length_mla"),
        &Value::U32(256)
    );
    assert_eq!(
        get(&g, "glm-dsa.attention.indexer.top_k"),
        &Value::U32(2048)
    );
    assert!(!keys(&g).iter().any(|k| k.contains("rope.scaling")));

    let v2 = meta("deepseek-v2-lite-bf16.gguf");
    assert!(!keys(&v2).contains(&"deepseek2.attention.q_lora_rank"));
    assert_eq!(
        get(&v2, "deepseek2.rope.scaling.yarn_log_multiplier"),
        &Value::F32(0.0707)
    );
}

#[test]
fn legacy_and_minicpm3_metadata() {
    let m = meta("deepseek-v3-legacy-kv-b-q8_0.gguf");
    assert_eq!(get(&m, "deepseek2.attention.head_count_kv"), &Value::U32(4));
    assert_eq!(get(&m, "deepseek2.attention.key_length"), &Value::U32(192));
    assert_eq!(
        get(&m, "deepseek2.attention.value_length"),
        &Value::U32(128)
    );
    assert!(!keys(&m)
        .iter()
        .any(|k| k.ends_with("_mla") || k.contains("yarn_beta")));
    assert_eq!(
        get(&m, "deepseek2.rope.scaling.yarn_log_multiplier"),
        &Value::F32(0.1)
    );

    let c = meta("minicpm3-f32.gguf");
    assert_eq!(get(&c, "minicpm3.attention.head_count_kv"), &Value::U32(4));
    assert_eq!(get(&c, "minicpm3.attention.key_length"), &Value::U32(96));
    // hidden/heads = 256/4 = 64 = v_head_dim, so, like the converter, no value_length key: llama.cpp
    // (and our loader) default the head size to hidden/heads.
    assert!(!keys(&c).contains(&"minicpm3.attention.value_length"));
    assert!(!keys(&c).iter().any(
        |k| k.ends_with("_mla") || k.contains("rope.") && !k.ends_with("rope.dimension_count")
    ));
    let f = GgufFile::open(fixture("minicpm3-f32.gguf")).unwrap();
    for n in ["rope_factors_long.weight", "rope_factors_short.weight"] {
        let t = f.tensor(n).unwrap();
        assert_eq!(
            (t.ne.as_slice(), t.ty.to_string().as_str()),
            (&[16u64][..], "F32")
        );
    }
}

#[test]
fn load_layer_prints_norms() {
    let o = run(&[
        "inspect",
        fixture("deepseek-v3-yarn-q4_k.gguf").to_str().unwrap(),
        "--load-layer",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: J = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["layer"], 1);
    assert_eq!(j["kv_b_layout"], "split");
    let names: Vec<&str> = j["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["weight"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "attn_norm",
            "q_a",
            "q_a_norm",
            "q_b",
            "kv_a",
            "kv_a_norm",
            "w_uk",
            "w_uv",
            "o"
        ]
    );
    for t in j["tensors"].as_array().unwrap() {
        let l2 = t["l2"].as_f64().unwrap();
        assert!(l2.is_finite() && l2 > 0.0, "{t}");
    }
    assert_eq!(j["tensors"][6]["shape"], J::from(vec![8, 128, 512]));
}
