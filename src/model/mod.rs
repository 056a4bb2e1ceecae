//! The model as the attention sees it: hyper-parameters (`config`, read by `loader` from the keys as
//! `keys` reads them) and per-layer weights (`weights`).

pub mod catalogue;
pub mod config;
pub mod indexer;
pub mod keys;
pub mod kpool;
pub mod loader;
pub mod rope_factors;
pub mod synthetic;
pub mod v4;
pub mod weights;

pub use config::{yarn_scales, Arch, HybridLayout, MlaConfig, RopeConfig, RopePairing, Yarn};
pub use indexer::{IndexerConfig, IndexerWeights};
pub use kpool::{KpoolConfig, KpoolIndexer, KpoolLayer, KpoolWeights};
pub use rope_factors::RopeFactors;
pub use weights::{KvBLayout, LayerWeights, QProj};
