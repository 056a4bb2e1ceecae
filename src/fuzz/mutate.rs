//! A GGUF-aware mutator. Seeds are parsed leniently into `Doc` (every count and length kept as written,
//! so a mutation can make them lie), mutated structurally, written back, then optionally byte-mutated.
//! A seed that does not parse is only byte-mutated.

use super::doc::{scalar_width, Doc, Kv, Val};
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

/// One structural mutation of `doc`; `other` is another seed, for splicing.
pub fn mutate_doc(doc: &mut Doc, other: Option<&Doc>, rng: &mut StdRng) {
    let nk = doc.kvs.len();
    let nt = doc.tensors.len();
    match rng.random_range(0..22) {
        0 => doc.version = *[0u32, 1, 2, 3, 4, u32::MAX].choose(rng).unwrap(),
        1 => doc.n_kv = interesting(rng, doc.n_kv),
        2 => doc.n_tensors = interesting(rng, doc.n_tensors),
        // A scalar value: interesting numbers and float specials, in its own width.
        3 | 4 if nk > 0 => {
            let kv = &mut doc.kvs[rng.random_range(0..nk)];
            match &mut kv.val {
                Val::Raw(r) => {
                    let near = raw_u64(r);
                    *r = int_bytes(rng, r.len(), near);
                }
                Val::Str { bytes, len } => {
                    *bytes = if rng.random_bool(0.5) {
                        ARCHS.choose(rng).unwrap().as_bytes().to_vec()
                    } else {
                        WEIRD_NAMES.choose(rng).unwrap().to_vec()
                    };
                    *len = bytes.len() as u64;
                }
                Val::Arr { items, len, .. } => {
                    if let Some(Val::Raw(r)) = items.first_mut() {
                        let near = raw_u64(r);
                        *r = int_bytes(rng, r.len(), near);
                    } else {
                        *len = interesting(rng, *len);
                    }
                }
            }
        }
        // The declared type: the old bytes get read as another type.
        5 if nk > 0 => {
            let kv = &mut doc.kvs[rng.random_range(0..nk)];
            kv.ty = if rng.random_bool(0.9) {
                rng.random_range(0..14)
            } else {
                rng.random()
            };
        }
        // Lengths that lie.
        6 if nk > 0 => {
            let kv = &mut doc.kvs[rng.random_range(0..nk)];
            match &mut kv.val {
                Val::Str { len, .. } | Val::Arr { len, .. } if rng.random_bool(0.7) => {
                    *len = interesting(rng, *len)
                }
                _ => kv.key_len = interesting(rng, kv.key_len),
            }
        }
        // Arrays: element type, size, nesting.
        7 if nk > 0 => {
            let kv = &mut doc.kvs[rng.random_range(0..nk)];
            match &mut kv.val {
                Val::Arr { elem, len, items } => match rng.random_range(0..3) {
                    0 => *elem = rng.random_range(0..14),
                    1 => {
                        let n = *[0usize, 1, 1000, 100_000].choose(rng).unwrap();
                        let item = items.first().cloned().unwrap_or(Val::Raw(vec![0]));
                        items.resize(n, item);
                        *len = n as u64;
                    }
                    _ => {
                        let inner = Val::Arr {
                            elem: *elem,
                            len: *len,
                            items: std::mem::take(items),
                        };
                        *elem = 9;
                        *len = 1;
                        *items = vec![inner];
                    }
                },
                _ => {
                    let depth = rng.random_range(1..12);
                    let mut v = Val::Raw(vec![1, 0, 0, 0]);
                    let mut e = 4;
                    for _ in 0..depth {
                        v = Val::Arr {
                            elem: e,
                            len: 1,
                            items: vec![v],
                        };
                        e = 9;
                    }
                    kv.ty = 9;
                    kv.val = v;
                }
            }
        }
        // Key names: another key the tool reads (the value keeps its type), or control characters.
        8 if nk > 0 => {
            let i = rng.random_range(0..nk);
            let key = if rng.random_bool(0.8) {
                key_for(rng, doc)
            } else {
                let mut k = doc.kvs[i].key.clone();
                k.extend_from_slice(WEIRD_NAMES.choose(rng).unwrap());
                k
            };
            doc.kvs[i].key_len = key.len() as u64;
            doc.kvs[i].key = key;
        }
        // Duplicate, remove or swap entries.
        9 if nk > 0 => {
            let i = rng.random_range(0..nk);
            match rng.random_range(0..3) {
                0 => {
                    let kv = doc.kvs[i].clone();
                    doc.kvs.insert(rng.random_range(0..=nk), kv);
                    doc.n_kv += 1;
                }
                1 => {
                    doc.kvs.remove(i);
                    doc.n_kv = doc.n_kv.saturating_sub(1);
                }
                _ => doc.kvs.swap(i, rng.random_range(0..nk)),
            }
        }
        // A new key the tool reads, with a random typed value.
        10 => {
            let key = key_for(rng, doc);
            let (ty, val) = random_value(rng);
            doc.kvs.push(Kv {
                key_len: key.len() as u64,
                key,
                ty,
                val,
            });
            doc.n_kv += 1;
        }
        // general.alignment: odd values and types; the data may or may not be re-padded to match.
        11 => {
            let a = *[
                0u64,
                1,
                2,
                3,
                8,
                16,
                24,
                31,
                64,
                4096,
                1 << 20,
                1 << 21,
                u64::MAX,
            ]
            .choose(rng)
            .unwrap();
            let (ty, raw) = match rng.random_range(0..4) {
                0 => (4, (a as u32).to_le_bytes().to_vec()),
                1 => (10, a.to_le_bytes().to_vec()),
                2 => (0, vec![a as u8]),
                _ => (5, (a as u32).to_le_bytes().to_vec()),
            };
            doc.kvs.retain(|kv| kv.key != b"general.alignment");
            doc.kvs.push(Kv {
                key: b"general.alignment".to_vec(),
                key_len: 17,
                ty,
                val: Val::Raw(raw),
            });
            doc.n_kv = doc.kvs.len() as u64;
            if rng.random_bool(0.7) && a > 0 && a <= 1 << 16 {
                doc.pad = a;
            }
        }
        // Tensor dims, their count, type and offset.
        12 | 13 if nt > 0 => {
            let t = &mut doc.tensors[rng.random_range(0..nt)];
            if t.dims.is_empty() || rng.random_bool(0.2) {
                t.dims.push(1);
            }
            let d = rng.random_range(0..t.dims.len());
            t.dims[d] = match rng.random_range(0..3) {
                0 => interesting(rng, t.dims[d]),
                1 => t.dims[rng.random_range(0..t.dims.len())],
                _ => 0,
            };
            if rng.random_bool(0.1) {
                t.dims.swap(0, d);
            }
            t.n_dims = t.dims.len() as u32;
        }
        14 if nt > 0 => {
            let t = &mut doc.tensors[rng.random_range(0..nt)];
            if rng.random_bool(0.5) {
                t.n_dims = *[0u32, 1, 2, 4, 5, u32::MAX].choose(rng).unwrap();
            } else {
                t.dims.pop();
                t.n_dims = t.dims.len() as u32;
            }
        }
        15 if nt > 0 => {
            let t = &mut doc.tensors[rng.random_range(0..nt)];
            t.ty = match rng.random_range(0..4) {
                0 => rng.random(),
                _ => rng.random_range(0..42),
            };
        }
        16 if nt > 0 => {
            let i = rng.random_range(0..nt);
            let other_off = doc.tensors[rng.random_range(0..nt)].offset;
            let data_len = doc.data.len() as u64;
            let t = &mut doc.tensors[i];
            t.offset = match rng.random_range(0..4) {
                0 => other_off,
                1 => data_len,
                2 => t.offset + *[1u64, 2, 4, 16].choose(rng).unwrap(),
                _ => interesting(rng, t.offset),
            };
        }
        // Tensor names: another tensor the tool reads, or control characters.
        17 if nt > 0 => {
            let t = &mut doc.tensors[rng.random_range(0..nt)];
            t.name = if rng.random_bool(0.7) {
                tensor_names().choose(rng).unwrap().clone().into_bytes()
            } else {
                let mut n = t.name.clone();
                n.extend_from_slice(WEIRD_NAMES.choose(rng).unwrap());
                n
            };
            t.name_len = if rng.random_bool(0.9) {
                t.name.len() as u64
            } else {
                interesting(rng, t.name.len() as u64)
            };
        }
        18 if nt > 0 => {
            let i = rng.random_range(0..nt);
            match rng.random_range(0..3) {
                0 => {
                    let t = doc.tensors[i].clone();
                    doc.tensors.push(t);
                    doc.n_tensors += 1;
                }
                1 => {
                    doc.tensors.remove(i);
                    doc.n_tensors = doc.n_tensors.saturating_sub(1);
                }
                _ => doc.tensors.swap(i, rng.random_range(0..nt)),
            }
        }
        // Tensor data: specials in fp16 scales and raw bytes, or a short data section.
        19 if !doc.data.is_empty() => {
            let n = rng.random_range(1..64);
            for _ in 0..n {
                let i = rng.random_range(0..doc.data.len() - 1);
                let v = *[0x7c00u16, 0xfc00, 0x7e00, 0xffff, 0x0001, 0x0000]
                    .choose(rng)
                    .unwrap();
                doc.data[i..i + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        20 if !doc.data.is_empty() => {
            let keep = rng.random_range(0..doc.data.len());
            doc.data.truncate(keep);
        }
        // Splice another seed's metadata or data into this one.
        21 => {
            if let Some(o) = other {
                if rng.random_bool(0.5) {
                    doc.data = o.data.clone();
                } else if !o.kvs.is_empty() {
                    let kv = o.kvs.choose(rng).unwrap().clone();
                    doc.kvs.push(kv);
                    doc.n_kv += 1;
                }
            }
        }
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
