//! Tuning overrides of the decode GEMV, read from the environment once per device: the per-shape
//! kernel (`NINFER_GEMV_SHAPES`, in place of `GEMV_TC_RULES`) and the L2 prefetch depth before
//! the PDL wait of the tensor-core GEMV (`NINFER_TC_PREFETCH_STEPS`) and of the CUDA-core one
//! (`NINFER_CC_PREFETCH`), and the CUDA-core GEMV's warps a block (`NINFER_CC_WARPS`).
//!
//! Why: the per-shape table was filled from an isolated, cold-L2 sweep, and in the model the
//! choice it made decoded slower than CUDA cores everywhere (docs/performance-history.md "The decode GEMV
//! choice"); what a kernel gains alone and what it gains between its neighbours (PDL overlap,
//! warm L2, the prefetch issued before the wait) differ. These let one process of the decode
//! bench (benches/gemv_variants.sh) measure a shape's kernel and the prefetch depth in the model
//! without a rebuild. A shape the override names runs that kernel at every M (batch invariant
//! for that shape), and a prefetch never changes a value.

use super::gemv::{GemvForm, GemvTcConfig, GEMV_WARPS};
use crate::{NinferError, Result};

/// The per-shape override: `ROWSxK=KERNEL` entries separated by commas, where ROWS x K is the
/// weight's shape (the fused gate_up weight's 2 * inter rows) and KERNEL is `cc` (the CUDA-core
/// GEMV) or a tensor-core instance label (`GemvTcConfig::label`, e.g. `w8u4h`); `*=KERNEL` sets
/// every shape no entry names. Shapes left out without a `*` keep `GEMV_TC_RULES`. Applies to
/// the per-shape form (`GemvForm::ByShape`, sm_80+ with `NINFER_TC_GEMV` unset).
pub const GEMV_SHAPES_VAR: &str = "NINFER_GEMV_SHAPES";

/// k32 steps per block of the tensor-core GEMV whose weight lines are prefetched into L2 before
/// the PDL wait, 0..=`TC_PREFETCH_MAX_STEPS` (0: none).
pub const TC_PREFETCH_VAR: &str = "NINFER_TC_PREFETCH_STEPS";

/// The default prefetch depth: 16 k32 steps a block (16 KB, 12.5% of a 4096-wide weight
/// tile), as first measured.
pub const TC_PREFETCH_DEFAULT_STEPS: u32 = 16;

/// The largest depth accepted: 512 k32 steps cover a whole K of 16384 (the longest rows of the
/// supported models are 17408 wide), so more would prefetch nothing more.
pub const TC_PREFETCH_MAX_STEPS: u32 = 512;

/// The CUDA-core GEMV's L2 prefetch before its PDL wait: `N` weight vectors (16 bytes) per lane
/// for every weight, or `NMB`, a budget of N MiB per launch spread over the weight's rows (a
/// weight of R rows prefetches budget / (R x 512 bytes) vectors per lane, at most its whole
/// rows); or per weight shape, `ROWSxK=SETTING` entries separated by commas (ROWS x K as in
/// `NINFER_GEMV_SHAPES`: the fused gate_up weight's 2 * inter rows) and `*=SETTING` for the
/// shapes no entry names (none without it). A tuning tool: the idea was that a prefetch pays
/// off while the kernels before the GEMV (attention, the norms) leave the memory idle, as far as
/// L2 keeps the lines until the GEMV reads them (a fixed depth prefetches ~8 MB of Llama-3-8B's
/// o_proj but ~60 MB of its gate_up); measured for every weight at once, none at all decodes
/// fastest (CC_PREFETCH_DEFAULT). Per shape, because the window differs: a kernel lets its
/// dependent launch right after its own PDL wait, so a GEMV after a norm (qkv, gate_up, the
/// lm_head) or after the decode attention (o) prefetches during that kernel's few microseconds,
/// while the down projection is launched when gate_up's last block starts, tens of microseconds
/// and ~100 MB of gate_up's stream before its lines are read (L2 is 50 MB on an H200).
pub const CC_PREFETCH_VAR: &str = "NINFER_CC_PREFETCH";

/// The CUDA-core GEMV's prefetch (`NINFER_CC_PREFETCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CcPrefetch {
    /// Weight vectors per lane, for every weight.
    Vectors(u32),
    /// Bytes per launch, spread over the weight's rows.
    Budget(u64),
}

