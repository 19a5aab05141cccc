//! Decode GEMM for the batches above the GEMV's 8 rows (9..=64): cuda/gemv_tc.cu
//! `gemv_tc_batch_m{16,32,64}_w{4,8}`, on sm_80+, in place of cuBLAS where the shape fits
//! (`batch_gemm_plan`). Why: cuBLAS reads the weights of an 8B's qkv / o / down projections at
//! 2.5-3.5 TB/s at these M on the H200 (a 4.16 TB/s copy; every cublasLt algorithm its
//! heuristic offers no better: benches/results/cublaslt_algos_6e9605a.log), while decode at a
//! batch is still bound by reading each weight once. The kernel streams the weights as the
//! tensor-core GEMV does (and requests its first ones before the PDL wait) and splits K over
//! blocks where N alone gives too few, summing the splits in a fixed order in the tile's last
//! block: the result depends on (N, K, the device's SM count), not on M.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Fewest and most rows of x the batch kernel takes (below: the GEMV; above: cuBLAS).
pub const BATCH_GEMM_MIN_M: usize = super::gemv::GEMV_MAX_M + 1;
pub const BATCH_GEMM_MAX_M: usize = 64;
/// k per chunk (TCB_KC in gemv_tc.cu): K and the split length are multiples of it.
pub const BATCH_GEMM_KC: usize = 128;
/// Chunks in flight (TCB_STAGES) and the chunk row stride in elements (TCB_LX).
const STAGES: usize = 3;
const LX: usize = BATCH_GEMM_KC + 32;
/// f32 partial sums the device keeps for split launches (16 MiB) and tile counters.
pub const BATCH_GEMM_PARTIAL_FLOATS: usize = 4 << 20;
pub const BATCH_GEMM_MAX_TILES: usize = 4096;
/// Blocks a launch aims for per SM: K is split until tiles x splits reaches it (one block of
/// 8 warps or several of 4 an SM keep ~64 KB of weights in flight there).
const BLOCKS_PER_SM: usize = 2;

/// `NINFER_BATCH_GEMM` (default on, sm_80+): decode batches of 9..64 rows on the batch kernel;
/// 0 sends them to cuBLAS (the A-B switch). Read once per device.
pub const BATCH_GEMM_SWITCH: &str = "NINFER_BATCH_GEMM";

/// One launch of the batch kernel: its instance (`rows` = 16 / 32 / 64 x rows it holds,
/// `warps` a block, 16 weight rows each) and its K split (`splits` blocks over K, `ks` k each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchGemmPlan {
    pub rows: usize,
    pub warps: usize,
    pub splits: usize,
    pub ks: usize,
}

impl BatchGemmPlan {
    /// The kernel's name (GEMV_TC_BATCH_INSTANCE in gemv_tc.cu).
    pub fn name(&self) -> Result<&'static str> {
        Ok(match (self.rows, self.warps) {
            (16, 4) => "gemv_tc_batch_m16_w4",
            (32, 4) => "gemv_tc_batch_m32_w4",
            (64, 4) => "gemv_tc_batch_m64_w4",
            (16, 8) => "gemv_tc_batch_m16_w8",
            (32, 8) => "gemv_tc_batch_m32_w8",
            (64, 8) => "gemv_tc_batch_m64_w8",
            (r, w) => return Err(NinferError::Device(format!("no batch GEMM instance of {r} rows and {w} warps"))),
        })
    }

    /// Weight-row tiles of the launch (grid x) for `n` output columns.
    pub fn tiles(&self, n: usize) -> usize {
        n.div_ceil(16 * self.warps)
    }

    /// f32 partials the launch writes for `n` columns (0 unsplit).
    pub fn partial_floats(&self, n: usize) -> usize {
        if self.splits == 1 {
            0
        } else {
            self.splits * self.tiles(n) * 16 * self.warps * self.rows
        }
    }

    /// Dynamic shared memory: TCB_STAGES chunks of `rows` x rows.
    pub fn smem_bytes(&self) -> usize {
        STAGES * self.rows * LX * 2
    }
}

/// The launch for x[m, k] against W[n, k] on a device of `sms` SMs with `warps` a block, or
/// None where the kernel does not apply (m outside 9..=64, K not a multiple of 128). Splits K
/// (in whole chunks, at least two a split) until tiles x splits reaches BLOCKS_PER_SM blocks an
/// SM, within the device's partial buffer. Depends on m only through `rows`, which changes no
/// sum: every m of 9..=64 gets the same bits for a row.
pub fn batch_gemm_plan_with(m: usize, n: usize, k: usize, sms: usize, warps: usize) -> Option<BatchGemmPlan> {
    if !(BATCH_GEMM_MIN_M..=BATCH_GEMM_MAX_M).contains(&m) || n == 0 || k == 0 || !k.is_multiple_of(BATCH_GEMM_KC) {
        return None;
    }
    let rows = if m <= 16 {
        16
    } else if m <= 32 {
        32
    } else {
        64
    };
    let mut plan = BatchGemmPlan { rows, warps, splits: 1, ks: k };
    let tiles = plan.tiles(n);
    if tiles > BATCH_GEMM_MAX_TILES {
        return None;
    }
    let chunks = k / BATCH_GEMM_KC;
    let want = (BLOCKS_PER_SM * sms).div_ceil(tiles).clamp(1, (chunks / 2).max(1));
    // The partials are sized for 64 rows whatever m, so the split (and the bits) never depend on m.
    let cap = BATCH_GEMM_PARTIAL_FLOATS / (tiles * 16 * warps * BATCH_GEMM_MAX_M);
    let splits = want.min(cap.max(1));
    let ks = chunks.div_ceil(splits) * BATCH_GEMM_KC;
    plan.splits = k.div_ceil(ks);
    plan.ks = ks;
    Some(plan)
}

