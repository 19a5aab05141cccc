//! The decode GEMV's routes: which kernel (CUDA cores, gemv.cu; tensor cores in one instance,
//! gemv_tc.cu) a weight shape runs at a launch's row count, and the launch that kernel takes
//! (`gemv_launch_spec`). Pure functions of the device plan, so the plan's table is testable on
//! the CPU; the launchers (gemv.rs) run what these return.

use crate::backend::cuda::plan::{Plan, GEMV_TC_RULES};
use crate::{NinferError, Result};

/// Warps a block of the CUDA-core GEMV (gemv.cu's GEMV_WARPS, its launch bound): the most a
/// plan may set.
pub const GEMV_WARPS: usize = 8;
/// Largest M one launch handles; larger M is split into launches of this many rows.
pub const GEMV_MAX_M: usize = 8;
/// Largest M that `linear` sends to the GEMV kernel; above it cuBLAS. Up to GEMV_MAX_M the
/// kernel's per-row summation order does not depend on M (each row keeps its own f32 chain over
/// the same weight loads, then the same warp reduction), so a sequence decoded in a batch of up
/// to 8 gets bit-identical projections, and hence logits, to the same sequence decoded alone.
/// cuBLAS picks its algorithm (and summation order) by M, which would break that. Both GEMV
/// kernels keep it on their own; `GemvForm::ByShape` mixes them by M (faster at batch 1) and so
/// gives it up unless the plan is batch invariant (plan/defaults.rs). Measured on
/// the H200 at 14336x4096 bf16: SIMT GEMV 3.70 / 3.33 /
/// 2.68 / 1.15 TB/s at M = 1 / 2 / 4 / 8 against cuBLAS 3.74 / 3.56 / 3.83 / 3.84.
pub const GEMV_ROUTE_MAX_M: usize = GEMV_MAX_M;

/// Which kernel runs the decode GEMV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvForm {
    /// cuda/gemv.cu: f32 FMAs on CUDA cores, a warp per 1 / 2 / 4 output columns by M. Bound by
    /// instruction issue from M = 4 on (2 M FLOP per weight element plus conversions).
    Simt,
    /// cuda/gemv_tc.cu: mma.sync m16n8k16 (storage-type inputs, f32 accumulation), a block of
    /// warps per 16 weight rows with K split across the warps; the same code for every M of 1..8,
    /// so the weight stream, not the products, bounds every M. sm_80+. The instance (warps,
    /// unroll, hold) is the weight shape's `gemv_tc_config`.
    TensorCores,
    /// The tensor-core GEMV in a given instance instead of the shape's `gemv_tc_config`: for the
    /// tests (every instance against the reference) and the sweep that fills the table.
    TensorCoresAs(GemvTcConfig),
    /// Per weight shape and batch, the kernel `GEMV_TC_RULES` gives it: at M = 1 the CUDA-core
    /// kernel where that decodes faster in the model (`cuda_cores`), else (and at every M >= 2)
    /// the rule's tensor-core instance. The fastest form, but a shape's M = 1 and M >= 2 kernels
    /// sum in different orders, so a sequence decoded in a batch may differ from it decoded
    /// alone in the last bits (and, at a near-tie, in a token): a batch-invariant plan runs
    /// `TensorCores` instead. sm_80+ default.
    ByShape,
}

/// One instance of the tensor-core GEMV (GEMV_TC_INSTANCE(W, U, HOLD, H) in gemv_tc.cu):
/// `warps` per block split K (which k32 steps each warp sums, hence the bits of the result);
/// `unroll` k32 steps a warp loads per iteration and `hold` (all of an iteration's loads issue
/// before its first mma, instead of ptxas's software pipeline of ~2-3 steps) set the bytes in
/// flight and leave the result's bits alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvTcConfig {
    pub warps: usize,
    pub unroll: usize,
    pub hold: bool,
}

/// Shorthand for the instance tables.
const fn tc(warps: usize, unroll: usize, hold: bool) -> GemvTcConfig {
    GemvTcConfig { warps, unroll, hold }
}