/// The default: none. Llama-3-8B batch-1 decode in the model (benches/gemv_variants.sh,
/// benches/results/cc_prefetch_variants_e27b4e8.log, H200): 227.6 tok/s with no prefetch
/// against 220.8 / 221.7 with the first default of 4 vectors a lane, 213.7 with 8, 189.6 with
/// 16 (whole 4096-wide rows), and 223.1 / 219.3 / 217.6 / 216.8 / 213.2 with budgets of 8 / 16
/// / 24 / 32 / 48 MiB: the early lines cost the kernels still running more than they save.
pub const CC_PREFETCH_DEFAULT: CcPrefetch = CcPrefetch::Vectors(0);

/// Bytes one warp's row vector step covers: 32 lanes x 16 bytes.
const CC_ROW_STEP_BYTES: u64 = 512;

impl CcPrefetch {
    /// Vectors per lane to prefetch for a weight of `rows` rows of `k` elements: at most
    /// ceil(k / 256), a whole row.
    pub fn vectors(self, rows: usize, k: usize) -> u32 {
        let whole = k.div_ceil(8).div_ceil(32) as u64;
        let v = match self {
            CcPrefetch::Vectors(v) => v as u64,
            CcPrefetch::Budget(b) => b / (rows.max(1) as u64 * CC_ROW_STEP_BYTES),
        };
        v.min(whole) as u32
    }
}

/// The CUDA-core GEMV's prefetch per weight shape (`NINFER_CC_PREFETCH`): `default` for every
/// shape `shapes` does not name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CcPrefetchPlan {
    shapes: Vec<((usize, usize), CcPrefetch)>,
    default: CcPrefetch,
}

impl CcPrefetchPlan {
    /// One setting for every shape.
    pub fn uniform(setting: CcPrefetch) -> Self {
        CcPrefetchPlan { shapes: Vec::new(), default: setting }
    }

    /// Vectors per lane to prefetch for a weight of `rows` x `k`: its entry's, else the default's.
    pub fn vectors(&self, rows: usize, k: usize) -> u32 {
        self.shapes.iter().find(|(s, _)| *s == (rows, k)).map_or(self.default, |(_, p)| *p).vectors(rows, k)
    }
}

/// One setting of `NINFER_CC_PREFETCH`: `N` vectors per lane (0..=4096) or `NMB` (0..=1024 MiB).
fn parse_cc_setting(v: &str) -> Option<CcPrefetch> {
    let lower = v.trim().to_ascii_lowercase();
    match lower.strip_suffix("mb") {
        Some(mb) => mb.trim().parse::<u64>().ok().filter(|&m| m <= 1024).map(|m| CcPrefetch::Budget(m << 20)),
        None => lower.parse::<u32>().ok().filter(|&n| n <= 4096).map(CcPrefetch::Vectors),
    }
}

/// `ROWSxK` with positive integers (the shape keys of `NINFER_GEMV_SHAPES` and
/// `NINFER_CC_PREFETCH`).
fn parse_shape_key(shape: &str) -> Option<(usize, usize)> {
    let (r, k) = shape.trim().split_once(['x', 'X'])?;
    Some((r.trim().parse::<usize>().ok()?, k.trim().parse::<usize>().ok()?)).filter(|&(r, k)| r > 0 && k > 0)
}

/// Per-shape values (`(ROWS, K)` keys in the order given) and the `*` value.
type ShapeEntries<T> = (Vec<((usize, usize), T)>, Option<T>);

/// The entries of a per-shape variable (`NINFER_GEMV_SHAPES`, `NINFER_CC_PREFETCH`,
/// `NINFER_CC_KSPLIT`): `ROWSxK=VALUE` and at most one `*=VALUE`, separated by commas, each
/// value read by `value`; `name` is what errors call the value (KERNEL, SETTING, SPLIT). The
/// named shapes in order and the `*` value; a malformed entry, a shape or `*` given twice is an
/// error made by `bad` (which names the variable).
fn parse_shape_entries<T>(v: &str, name: &str, bad: &dyn Fn(String) -> NinferError, mut value: impl FnMut(&str) -> Result<T>) -> Result<ShapeEntries<T>> {
    let (mut shapes, mut star) = (Vec::new(), None);
    for entry in v.split(',').map(str::trim) {
        let Some((shape, text)) = entry.split_once('=') else {
            return Err(bad(format!("entry {entry:?} is not ROWSxK={name} or *={name}")));
        };
        let parsed = value(text)?;
        let shape = shape.trim();
        if shape == "*" {
            if star.replace(parsed).is_some() {
                return Err(bad("* given twice".into()));
            }
            continue;
        }
        let key = parse_shape_key(shape).ok_or_else(|| bad(format!("shape {shape:?} is not ROWSxK with positive integers")))?;
        if shapes.iter().any(|(s, _)| *s == key) {
            return Err(bad(format!("shape {}x{} given twice", key.0, key.1)));
        }
        shapes.push((key, parsed));
    }
    Ok((shapes, star))
}

