//! Coverage: which attention kernels a run used and which of their boundary cases its schedule crossed.
//!
//! A bug confined to a kernel path the schedule never reaches passes every check (issue #14: the pre-#14
//! default run gave each decode split at most 16 keys, so the second half of a 64-key tile, a split's
//! second tile and its partial last tile never ran). The backend says which kernel ran per phase and its
//! tile geometry (`Backend::kernels`: rows per CTA, keys per tile, key slices, pipeline stages); the
//! classes below are then computed on the host from that geometry and the schedule, exactly as the
//! kernels partition the work (`kernels/attention.cuh`: `att_key_range`, `att_row`; the CPU mirror's
//! `backend/cpu/flash.rs`). Nothing here is measured on the device: a count is a fact about the work the
//! kernel was given. A kernel whose geometry is unknown (an external runner) gets `None` counts.
//!
//! Counts are of key ranges (one per CTA row tile and split; for a kernel that cuts ranges per row, one
//! per query and split), tiles, steps or chunks, never multiplied by heads that share them.

pub mod covering;
mod variants;

pub use variants::{variants, VariantRun, Variants};

use crate::kernel_use::{Geometry, KernelUse, Phase};
use crate::model::MlaConfig;
use crate::schedule::Schedule;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A boundary class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// A key range of at least two full tiles (a tile after the first, with its rescale).
    TwoFullTiles,
    /// A partial last tile after a full one (the tail of the tile loop).
    TailTile,
    /// A tile with keys in its last key slice (every warp / warpgroup slice scores keys).
    KeySlices,
    /// A key range of more tiles than pipeline stages (the load ring is reused).
    PipelineWrap,
    /// A decode tile whose keys cross a page boundary (two block-table lookups in one tile).
    PageInTile,
    /// More rows than one CTA takes (a second row tile).
    RowTiles,
    /// A query whose range in a split is empty: the combine gets lse −inf.
    EmptySplit,
    /// A query whose combine merges at least two non-empty splits.
    SplitMerge,
    /// A prefill chunk boundary.
    ChunkBoundary,
    /// A prefill chunk merged with its cached context.
    ContextMerge,
}

impl Class {
    pub const ALL: [Class; 10] = [
        Class::TwoFullTiles,
        Class::TailTile,
        Class::KeySlices,
        Class::PipelineWrap,
        Class::PageInTile,
        Class::RowTiles,
        Class::EmptySplit,
        Class::SplitMerge,
        Class::ChunkBoundary,
        Class::ContextMerge,
    ];
    pub fn id(self) -> &'static str {
        match self {
            Class::TwoFullTiles => "two_full_tiles",
            Class::TailTile => "tail_tile",
            Class::KeySlices => "key_slices",
            Class::PipelineWrap => "pipeline_wrap",
            Class::PageInTile => "page_in_tile",
            Class::RowTiles => "row_tiles",
            Class::EmptySplit => "empty_split",
            Class::SplitMerge => "split_merge",
            Class::ChunkBoundary => "chunk_boundary",
            Class::ContextMerge => "context_merge",
        }
    }
    pub fn what(self) -> &'static str {
        match self {
            Class::TwoFullTiles => "a key range of 2 or more full tiles",
            Class::TailTile => "a partial last tile after a full one",
            Class::KeySlices => "keys in every warp/warpgroup key slice of a tile",
            Class::PipelineWrap => "more tiles in a range than pipeline stages",
            Class::PageInTile => "a page boundary inside a tile",
            Class::RowTiles => "rows spanning more than one row tile",
            Class::EmptySplit => "a split with no key for a query (lse -inf in the combine)",
            Class::SplitMerge => "a combine of 2 or more non-empty splits",
            Class::ChunkBoundary => "a prefill chunk boundary",
            Class::ContextMerge => "a chunk merged with its cached context",
        }
    }
    /// The classes of a phase for a kernel of geometry `g` (`None`: unknown, all that may apply); those
    /// the geometry cannot have (one key slice, no pipeline, one row per CTA) are left out.
    pub fn of(phase: Phase, g: Option<&Geometry>) -> Vec<Class> {
        let applies = |c: Class| match (c, g) {
            (Class::KeySlices, Some(g)) => g.key_slices > 1,
            (Class::PipelineWrap, Some(g)) => g.stages > 1,
            (Class::RowTiles, Some(g)) => g.rows_per_cta > 1,
            _ => true,
        };
        let own: &[Class] = match phase {
            Phase::Decode => &[Class::PageInTile, Class::EmptySplit, Class::SplitMerge],
            Phase::Prefill => &[Class::ChunkBoundary, Class::ContextMerge],
        };
        Class::ALL
            .into_iter()
            .filter(|c| {
                own.contains(c)
                    || matches!(
                        c,
                        Class::TwoFullTiles
                            | Class::TailTile
                            | Class::KeySlices
                            | Class::PipelineWrap
                            | Class::RowTiles
                    )
            })
            .filter(|&c| applies(c))
            .collect()
    }
}