impl GemvTcConfig {
    /// What every shape runs unless `GEMV_TC_RULES` says otherwise: the kernel as first
    /// measured (passes every op and model test on the H200).
    pub const DEFAULT: GemvTcConfig = tc(8, 4, false);
    /// Every instance (the GEMV_TC_INSTANCE lines of gemv_tc.cu), warps-major: per warps count
    /// the compiler-scheduled unroll 4 and the held unroll 4 and 8 (unroll 2 and an unheld 8
    /// compile to the same ~2-3 steps in flight as the unheld 4). Registers (ptxas, NVRTC 12.9,
    /// sm_90), which bound the blocks an SM holds: u4 55-62, u4h 72-78, u8h 98 (w4) / 128, no
    /// spills; so w16u4h and w16u8h run one block of 512 threads an SM, w8u8h two of 256.
    pub const ALL: [GemvTcConfig; 9] = [
        tc(4, 4, false),
        tc(4, 4, true),
        tc(4, 8, true),
        tc(8, 4, false),
        tc(8, 4, true),
        tc(8, 8, true),
        tc(16, 4, false),
        tc(16, 4, true),
        tc(16, 8, true),
    ];

    /// Every instance, as `ALL`.
    pub fn all() -> impl Iterator<Item = GemvTcConfig> {
        Self::ALL.into_iter()
    }

    /// "w{warps}u{unroll}" plus "h" when held: the kernel name's suffix and the sweep's key.
    pub fn label(self) -> String {
        format!("w{}u{}{}", self.warps, self.unroll, if self.hold { "h" } else { "" })
    }
}

/// A row of the per-shape table: weights with at most `max_rows` rows and at least `min_k`
/// columns run `config` on tensor cores, or under `GemvForm::ByShape` at M = 1 the CUDA-core
/// kernel when `cuda_cores` (it decodes the shape faster at batch 1, though not at M >= 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvTcRule {
    pub max_rows: usize,
    pub min_k: usize,
    pub config: GemvTcConfig,
    pub cuda_cores: bool,
}


/// The tensor-core GEMV instance for a weight of `rows` x `k` (the fused gate_up weight's
/// 2 * inter rows for the SwiGLU epilogue) in the default table (`GEMV_TC_RULES`).
pub fn gemv_tc_config(rows: usize, k: usize) -> GemvTcConfig {
    gemv_tc_config_in(GEMV_TC_RULES, rows, k)
}

/// Whether `GemvForm::ByShape` runs a weight of `rows` x `k` on CUDA cores at M = 1 in the
/// default table (its rule's `cuda_cores`; shapes no rule covers stay on tensor cores).
pub fn gemv_shape_on_cuda_cores(rows: usize, k: usize) -> bool {
    gemv_rule_in(GEMV_TC_RULES, rows, k).is_some_and(|r| r.cuda_cores)
}

/// The instance of the first rule of `rules` that matches a weight of `rows` x `k`, else
/// `GemvTcConfig::DEFAULT`.
pub fn gemv_tc_config_in(rules: &[GemvTcRule], rows: usize, k: usize) -> GemvTcConfig {
    gemv_rule_in(rules, rows, k).map_or(GemvTcConfig::DEFAULT, |r| r.config)
}

fn gemv_rule_in(rules: &[GemvTcRule], rows: usize, k: usize) -> Option<&GemvTcRule> {
    rules.iter().find(|r| rows <= r.max_rows && k >= r.min_k)
}
/// Which kernel a weight shape's decode GEMV runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvKernel {
    /// cuda/gemv.cu.
    CudaCores,
    /// cuda/gemv_tc.cu in this instance.
    TensorCores(GemvTcConfig),
}

