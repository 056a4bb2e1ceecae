//! A GGUF-aware mutator. Seeds are parsed leniently into `Doc` (every count and length kept as written,
//! so a mutation can make them lie), mutated structurally, written back, then optionally byte-mutated.
//! A seed that does not parse is only byte-mutated.

mod structural;

use super::doc::{scalar_width, Doc, Val};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;

const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    31,
    32,
    63,
    64,
    128,
    255,
    256,
    512,
    1023,
    1024,
    4096,
    65535,
    65536,
    1 << 20,
    (1 << 20) + 1,
    1 << 24,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 40,
    1 << 62,
    (1 << 63) - 1,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

/// Keys the tool reads (with `{a}` the architecture); renames and insertions draw from these.
const KEYS: &[&str] = &[
    "{a}.block_count",
    "{a}.embedding_length",
    "{a}.attention.head_count",
    "{a}.attention.head_count_kv",
    "{a}.attention.kv_lora_rank",
    "{a}.attention.q_lora_rank",
    "{a}.rope.dimension_count",
    "{a}.attention.key_length_mla",
    "{a}.attention.value_length_mla",
    "{a}.attention.key_length",
    "{a}.attention.value_length",
    "{a}.attention.layer_norm_rms_epsilon",
    "{a}.rope.freq_base",
    "{a}.rope.scaling.type",
    "{a}.rope.scaling.factor",
    "{a}.rope.scaling.yarn_log_multiplier",
    "{a}.rope.scaling.original_context_length",
    "{a}.rope.scaling.yarn_beta_fast",
    "{a}.rope.scaling.yarn_beta_slow",
    "{a}.rope.scaling.yarn_ext_factor",
    "{a}.rope.scaling.attn_factor",
    "{a}.nextn_predict_layers",
    "{a}.context_length",
    "general.architecture",
    "general.alignment",
    "general.name",
];

const ARCHS: &[&str] = &[
    "deepseek2",
    "glm-dsa",
    "deepseek32",
    "mistral4",
    "minicpm3",
    "plm",
    "llama",
    "",
];

const WEIRD_NAMES: &[&[u8]] = &[
    b"",
    b"\n",
    b"a\nb",
    b"\x1b[31mred\x1b[0m",
    b"\r\x07\x00",
    b"\xff\xfe\xc3",
    b"\"quoted\\",
    b"blk.0.attn_norm.weight\n",
];

fn tensor_names() -> Vec<String> {
    let mut v: Vec<String> = crate::model::weights::tensor_names(0).into();
    v.extend(crate::model::weights::tensor_names(1));
    v.extend(
        [
            "rope_factors_short.weight",
            "rope_factors_long.weight",
            "rope_freqs.weight",
            "token_embd.weight",
        ]
        .map(String::from),
    );
    v
}

fn interesting(rng: &mut StdRng, near: u64) -> u64 {
    match rng.random_range(0..6) {
        0 => near.wrapping_add(1),
        1 => near.wrapping_sub(1),
        2 => near.wrapping_mul(2),
        3 => near / 2,
        4 => rng.random(),
        _ => *INTERESTING.choose(rng).unwrap(),
    }
}

fn int_bytes(rng: &mut StdRng, width: usize, near: u64) -> Vec<u8> {
    let v = if rng.random_bool(0.3) && width >= 4 {
        // Float specials for the f32/f64 keys.
        let f = *[
            f64::NAN,
            f64::INFINITY,
            -1.0,
            0.0,
            1e-30,
            1e30,
            -0.0,
            1.0,
            0.1,
        ]
        .choose(rng)
        .unwrap();
        if width == 4 {
            (f as f32).to_bits() as u64
        } else {
            f.to_bits()
        }
    } else {
        interesting(rng, near)
    };
    v.to_le_bytes()[..width].to_vec()
}

fn raw_u64(r: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b[..r.len().min(8)].copy_from_slice(&r[..r.len().min(8)]);
    u64::from_le_bytes(b)
}

fn random_value(rng: &mut StdRng) -> (u32, Val) {
    let ty = rng.random_range(0..13u32);
    let val = match ty {
        8 => {
            let bytes = if rng.random_bool(0.5) {
                ARCHS.choose(rng).unwrap().as_bytes().to_vec()
            } else {
                WEIRD_NAMES.choose(rng).unwrap().to_vec()
            };
            Val::Str {
                len: bytes.len() as u64,
                bytes,
            }
        }
        9 => {
            let n = *[0usize, 1, 3, 100, 5000].choose(rng).unwrap();
            Val::Arr {
                elem: 0,
                len: n as u64,
                items: vec![Val::Raw(vec![1]); n],
            }
        }
        _ => Val::Raw(int_bytes(rng, scalar_width(ty).unwrap(), 1)),
    };
    (ty, val)
}

fn key_for(rng: &mut StdRng, doc: &Doc) -> Vec<u8> {
    let a = if rng.random_bool(0.9) {
        doc.arch()
    } else {
        ARCHS.choose(rng).unwrap().to_string()
    };
    KEYS.choose(rng).unwrap().replace("{a}", &a).into_bytes()
}

