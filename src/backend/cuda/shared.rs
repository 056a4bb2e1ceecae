//! One GPU context, cuBLAS handle and kernel cache behind many backends. `mla-diff selftest` makes a
//! backend per case (each with its dtype); with a fresh `CudaBackend` each time NVRTC would recompile
//! the unchanged kernels for every case. `backend::Factory` holds the `SharedGpu`.

use super::{CudaBackend, CudaOptions};
use crate::backend::{Backend, LayerCtx};
use crate::error::Result;
use crate::precision::Dtype;
use crate::trace::{LayerTrace, StageSet};
use std::cell::RefCell;
use std::rc::Rc;

/// The `CudaBackend` a factory opened first, if any.
#[derive(Default)]
pub struct SharedGpu(Option<Rc<RefCell<CudaBackend>>>);

/// A view of a shared `CudaBackend` with its own dtype.
pub struct SharedCuda {
    inner: Rc<RefCell<CudaBackend>>,
    dtype: Dtype,
    /// This view's latent cache format (`run --kv-cache-dtype`).
    kv_format: crate::kv_format::KvFormat,
    /// This view's serving batches (the shared backend holds the running view's during `run_layer`).
    batch: crate::backend::serving::Record,
}

impl SharedCuda {
    /// A view of `shared`'s backend with `o.dtype`, opened now with `o` if it is not yet.
    pub fn open(shared: &mut SharedGpu, o: CudaOptions) -> Result<SharedCuda> {
        let inner = match &shared.0 {
            Some(b) => b.clone(),
            None => {
                let b = Rc::new(RefCell::new(CudaBackend::new(o.clone())?));
                shared.0 = Some(b.clone());
                b
            }
        };
        Ok(SharedCuda {
            inner,
            dtype: o.dtype,
            kv_format: Default::default(),
            batch: Default::default(),
        })
    }
    /// This view storing its latent cache in `kv` (kernels/cache_write.cu `cache_write_format`).
    pub fn with_kv_format(mut self, kv: crate::kv_format::KvFormat) -> SharedCuda {
        self.kv_format = kv;
        self
    }
    /// Point the shared backend at this view's settings.
    fn bind(&self) -> std::cell::RefMut<'_, CudaBackend> {
        let mut b = self.inner.borrow_mut();
        b.opts.dtype = self.dtype;
        b.kv_format = self.kv_format;
        b
    }
}

impl Backend for SharedCuda {
    fn describe(&self) -> String {
        self.bind().describe()
    }
    fn device(&self) -> Option<String> {
        self.inner.borrow().device()
    }
    fn provides(&self) -> StageSet {
        self.inner.borrow().provides()
    }
    fn run_layer(&mut self, ctx: &LayerCtx, x: &ndarray::Array2<f64>) -> Result<LayerTrace> {
        let inner = self.inner.clone();
        let mut b = inner.borrow_mut();
        b.opts.dtype = self.dtype;
        b.kv_format = self.kv_format;
        std::mem::swap(&mut b.batch, &mut self.batch);
        let tr = b.run_layer(ctx, x);
        std::mem::swap(&mut b.batch, &mut self.batch);
        tr
    }
    fn decode_extra(&self, sched: &crate::schedule::Schedule) -> Vec<crate::batch::Request> {
        self.batch.decode_extra(sched)
    }
    fn aimed_variants(&self) -> Vec<String> {
        self.batch.aimed_variants()
    }
    fn runner_checks(&self) -> Option<crate::backend::runner::checks::RunnerChecks> {
        self.batch.runner_checks()
    }
    fn indexer(
        &mut self,
        ctx: &LayerCtx,
        ic: &crate::model::IndexerConfig,
        iw: &crate::model::IndexerWeights,
        x: &ndarray::Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        self.bind().indexer(ctx, ic, iw, x, keys)
    }
    fn kpool_indexer(
        &mut self,
        ctx: &LayerCtx,
        k: &crate::model::KpoolIndexer,
        kw: &crate::model::KpoolLayer,
        x: &ndarray::Array2<f64>,
        keys: crate::precision::KeyPrecision,
    ) -> Result<Option<crate::reference::sparse::Selection>> {
        self.bind().kpool_indexer(ctx, k, kw, x, keys)
    }
    fn notices(&self) -> Vec<String> {
        self.inner.borrow().notices()
    }
    fn judging(&self) -> crate::backend::Judging {
        self.inner.borrow().judging()
    }
    fn reads_stored_weights_only(&self) -> bool {
        self.inner.borrow().reads_stored_weights_only()
    }
    fn kernels(
        &self,
        cfg: &crate::model::MlaConfig,
        sched: &crate::schedule::Schedule,
    ) -> Vec<crate::kernel_use::KernelUse> {
        self.inner.borrow().kernels(cfg, sched)
    }
}

#[cfg(test)]
mod tests {
    /// The names of the `fn`s an `impl Backend for TYPE` block of `src` defines.
    fn methods(src: &str, ty: &str) -> Vec<String> {
        let start = src
            .find(&format!("impl Backend for {ty} {{"))
            .expect("impl block");
        let body = &src[start..];
        let end = body.find("\n}\n").expect("end of impl block");
        body[..end]
            .lines()
            .filter_map(|l| l.trim().strip_prefix("fn "))
            .map(|l| l.split(['(', '<']).next().unwrap().to_string())
            .collect()
    }

    /// Every method `CudaBackend` overrides, the view forwards: a trait default here would silently
    /// stand the CPU mirror in for a GPU part on every `run --backend cuda` (it did, for the k-pool
    /// indexer, until its first H200 run), and CI has no GPU to notice.
    #[test]
    fn the_view_forwards_every_method_the_backend_overrides() {
        let view = methods(include_str!("shared.rs"), "SharedCuda");
        let missing: Vec<String> = methods(include_str!("mod.rs"), "CudaBackend")
            .into_iter()
            .filter(|m| !view.contains(m))
            .collect();
        assert!(
            missing.is_empty(),
            "SharedCuda does not forward {missing:?}"
        );
    }
}