/// `value` of `NINFER_CC_PREFETCH`: the default when unset or blank; one setting for every
/// shape (`N` vectors per lane, 0..=4096, or `NMB`, 0..=1024 MiB a launch); or
/// `ROWSxK=SETTING` entries and at most one `*=SETTING`, separated by commas. Anything else
/// (a bad setting or shape, a shape or `*` given twice) is an error naming the variable and the
/// offending text.
pub fn parse_cc_prefetch(value: Option<&str>) -> Result<CcPrefetchPlan> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(CcPrefetchPlan::uniform(CC_PREFETCH_DEFAULT)) };
    let bad = |what: String| NinferError::config(CC_PREFETCH_VAR, format!("{what} in {v:?}"));
    let setting = |text: &str| {
        parse_cc_setting(text).ok_or_else(|| bad(format!("expected vectors per lane (0..=4096) or a budget such as 16MB (0..=1024 MB), got {:?}", text.trim())))
    };
    if !v.contains('=') {
        return setting(v).map(CcPrefetchPlan::uniform);
    }
    let (shapes, star) = parse_shape_entries(v, "SETTING", &bad, setting)?;
    Ok(CcPrefetchPlan { shapes, default: star.unwrap_or(CcPrefetch::Vectors(0)) })
}

/// Which kernel a weight shape's decode GEMV runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvKernel {
    /// cuda/gemv.cu.
    CudaCores,
    /// cuda/gemv_tc.cu in this instance.
    TensorCores(GemvTcConfig),
}

impl GemvKernel {
    /// `cc` or the instance label: the spelling of `NINFER_GEMV_SHAPES`.
    pub fn label(self) -> String {
        match self {
            GemvKernel::CudaCores => "cc".into(),
            GemvKernel::TensorCores(c) => c.label(),
        }
    }

    fn parse(v: &str) -> Option<GemvKernel> {
        if v.eq_ignore_ascii_case("cc") {
            return Some(GemvKernel::CudaCores);
        }
        GemvTcConfig::all().find(|c| c.label().eq_ignore_ascii_case(v)).map(GemvKernel::TensorCores)
    }
}

/// A parsed `NINFER_GEMV_SHAPES`: per-shape kernels and the `*` default, both optional.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GemvShapeOverride {
    shapes: Vec<((usize, usize), GemvKernel)>,
    default: Option<GemvKernel>,
}

impl GemvShapeOverride {
    /// The kernel the override gives a weight of `rows` x `k`: its entry, else the `*`
    /// default, else None (the built-in table decides).
    pub fn kernel(&self, rows: usize, k: usize) -> Option<GemvKernel> {
        self.shapes.iter().find(|(s, _)| *s == (rows, k)).map(|(_, kernel)| *kernel).or(self.default)
    }

    /// The value back in the variable's spelling (entries in the given order, `*` last): what
    /// the bench logs per variant.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> =
            self.shapes.iter().map(|((r, k), kernel)| format!("{r}x{k}={}", kernel.label())).collect();
        if let Some(d) = self.default {
            parts.push(format!("*={}", d.label()));
        }
        parts.join(",")
    }
}

/// `value` of `NINFER_GEMV_SHAPES`: None when unset or blank; a malformed entry, an unknown
/// kernel or a shape given twice is an error naming the variable and the offending text.
pub fn parse_gemv_shapes(value: Option<&str>) -> Result<Option<GemvShapeOverride>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(None) };
    let bad = |what: String| NinferError::config(GEMV_SHAPES_VAR, format!("{what} in {v:?}"));
    let kernel = |text: &str| {
        let text = text.trim();
        GemvKernel::parse(text).ok_or_else(|| {
            let labels: Vec<String> = GemvTcConfig::all().map(GemvTcConfig::label).collect();
            bad(format!("unknown kernel {text:?} (cc or one of {})", labels.join(", ")))
        })
    };
    let (shapes, default) = parse_shape_entries(v, "KERNEL", &bad, kernel)?;
    Ok(Some(GemvShapeOverride { shapes, default }))
}

