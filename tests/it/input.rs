//! Layer inputs: token embeddings (only the needed rows dequantized), seeded hidden states with outlier
//! channels, and captured `.npy` activations with clear errors for bad shapes and values.

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use mla_diff::error::Error;
use mla_diff::gguf::GgufFile;
use mla_diff::input::{from_token_ids, load_npy, random_hidden, LayerInputs};
use mla_diff::model::synthetic::Family;
use ndarray::{Array2, Array3};

fn write_embd(path: &std::path::Path, vocab: usize, hidden: usize, dtype: GgmlDType) -> Vec<f32> {
    let vals: Vec<f32> = (0..vocab * hidden)
        .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let t = Tensor::from_vec(vals.clone(), (vocab, hidden), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let arch = gguf_file::Value::String("deepseek2".into());
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(
        &mut f,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &q)],
    )
    .unwrap();
    // What the file holds after quantization, row-major [vocab, hidden].
    q.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn token_ids_read_their_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Family::DeepseekV3.test_config();
    cfg.hidden = 64;
    for (name, dt) in [
        ("f32", GgmlDType::F32),
        ("q8", GgmlDType::Q8_0),
        ("q4k", GgmlDType::Q4K),
    ] {
        let hidden = if dt == GgmlDType::Q4K { 256 } else { 64 };
        cfg.hidden = hidden;
        let path = dir.path().join(format!("{name}.gguf"));
        let stored = write_embd(&path, 50, hidden, dt);
        let f = GgufFile::open(&path).unwrap();
        let ids = [3u32, 0, 49, 3];
        let x = from_token_ids(&f, &cfg, &ids).unwrap();
        assert_eq!(x.dim(), (4, hidden));
        for (r, &id) in ids.iter().enumerate() {
            for c in 0..hidden {
                assert_eq!(
                    x[[r, c]],
                    stored[id as usize * hidden + c] as f64,
                    "{name} row {r}"
                );
            }
        }
        let e = from_token_ids(&f, &cfg, &[50]).unwrap_err();
        assert!(
            matches!(e, Error::Usage(_)) && e.to_string().contains("out of range"),
            "{e}"
        );
        cfg.hidden = hidden + 1;
        assert!(matches!(
            from_token_ids(&f, &cfg, &[1]),
            Err(Error::Tensor(_))
        ));
    }
}

#[test]
fn random_hidden_has_outliers_and_is_seeded() {
    let a = random_hidden(2048, 32, 1);
    assert_eq!(a, random_hidden(2048, 32, 1));
    assert_ne!(a, random_hidden(2048, 32, 2));
    let mut rms: Vec<f64> = a
        .columns()
        .into_iter()
        .map(|c| (c.iter().map(|v| v * v).sum::<f64>() / c.len() as f64).sqrt())
        .collect();
    rms.sort_by(f64::total_cmp);
    let median = rms[rms.len() / 2];
    let outliers = rms.iter().filter(|&&r| r > 20.0 * median).count();
    assert!((1..=6).contains(&outliers), "{outliers} outlier channels");
    assert!(a.iter().all(|v| v.is_finite()));
}

#[test]
fn npy_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let shared = Array2::<f32>::from_shape_fn((5, 8), |(i, j)| (i * 8 + j) as f32);
    ndarray_npy::write_npy(p("shared.npy"), &shared).unwrap();
    match load_npy(&p("shared.npy"), 8, 5).unwrap() {
        LayerInputs::Shared(x) => assert_eq!(x, shared.mapv(f64::from)),
        other => panic!("{other:?}"),
    }
    let per = Array3::<f64>::from_shape_fn((3, 5, 8), |(l, i, j)| (l * 100 + i * 8 + j) as f64);
    ndarray_npy::write_npy(p("per.npy"), &per).unwrap();
    let li = load_npy(&p("per.npy"), 8, 5).unwrap();
    assert_eq!(li.layer(2).unwrap()[[4, 7]], 239.0);
    assert!(matches!(li.layer(3), Err(Error::Usage(_))));

    let e = load_npy(&p("shared.npy"), 8, 6).unwrap_err().to_string();
    assert!(e.contains("[5, 8]") && e.contains("[6, 8]"), "{e}");
    ndarray_npy::write_npy(p("int.npy"), &Array2::<i32>::zeros((5, 8))).unwrap();
    let e = load_npy(&p("int.npy"), 8, 5).unwrap_err().to_string();
    assert!(e.contains("float32 or float64"), "{e}");
    let mut bad = shared.clone();
    bad[[1, 1]] = f32::NAN;
    ndarray_npy::write_npy(p("nan.npy"), &bad).unwrap();
    assert!(load_npy(&p("nan.npy"), 8, 5)
        .unwrap_err()
        .to_string()
        .contains("NaN"));
    assert!(matches!(
        load_npy(&p("missing.npy"), 8, 5),
        Err(Error::Io { .. })
    ));
    std::fs::write(p("junk.npy"), b"not an npy").unwrap();
    assert!(matches!(
        load_npy(&p("junk.npy"), 8, 5),
        Err(Error::Usage(_))
    ));
}