/// The kernel a weight of `rows` x `k` runs in form `form` with the per-shape table `rules`
/// (the plan's): the one place that resolves a form to a kernel, for the GEMV launcher and the
/// fused routes alike. `m` is the rows of the launch (1..=GEMV_MAX_M): only `ByShape` looks at
/// it, to run its batch-1 kernel (a rule's `cuda_cores`) at M = 1 alone.
pub fn gemv_kernel(form: GemvForm, rules: &[GemvTcRule], rows: usize, k: usize, m: usize) -> GemvKernel {
    match form {
        GemvForm::Simt => GemvKernel::CudaCores,
        GemvForm::TensorCores => GemvKernel::TensorCores(gemv_tc_config_in(rules, rows, k)),
        GemvForm::TensorCoresAs(c) => GemvKernel::TensorCores(c),
        GemvForm::ByShape => {
            if m == 1 && gemv_rule_in(rules, rows, k).is_some_and(|r| r.cuda_cores) {
                GemvKernel::CudaCores
            } else {
                GemvKernel::TensorCores(gemv_tc_config_in(rules, rows, k))
            }
        }
    }
}

/// The instance of a kernel family `$prefix_w{W}_u{U}{h}` (GEMV_TC_INSTANCE in gemv_tc.cu),
/// None for a config that has no instance (`GemvTcConfig::ALL` lists those that do).
macro_rules! by_tc_config {
    ($prefix:literal, $c:expr) => {
        match ($c.warps, $c.unroll, $c.hold) {
            (4, 4, false) => Some(concat!($prefix, "_w4_u4")),
            (4, 4, true) => Some(concat!($prefix, "_w4_u4h")),
            (4, 8, true) => Some(concat!($prefix, "_w4_u8h")),
            (8, 4, false) => Some(concat!($prefix, "_w8_u4")),
            (8, 4, true) => Some(concat!($prefix, "_w8_u4h")),
            (8, 8, true) => Some(concat!($prefix, "_w8_u8h")),
            (16, 4, false) => Some(concat!($prefix, "_w16_u4")),
            (16, 4, true) => Some(concat!($prefix, "_w16_u4h")),
            (16, 8, true) => Some(concat!($prefix, "_w16_u8h")),
            _ => None,
        }
    };
}

/// The error for a tensor-core GEMV config without a GEMV_TC_INSTANCE.
fn no_tc_instance(c: GemvTcConfig) -> NinferError {
    NinferError::Device(format!(
        "the tensor-core GEMV has no instance with {} warps, unroll {}, hold {} (instances: {})",
        c.warps,
        c.unroll,
        c.hold,
        GemvTcConfig::all().map(GemvTcConfig::label).collect::<Vec<_>>().join(", ")
    ))
}

/// Output columns one warp computes in the kernel for `m` rows (the C of each GEMV_INSTANCE
/// in gemv.cu, which this must match): sharing each x load between C weight rows keeps
/// multi-row GEMV from being bound by re-reading x; one row keeps one column per warp for
/// more warps in flight.
fn cols_per_warp(m: usize) -> usize {
    match m {
        1 => 1,
        2..=4 => 2,
        _ => 4,
    }
}

/// Gate/up pairs (output columns of the activation) one warp computes in
/// `gemv_gateup_swiglu_m*` for `m` rows: the kernel's SC (weight rows per warp, the GEMV_INSTANCE
/// macro in gemv.cu) is cols_per_warp rounded up to a pair, and each pair is two weight rows.
fn pairs_per_warp(m: usize) -> usize {
    cols_per_warp(m).div_ceil(2)
}

/// What the GEMV kernel stores: the three epilogues of gemv_body (GEMV_OUT_* in gemv.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemvOut {
    /// y[M, N] in the storage type.
    Store,
    /// y[M, N] in f32; with `true` each value rounded to the storage type first (the
    /// kernels' `round_out` argument: logits_dtype "auto").
    F32(bool),
    /// act[M, N] = silu(gate) * up of the fused gate_up weight's rows n and N + n.
    SwiGlu,
}