/// How often a run crossed one class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassCount {
    pub phase: Phase,
    /// `Class::id`.
    pub class: String,
    /// `Class::what`.
    pub what: String,
    /// `None`: unknown (the kernel's geometry is not known).
    pub count: Option<u64>,
}

/// The coverage section of a report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Coverage {
    pub kernels: Vec<KernelUse>,
    pub classes: Vec<ClassCount>,
    /// Classes not exercised, unknown geometry, a production kernel that did not run.
    pub warnings: Vec<String>,
    /// A DSA file (GLM-5, DeepSeek-V3.2): whether the run went past top_k; absent for dense models.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dsa: Option<DsaCoverage>,
    /// The production variants the selection rules can pick for the model's dims over the serving
    /// matrix (`tiles::variants`), each with whether this run's schedule reached it (issue #35);
    /// absent in reports before it.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub variants: Option<Variants>,
}

/// What a run on a DSA file covered of the sparse model (docs/dsa.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DsaCoverage {
    pub top_k: usize,
    /// Keys the last query sees.
    pub max_keys: usize,
    /// Queries that see more than top_k keys: where the indexer's selection matters (0: DSA is dense
    /// attention exactly on this schedule).
    pub sparse_queries: usize,
    /// How the optimized side's indexer computed; `None` when it did not run (no query past top_k).
    pub indexer: Option<String>,
}

impl DsaCoverage {
    /// One line for the table, Markdown and JUnit.
    pub fn line(&self) -> String {
        match &self.indexer {
            Some(ix) => format!(
                "dsa: sparse, {} queries past top_k {} (up to {} keys); indexer: {ix}",
                self.sparse_queries, self.top_k, self.max_keys
            ),
            None if self.sparse_queries == 0 => format!(
                "dsa: no query past top_k {} (up to {} keys): dense attention exactly, indexer not run",
                self.top_k, self.max_keys
            ),
            None => format!(
                "dsa: {} queries past top_k {} but no indexer tensors: dense attention, not the model",
                self.sparse_queries, self.top_k
            ),
        }
    }
}

/// The decode requests of a run: each schedule step (its keys end at the step's end), then the extra
/// requests of a serving batch (`crate::batch`), as (keys, queries).
fn decode_requests(s: &Schedule, extra: &[crate::batch::Request]) -> Vec<(usize, usize)> {
    s.decode_ranges()
        .iter()
        .map(|r| (r.end, r.len()))
        .chain(extra.iter().map(|r| (r.seq_len, r.q_len)))
        .collect()
}

/// The key ranges one phase's kernel loops over, for a kernel of geometry `g`.
fn decode_ranges(
    g: &Geometry,
    heads: usize,
    s: &Schedule,
    extra: &[crate::batch::Request],
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for (seq, q) in decode_requests(s, extra) {
        if seq < q {
            continue;
        }
        let splits = s.split_ranges(seq);
        // The last key a query of the step sees: query i (0-based in the step) sees keys < seq - q + i + 1.
        let end_of = |i: usize| seq - q + i + 1;
        let mut push = |end: usize| {
            for k in &splits {
                out.push(k.start..k.end.min(end).max(k.start));
            }
        };
        if g.per_row_ranges {
            (0..q).for_each(|i| push(end_of(i)));
        } else {
            let rows = q * heads;
            let m = g.rows_per_cta.max(1);
            for rt in 0..rows.div_ceil(m) {
                let last = ((rt + 1) * m).min(rows) - 1;
                push(end_of(last / heads));
            }
        }
    }
    out
}

/// Prefill: each chunk's causal pass over its own keys and, with context, its pass over the context.
fn prefill_ranges(g: &Geometry, s: &Schedule) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for c in s.prefill_chunks() {
        let n = c.len();
        let m = if g.per_row_ranges {
            1
        } else {
            g.rows_per_cta.max(1)
        };
        for rt in 0..n.div_ceil(m) {
            let last = ((rt + 1) * m).min(n) - 1;
            out.push(0..last + 1);
            if c.start > 0 {
                out.push(0..c.start);
            }
        }
    }
    out
}