/// `value` of `NINFER_TC_PREFETCH_STEPS`: the default when unset or blank, else an integer of
/// 0..=TC_PREFETCH_MAX_STEPS (an error naming the variable and the value otherwise).
pub fn parse_tc_prefetch_steps(value: Option<&str>) -> Result<u32> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(TC_PREFETCH_DEFAULT_STEPS) };
    v.parse::<u32>().ok().filter(|&s| s <= TC_PREFETCH_MAX_STEPS).ok_or_else(|| {
        NinferError::config(TC_PREFETCH_VAR, format!("expected an integer of 0..={TC_PREFETCH_MAX_STEPS}, got {v:?}"))
    })
}

/// Warps a block of the CUDA-core GEMV (gemv.cu, one output column a warp at M = 1; the fused
/// RoPE epilogue's pairs too): 2, 4 or 8 (default `default_cc_warps`). A tuning tool: a block's slot
/// frees only when its slowest warp is done, so smaller blocks let the scheduler fill an SM at a
/// finer grain at a kernel's tail. Never changes a value (a warp's sums do not depend on its
/// block). Measured on the H200 (report_gemv_chain, benches/results/gemv_chain_ccwarps_2c4d4fb.log:
/// the 8B decoder's GEMVs chained over 32 layers): 3.688 / 3.679 ms with 8 warps, 3.657 with 4,
/// 3.645 with 2 (-1%); in the model (cc_warps_variants_626c549.log) 2 and 4 decode within the
/// spread of 8 (232.47 / 232.13 and 231.57 / 233.38 against 232.80 / 232.30 tok/s), so unsplit
/// GEMVs keep 8; with the K split of 2 (`NINFER_CC_KSPLIT`) 4 measured faster.
pub const CC_WARPS_VAR: &str = "NINFER_CC_WARPS";

/// `value` of `NINFER_CC_WARPS`: None when unset or blank (the model's default applies,
/// `default_cc_warps`), else 2, 4 or 8.
pub fn parse_cc_warps(value: Option<&str>) -> Result<Option<usize>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(None) };
    v.parse::<usize>().ok().filter(|w| [2, 4, GEMV_WARPS].contains(w)).map(Some).ok_or_else(|| NinferError::config(CC_WARPS_VAR, format!("expected 2, 4 or 8, got {v:?}")))
}

/// Warps a CUDA-core GEMV block when `NINFER_CC_WARPS` is unset, given the K split: 4 (two
/// column groups a block) with a split of 2, else GEMV_WARPS. Only the pair measured together
/// moves: Llama-3-8B batch-1 decode at a split of 2 with 4 warps 238.85 / 240.22 / 238.89 tok/s
/// against 236.04 / 236.95 / 237.96 with 8, interleaved in one call
/// (benches/results/ksplit_default_bs1_8b_a3d1188.log; 238.85 / 239.27 against 237.11 / 237.45 in
/// ksplit_combos_5d6320b.log); unsplit models keep 8 (session 10: 4 within the spread of 8).
/// Never changes a value (a warp's sums do not depend on its block).
pub fn default_cc_warps(ksplit: usize) -> usize {
    if ksplit == 2 {
        4
    } else {
        GEMV_WARPS
    }
}

/// Warps of a CUDA-core GEMV block that share one warp's columns, splitting K between them
/// (gemv.cu `gemv_body`): 1 (a warp streams whole rows), 2, 4 or 8, at most the block's warps
/// (`NINFER_CC_WARPS`). A warp then streams 1 / ksplit of a row, so the kernel's tail (its last
/// warps, too few to keep the weight stream busy) is that much shorter, at the price of a
/// shared-memory reduction per block. Changes the order of each sum (one fixed order per
/// setting; every CUDA-core kernel of a model takes the same, so the fused epilogues still equal
/// their unfused pairs bit for bit). Unset: `default_cc_ksplit` of the model's hidden size.
/// Per weight shape too (`ROWSxK=SPLIT,...`, `*=SPLIT` for the rest, the shape keys of
/// `NINFER_GEMV_SHAPES`): a shape's kernels (the plain GEMV, its fused SwiGLU / RoPE forms) key
/// on the same weight, so the fused forms still equal their unfused pairs.
pub const CC_KSPLIT_VAR: &str = "NINFER_CC_KSPLIT";