/// Warps a block of the batch kernel (gemv_tc.cu instances 4 and 8).
pub const BATCH_GEMM_WARPS: usize = 4;

impl CudaDevice {
    /// The batch kernel's launch for this device, or None (cuBLAS) where it does not apply or
    /// `NINFER_BATCH_GEMM` is off or the device is below sm_80.
    pub fn batch_gemm_plan(&self, m: usize, n: usize, k: usize) -> Option<BatchGemmPlan> {
        if !self.batch_gemm() {
            return None;
        }
        batch_gemm_plan_with(m, n, k, self.sm_count(), BATCH_GEMM_WARPS)
    }

    /// y[M, N] = x[M, K] * W[N, K]^T for M above the GEMV's rows: the batch kernel where
    /// `batch_gemm_plan` gives a launch, cuBLAS otherwise.
    pub fn gemm_rows(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        match self.batch_gemm_plan(m, n, k) {
            Some(plan) => self.gemv_batch_with(plan, x, w, y, m, n, k),
            None => self.gemm(x, w, y, m, n, k),
        }
    }

    /// The batch kernel in a given launch (the op tests and the sweep compare launches).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_batch_with(
        &self,
        plan: BatchGemmPlan,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("batch gemm x", x.len(), m * k)?;
        check_len("batch gemm w", w.len(), n * k)?;
        check_len("batch gemm y", y.len(), m * n)?;
        if m == 0 || m > plan.rows || !k.is_multiple_of(BATCH_GEMM_KC) || !plan.ks.is_multiple_of(BATCH_GEMM_KC) || plan.ks == 0 {
            return Err(NinferError::Device(format!(
                "batch gemm: m = {m}, k = {k} do not fit the launch {plan:?} (m <= rows, k and ks multiples of {BATCH_GEMM_KC})"
            )));
        }
        if k.div_ceil(plan.ks) != plan.splits {
            return Err(NinferError::Device(format!("batch gemm: {} splits of {} do not cover k = {k}", plan.splits, plan.ks)));
        }
        let tiles = plan.tiles(n);
        let (partial, arrivals) = self.batch_work()?;
        if plan.partial_floats(n) > partial.len() || tiles > arrivals.len() {
            return Err(NinferError::Device(format!(
                "batch gemm: the launch {plan:?} for n = {n} needs {} partials and {tiles} counters, the device keeps {} and {}",
                plan.partial_floats(n),
                partial.len(),
                arrivals.len()
            )));
        }
        let name = plan.name()?;
        let f = self.function_with_smem(KernelFamily::GemvTc, name, plan.smem_bytes())?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        if [xp, wp].iter().any(|p| p % 16 != 0) {
            return Err(NinferError::Device("batch gemm: x and w must be 16-byte aligned".into()));
        }
        let (pp, _d) = partial.device_ptr(s);
        let (ap, _e) = arrivals.device_ptr(s);
        let args = [
            KArg::Ptr(xp),
            KArg::Ptr(wp),
            KArg::Ptr(yp),
            KArg::Ptr(pp),
            KArg::Ptr(ap),
            KArg::I32(m as i32),
            KArg::I32(as_i32("batch gemm n", n)?),
            KArg::I32(as_i32("batch gemm k", k)?),
            KArg::I32(as_i32("batch gemm ks", plan.ks)?),
        ];
        let mut c = cfg((as_i32("batch gemm tiles", tiles)? as u32, plan.splits as u32, 1), (plan.warps * 32) as u32);
        c.shared_mem_bytes = plan.smem_bytes() as u32;
        self.launch_pdl(&f, c, name, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_9_to_64_rows_with_k_in_whole_chunks() {
        assert_eq!(batch_gemm_plan_with(8, 4096, 4096, 132, 4), None);
        assert_eq!(batch_gemm_plan_with(65, 4096, 4096, 132, 4), None);
        assert_eq!(batch_gemm_plan_with(16, 4096, 4000, 132, 4), None, "K not a multiple of 128");
        for (m, rows) in [(9, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64)] {
            assert_eq!(batch_gemm_plan_with(m, 4096, 4096, 132, 4).unwrap().rows, rows, "m = {m}");
        }
    }

    #[test]
    fn the_split_depends_on_the_shape_not_on_m() {
        for (n, k) in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (5120, 17408), (64, 128)] {
            let p16 = batch_gemm_plan_with(9, n, k, 132, 4).unwrap();
            for m in 10..=64 {
                let p = batch_gemm_plan_with(m, n, k, 132, 4).unwrap();
                assert_eq!((p.splits, p.ks), (p16.splits, p16.ks), "n {n} k {k} m {m}");
            }
            // Every split holds whole chunks, at least one, and together they cover K.
            assert!(p16.ks.is_multiple_of(BATCH_GEMM_KC) && p16.ks > 0);
            assert_eq!(k.div_ceil(p16.ks), p16.splits);
            assert!(p16.partial_floats(n) <= BATCH_GEMM_PARTIAL_FLOATS);
        }
    }

    #[test]
    fn small_n_is_split_over_k_and_large_n_is_not() {
        // 8B o projection: 64 tiles of 64 rows, split to reach 2 blocks an SM.
        let o = batch_gemm_plan_with(64, 4096, 4096, 132, 4).unwrap();
        assert_eq!((o.splits, o.ks), (5, 896));
        // gate_up of 28672 rows: 448 tiles, no split.
        assert_eq!(batch_gemm_plan_with(64, 28672, 4096, 132, 4).unwrap().splits, 1);
    }
}
