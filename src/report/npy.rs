//! `.npy` dumps of reference and optimized stage tensors, loadable by numpy:
//! `DIR/layer{L}/{stage}.ref.npy` and `.opt.npy` (float64, the stage's shape; axes in `DIR/layer{L}/axes.json`).

use crate::error::{Error, Result};
use crate::trace::LayerTrace;
use ndarray::{ArrayD, IxDyn};
use std::path::Path;

/// Returns the layer's directory.
pub fn dump_layer(
    dir: &Path,
    reference: &LayerTrace,
    optimized: &LayerTrace,
) -> Result<std::path::PathBuf> {
    let d = dir.join(format!("layer{}", reference.layer));
    std::fs::create_dir_all(&d)
        .map_err(|e| Error::io(format!("cannot create {}", d.display()), e))?;
    let mut axes = serde_json::Map::new();
    for (side, trace) in [("ref", reference), ("opt", optimized)] {
        for t in &trace.stages {
            let a = ArrayD::from_shape_vec(IxDyn(&t.shape), t.data.clone())
                .expect("stage shape matches data");
            let path = d.join(format!("{}.{side}.npy", t.stage.name()));
            ndarray_npy::write_npy(&path, &a)
                .map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))?;
            axes.insert(
                t.stage.name().to_string(),
                serde_json::json!(t.stage.axes()),
            );
        }
    }
    super::write_file(
        &d.join("axes.json"),
        &serde_json::to_string_pretty(&axes).expect("json"),
    )?;
    Ok(d)
}
