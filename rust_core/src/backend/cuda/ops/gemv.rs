//! Decode GEMV launcher: y[M, N] = x[M, K] * W[N, K]^T for small M, on tensor cores
//! (cuda/gemv_tc.cu) from sm_80 on, on CUDA cores (cuda/gemv.cu) below.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gemv_tuning::{GemvKernel, GemvShapeOverride};
use super::{as_i32, cfg, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Warps a block of the CUDA-core GEMV (gemv.cu's GEMV_WARPS, its launch bound): the default
/// and the most `NINFER_CC_WARPS` may set.
pub(super) const GEMV_WARPS: usize = 8;
/// Largest M one launch handles; larger M is split into launches of this many rows.
pub const GEMV_MAX_M: usize = 8;
/// Largest M that `linear` sends to the GEMV kernel; above it cuBLAS. Up to GEMV_MAX_M the
/// kernel's per-row summation order does not depend on M (each row keeps its own f32 chain over
/// the same weight loads, then the same warp reduction), so a sequence decoded in a batch of up
/// to 8 gets bit-identical projections, and hence logits, to the same sequence decoded alone.
/// cuBLAS picks its algorithm (and summation order) by M, which would break that. Both GEMV
/// kernels keep it on their own; `GemvForm::ByShape` mixes them by M (faster at batch 1) and so
/// gives it up unless `NINFER_BATCH_INVARIANT` is on (`gemv_form_with_switch`). Measured on
/// the H200 at 14336x4096 bf16 (benches/results/perf_ops_71d15e5.log): SIMT GEMV 3.70 / 3.33 /
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
    /// the rule's tensor-core instance; or, on a device opened with `NINFER_GEMV_SHAPES`
    /// (gemv_tuning.rs), the kernel that override names for the shape at every M. The fastest
    /// form, but a shape's M = 1 and M >= 2 kernels sum in different orders, so a sequence
    /// decoded in a batch may differ from it decoded alone in the last bits (and, at a near-tie,
    /// in a token): `NINFER_BATCH_INVARIANT=1` runs `TensorCores` instead. sm_80+ default.
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
#[derive(Debug, Clone, Copy)]
pub struct GemvTcRule {
    pub max_rows: usize,
    pub min_k: usize,
    pub config: GemvTcConfig,
    pub cuda_cores: bool,
}

/// The tensor-core GEMV instance per weight shape, first matching row wins, else
/// `GemvTcConfig::DEFAULT` (w8u4). Filled from `report_gemv_tc_sweep` on the H200 at c175fe2
/// (cold-L2 weight read rate per instance, rust_core/tests/cuda_ops/gemv_tc.rs; the log is
/// benches/results/gemv_tc_sweep_c175fe2.log): per shape the instance with the least time
/// summed over M = 1, 2, 4, 8, a warps-8 one where it is within 2% (w8 instances give w8u4's
/// bits). Why it depends on the shape: a block per 16 weight rows gives rows / 16 blocks (256
/// for a 4096-row projection against 132 SMs: few warps to keep loads in flight, where holding
/// 8 steps of loads per warp gained 13-14%) while a warp streams K / 32 / warps steps (the
/// 14336-wide down projection: 16 warps a block gained 4%). GB/s at M = 1, chosen / w8u4 /
/// CUDA-core kernel (copy 4248, read + write):
///
/// | model       | weight       | rows x K        | blocks | instance | GB/s at M = 1        |
/// |-------------|--------------|-----------------|--------|----------|----------------------|
/// | Llama-3-8B  | qkv          | 6144 x 4096     | 384    | w8u4h    | 3295 / 2887 / 2999   |
/// | Llama-3-8B  | o            | 4096 x 4096     | 256    | w8u8h    | 3086 / 2732 / 2952   |
/// | Llama-3-8B  | gate_up      | 28672 x 4096    | 1792   | w8u8h    | 3692 / 3610 / 3729   |
/// | Llama-3-8B  | down         | 4096 x 14336    | 256    | cc/w16u4 | 3532 / 3384 / 3663   |
/// | Llama-3-8B  | lm_head f32  | 128256 x 4096   | 8016   | cc/w16u4h| 3960 / 3762 / 4252   |
/// | Qwen3.5-27B | attn qkv+gate| 14336 x 5120    | 896    | cc/w8u8h | 3510 / 3533 / 3798   |
/// | Qwen3.5-27B | attn o       | 5120 x 6144     | 320    | w8u4h    | 3066 / 2786 / 2837   |
/// | Qwen3.5-27B | GDN in_proj  | 16480 x 5120    | 1030   | cc/w8u8h | 3639 / 3596 / 3886   |
/// | Qwen3.5-27B | GDN out      | 5120 x 6144     | 320    | w8u4h    | (as attn o)          |
/// | Qwen3.5-27B | gate_up      | 34816 x 5120    | 2176   | cc/w8u8h | 3784 / 3729 / 3941   |
/// | Qwen3.5-27B | down         | 5120 x 17408    | 320    | cc/w8u4  | 3258 / 3258 / 3569   |
/// | Qwen3.5-27B | lm_head f32  | 248320 x 5120   | 15520  | cc/w8u8h | 4063 / 3933 / 4438   |
///
/// The CUDA-core kernel reads most big matrices faster at M = 1 (4-9% on the 27B's, 4-7% on the
/// 8B's down and lm_head) but not at M >= 2 (1.19 TB/s at M = 8 against 3.8). In the model the
/// isolated figures mislead (neighbours overlap under PDL, L2 is warm, the pre-wait prefetch
/// differs): Llama-3-8B batch-1 decode at 64e81ae (benches/gemv_variants.sh,
/// benches/results/gemv_variants_64e81ae.log; tok/s, noise ~0.8%) gave 212.6 with this table's
/// first form (qkv / o / gate_up on tensor cores, down / lm_head on CUDA cores), 223.3 with
/// every shape on CUDA cores, 218.9 with only gate_up moved to CUDA cores, 218.0 with only down
/// moved to tensor cores (w16u4), no change from qkv or o alone, and a deeper pre-wait prefetch
/// only hurt (128 steps: 183.0). With the M = 1 kernel chosen apart from the batched one
/// (391a3f6, gemv_variants_391a3f6.log): CUDA cores everywhere 224.7 against 221.5-221.8 with
/// the 8B's down on tensor cores (w16u4; w16u4h / w16u8h 218.1 / 217.6), the lm_head on tensor
/// cores 220.1; the Qwen3.5-27B shape 75.2 tok/s with CUDA cores everywhere against 72.1 with its
/// down on tensor cores. So `cuda_cores` (the kernel `GemvForm::ByShape` runs at M = 1) is set
/// for every shape measured; from M = 2 on every shape runs its tensor-core instance (`config`).
pub const GEMV_TC_RULES: &[GemvTcRule] = &[
    GemvTcRule { max_rows: 4096, min_k: 8192, config: tc(16, 4, false), cuda_cores: true },
    GemvTcRule { max_rows: 4096, min_k: 0, config: tc(8, 8, true), cuda_cores: true },
    GemvTcRule { max_rows: 5120, min_k: 16384, config: GemvTcConfig::DEFAULT, cuda_cores: true },
    GemvTcRule { max_rows: 6144, min_k: 0, config: tc(8, 4, true), cuda_cores: true },
    GemvTcRule { max_rows: 65536, min_k: 5120, config: tc(8, 8, true), cuda_cores: true },
    GemvTcRule { max_rows: 65536, min_k: 0, config: tc(8, 8, true), cuda_cores: true },
    GemvTcRule { max_rows: 131072, min_k: 0, config: tc(16, 4, true), cuda_cores: true },
    GemvTcRule { max_rows: usize::MAX, min_k: 0, config: tc(8, 8, true), cuda_cores: true },
];

/// The tensor-core GEMV instance for a weight of `rows` x `k` (the fused gate_up weight's
/// 2 * inter rows for the SwiGLU epilogue): the first row of `GEMV_TC_RULES` that matches.
pub fn gemv_tc_config(rows: usize, k: usize) -> GemvTcConfig {
    gemv_tc_config_in(GEMV_TC_RULES, rows, k)
}

/// Whether `GemvForm::ByShape` runs a weight of `rows` x `k` on CUDA cores at M = 1 (its rule's
/// `cuda_cores`; shapes no rule covers stay on tensor cores).
pub fn gemv_shape_on_cuda_cores(rows: usize, k: usize) -> bool {
    gemv_rule_in(GEMV_TC_RULES, rows, k).is_some_and(|r| r.cuda_cores)
}

/// `gemv_tc_config` over a given table (unit-tested apart from the live one).
fn gemv_tc_config_in(rules: &[GemvTcRule], rows: usize, k: usize) -> GemvTcConfig {
    gemv_rule_in(rules, rows, k).map_or(GemvTcConfig::DEFAULT, |r| r.config)
}

fn gemv_rule_in(rules: &[GemvTcRule], rows: usize, k: usize) -> Option<&GemvTcRule> {
    rules.iter().find(|r| rows <= r.max_rows && k >= r.min_k)
}

/// The kernel a weight of `rows` x `k` runs in form `form`, with the device's per-shape
/// override `shapes` (`NINFER_GEMV_SHAPES`, which only `ByShape` consults; None: the built-in
/// table): the one place that resolves a form to a kernel, for the GEMV launcher and the fused
/// add + RMSNorm route alike. `m` is the rows of the launch (1..=GEMV_MAX_M): only `ByShape`
/// looks at it, to run its batch-1 kernel (`gemv_shape_on_cuda_cores`) at M = 1 alone.
pub fn gemv_kernel(form: GemvForm, shapes: Option<&GemvShapeOverride>, rows: usize, k: usize, m: usize) -> GemvKernel {
    match form {
        GemvForm::Simt => GemvKernel::CudaCores,
        GemvForm::TensorCores => GemvKernel::TensorCores(gemv_tc_config(rows, k)),
        GemvForm::TensorCoresAs(c) => GemvKernel::TensorCores(c),
        GemvForm::ByShape => shapes.and_then(|o| o.kernel(rows, k)).unwrap_or_else(|| {
            if m == 1 && gemv_shape_on_cuda_cores(rows, k) {
                GemvKernel::CudaCores
            } else {
                GemvKernel::TensorCores(gemv_tc_config(rows, k))
            }
        }),
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

/// The output projection with the residual add + RMSNorm epilogue (`gemv_add_rmsnorm`) in
/// instance `c`: the instance the plain GEMV of the same weight runs, so that the fused kernel
/// sums exactly as `gemv` does.
pub(super) fn tc_add_rmsnorm_name(c: GemvTcConfig) -> Result<&'static str> {
    by_tc_config!("gemv_tc_add_rmsnorm", c).ok_or_else(|| no_tc_instance(c))
}

/// The GEMV form for compute capability `cc`: per weight shape from sm_80 on (tensor cores,
/// m16n8k16 with bf16 inputs, or CUDA cores where those stream the shape faster at M = 1), CUDA
/// cores below. The one place that decides it; every `gemv*` launcher asks here.
pub fn gemv_form(cc: (u32, u32)) -> GemvForm {
    if cc.0 >= 8 {
        GemvForm::ByShape
    } else {
        GemvForm::Simt
    }
}

/// The environment switch that puts every shape on one GEMV kernel: 1 tensor cores (batched
/// decode: 2-3x the CUDA-core kernel's rate at M = 8), 0 CUDA cores; unset: per shape.
pub const TC_GEMV_SWITCH: &str = "NINFER_TC_GEMV";

/// The environment switch for batch-invariant decode: on, every M of a weight shape runs one
/// kernel (the tensor-core form from sm_80 on), so a sequence decoded in a batch of up to
/// GEMV_MAX_M equals it decoded alone bit for bit; off (default), `GemvForm::ByShape` runs the
/// faster CUDA-core kernel of some shapes at M = 1 only.
pub const BATCH_INVARIANT_SWITCH: &str = "NINFER_BATCH_INVARIANT";

/// `gemv_form(cc)` when `NINFER_TC_GEMV` (value `switch`) is unset and `invariant`
/// (`NINFER_BATCH_INVARIANT`, parsed once by the device with its other switches) is off;
/// `TensorCores` when either is on (on sm_80+; below, the CUDA-core kernel is all there is),
/// `Simt` when `NINFER_TC_GEMV` is off; a misspelt value is an error naming the variable. Read
/// once per device (`CudaDevice::gemv_form`), so a sequence's projections never change form
/// mid-run. `Simt` and `TensorCores` are batch invariant (one kernel per shape whatever M);
/// `ByShape` is not.
pub fn gemv_form_with_switch(cc: (u32, u32), switch: Option<&str>, invariant: bool) -> Result<GemvForm> {
    if switch.map(str::trim).is_none_or(str::is_empty) {
        return Ok(match gemv_form(cc) {
            GemvForm::ByShape if invariant => GemvForm::TensorCores,
            f => f,
        });
    }
    let on = crate::config::env_switch::parse_switch(TC_GEMV_SWITCH, switch, true)?;
    super::refuse_explicit_on(TC_GEMV_SWITCH, switch, cc.0 >= 8, &super::needs_cc("the tensor-core GEMV", (8, 0), cc))?;
    Ok(if on { GemvForm::TensorCores } else { GemvForm::Simt })
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
#[derive(Clone, Copy)]
enum GemvOut {
    /// y[M, N] in the storage type.
    Store,
    /// y[M, N] in f32; with `true` each value rounded to the storage type first (the
    /// kernels' `round_out` argument: logits_dtype "auto").
    F32(bool),
    /// act[M, N] = silu(gate) * up of the fused gate_up weight's rows n and N + n.
    SwiGlu,
}

impl GemvOut {
    fn name(self, m: usize) -> &'static str {
        match self {
            GemvOut::Store => NAMES[m - 1],
            GemvOut::F32(_) => NAMES_F32[m - 1],
            GemvOut::SwiGlu => NAMES_GATEUP_SWIGLU[m - 1],
        }
    }

    /// The tensor-core kernel of this epilogue in instance `c` (one for every M).
    fn tc_name(self, c: GemvTcConfig) -> Result<&'static str> {
        match self {
            GemvOut::Store => by_tc_config!("gemv_tc", c),
            GemvOut::F32(_) => by_tc_config!("gemv_tc_f32out", c),
            GemvOut::SwiGlu => by_tc_config!("gemv_tc_gateup_swiglu", c),
        }
        .ok_or_else(|| no_tc_instance(c))
    }

    /// Rows of the weight for `n` output columns: the fused gate_up weight has a gate and an
    /// up row per activation.
    fn weight_rows(self, n: usize) -> usize {
        match self {
            GemvOut::Store | GemvOut::F32(_) => n,
            GemvOut::SwiGlu => 2 * n,
        }
    }

    /// Output columns one tensor-core block covers: a tile of 16 weight rows, which for SwiGLU
    /// is 8 gate rows and their 8 up rows (gemv_tc_cols in gemv_tc.cu).
    fn tc_cols_per_block(self) -> usize {
        match self {
            GemvOut::Store | GemvOut::F32(_) => 16,
            GemvOut::SwiGlu => 8,
        }
    }

    /// Output columns one block of `warps` warps covers for `m` rows.
    fn cols_per_block(self, m: usize, warps: usize) -> usize {
        warps
            * match self {
                GemvOut::Store | GemvOut::F32(_) => cols_per_warp(m),
                GemvOut::SwiGlu => pairs_per_warp(m),
            }
    }

    /// The f32 kernels' trailing `round_out` argument (0 for the other epilogues, which take
    /// none: `args` drops it).
    fn round_arg(self) -> i32 {
        matches!(self, GemvOut::F32(true)) as i32
    }

    /// Kernel arguments of this epilogue, given the `common` ones every epilogue takes: the
    /// f32 kernels take `round_out` after them.
    fn args(self, common: usize) -> usize {
        common + matches!(self, GemvOut::F32(_)) as usize
    }

    fn elem_bytes(self) -> u64 {
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

impl CudaDevice {
    /// Launches the GEMV of form `form` with epilogue `out` over `m` rows, GEMV_MAX_M rows per
    /// launch; `n` is the number of output columns (the activation width for SwiGlu).
    #[allow(clippy::too_many_arguments)]
    fn gemv_launch(&self, form: GemvForm, x: u64, w: u64, y: u64, out: GemvOut, m: usize, n: usize, k: usize) -> Result<()> {
        if !k.is_multiple_of(8) {
            return Err(NinferError::Device(format!(
                "gemv needs K to be a multiple of 8 (16-byte loads), got K = {k}"
            )));
        }
        if form != GemvForm::Simt && self.compute_capability().0 < 8 {
            return Err(NinferError::Device(format!(
                "the tensor-core GEMV needs sm_80 or newer, this device is {}",
                self.arch()
            )));
        }
        let mut row = 0;
        while row < m {
            let mm = (m - row).min(GEMV_MAX_M);
            let xr = x + (row * k * 2) as u64;
            let yr = y + (row * n) as u64 * out.elem_bytes();
            match self.gemv_kernel(form, out.weight_rows(n), k, mm) {
                GemvKernel::CudaCores => {
                    // ksplit warps share one warp's columns (NINFER_CC_KSPLIT, keyed like NINFER_GEMV_SHAPES).
                    let ksplit = self.cc_ksplit_for(out.weight_rows(n), k);
                    let grid = (as_i32("gemv n", n.div_ceil(out.cols_per_block(mm, self.cc_warps() / ksplit)))? as u32, 1, 1);
                    let name = out.name(mm);
                    let f = self.function(KernelFamily::Gemv, name)?;
                    let args = [
                        KArg::Ptr(xr),
                        KArg::Ptr(w),
                        KArg::Ptr(yr),
                        KArg::I32(as_i32("gemv n", n)?),
                        KArg::I32(as_i32("gemv k", k)?),
                        KArg::I32(self.cc_prefetch().vectors(out.weight_rows(n), k) as i32),
                        KArg::I32(ksplit as i32),
                        KArg::I32(out.round_arg()),
                    ];
                    self.launch_pdl(&f, cfg(grid, (self.cc_warps() * 32) as u32), name, &args[..out.args(7)])?;
                }
                // One instance per weight shape, whatever M.
                GemvKernel::TensorCores(c) => {
                    let grid = (as_i32("gemv n", n.div_ceil(out.tc_cols_per_block()))? as u32, 1, 1);
                    let name = out.tc_name(c)?;
                    let f = self.function(KernelFamily::GemvTc, name)?;
                    let args = [
                        KArg::Ptr(xr),
                        KArg::Ptr(w),
                        KArg::Ptr(yr),
                        KArg::I32(mm as i32),
                        KArg::I32(as_i32("gemv n", n)?),
                        KArg::I32(as_i32("gemv k", k)?),
                        KArg::I32(self.tc_prefetch_steps() as i32),
                        KArg::I32(out.round_arg()),
                    ];
                    self.launch_pdl(&f, cfg(grid, (c.warps * 32) as u32), name, &args[..out.args(7)])?;
                }
            }
            row += mm;
        }
        Ok(())
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T, reading W once per 8 rows of x, in this
    /// device's `gemv_form`. For decode (small M); K must be a multiple of 8 and all buffers
    /// 16-byte aligned.
    pub fn gemv(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_with(self.gemv_form(), x, w, y, m, n, k)
    }

    /// As `gemv` in the given form (tests and the throughput report compare the forms;
    /// TensorCores on a device below sm_80 is an error).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemv x", x.len(), m * k)?;
        check_len("gemv w", w.len(), n * k)?;
        check_len("gemv y", y.len(), m * n)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemv_launch(form, xp, wp, yp, GemvOut::Store, m, n, k)
    }

    /// y[M, N] = x[M, K] * W[N, K]^T by the faster route for M: the GEMV kernel for
    /// M <= GEMV_ROUTE_MAX_M (and K % 8 == 0), the warpgroup GEMM for 9..=64 rows where it
    /// runs (`wg_gemm_fits`: sm_90a, `NINFER_WG_GEMM`), cuBLAS otherwise.
    pub fn linear(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        if m <= GEMV_ROUTE_MAX_M && k.is_multiple_of(8) {
            self.gemv(x, w, y, m, n, k)
        } else if self.wg_gemm_fits(m, k) {
            self.gemm_wg_with(x, w, y, m, n, k, None, None)
        } else {
            self.gemm(x, w, y, m, n, k)
        }
    }

    /// As `linear` with f32 output (the lm_head producing logits): GEMV up to
    /// GEMV_ROUTE_MAX_M rows, cuBLAS above. With `round`, every output is rounded to the
    /// storage type and kept as f32 (logits_dtype "auto", model/logits_dtype.rs): in the GEMV's
    /// epilogue (decode of up to 8 rows gains no kernel), and after cuBLAS by
    /// `round_f32_to_storage` in place (one elementwise kernel for prefill and for decode
    /// batches above 8 rows; cuBLAS writing the storage type instead would round the same sums
    /// identically but needs a second buffer and a widening kernel all the same).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32_out(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        round: bool,
    ) -> Result<()> {
        if m <= GEMV_ROUTE_MAX_M && k.is_multiple_of(8) {
            self.gemv_f32_out_round_with(self.gemv_form(), x, w, y, m, n, k, round)
        } else {
            self.gemm_f32_out(x, w, y, m, n, k)?;
            if round {
                self.round_f32_to_storage(y, m * n)?;
            }
            Ok(())
        }
    }

    /// y[M, N] = x[M, K] * W[N, K]^T + bias[N] in the storage type, rounded once after the
    /// bias is added (as torch's addmm rounds): the f32 sums of `linear_f32_out` into `y32`
    /// (at least M x N), then `add_bias_to_storage`. For the projections of checkpoints with
    /// biases; the fused epilogues (RoPE, SwiGLU, residual + norm) run only without one.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_bias(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        bias: &impl DevicePtr<u16>,
        y32: &mut impl DevicePtrMut<f32>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("linear_bias bias", bias.len(), n)?;
        check_len("linear_bias y32", y32.len(), m * n)?;
        check_len("linear_bias y", y.len(), m * n)?;
        if m == 0 {
            return Ok(());
        }
        self.linear_f32_out(x, w, y32, m, n, k, false)?;
        let s = self.stream();
        let (sp, _a) = y32.device_ptr_mut(s);
        let (bp, _b) = bias.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        let f = self.function(KernelFamily::Gemv, "add_bias_to_storage")?;
        let args = [KArg::Ptr(sp), KArg::Ptr(bp), KArg::Ptr(yp), KArg::I64(m as i64), KArg::I64(n as i64)];
        self.launch(&f, cfg(super::elementwise::elementwise_grid(m * n), 256), "add_bias_to_storage", &args)
    }

    /// Rounds the first `len` values of `y` to the storage type in place, kept as f32
    /// (`round_st` of common.cuh, round-to-nearest-even: what the GEMV's `round_out` does).
    pub fn round_f32_to_storage(&self, y: &mut impl DevicePtrMut<f32>, len: usize) -> Result<()> {
        check_len("round_f32_to_storage y", y.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (yp, _c) = y.device_ptr_mut(s);
        // Four values a thread where y allows 16-byte accesses (the logits buffers do), so a
        // quarter of the threads; at most enough blocks to fill the device several times over
        // (the kernels stride past them).
        const THREADS: usize = 256;
        const MAX_BLOCKS: usize = 1 << 16;
        let (name, per_thread) = if yp.is_multiple_of(16) { ("round_f32_to_storage_v4", 4) } else { ("round_f32_to_storage", 1) };
        let grid = (len.div_ceil(per_thread * THREADS).min(MAX_BLOCKS) as u32, 1, 1);
        let f = self.function(KernelFamily::Gemv, name)?;
        let args = [KArg::Ptr(yp), KArg::I64(len as i64)];
        self.launch(&f, cfg(grid, THREADS as u32), name, &args)
    }

    /// As `gemv` with f32 output (the lm_head producing logits).
    pub fn gemv_f32_out(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_f32_out_with(self.gemv_form(), x, w, y, m, n, k)
    }

    /// As `gemv_f32_out` in the given form.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32_out_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_f32_out_round_with(form, x, w, y, m, n, k, false)
    }

    /// As `gemv_f32_out_with`, each output rounded to the storage type (kept as f32) in the
    /// kernel's epilogue when `round`: bit for bit the unrounded output rounded afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32_out_round_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        round: bool,
    ) -> Result<()> {
        check_len("gemv x", x.len(), m * k)?;
        check_len("gemv w", w.len(), n * k)?;
        check_len("gemv y", y.len(), m * n)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemv_launch(form, xp, wp, yp, GemvOut::F32(round), m, n, k)
    }

    /// The gate_up projection of a SwiGLU MLP with the activation in its epilogue:
    /// act[M, inter] = silu(x W_gate^T) * (x W_up^T), where `w_gate_up` is the fused [2 * inter, K]
    /// weight the loader packs (gate rows, then up rows). Bit for bit what `gemv` into a
    /// [M, 2 * inter] buffer followed by `swiglu` gives (each sum is rounded to the storage type
    /// where the GEMV stores it), with one kernel and one gate_up round trip less; the weight
    /// stream is the plain GEMV's. For decode (small M; any M runs, in launches of GEMV_MAX_M
    /// rows); K must be a multiple of 8 and all buffers 16-byte aligned.
    pub fn gemv_gateup_swiglu(
        &self,
        x: &impl DevicePtr<u16>,
        w_gate_up: &impl DevicePtr<u16>,
        act: &mut impl DevicePtrMut<u16>,
        m: usize,
        inter: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_gateup_swiglu_with(self.gemv_form(), x, w_gate_up, act, m, inter, k)
    }

    /// As `gemv_gateup_swiglu` in the given form (bit for bit `gemv_with` of the same form
    /// followed by swiglu).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_gateup_swiglu_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w_gate_up: &impl DevicePtr<u16>,
        act: &mut impl DevicePtrMut<u16>,
        m: usize,
        inter: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemv_gateup_swiglu x", x.len(), m * k)?;
        check_len("gemv_gateup_swiglu w", w_gate_up.len(), 2 * inter * k)?;
        check_len("gemv_gateup_swiglu act", act.len(), m * inter)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w_gate_up.device_ptr(s);
        let (ap, _c) = act.device_ptr_mut(s);
        self.gemv_launch(form, xp, wp, ap, GemvOut::SwiGlu, m, inter, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_gemv_switch_picks_the_form_and_rejects_a_misspelt_value() {
        assert_eq!(gemv_form_with_switch((9, 0), None, false).unwrap(), GemvForm::ByShape);
        assert_eq!(gemv_form_with_switch((9, 0), Some(" "), false).unwrap(), GemvForm::ByShape);
        assert_eq!(gemv_form_with_switch((7, 5), None, false).unwrap(), GemvForm::Simt);
        assert_eq!(gemv_form_with_switch((9, 0), Some("0"), false).unwrap(), GemvForm::Simt);
        assert_eq!(gemv_form_with_switch((9, 0), Some("on"), false).unwrap(), GemvForm::TensorCores);
        // On for a device without the mma path is refused, not ignored.
        let e = gemv_form_with_switch((7, 5), Some("1"), false).unwrap_err().to_string();
        assert!(e.contains("NINFER_TC_GEMV") && e.contains("8.0") && e.contains("7.5"), "{e}");
        assert_eq!(gemv_form_with_switch((7, 5), Some("0"), false).unwrap(), GemvForm::Simt);
        let e = gemv_form_with_switch((9, 0), Some("tc"), false).unwrap_err().to_string();
        assert!(e.contains(TC_GEMV_SWITCH) && e.contains("tc"), "{e}");
        // Batch invariance: one kernel per shape for every M (tensor cores), whatever M; an
        // explicit NINFER_TC_GEMV is invariant already and wins; below sm_80 the SIMT form is.
        assert_eq!(gemv_form_with_switch((9, 0), None, true).unwrap(), GemvForm::TensorCores);
        assert_eq!(gemv_form_with_switch((9, 0), Some("0"), true).unwrap(), GemvForm::Simt);
        assert_eq!(gemv_form_with_switch((7, 5), None, true).unwrap(), GemvForm::Simt);
        let e = crate::config::env_switch::parse_switch(BATCH_INVARIANT_SWITCH, Some("always"), false).unwrap_err().to_string();
        assert!(e.contains(BATCH_INVARIANT_SWITCH) && e.contains("always"), "{e}");
    }

    #[test]
    fn gemv_kernel_resolves_the_form_and_only_by_shape_takes_the_override() {
        let o = super::super::gemv_tuning::parse_gemv_shapes(Some("6144x4096=cc,4096x14336=w16u4h")).unwrap().unwrap();
        let on_tc = GemvKernel::TensorCores;
        // Without an override ByShape is GEMV_TC_RULES: at M = 1 on CUDA cores; from M = 2 on
        // every shape on its tensor-core instance.
        assert_eq!(gemv_kernel(GemvForm::ByShape, None, 6144, 4096, 1), GemvKernel::CudaCores);
        assert_eq!(gemv_kernel(GemvForm::ByShape, None, 4096, 14336, 1), GemvKernel::CudaCores);
        assert_eq!(gemv_kernel(GemvForm::ByShape, None, 4096, 14336, 2), on_tc(gemv_tc_config(4096, 14336)));
        for m in [2, 5, 8] {
            assert_eq!(gemv_kernel(GemvForm::ByShape, None, 6144, 4096, m), on_tc(gemv_tc_config(6144, 4096)));
            assert_eq!(gemv_kernel(GemvForm::ByShape, None, 128256, 4096, m), on_tc(gemv_tc_config(128256, 4096)));
        }
        // The override moves the shapes it names, and only those, at every M.
        for m in [1, 3] {
            assert_eq!(gemv_kernel(GemvForm::ByShape, Some(&o), 6144, 4096, m), GemvKernel::CudaCores);
            assert_eq!(gemv_kernel(GemvForm::ByShape, Some(&o), 4096, 14336, m), on_tc(tc(16, 4, true)));
        }
        assert_eq!(gemv_kernel(GemvForm::ByShape, Some(&o), 4096, 4096, 1), GemvKernel::CudaCores);
        assert_eq!(gemv_kernel(GemvForm::ByShape, Some(&o), 4096, 4096, 2), on_tc(gemv_tc_config(4096, 4096)));
        // The forms that put every shape on one kernel consult neither the override nor M.
        for m in [1, 8] {
            assert_eq!(gemv_kernel(GemvForm::Simt, Some(&o), 4096, 14336, m), GemvKernel::CudaCores);
            assert_eq!(gemv_kernel(GemvForm::TensorCores, Some(&o), 6144, 4096, m), on_tc(gemv_tc_config(6144, 4096)));
            assert_eq!(gemv_kernel(GemvForm::TensorCoresAs(GemvTcConfig::DEFAULT), Some(&o), 6144, 4096, m), on_tc(GemvTcConfig::DEFAULT));
        }
    }

    #[test]
    fn kernel_names_follow_the_instances_of_gemv_tc_cu() {
        let src = include_str!("../../../../../cuda/gemv_tc.cu");
        for prefix in ["gemv_tc", "gemv_tc_f32out", "gemv_tc_gateup_swiglu", "gemv_tc_add_rmsnorm"] {
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
            assert_eq!(tc_add_rmsnorm_name(c).unwrap(), format!("gemv_tc_add_rmsnorm_w{w}_u{u}{h}"));
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