/// Counts of the tile classes over key ranges.
fn tile_counts(g: &Geometry, ranges: &[Range<usize>], page: Option<usize>) -> [(Class, u64); 5] {
    let bn = g.keys_per_tile.max(1);
    let slices = g.key_slices.max(1);
    // A tile's last slice starts after (slices - 1) slices of bn / slices keys.
    let last_slice_from = (slices - 1) * (bn / slices);
    let (mut two, mut tail, mut sl, mut wrap, mut pg) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for r in ranges {
        let len = r.len();
        two += (len >= 2 * bn) as u64;
        tail += (len > bn && len % bn != 0) as u64;
        wrap += (len.div_ceil(bn) > g.stages) as u64;
        sl += (len / bn) as u64 + (len % bn > last_slice_from) as u64;
        if let Some(p) = page.filter(|&p| p > 0) {
            let mut j0 = r.start;
            while j0 < r.end {
                let j1 = (j0 + bn).min(r.end);
                pg += ((j1 - 1) / p != j0 / p) as u64;
                j0 = j1;
            }
        }
    }
    [
        (Class::TwoFullTiles, two),
        (Class::TailTile, tail),
        (Class::KeySlices, sl),
        (Class::PipelineWrap, wrap),
        (Class::PageInTile, pg),
    ]
}

/// Per query of every decode step: how many splits it sees nothing of, and whether it merges two or more.
fn split_counts(s: &Schedule, extra: &[crate::batch::Request]) -> (u64, u64) {
    let (mut empty, mut merge) = (0u64, 0u64);
    for (seq, q) in decode_requests(s, extra) {
        if seq < q {
            continue;
        }
        let splits = s.split_ranges(seq);
        for i in 0..q {
            let end = seq - q + i + 1;
            let seen = splits.iter().filter(|k| k.start < end.min(k.end)).count();
            empty += (splits.len() - seen) as u64;
            merge += (seen >= 2) as u64;
        }
    }
    (empty, merge)
}

/// The counts of every class of `phase` for a kernel of geometry `g` (`None`: geometry-free classes
/// only), over the schedule's decode steps and `extra` decode requests (a serving batch, `crate::batch`).
pub fn count(
    phase: Phase,
    g: Option<&Geometry>,
    heads: usize,
    s: &Schedule,
    extra: &[crate::batch::Request],
) -> Vec<(Class, Option<u64>)> {
    let classes = Class::of(phase, g);
    let tiles = g.map(|g| match phase {
        Phase::Decode => tile_counts(g, &decode_ranges(g, heads, s, extra), Some(s.page_size)),
        Phase::Prefill => tile_counts(g, &prefill_ranges(g, s), None),
    });
    let chunks = s.prefill_chunks();
    let splits = match phase {
        Phase::Decode => Some(split_counts(s, extra)),
        Phase::Prefill => None,
    };
    classes
        .into_iter()
        .map(|c| {
            let n = match c {
                Class::ChunkBoundary => Some(chunks.len().saturating_sub(1) as u64),
                Class::ContextMerge => Some(chunks.iter().filter(|c| c.start > 0).count() as u64),
                Class::EmptySplit => splits.map(|x| x.0),
                Class::SplitMerge => splits.map(|x| x.1),
                Class::RowTiles => g.map(|g| {
                    let m = g.rows_per_cta.max(1);
                    match phase {
                        Phase::Decode => decode_requests(s, extra)
                            .iter()
                            .filter(|(_, q)| q * heads > m)
                            .count() as u64,
                        Phase::Prefill => chunks.iter().filter(|c| c.len() > m).count() as u64,
                    }
                }),
                _ => tiles
                    .as_ref()
                    .and_then(|t| t.iter().find(|(k, _)| *k == c).map(|(_, n)| *n)),
            };
            (c, n)
        })
        .collect()
}

/// Whether `phase` runs at all on schedule `s`.
pub fn phase_runs(phase: Phase, s: &Schedule) -> bool {
    match phase {
        Phase::Prefill => s.prompt_len > 0,
        Phase::Decode => s.decode_steps > 0,
    }
}