/// Largest hidden size whose CUDA-core GEMVs split K in two by default. Measured on the H200
/// (benches/results/ksplit_bs1_8b_5d6320b.log, ksplit_combos_5d6320b.log; one process a setting):
/// Llama-3-8B (hidden 4096) batch-1 decode 228.0 / 227.9 / 227.8 tok/s unsplit against 239.5 /
/// 239.8 / 237.1 / 237.5 at 2, 234.7 / 233.2 at 4, 214.9 / 214.3 at 8; Qwen3.5-27B (hidden 5120)
/// 74.5 / 74.0 unsplit against 72.4 / 72.3 at 2. Its GEMVs stream more bytes a launch, so the
/// tail is a smaller share of each and the reduction costs more than it saves. One split for all
/// of a model's weights: the 8B's qkv weight at 4 (its best in a GEMV chain) and the rest at 2
/// decodes at 242.8 tok/s against 245.0 with 2 everywhere (ksplit_shape_ab_8b_bb0e2b7.log).
pub const CC_KSPLIT_MAX_HIDDEN: usize = 4096;

/// The K split of a model of hidden size `hidden` when `NINFER_CC_KSPLIT` is unset.
pub fn default_cc_ksplit(hidden: usize) -> usize {
    if hidden <= CC_KSPLIT_MAX_HIDDEN {
        2
    } else {
        1
    }
}

/// The K split per weight shape (`NINFER_CC_KSPLIT`): `shapes` name some shapes, `default`
/// the rest (None: the model's `default_cc_ksplit`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CcKsplitPlan {
    pub shapes: Vec<((usize, usize), usize)>,
    pub default: Option<usize>,
}

impl CcKsplitPlan {
    /// The split the variable names for a weight of `rows` x `k` itself (not through `*`).
    pub fn named(&self, rows: usize, k: usize) -> Option<usize> {
        self.shapes.iter().find(|(s, _)| *s == (rows, k)).map(|(_, v)| *v)
    }

    /// The split the variable gives a weight of `rows` x `k` (None: the model's default).
    pub fn for_shape(&self, rows: usize, k: usize) -> Option<usize> {
        self.named(rows, k).or(self.default)
    }

    /// The largest split any shape names (1 when none), which the block's warps must hold.
    pub fn max_named(&self) -> usize {
        self.shapes.iter().map(|(_, v)| *v).chain(self.default).max().unwrap_or(1)
    }
}

/// `value` of `NINFER_CC_KSPLIT` for blocks of `warps` warps: empty when unset or blank (the
/// model's default applies); one split for every shape; or `ROWSxK=SPLIT` entries and at most
/// one `*=SPLIT`, separated by commas. A split is 1, 2, 4 or 8, at most `warps`. Anything else
/// (a bad split or shape, a shape or `*` given twice) is an error naming the variable and the
/// offending text.
pub fn parse_cc_ksplit(value: Option<&str>, warps: usize) -> Result<CcKsplitPlan> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(CcKsplitPlan::default()) };
    let bad = |what: String| NinferError::config(CC_KSPLIT_VAR, format!("{what} in {v:?}"));
    let split = |text: &str| {
        let t = text.trim();
        t.parse::<usize>()
            .ok()
            .filter(|s| [1, 2, 4, 8].contains(s) && *s <= warps)
            .ok_or_else(|| bad(format!("expected 1, 2, 4 or 8 and at most {CC_WARPS_VAR} ({warps}), got {t:?}")))
    };
    if !v.contains('=') {
        return Ok(CcKsplitPlan { shapes: Vec::new(), default: Some(split(v)?) });
    }
    let (shapes, default) = parse_shape_entries(v, "SPLIT", &bad, split)?;
    Ok(CcKsplitPlan { shapes, default })
}

