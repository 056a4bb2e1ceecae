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
