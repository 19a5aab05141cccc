//! Decode GEMM of 9-64 rows on Hopper's warpgroup tensor cores (cuda/gemm_wg.cu): the
//! instance per M, the split of K over a thread-block cluster, the launcher, and the switch
//! that routes `linear` to it (`NINFER_WG_GEMM`).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::{as_i32, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// `NINFER_WG_GEMM=0` sends decode launches of 9-64 rows to cuBLAS instead of `gemm_wg_*`.
pub const WG_GEMM_SWITCH: &str = "NINFER_WG_GEMM";
/// Fewest rows `linear` sends to the kernel (fewer run the decode GEMV).
pub const WG_GEMM_MIN_M: usize = super::GEMV_ROUTE_MAX_M + 1;
/// Most rows one launch takes: the widest instance's wgmma N.
pub const WG_GEMM_MAX_M: usize = 64;

/// Weight rows a block (two warpgroups of 64), k a stage, threads a block, stages in the ring
/// (gemm_wg.cu's GW_ROWS, GW_BK, GW_THREADS and the instances' STAGES).
const GW_ROWS: usize = 128;
const GW_BK: usize = 64;
const GW_THREADS: u32 = 256;
const GW_STAGES: usize = 4;
/// Largest portable cluster: the most blocks that split one tile's K.
const MAX_SPLITS: usize = 8;
/// Fewest 64-column stages a split takes (shorter splits spend more on the pipeline's fill and
/// the cluster's sum than they stream).
const MIN_SPLIT_STEPS: usize = 4;
/// Shared memory of a Hopper SM (228 KiB, 1 KiB of it reserved per resident block): how many
/// blocks of an instance an SM holds, which sets how many splits fill the device.
const SM_SMEM_BYTES: usize = 228 << 10;
/// Registers of an SM and what the widest instance takes a thread (74, ptxas of NVRTC 12.9 /
/// 13.0, rounded up to the allocation granule): at most 3 blocks of 256 threads an SM.
const SM_REGS: usize = 65536;
const MAX_REGS_PER_THREAD: usize = 80;

/// `NINFER_WG_GEMM` as read (`config::parse_switch`; unset means on). A misspelt value is an
/// error naming the variable.
pub fn parse_wg_gemm_switch(value: Option<&str>) -> Result<bool> {
    crate::config::env_switch::parse_switch(WG_GEMM_SWITCH, value, true)
}

/// The instance (kernel name, wgmma N) for a launch of `m` rows.
fn instance(m: usize) -> (&'static str, usize) {
    match m {
        0..=16 => ("gemm_wg_n16", 16),
        17..=32 => ("gemm_wg_n32", 32),
        _ => ("gemm_wg_n64", 64),
    }
}

/// Dynamic shared memory of the instance of wgmma N `mn`: the ring of stages (a 128-row weight
/// tile and `mn` x rows, 128 bytes a row) and 1 KiB to align it to the swizzle's 1 KiB atoms.
fn smem_bytes(mn: usize) -> usize {
    GW_STAGES * (GW_ROWS + mn) * 128 + 1024
}

/// How one launch covers y[M, N]: `tiles` 128-row weight tiles (grid.y), each split over
/// `splits` blocks of one cluster (grid.x) taking `steps` 64-column stages of K each (the last
/// possibly fewer, none empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmWgPlan {
    pub tiles: usize,
    pub splits: usize,
    pub steps: usize,
}

/// The plan for `m` x `n` x `k` on `sm_count` SMs, with `splits` forced where given (the op
/// tests and the sweep), else as many splits as fill every SM's resident blocks once
/// (tiles x splits <= SMs x blocks an SM), within 1..=8 and at least MIN_SPLIT_STEPS stages a
/// split. Why fill once and not more: a second wave of blocks starts its pipeline from empty,
/// and the partial tiles of more splits cost more cluster sums.
pub fn gemm_wg_plan(m: usize, n: usize, k: usize, sm_count: usize, splits: Option<usize>) -> GemmWgPlan {
    let (_, mn) = instance(m);
    let tiles = n.div_ceil(GW_ROWS).max(1);
    let total = k.div_ceil(GW_BK).max(1);
    let per_sm = (SM_SMEM_BYTES / (smem_bytes(mn) + 1024)).min(SM_REGS / (MAX_REGS_PER_THREAD * GW_THREADS as usize)).max(1);
    let want = splits.unwrap_or_else(|| (sm_count * per_sm / tiles).min((total / MIN_SPLIT_STEPS).max(1)));
    let want = want.clamp(1, MAX_SPLITS).min(total);
    let steps = total.div_ceil(want);
    GemmWgPlan { tiles, splits: total.div_ceil(steps), steps }
}