/// A `.npy` file from parts: format version, header dict text (padded as numpy does), raw data.
fn npy_bytes(version: u8, dict: &str, data: &[u8]) -> Vec<u8> {
    let pre = if version == 1 { 10 } else { 12 };
    let mut h = dict.to_string();
    while !(pre + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY".to_vec();
    b.extend([version, 0]);
    if version == 1 {
        b.extend((h.len() as u16).to_le_bytes());
    } else {
        b.extend((h.len() as u32).to_le_bytes());
    }
    b.extend(h.as_bytes());
    b.extend(data);
    b
}

fn dict(descr: &str, fortran: bool, shape: &str) -> String {
    let fo = if fortran { "True" } else { "False" };
    format!("{{'descr': '{descr}', 'fortran_order': {fo}, 'shape': {shape}, }}")
}

#[test]
fn npy_layouts_built_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let x = Array2::<f64>::from_shape_fn((5, 8), |(i, j)| (i * 8 + j) as f64 / 8.0);
    let write = |name: &str, b: Vec<u8>| {
        let p = dir.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let column_major: Vec<f64> = x.t().iter().copied().collect();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "<f4",
            x.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
        ),
        (">f8", x.iter().flat_map(|&v| v.to_be_bytes()).collect()),
        (
            ">f2",
            x.iter()
                .flat_map(|&v| half::f16::from_f64(v).to_be_bytes())
                .collect(),
        ),
    ];
    for (descr, data) in cases {
        for version in [1, 2, 3] {
            let p = write(
                "c.npy",
                npy_bytes(version, &dict(descr, false, "(5, 8)"), &data),
            );
            match load_npy(&p, 8, 5).unwrap() {
                LayerInputs::Shared(a) => assert_eq!(a, x, "{descr} v{version}"),
                other => panic!("{other:?}"),
            }
        }
    }
    // Fortran order (np.save of a transposed array): column-major data, rows must come out contiguous.
    let data: Vec<u8> = column_major.iter().flat_map(|v| v.to_le_bytes()).collect();
    let p = write("f.npy", npy_bytes(1, &dict("<f8", true, "(5, 8)"), &data));
    match load_npy(&p, 8, 5).unwrap() {
        LayerInputs::Shared(a) => {
            assert_eq!(a, x);
            assert!(a.is_standard_layout());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn npy_bad_headers_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let check = |name: &str, bytes: Vec<u8>, hidden: usize, tokens: usize, needle: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = load_npy(&p, hidden, tokens).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Usage(_)), "{name}: {msg}");
        assert!(msg.contains(needle), "{name}: {msg}");
        assert!(!msg.contains('\n'), "{name}: multi-line: {msg}");
    };
    let small = vec![0u8; 16];
    // A header promising 1 TB is refused from the file size, before any allocation.
    check(
        "huge.npy",
        npy_bytes(1, &dict("<f4", false, "(2147483648, 128)"), &small),
        128,
        1 << 31,
        "does not match the 16 data bytes",
    );
    check(
        "huge3.npy",
        npy_bytes(1, &dict("<f4", false, "(1099511627776, 5, 8)"), &small),
        8,
        5,
        "does not match",
    );
    // Element count overflowing usize.
    check(
        "overflow.npy",
        npy_bytes(
            1,
            &dict(
                "<f8",
                false,
                "(4611686018427387904, 4611686018427387904, 8)",
            ),
            &small,
        ),
        8,
        1 << 62,
        "does not match",
    );
    check(
        "short.npy",
        npy_bytes(1, &dict("<f4", false, "(5, 8)"), &small),
        8,
        5,
        "does not match the 16 data bytes",
    );
    check(
        "malformed.npy",
        npy_bytes(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (5, 8 }",
            &small,
        ),
        8,
        5,
        "not a readable .npy array",
    );
    check(
        "noshape.npy",
        npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, }", &small),
        8,
        5,
        "no \"shape\"",
    );
    check(
        "int.npy",
        npy_bytes(1, &dict("<i4", false, "(5, 8)"), &small),
        8,
        5,
        "float16, float32 or float64",
    );
    check(
        "struct.npy",
        npy_bytes(
            1,
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (5, 8), }",
            &small,
        ),
        8,
        5,
        "structured",
    );
    let mut v9 = npy_bytes(1, &dict("<f4", false, "(5, 8)"), &small);
    v9[6] = 9;
    check("v9.npy", v9, 8, 5, "format version 9");
    // A zero header length (the preamble read overlaps what would be data) and a cut-off header.
    let mut empty = b"\x93NUMPY\x01\x00\x00\x00".to_vec();
    empty.extend([0u8; 4]);
    check("empty.npy", empty, 8, 5, "not a {...} dict");
    let full = npy_bytes(1, &dict("<f4", false, "(5, 8)"), &[]);
    check(
        "cut.npy",
        full[..40].to_vec(),
        8,
        5,
        "ends inside the header",
    );
}