impl GemvOut {
    pub(crate) fn name(self, m: usize) -> &'static str {
        match self {
            GemvOut::Store => NAMES[m - 1],
            GemvOut::F32(_) => NAMES_F32[m - 1],
            GemvOut::SwiGlu => NAMES_GATEUP_SWIGLU[m - 1],
        }
    }

    /// The tensor-core kernel of this epilogue in instance `c` (one for every M).
    pub(crate) fn tc_name(self, c: GemvTcConfig) -> Result<&'static str> {
        match self {
            GemvOut::Store => by_tc_config!("gemv_tc", c),
            GemvOut::F32(_) => by_tc_config!("gemv_tc_f32out", c),
            GemvOut::SwiGlu => by_tc_config!("gemv_tc_gateup_swiglu", c),
        }
        .ok_or_else(|| no_tc_instance(c))
    }

    /// Rows of the weight for `n` output columns: the fused gate_up weight has a gate and an
    /// up row per activation.
    pub(crate) fn weight_rows(self, n: usize) -> usize {
        match self {
            GemvOut::Store | GemvOut::F32(_) => n,
            GemvOut::SwiGlu => 2 * n,
        }
    }

    /// Output columns one tensor-core block covers: a tile of 16 weight rows, which for SwiGLU
    /// is 8 gate rows and their 8 up rows (gemv_tc_cols in gemv_tc.cu).
    pub(crate) fn tc_cols_per_block(self) -> usize {
        match self {
            GemvOut::Store | GemvOut::F32(_) => 16,
            GemvOut::SwiGlu => 8,
        }
    }

    /// Output columns one block of `warps` warps covers for `m` rows.
    pub(crate) fn cols_per_block(self, m: usize, warps: usize) -> usize {
        warps
            * match self {
                GemvOut::Store | GemvOut::F32(_) => cols_per_warp(m),
                GemvOut::SwiGlu => pairs_per_warp(m),
            }
    }

    /// The f32 kernels' trailing `round_out` argument (0 for the other epilogues, which take
    /// none: `args` drops it).
    pub(crate) fn round_arg(self) -> i32 {
        matches!(self, GemvOut::F32(true)) as i32
    }

    /// Kernel arguments of this epilogue, given the `common` ones every epilogue takes: the
    /// f32 kernels take `round_out` after them.
    pub(crate) fn args(self, common: usize) -> usize {
        common + matches!(self, GemvOut::F32(_)) as usize
    }

    pub(crate) fn elem_bytes(self) -> u64 {
        match self {
            GemvOut::F32(_) => 4,
            GemvOut::Store | GemvOut::SwiGlu => 2,
        }
    }
}

const NAMES: [&str; GEMV_MAX_M] =
    ["gemv_m1", "gemv_m2", "gemv_m3", "gemv_m4", "gemv_m5", "gemv_m6", "gemv_m7", "gemv_m8"];
const NAMES_GATEUP_SWIGLU: [&str; GEMV_MAX_M] = [
    "gemv_gateup_swiglu_m1",
    "gemv_gateup_swiglu_m2",
    "gemv_gateup_swiglu_m3",
    "gemv_gateup_swiglu_m4",
    "gemv_gateup_swiglu_m5",
    "gemv_gateup_swiglu_m6",
    "gemv_gateup_swiglu_m7",
    "gemv_gateup_swiglu_m8",
];
const NAMES_F32: [&str; GEMV_MAX_M] = [
    "gemv_f32out_m1",
    "gemv_f32out_m2",
    "gemv_f32out_m3",
    "gemv_f32out_m4",
    "gemv_f32out_m5",
    "gemv_f32out_m6",
    "gemv_f32out_m7",
    "gemv_f32out_m8",
];
/// Most int arguments a GEMV kernel takes after its three pointers.
const GEMV_MAX_INTS: usize = 5;

/// One GEMV launch of at most GEMV_MAX_M rows as the plan routes it: the kernel, its grid and
/// block, and the int arguments that follow x, w and y (`ints()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvLaunch {
    pub family: crate::backend::cuda::kernels::KernelFamily,
    pub name: &'static str,
    pub grid: u32,
    pub block: u32,
    ints: [i32; GEMV_MAX_INTS],
    n_ints: usize,
}

impl GemvLaunch {
    /// The kernel's int arguments after x, w and y, in order: (n, k, prefetch vectors, K split)
    /// on CUDA cores, (m, n, k, prefetch steps) on tensor cores, then `round_out` for the f32
    /// epilogue.
    pub fn ints(&self) -> &[i32] {
        &self.ints[..self.n_ints]
    }
}