/// The per-shape override a device uses for GEMV form `form` (compute capability `cc`), from
/// the variable's value `shapes`: it applies to `GemvForm::ByShape` only (at every M); with
/// `NINFER_TC_GEMV` or `NINFER_BATCH_INVARIANT` set, which put every shape on one kernel, it would be silently ignored, so that is an error
/// naming both variables. Below sm_80 (form Simt, no tensor-core GEMV) it is ignored, as
/// `NINFER_TC_GEMV=1` is.
pub fn gemv_shapes_for(
    cc: (u32, u32),
    form: GemvForm,
    tc_switch: Option<&str>,
    shapes: Option<&str>,
) -> Result<Option<GemvShapeOverride>> {
    let Some(o) = parse_gemv_shapes(shapes)? else { return Ok(None) };
    if cc.0 < 8 {
        // Every shape runs the CUDA-core GEMV there: the table it would replace does not apply.
        return Err(NinferError::config(
            GEMV_SHAPES_VAR,
            format!("picks tensor-core GEMV kernels per shape: {}", super::needs_cc("the tensor-core GEMV", (8, 0), cc)),
        ));
    }
    if form != GemvForm::ByShape {
        let tc = tc_switch.unwrap_or_default().trim();
        return Err(NinferError::config(
            GEMV_SHAPES_VAR,
            format!(
                "sets kernels per shape, but {}={tc:?} or {} on puts every shape on one kernel: unset one of them",
                super::gemv::TC_GEMV_SWITCH,
                super::gemv::BATCH_INVARIANT_SWITCH
            ),
        ));
    }
    Ok(Some(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cc_prefetch_parses_vectors_or_a_budget_and_caps_at_the_row() {
        let uniform = CcPrefetchPlan::uniform;
        assert_eq!(parse_cc_prefetch(None).unwrap(), uniform(CC_PREFETCH_DEFAULT));
        assert_eq!(parse_cc_prefetch(Some(" ")).unwrap(), uniform(CC_PREFETCH_DEFAULT));
        assert_eq!(parse_cc_prefetch(Some("8")).unwrap(), uniform(CcPrefetch::Vectors(8)));
        assert_eq!(parse_cc_prefetch(Some("16MB")).unwrap(), uniform(CcPrefetch::Budget(16 << 20)));
        assert_eq!(parse_cc_prefetch(Some("24 mb")).unwrap(), uniform(CcPrefetch::Budget(24 << 20)));
        for bad in ["-1", "x", "4097", "2000MB", "MB", "1.5"] {
            let e = parse_cc_prefetch(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(CC_PREFETCH_VAR) && e.contains(bad.trim()), "{bad}: {e}");
        }
        // Llama-3-8B at 16 MiB: o_proj (4096 x 4096) 8 of its 16 vectors a lane, gate_up (28672
        // rows) 1, the lm_head none; a fixed depth is capped at the row (K 4096: 16).
        let b = CcPrefetch::Budget(16 << 20);
        assert_eq!((b.vectors(4096, 4096), b.vectors(28672, 4096), b.vectors(128256, 4096)), (8, 1, 0));
        assert_eq!(b.vectors(4096, 14336), 8);
        assert_eq!(CcPrefetch::Budget(1 << 30).vectors(4096, 4096), 16);
        assert_eq!(CcPrefetch::Vectors(64).vectors(4096, 4096), 16);
        assert_eq!(CcPrefetch::Vectors(4).vectors(4096, 4096), 4);
        assert_eq!(CcPrefetch::Vectors(4).vectors(10, 8), 1);
    }

    #[test]
    fn cc_prefetch_per_shape_names_weights_and_defaults_the_rest() {
        // Llama-3-8B: the qkv and gate_up GEMVs (launched after a norm) prefetch, the others not.
        let plan = parse_cc_prefetch(Some(" 6144x4096=4, 28672X4096 = 16MB ")).unwrap();
        assert_eq!(plan.vectors(6144, 4096), 4);
        assert_eq!(plan.vectors(28672, 4096), 1);
        assert_eq!((plan.vectors(4096, 4096), plan.vectors(4096, 14336), plan.vectors(128256, 4096)), (0, 0, 0));
        let starred = parse_cc_prefetch(Some("4096x14336=0,*=2")).unwrap();
        assert_eq!((starred.vectors(4096, 14336), starred.vectors(4096, 4096), starred.vectors(6144, 4096)), (0, 2, 2));
        for bad in ["6144x4096=4,6144x4096=2", "*=1,*=2", "6144x4096", "6144x4096=x", "0x4096=1", "6144=1", "a=1,6144x4096=1", "6144x4096=5000"] {
            let e = parse_cc_prefetch(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(CC_PREFETCH_VAR) && e.contains(bad), "{bad}: {e}");
        }
    }

    fn tc(warps: usize, unroll: usize, hold: bool) -> GemvKernel {
        GemvKernel::TensorCores(GemvTcConfig { warps, unroll, hold })
    }

    #[test]
    fn shapes_parse_to_per_shape_kernels_with_a_default() {
        assert_eq!(parse_gemv_shapes(None).unwrap(), None);
        assert_eq!(parse_gemv_shapes(Some("  ")).unwrap(), None);
        let o = parse_gemv_shapes(Some(" 6144x4096=cc, 4096X4096 = W8U8H,*=w16u4")).unwrap().unwrap();
        assert_eq!(o.kernel(6144, 4096), Some(GemvKernel::CudaCores));
        assert_eq!(o.kernel(4096, 4096), Some(tc(8, 8, true)));
        assert_eq!(o.kernel(28672, 4096), Some(tc(16, 4, false)));
        assert_eq!(o.describe(), "6144x4096=cc,4096x4096=w8u8h,*=w16u4");
        // Without `*` the shapes it does not name are left to the built-in table.
        let o = parse_gemv_shapes(Some("4096x14336=w8u4h")).unwrap().unwrap();
        assert_eq!(o.kernel(4096, 14336), Some(tc(8, 4, true)));
        assert_eq!(o.kernel(14336, 4096), None);
        assert_eq!(parse_gemv_shapes(Some("*=cc")).unwrap().unwrap().kernel(1, 8), Some(GemvKernel::CudaCores));
        // Every instance label is accepted.
        for c in GemvTcConfig::all() {
            let o = parse_gemv_shapes(Some(&format!("*={}", c.label()))).unwrap().unwrap();
            assert_eq!(o.kernel(4096, 4096), Some(GemvKernel::TensorCores(c)));
        }
    }

    #[test]
    fn each_malformed_shapes_value_is_an_error_naming_the_variable_and_the_fault() {
        for (v, fault) in [
            ("6144x4096", "is not ROWSxK=KERNEL"),
            ("6144x4096=cc,", "\"\" is not ROWSxK=KERNEL"),
            ("6144x4096=tc", "unknown kernel \"tc\""),
            ("6144x4096=w32u4", "unknown kernel \"w32u4\""),
            ("6144*4096=cc", "shape \"6144*4096\""),
            ("6144x=cc", "shape \"6144x\""),
            ("0x4096=cc", "shape \"0x4096\""),
            ("-1x4096=cc", "shape \"-1x4096\""),
            ("6144x4096=cc,6144x4096=w8u4", "6144x4096 given twice"),
            ("*=cc,*=w8u4", "* given twice"),
        ] {
            let e = parse_gemv_shapes(Some(v)).unwrap_err().to_string();
            assert!(e.contains(GEMV_SHAPES_VAR) && e.contains(fault), "{v}: {e}");
        }
        let e = parse_gemv_shapes(Some("*=fast")).unwrap_err().to_string();
        assert!(e.contains("w8u4h") && e.contains("cc or"), "lists the kernels: {e}");
    }

    #[test]
    fn prefetch_steps_default_to_16_and_reject_what_is_not_0_to_512() {
        assert_eq!(parse_tc_prefetch_steps(None).unwrap(), 16);
        assert_eq!(parse_tc_prefetch_steps(Some(" ")).unwrap(), TC_PREFETCH_DEFAULT_STEPS);
        for (v, want) in [("0", 0), (" 32 ", 32), ("512", 512)] {
            assert_eq!(parse_tc_prefetch_steps(Some(v)).unwrap(), want, "{v}");
        }
        for v in ["513", "-1", "16k", "1e2", "sixteen"] {
            let e = parse_tc_prefetch_steps(Some(v)).unwrap_err().to_string();
            assert!(e.contains(TC_PREFETCH_VAR) && e.contains(v) && e.contains("0..=512"), "{v}: {e}");
        }
    }

    #[test]
    fn cc_warps_default_by_k_split_and_take_2_4_or_8() {
        assert_eq!(parse_cc_warps(None).unwrap(), None);
        assert_eq!(parse_cc_warps(Some(" ")).unwrap(), None);
        for (v, want) in [("2", 2), (" 4 ", 4), ("8", 8)] {
            assert_eq!(parse_cc_warps(Some(v)).unwrap(), Some(want), "{v}");
        }
        // Unset: 4 with the K split of 2 (the pair measured together), else 8; never below the split.
        assert_eq!([1, 2, 4, 8].map(default_cc_warps), [GEMV_WARPS, 4, GEMV_WARPS, GEMV_WARPS]);
        assert!([1, 2, 4, 8].iter().all(|&s| default_cc_warps(s) >= s));
        for v in ["0", "1", "3", "16", "-2", "four"] {
            let e = parse_cc_warps(Some(v)).unwrap_err().to_string();
            assert!(e.contains(CC_WARPS_VAR) && e.contains(v) && e.contains("2, 4 or 8"), "{v}: {e}");
        }
    }

    #[test]
    fn cc_ksplit_defaults_by_hidden_size_and_divides_the_block() {
        assert_eq!(parse_cc_ksplit(None, 8).unwrap(), CcKsplitPlan::default());
        assert_eq!(parse_cc_ksplit(Some(" "), 8).unwrap().for_shape(6144, 4096), None);
        for (v, warps, want) in [("2", 8, 2), (" 4 ", 8, 4), ("8", 8, 8), ("2", 2, 2), ("1", 2, 1)] {
            let plan = parse_cc_ksplit(Some(v), warps).unwrap();
            assert_eq!((plan.for_shape(6144, 4096), plan.for_shape(1, 8), plan.max_named()), (Some(want), Some(want), want), "{v}");
        }
        // Split in two up to the 8B's hidden size, not from the 27B's.
        assert_eq!((default_cc_ksplit(64), default_cc_ksplit(4096), default_cc_ksplit(5120)), (2, 2, 1));
        for (v, warps) in [("0", 8), ("3", 8), ("16", 8), ("4", 2), ("-1", 8), ("two", 8)] {
            let e = parse_cc_ksplit(Some(v), warps).unwrap_err().to_string();
            assert!(e.contains(CC_KSPLIT_VAR) && e.contains(v) && e.contains(&format!("({warps})")), "{v}: {e}");
        }
    }

    #[test]
    fn cc_ksplit_per_shape_names_shapes_and_the_rest() {
        let plan = parse_cc_ksplit(Some("6144x4096=4, *=2"), 8).unwrap();
        assert_eq!((plan.for_shape(6144, 4096), plan.for_shape(4096, 4096), plan.max_named()), (Some(4), Some(2), 4));
        // Without `*` the shapes not named keep the model's default.
        let plan = parse_cc_ksplit(Some("4096X14336=8"), 8).unwrap();
        assert_eq!((plan.for_shape(4096, 14336), plan.for_shape(4096, 4096), plan.max_named()), (Some(8), None, 8));
        for (v, why) in [
            ("6144x4096=3", "got \"3\""),
            ("6144x4096=4,6144x4096=2", "given twice"),
            ("*=2,*=4", "* given twice"),
            ("6144x=2", "not ROWSxK"),
            ("6144x4096", "got \"6144x4096\""),
            ("6144x4096=2;*=4", "got \"2;*=4\""),
            ("6144x4096=8", "at most"),
        ] {
            let e = parse_cc_ksplit(Some(v), 4).unwrap_err().to_string();
            assert!(e.contains(CC_KSPLIT_VAR) && e.contains(why), "{v}: {e}");
        }
    }

    #[test]
    fn the_shape_override_needs_the_per_shape_form() {
        let v = Some("6144x4096=cc");
        let o = gemv_shapes_for((9, 0), GemvForm::ByShape, None, v).unwrap().unwrap();
        assert_eq!(o.kernel(6144, 4096), Some(GemvKernel::CudaCores));
        assert_eq!(gemv_shapes_for((9, 0), GemvForm::ByShape, None, None).unwrap(), None);
        for (form, tc) in [(GemvForm::TensorCores, "1"), (GemvForm::Simt, "0")] {
            let e = gemv_shapes_for((9, 0), form, Some(tc), v).unwrap_err().to_string();
            assert!(e.contains(GEMV_SHAPES_VAR) && e.contains("NINFER_TC_GEMV"), "{e}");
        }
        // Below sm_80 there is one kernel: the override is refused naming the device (spelling
        // first), and unset is fine.
        let e = gemv_shapes_for((7, 5), GemvForm::Simt, None, v).unwrap_err().to_string();
        assert!(e.contains(GEMV_SHAPES_VAR) && e.contains("8.0") && e.contains("7.5"), "{e}");
        assert!(gemv_shapes_for((7, 5), GemvForm::Simt, None, Some("x")).is_err());
        assert_eq!(gemv_shapes_for((7, 5), GemvForm::Simt, None, None).unwrap(), None);
    }
}