/// Every layout numpy itself writes: C and Fortran order, f16/f32/f64 in both byte orders, format
/// versions 1–3, 2-D and 3-D. Needs MLA_DIFF_PYTHON (a python with numpy); skipped loudly without it.
#[test]
fn npy_layouts_written_by_numpy() {
    let Some(py) = std::env::var("MLA_DIFF_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
    else {
        assert!(
            std::env::var_os("CI").is_none(),
            "MLA_DIFF_PYTHON is not set, but CI is"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED npy_layouts_written_by_numpy: set MLA_DIFF_PYTHON to a python with numpy"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import sys, numpy as np
d = sys.argv[1]
x = np.arange(40, dtype=np.float64).reshape(5, 8) / 8
x3 = np.arange(120, dtype=np.float64).reshape(3, 5, 8) / 8
names = []
for dt in ['<f2', '>f2', '<f4', '>f4', '<f8', '>f8']:
    tag = ('le' if dt[0] == '<' else 'be') + dt[2]
    np.save(f'{d}/c_{tag}.npy', x.astype(dt))
    np.save(f'{d}/f_{tag}.npy', x.astype(dt).T.copy().T)
    np.save(f'{d}/f3_{tag}.npy', np.asfortranarray(x3.astype(dt)))
    for v in [(2, 0), (3, 0)]:
        with open(f'{d}/v{v[0]}_{tag}.npy', 'wb') as f:
            np.lib.format.write_array(f, np.asfortranarray(x.astype(dt)), version=v)
    names += [f'c_{tag}', f'f_{tag}', f'f3_{tag}', f'v2_{tag}', f'v3_{tag}']
assert np.load(f'{d}/f_le4.npy').flags.f_contiguous
print(' '.join(names))
"#;
    let o = crate::common::python_command(&py)
        .args(["-c", script, dir.path().to_str().unwrap()])
        .output()
        .expect("run python");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let names = String::from_utf8(o.stdout).unwrap();
    let x = Array2::<f64>::from_shape_fn((5, 8), |(i, j)| (i * 8 + j) as f64 / 8.0);
    let mut n = 0;
    for name in names.split_whitespace() {
        let li = load_npy(&dir.path().join(format!("{name}.npy")), 8, 5)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for l in 0..if name.starts_with("f3") { 3 } else { 1 } {
            let a = li.layer(l).unwrap();
            assert!(a.is_standard_layout(), "{name}");
            assert_eq!(a, x.mapv(|v| v + 5.0 * l as f64), "{name} layer {l}");
        }
        n += 1;
    }
    assert_eq!(n, 30);
}