/// The launch of the GEMV of form `form` with epilogue `out` for `m` rows (1..=GEMV_MAX_M) of a
/// weight giving `n` output columns (the activation width for SwiGLU) over K = `k`, under
/// `plan`: its weight shape's kernel, the plan's CUDA-core block and K split (every kernel of a
/// weight takes the same, so the fused forms sum as their unfused pairs) and prefetch depths.
pub(crate) fn gemv_launch_spec(plan: &Plan, form: GemvForm, out: GemvOut, m: usize, n: usize, k: usize) -> Result<GemvLaunch> {
    use crate::backend::cuda::kernels::KernelFamily;
    let (ni, ki) = (super::as_i32("gemv n", n)?, super::as_i32("gemv k", k)?);
    let rows = out.weight_rows(n);
    let (family, name, grid, block, ints) = match gemv_kernel(form, &plan.gemv_rules, rows, k, m) {
        GemvKernel::CudaCores => {
            let (warps, ksplit) = (plan.cc_warps, plan.cc_ksplit);
            let grid = super::as_i32("gemv n", n.div_ceil(out.cols_per_block(m, warps / ksplit)))?;
            let ints = [ni, ki, plan.cc_prefetch_vectors(rows, k) as i32, ksplit as i32, out.round_arg()];
            (KernelFamily::Gemv, out.name(m), grid, warps * 32, ints)
        }
        // One instance per weight shape, whatever M.
        GemvKernel::TensorCores(c) => {
            let grid = super::as_i32("gemv n", n.div_ceil(out.tc_cols_per_block()))?;
            let ints = [m as i32, ni, ki, plan.tc_prefetch_steps as i32, out.round_arg()];
            (KernelFamily::GemvTc, out.tc_name(c)?, grid, c.warps * 32, ints)
        }
    };
    Ok(GemvLaunch { family, name, grid: grid as u32, block: block as u32, ints, n_ints: out.args(7) - 3 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_kernel_resolves_the_form_over_the_table() {
        let on_tc = GemvKernel::TensorCores;
        let rules = GEMV_TC_RULES;
        // ByShape: at M = 1 on CUDA cores; from M = 2 on every shape on its tensor-core instance.
        assert_eq!(gemv_kernel(GemvForm::ByShape, rules, 6144, 4096, 1), GemvKernel::CudaCores);
        assert_eq!(gemv_kernel(GemvForm::ByShape, rules, 4096, 14336, 1), GemvKernel::CudaCores);
        assert_eq!(gemv_kernel(GemvForm::ByShape, rules, 4096, 14336, 2), on_tc(gemv_tc_config(4096, 14336)));
        for m in [2, 5, 8] {
            assert_eq!(gemv_kernel(GemvForm::ByShape, rules, 6144, 4096, m), on_tc(gemv_tc_config(6144, 4096)));
            assert_eq!(gemv_kernel(GemvForm::ByShape, rules, 128256, 4096, m), on_tc(gemv_tc_config(128256, 4096)));
        }
        // Another table (a device profile's) moves the shapes it covers.
        let other = [GemvTcRule { max_rows: 8192, min_k: 0, config: tc(16, 4, true), cuda_cores: false }];
        assert_eq!(gemv_kernel(GemvForm::ByShape, &other, 6144, 4096, 1), on_tc(tc(16, 4, true)));
        assert_eq!(gemv_kernel(GemvForm::ByShape, &other, 16384, 4096, 1), on_tc(GemvTcConfig::DEFAULT));
        // The forms that put every shape on one kernel never look at M.
        for m in [1, 8] {
            assert_eq!(gemv_kernel(GemvForm::Simt, rules, 4096, 14336, m), GemvKernel::CudaCores);
            assert_eq!(gemv_kernel(GemvForm::TensorCores, rules, 6144, 4096, m), on_tc(gemv_tc_config(6144, 4096)));
            assert_eq!(gemv_kernel(GemvForm::TensorCoresAs(GemvTcConfig::DEFAULT), rules, 6144, 4096, m), on_tc(GemvTcConfig::DEFAULT));
        }
    }

    #[test]
    fn kernel_names_follow_the_instances_of_gemv_tc_cu() {
        let src = include_str!("../../../../../cuda/gemv_tc.cu");
        for prefix in ["gemv_tc", "gemv_tc_f32out", "gemv_tc_gateup_swiglu"] {
            assert!(src.contains(&format!("{prefix}_w##W##_u##U##H(")), "{prefix}");
        }
        assert!(GemvTcConfig::all().any(|c| c == GemvTcConfig::DEFAULT));
        for c in GemvTcConfig::all() {
            let (w, u, h) = (c.warps, c.unroll, if c.hold { "h" } else { "" });
            let line = format!("\nGEMV_TC_INSTANCE({w}, {u}, {}, {h})\n", c.hold);
            assert!(src.contains(&line), "{line}");
            for (out, prefix) in [(GemvOut::Store, "gemv_tc"), (GemvOut::F32(false), "gemv_tc_f32out"), (GemvOut::SwiGlu, "gemv_tc_gateup_swiglu")] {
                assert_eq!(out.tc_name(c).unwrap(), format!("{prefix}_w{w}_u{u}{h}"));
            }
        }
        // The source has no instance the table does not list.
        assert_eq!(src.matches("\nGEMV_TC_INSTANCE(").count(), GemvTcConfig::ALL.len());
        let err = GemvOut::Store.tc_name(tc(32, 4, false)).unwrap_err();
        assert!(err.to_string().contains("32 warps"), "{err}");
    }

    #[test]
    fn gemv_tc_config_takes_the_first_matching_rule_by_shape() {
        let w16 = tc(16, 4, true);
        let w4 = tc(4, 8, true);
        let rules = [GemvTcRule { max_rows: 6144, min_k: 4096, config: w16, cuda_cores: false }, GemvTcRule { max_rows: usize::MAX, min_k: 0, config: w4, cuda_cores: false }];
        assert_eq!(gemv_tc_config_in(&rules, 4096, 14336), w16);
        assert_eq!(gemv_tc_config_in(&rules, 6144, 4096), w16);
        assert_eq!(gemv_tc_config_in(&rules, 6145, 4096), w4);
        assert_eq!(gemv_tc_config_in(&rules, 4096, 1024), w4);
        assert_eq!(gemv_tc_config_in(&rules[..1], 128256, 4096), GemvTcConfig::DEFAULT);
        // The live table names only instances that exist.
        for r in GEMV_TC_RULES {
            assert!(GemvTcConfig::all().any(|c| c == r.config), "{r:?}");
        }
        // The live table gives each documented decode shape its instance.
        for (rows, k, want) in [
            (6144, 4096, tc(8, 4, true)),
            (4096, 4096, tc(8, 8, true)),
            (28672, 4096, tc(8, 8, true)),
            (4096, 14336, tc(16, 4, false)),
            (128256, 4096, tc(16, 4, true)),
            (14336, 5120, tc(8, 8, true)),
            (5120, 6144, tc(8, 4, true)),
            (16480, 5120, tc(8, 8, true)),
            (34816, 5120, tc(8, 8, true)),
            (5120, 17408, GemvTcConfig::DEFAULT),
            (248320, 5120, tc(8, 8, true)),
        ] {
            assert_eq!(gemv_tc_config(rows, k), want, "{rows} x {k}");
        }
        // ByShape at M = 1: CUDA cores for every shape (the in-model decode figures).
        for (rows, k, cc) in [
            (6144, 4096, true),
            (4096, 4096, true),
            (28672, 4096, true),
            (4096, 14336, true),
            (128256, 4096, true),
            (14336, 5120, true),
            (5120, 6144, true),
            (16480, 5120, true),
            (34816, 5120, true),
            (5120, 17408, true),
            (248320, 5120, true),
        ] {
            assert_eq!(gemv_shape_on_cuda_cores(rows, k), cc, "{rows} x {k}");
        }
        // The SwiGLU epilogue looks the shape up by the fused weight's rows.
        assert_eq!(GemvOut::SwiGlu.weight_rows(14336), 28672);
        assert_eq!(GemvOut::F32(false).weight_rows(128256), 128256);
    }
}