/// One structural mutation of `doc`; `other` is another seed, for splicing. Which one is the first
/// draw; an entry kind the seed lacks (no metadata, no tensors, no data) leaves it unchanged.
pub fn mutate_doc(doc: &mut Doc, other: Option<&Doc>, rng: &mut StdRng) {
    use structural as s;
    let kvs = !doc.kvs.is_empty();
    let tensors = !doc.tensors.is_empty();
    let data = !doc.data.is_empty();
    match rng.random_range(0..22) {
        0 => doc.version = *[0u32, 1, 2, 3, 4, u32::MAX].choose(rng).unwrap(),
        1 => doc.n_kv = interesting(rng, doc.n_kv),
        2 => doc.n_tensors = interesting(rng, doc.n_tensors),
        3 | 4 if kvs => s::scalar_value(doc, rng),
        5 if kvs => s::declared_type(doc, rng),
        6 if kvs => s::lying_length(doc, rng),
        7 if kvs => s::array_shape(doc, rng),
        8 if kvs => s::rename_key(doc, rng),
        9 if kvs => s::reorder_kvs(doc, rng),
        10 => s::new_key(doc, rng),
        11 => s::alignment(doc, rng),
        12 | 13 if tensors => s::tensor_dims(doc, rng),
        14 if tensors => s::tensor_n_dims(doc, rng),
        15 if tensors => s::tensor_type(doc, rng),
        16 if tensors => s::tensor_offset(doc, rng),
        17 if tensors => s::tensor_name(doc, rng),
        18 if tensors => s::reorder_tensors(doc, rng),
        19 if data => s::data_specials(doc, rng),
        20 if data => s::truncate_data(doc, rng),
        21 => s::splice(doc, other, rng),
        _ => {}
    }
}

/// One plain byte-level mutation.
pub fn mutate_bytes(b: &mut Vec<u8>, rng: &mut StdRng) {
    if b.is_empty() {
        b.extend_from_slice(b"GGUF");
        return;
    }
    // Most of the structure sits in the first few KB: aim there half the time.
    let pos = |rng: &mut StdRng, len: usize| {
        if rng.random_bool(0.5) {
            rng.random_range(0..len.min(4096))
        } else {
            rng.random_range(0..len)
        }
    };
    let len = b.len();
    match rng.random_range(0..7) {
        0 => {
            let i = pos(rng, len);
            b[i] ^= 1 << rng.random_range(0..8);
        }
        1 => {
            let i = pos(rng, len);
            b[i] = rng.random();
        }
        2 => {
            let w = *[4usize, 8].choose(rng).unwrap();
            if len >= w {
                let i = pos(rng, len - w + 1);
                let v = interesting(rng, raw_u64(&b[i..i + w]));
                b[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
        }
        3 => b.truncate(pos(rng, len)),
        4 => {
            let i = pos(rng, len);
            let n = rng.random_range(1..=16usize).min(len - i);
            b.drain(i..i + n);
        }
        5 => {
            let i = pos(rng, len);
            let n = rng.random_range(1..=64usize).min(len - i);
            let chunk = b[i..i + n].to_vec();
            let j = pos(rng, len);
            b.splice(j..j, chunk);
        }
        _ => {
            let n = rng.random_range(1..64);
            b.extend((0..n).map(|_| rng.random::<u8>()));
        }
    }
}

/// The input of one execution: a seed, 1..=4 structural mutations (if it parses), then maybe a few byte
/// mutations. Deterministic in `rng`.
pub fn generate(seeds: &[Seed], rng: &mut StdRng) -> Vec<u8> {
    let s = &seeds[pick_seed(seeds, rng)];
    let other = seeds.choose(rng).and_then(|o| o.doc.as_ref());
    let mut bytes = match &s.doc {
        Some(d) if rng.random_bool(0.85) => {
            let mut d = d.clone();
            let n = 1 + (rng.random_range(0..8u32)).trailing_zeros().min(3);
            for _ in 0..n {
                mutate_doc(&mut d, other, rng);
            }
            d.write()
        }
        _ => s.bytes.clone(),
    };
    if s.doc.is_none() || rng.random_bool(0.3) {
        for _ in 0..rng.random_range(1..=4) {
            mutate_bytes(&mut bytes, rng);
        }
    }
    bytes
}

fn pick_seed(seeds: &[Seed], rng: &mut StdRng) -> usize {
    let total: u32 = seeds.iter().map(|s| s.weight).sum();
    let mut x = rng.random_range(0..total.max(1));
    for (i, s) in seeds.iter().enumerate() {
        if x < s.weight {
            return i;
        }
        x -= s.weight;
    }
    0
}

/// A starting file, with its parse and how often it is picked (relative weight).
pub struct Seed {
    pub name: String,
    pub bytes: Vec<u8>,
    pub doc: Option<Doc>,
    pub weight: u32,
}

impl Seed {
    pub fn new(name: String, bytes: Vec<u8>, weight: u32) -> Seed {
        let doc = Doc::parse(&bytes);
        Seed {
            name,
            bytes,
            doc,
            weight,
        }
    }
}
