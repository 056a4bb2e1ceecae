//! The structural mutations of a parsed seed, one function each; `mutate_doc` draws which one runs.
//! Each draws from the RNG in exactly the order it always has: a corpus and its findings stay
//! reproducible from `(seed, iteration)` across versions.

use super::{
    int_bytes, interesting, key_for, random_value, raw_u64, tensor_names, ARCHS, WEIRD_NAMES,
};
use crate::fuzz::doc::{Doc, Kv, Val};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;

/// A scalar value: interesting numbers and float specials, in its own width.
pub(super) fn scalar_value(doc: &mut Doc, rng: &mut StdRng) {
    let nk = doc.kvs.len();
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

/// The declared type: the old bytes get read as another type.
pub(super) fn declared_type(doc: &mut Doc, rng: &mut StdRng) {
    let nk = doc.kvs.len();
    let kv = &mut doc.kvs[rng.random_range(0..nk)];
    kv.ty = if rng.random_bool(0.9) {
        rng.random_range(0..14)
    } else {
        rng.random()
    };
}

/// Lengths that lie.
pub(super) fn lying_length(doc: &mut Doc, rng: &mut StdRng) {
    let nk = doc.kvs.len();
    let kv = &mut doc.kvs[rng.random_range(0..nk)];
    match &mut kv.val {
        Val::Str { len, .. } | Val::Arr { len, .. } if rng.random_bool(0.7) => {
            *len = interesting(rng, *len)
        }
        _ => kv.key_len = interesting(rng, kv.key_len),
    }
}

/// Arrays: element type, size, nesting.
pub(super) fn array_shape(doc: &mut Doc, rng: &mut StdRng) {
    let nk = doc.kvs.len();
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

/// Key names: another key the tool reads (the value keeps its type), or control characters.
pub(super) fn rename_key(doc: &mut Doc, rng: &mut StdRng) {
    let nk = doc.kvs.len();
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

/// Duplicate, remove or swap metadata entries.
pub(super) fn reorder_kvs(doc: &mut Doc, rng: &mut StdRng) {
    let nk = doc.kvs.len();
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

/// A new key the tool reads, with a random typed value.
pub(super) fn new_key(doc: &mut Doc, rng: &mut StdRng) {
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

/// general.alignment: odd values and types; the data may or may not be re-padded to match.
pub(super) fn alignment(doc: &mut Doc, rng: &mut StdRng) {
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

/// A tensor dim: an interesting number, another dim, or 0 (sometimes a dim is added or moved first).
pub(super) fn tensor_dims(doc: &mut Doc, rng: &mut StdRng) {
    let nt = doc.tensors.len();
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

/// The tensor's dim count: a lie, or one dim fewer.
pub(super) fn tensor_n_dims(doc: &mut Doc, rng: &mut StdRng) {
    let nt = doc.tensors.len();
    let t = &mut doc.tensors[rng.random_range(0..nt)];
    if rng.random_bool(0.5) {
        t.n_dims = *[0u32, 1, 2, 4, 5, u32::MAX].choose(rng).unwrap();
    } else {
        t.dims.pop();
        t.n_dims = t.dims.len() as u32;
    }
}

/// The tensor's ggml type: often a known one, sometimes any u32.
pub(super) fn tensor_type(doc: &mut Doc, rng: &mut StdRng) {
    let nt = doc.tensors.len();
    let t = &mut doc.tensors[rng.random_range(0..nt)];
    t.ty = match rng.random_range(0..4) {
        0 => rng.random(),
        _ => rng.random_range(0..42),
    };
}

/// The tensor's data offset: another tensor's, the end of the data, misaligned, or interesting.
pub(super) fn tensor_offset(doc: &mut Doc, rng: &mut StdRng) {
    let nt = doc.tensors.len();
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

/// Tensor names: another tensor the tool reads, or control characters.
pub(super) fn tensor_name(doc: &mut Doc, rng: &mut StdRng) {
    let nt = doc.tensors.len();
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

/// Duplicate, remove or swap tensor infos.
pub(super) fn reorder_tensors(doc: &mut Doc, rng: &mut StdRng) {
    let nt = doc.tensors.len();
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

/// Tensor data: specials in fp16 scales and raw bytes.
pub(super) fn data_specials(doc: &mut Doc, rng: &mut StdRng) {
    let n = rng.random_range(1..64);
    for _ in 0..n {
        let i = rng.random_range(0..doc.data.len() - 1);
        let v = *[0x7c00u16, 0xfc00, 0x7e00, 0xffff, 0x0001, 0x0000]
            .choose(rng)
            .unwrap();
        doc.data[i..i + 2].copy_from_slice(&v.to_le_bytes());
    }
}

/// A short data section.
pub(super) fn truncate_data(doc: &mut Doc, rng: &mut StdRng) {
    let keep = rng.random_range(0..doc.data.len());
    doc.data.truncate(keep);
}

/// Splice another seed's metadata or data into this one.
pub(super) fn splice(doc: &mut Doc, other: Option<&Doc>, rng: &mut StdRng) {
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