impl CudaDevice {
    /// Whether `linear` runs `m` x `k` on `gemm_wg` here: sm_90a code, `NINFER_WG_GEMM` on,
    /// 9..=64 rows, K a multiple of 8 (16-byte rows).
    pub fn wg_gemm_fits(&self, m: usize, k: usize) -> bool {
        self.wg_gemm() && (WG_GEMM_MIN_M..=WG_GEMM_MAX_M).contains(&m) && k.is_multiple_of(8)
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T on warpgroup tensor cores, for M of
    /// 1..=64 (`linear` sends 9..=64), with the plan's splits or `splits` where given. sm_90a
    /// only; K a multiple of 8 and x, W 16-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_wg_with(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
        splits: Option<usize>,
    ) -> Result<()> {
        let (major, minor) = self.compute_capability();
        if !crate::backend::cuda::kernels::has_sm90a_code(major, minor) {
            return Err(NinferError::Device(format!("gemm_wg needs sm_90a code (wgmma); this device is {}", self.arch())));
        }
        if m == 0 || m > WG_GEMM_MAX_M || !k.is_multiple_of(8) {
            return Err(NinferError::Device(format!("gemm_wg takes 1..={WG_GEMM_MAX_M} rows and K a multiple of 8, got m {m}, k {k}")));
        }
        check_len("gemm_wg x", x.len(), m * k)?;
        check_len("gemm_wg w", w.len(), n * k)?;
        check_len("gemm_wg y", y.len(), m * n)?;
        if n == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        if !xp.is_multiple_of(16) || !wp.is_multiple_of(16) {
            return Err(NinferError::Device("gemm_wg: x and W must be 16-byte aligned".into()));
        }
        let plan = gemm_wg_plan(m, n, k, self.sm_count(), splits);
        let (name, mn) = instance(m);
        let smem = smem_bytes(mn);
        let f = self.function_with_smem(KernelFamily::GemmWg, name, smem)?;
        let config = LaunchConfig {
            grid_dim: (plan.splits as u32, as_i32("gemm_wg tiles", plan.tiles)? as u32, 1),
            block_dim: (GW_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let args = [
            KArg::Ptr(xp),
            KArg::Ptr(wp),
            KArg::Ptr(yp),
            KArg::I32(m as i32),
            KArg::I32(as_i32("gemm_wg n", n)?),
            KArg::I32(as_i32("gemm_wg k", k)?),
            KArg::I32(plan.steps as i32),
        ];
        // The kernel waits for the one before in every block before it reads x or writes y
        // (`launch_pdl`'s invariant): the launch may take PDL wherever the device does.
        self.launch_ex(&f, config, name, &args, self.pdl(), plan.splits as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_fill_the_h200_once_and_keep_every_split_non_empty() {
        // Llama-3-8B at 64 rows on 132 SMs (two 97 KiB blocks an SM): qkv, o, down, gate_up.
        assert_eq!(gemm_wg_plan(64, 6144, 4096, 132, None), GemmWgPlan { tiles: 48, splits: 5, steps: 13 });
        assert_eq!(gemm_wg_plan(64, 4096, 4096, 132, None), GemmWgPlan { tiles: 32, splits: 8, steps: 8 });
        assert_eq!(gemm_wg_plan(64, 4096, 14336, 132, None), GemmWgPlan { tiles: 32, splits: 8, steps: 28 });
        assert_eq!(gemm_wg_plan(64, 28672, 4096, 132, None), GemmWgPlan { tiles: 224, splits: 1, steps: 64 });
        // Three 73 KiB blocks an SM at 16 rows.
        assert_eq!(gemm_wg_plan(16, 6144, 4096, 132, None).splits, 8);
        // Short K: at least MIN_SPLIT_STEPS stages a split; ragged K: no empty split.
        assert_eq!(gemm_wg_plan(64, 333, 1000, 132, None), GemmWgPlan { tiles: 3, splits: 4, steps: 4 });
        for k in [8, 64, 65, 1000, 4096] {
            for forced in 1..=8 {
                let p = gemm_wg_plan(40, 333, k, 132, Some(forced));
                let total = k.div_ceil(64);
                assert!(p.splits >= 1 && p.splits <= forced && (p.splits - 1) * p.steps < total && p.splits * p.steps >= total, "{k} {forced} {p:?}");
            }
        }
    }

    #[test]
    fn the_switch_defaults_on_and_rejects_a_misspelt_value() {
        assert!(parse_wg_gemm_switch(None).unwrap());
        assert!(!parse_wg_gemm_switch(Some("0")).unwrap());
        let e = parse_wg_gemm_switch(Some("cublas")).unwrap_err().to_string();
        assert!(e.contains(WG_GEMM_SWITCH) && e.contains("cublas"), "{e}");
    }
}