/// What would have exercised a class that was not, from the schedule and the geometry.
fn hint(
    c: Class,
    phase: Phase,
    g: Option<&Geometry>,
    cfg: &MlaConfig,
    s: &Schedule,
    extra: &[crate::batch::Request],
) -> String {
    let longest = |ranges: Vec<Range<usize>>| ranges.iter().map(|r| r.len()).max().unwrap_or(0);
    match (c, g) {
        (Class::TwoFullTiles | Class::TailTile | Class::PipelineWrap, Some(g)) => {
            let n = match phase {
                Phase::Decode => longest(decode_ranges(g, cfg.n_head, s, extra)),
                Phase::Prefill => longest(prefill_ranges(g, s)),
            };
            format!(
                "its longest key range holds {n} keys, a tile {}",
                g.keys_per_tile
            )
        }
        (Class::KeySlices, Some(g)) => format!(
            "no tile holds more than {} keys",
            (g.key_slices - 1) * (g.keys_per_tile / g.key_slices)
        ),
        (Class::PageInTile, Some(g)) => format!(
            "page {} with tiles of {} keys",
            s.page_size, g.keys_per_tile
        ),
        (Class::RowTiles, Some(g)) => match phase {
            Phase::Decode => format!(
                "q_len x heads = {} x {} rows fit one {}-row tile",
                s.q_len, cfg.n_head, g.rows_per_cta
            ),
            Phase::Prefill => format!(
                "chunks of {} queries fit one {}-query tile",
                s.chunk, g.rows_per_cta
            ),
        },
        (Class::EmptySplit, _) => {
            "every query sees keys in every split (an empty split needs more splits than keys, or a step whose early queries stop before the last split)".into()
        }
        (Class::SplitMerge, _) => "no query sees keys in two splits".into(),
        (Class::ChunkBoundary | Class::ContextMerge, _) => {
            format!("the prompt of {} is one chunk", s.prompt_len)
        }
        _ => String::new(),
    }
}

/// The coverage of a run: its kernels' classes counted, and the warnings. `extra`: decode requests the
/// decode kernel ran besides the schedule's steps (a serving batch, `crate::batch`).
pub fn compute(
    kernels: &[KernelUse],
    cfg: &MlaConfig,
    s: &Schedule,
    extra: &[crate::batch::Request],
) -> Coverage {
    let mut classes = Vec::new();
    let mut warnings = Vec::new();
    let mut used = Vec::new();
    for phase in [Phase::Prefill, Phase::Decode] {
        if !phase_runs(phase, s) {
            warnings.push(format!(
                "coverage: no {} in this schedule: its kernel and classes were not exercised",
                match phase {
                    Phase::Prefill => "prompt",
                    Phase::Decode => "decode step",
                }
            ));
            continue;
        }
        let Some(k) = kernels.iter().find(|k| k.phase == phase) else {
            warnings.push(format!(
                "coverage: the backend did not say which {} kernel ran",
                phase.name()
            ));
            continue;
        };
        used.push(k.clone());
        let g = k.geometry.as_ref();
        let extra = if phase == Phase::Decode { extra } else { &[] };
        let counts = count(phase, g, cfg.n_head, s, extra);
        let unknown: Vec<&str> = counts
            .iter()
            .filter(|(_, n)| n.is_none())
            .map(|(c, _)| c.id())
            .collect();
        if !unknown.is_empty() {
            warnings.push(format!(
                "coverage: {} kernel {} has an unknown tile geometry: not known to be exercised: {}",
                phase.name(),
                k.describe(),
                unknown.join(", ")
            ));
        }
        for (c, n) in &counts {
            if *n == Some(0) {
                warnings.push(format!(
                    "coverage: {} ({}): not exercised: {} ({})",
                    phase.name(),
                    k.describe(),
                    c.what(),
                    hint(*c, phase, g, cfg, s, extra)
                ));
            }
            classes.push(ClassCount {
                phase,
                class: c.id().into(),
                what: c.what().into(),
                count: *n,
            });
        }
        if let Some(p) = &k.production {
            warnings.push(format!(
                "coverage: the production {} kernel for this device and dims, {}: {}, did not run ({} ran): {}",
                phase.name(),
                p.family.name(),
                p.label,
                k.describe(),
                p.why
            ));
        }
    }
    Coverage {
        kernels: used,
        classes,
        warnings,
        dsa: None,
        variants: None,
    }
}

impl Coverage {
    /// `class ×N` for the classes of `phase`, in order; `?` for unknown counts.
    pub fn summary(&self, phase: Phase) -> String {
        self.classes
            .iter()
            .filter(|c| c.phase == phase)
            .map(|c| match c.count {
                Some(n) => format!("{} {n}", c.class),
                None => format!("{} ?", c.class),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}
