//! One GPU context, cuBLAS handle and kernel cache behind many backends. `mla-diff selftest` makes a
//! backend per case (each with its dtype and faults); with a fresh `CudaBackend` each time NVRTC would
//! recompile the unchanged kernels for every case.

use super::{CudaBackend, CudaOptions};
use crate::backend::{Backend, Dtype};
use crate::error::Result;
use crate::faults::{FaultSet, Injection};
use crate::gguf::GgufFile;
use crate::model::rope_factors::RopeFactors;
use crate::model::{LayerWeights, MlaConfig};
use crate::schedule::Schedule;
use crate::trace::LayerTrace;
use std::cell::RefCell;
use std::rc::Rc;

/// A view of a shared `CudaBackend` with its own dtype, faults and rope factors.
pub struct SharedCuda {
    inner: Rc<RefCell<CudaBackend>>,
    dtype: Dtype,
    faults: FaultSet,
    rope_factors: Option<RopeFactors>,
}

impl SharedCuda {
    /// Point the shared backend at this view's settings.
    fn bind(&self) -> std::cell::RefMut<'_, CudaBackend> {
        let mut b = self.inner.borrow_mut();
        b.opts.dtype = self.dtype;
        b.faults = self.faults.clone();
        b.rope_factors = self.rope_factors.clone();
        b
    }
}

impl Backend for SharedCuda {
    fn describe(&self) -> String {
        self.bind().describe()
    }
    fn injected(&self) -> Vec<Injection> {
        self.faults.0.clone()
    }
    fn run_layer(
        &mut self,
        cfg: &MlaConfig,
        w: &LayerWeights,
        x: &ndarray::Array2<f64>,
        sched: &Schedule,
    ) -> Result<LayerTrace> {
        self.bind().run_layer(cfg, w, x, sched)
    }
}

/// A backend factory (`selftest::BackendFactory`) over one `CudaBackend`, opened on first use.
pub fn factory(
    kernels_dir: Option<std::path::PathBuf>,
) -> impl FnMut(&GgufFile, Dtype, FaultSet) -> Result<Box<dyn Backend>> {
    let mut shared: Option<Rc<RefCell<CudaBackend>>> = None;
    move |file, dtype, faults| {
        let cfg = MlaConfig::from_gguf(file)?;
        let rope_factors = RopeFactors::load(file, &cfg)?;
        let inner = match &shared {
            Some(b) => b.clone(),
            None => {
                let b = Rc::new(RefCell::new(CudaBackend::new(CudaOptions {
                    dtype,
                    kernels_dir: kernels_dir.clone(),
                    debug: true,
                    force_scalar: false,
                })?));
                shared = Some(b.clone());
                b
            }
        };
        Ok(Box::new(SharedCuda {
            inner,
            dtype,
            faults,
            rope_factors,
        }))
    }
}
