//! Decode GEMM of 9-64 rows on Hopper's warpgroup tensor cores (cuda/gemm_wg.cu): the
//! instance per M, the split of K over a thread-block cluster, the launcher, and the switch
//! that routes `linear` to it (`NINFER_WG_GEMM=1`; an error on a GPU without sm_90a code).
//!
//! Off by default: measured on the H200 (benches/results/gemm_wg_sweep_a626660.log,
//! wg_gemm_ab_a626660.log) it reads the weights at 0.94x cuBLAS's rate summed over the decode
//! shapes of Llama-3-8B and Qwen3.5-27B at 16 / 32 / 64 rows (1.10-1.14x on the 8B's o
//! projection at 16-32 rows, 0.83-0.88x on the 27B's gate_up), and Llama-3-8B batched decode
//! at concurrency 16 / 32 / 64 with it is within 1% of cuBLAS either way. docs/kernels.md
//! "Decode GEMM on warpgroup tensor cores" says what bounds it and what would lift it.

use cudarc::driver::{sys, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{as_i32, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// `NINFER_WG_GEMM=1` sends decode launches of 9-64 rows to `gemm_wg_*` instead of cuBLAS.
pub const WG_GEMM_SWITCH: &str = "NINFER_WG_GEMM";
/// Fewest rows `linear` sends to the kernel (fewer run the decode GEMV).
pub const WG_GEMM_MIN_M: usize = super::GEMV_ROUTE_MAX_M + 1;
/// Most rows one launch takes: the widest instance's wgmma N.
pub const WG_GEMM_MAX_M: usize = 64;

/// `NINFER_WG_GEMM` as read (`config::parse_switch`; unset means off). A misspelt value is an
/// error naming the variable.
pub fn parse_wg_gemm_switch(value: Option<&str>) -> Result<bool> {
    crate::config::env_switch::parse_switch(WG_GEMM_SWITCH, value, false)
}

/// Whether a device of compute capability `cc` runs gemm_wg, given `NINFER_WG_GEMM`'s value:
/// asking for it where there is no sm_90a code (no wgmma: anything but 9.0) is an error naming
/// the variable and the device, not a switch silently ignored.
pub fn wg_gemm_enabled(cc: (u32, u32), value: Option<&str>) -> Result<bool> {
    let on = parse_wg_gemm_switch(value)?;
    let has = crate::backend::cuda::kernels::has_sm90a_code(cc.0, cc.1);
    let why = format!("gemm_wg needs sm_90a (H100 / H200: wgmma); this device is compute capability {}.{}, where cuBLAS runs", cc.0, cc.1);
    super::refuse_explicit_on(WG_GEMM_SWITCH, value, has, &why)?;
    Ok(on)
}

/// The launch shapes gemm_wg takes: 1..=64 rows and K a multiple of 8 (16-byte rows).
pub fn check_wg_shape(m: usize, k: usize) -> Result<()> {
    if m == 0 || m > WG_GEMM_MAX_M || !k.is_multiple_of(8) {
        return Err(NinferError::Device(format!("gemm_wg takes 1..={WG_GEMM_MAX_M} rows and K a multiple of 8, got m {m}, k {k}")));
    }
    Ok(())
}

/// k a stage and threads a block (gemm_wg.cu's GW_BK and GW_THREADS).
const GW_BK: usize = 64;
const GW_THREADS: u32 = 256;
/// Largest portable cluster: the most blocks that split one tile's K.
const MAX_SPLITS: usize = 8;
/// Fewest 64-column stages a split takes (shorter splits spend more on the pipeline's fill and
/// the cluster's sum than they stream).
const MIN_SPLIT_STEPS: usize = 4;

/// One kernel of gemm_wg.cu (GEMM_WG_INSTANCE): x rows of the wgmma (`mn`, 16 / 32 / 64),
/// weight rows a block (`rows`, 128 or 256: 64 or 128 a warpgroup) and stages in the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmWgInstance {
    pub mn: usize,
    pub rows: usize,
    pub stages: usize,
}

const fn gw(mn: usize, rows: usize, stages: usize) -> GemmWgInstance {
    GemmWgInstance { mn, rows, stages }
}

impl GemmWgInstance {
    /// Every instance (the GEMM_WG_INSTANCE lines of gemm_wg.cu).
    pub const ALL: [GemmWgInstance; 6] = [gw(16, 128, 4), gw(32, 128, 4), gw(64, 128, 4), gw(16, 256, 6), gw(32, 256, 5), gw(64, 256, 5)];

    /// The instance for `m` rows with `rows` weight rows a block (None: DEFAULT_ROWS).
    pub fn for_rows(m: usize, rows: Option<usize>) -> Result<Self> {
        let mn = match m {
            0..=16 => 16,
            17..=32 => 32,
            _ => 64,
        };
        let rows = rows.unwrap_or(DEFAULT_ROWS);
        Self::ALL
            .into_iter()
            .find(|i| i.mn == mn && i.rows == rows)
            .ok_or_else(|| NinferError::Device(format!("gemm_wg has no instance of {rows} weight rows a block (128 or 256)")))
    }

    /// The kernel's name: gemm_wg_n{mn}_r{rows}_s{stages}.
    pub fn name(self) -> &'static str {
        match (self.mn, self.rows, self.stages) {
            (16, 128, 4) => "gemm_wg_n16_r128_s4",
            (32, 128, 4) => "gemm_wg_n32_r128_s4",
            (64, 128, 4) => "gemm_wg_n64_r128_s4",
            (16, 256, 6) => "gemm_wg_n16_r256_s6",
            (32, 256, 5) => "gemm_wg_n32_r256_s5",
            (64, 256, 5) => "gemm_wg_n64_r256_s5",
            _ => unreachable!("gemm_wg instance {self:?} is not in ALL"),
        }
    }

    /// Dynamic shared memory: the ring of stages (the weight tile and `mn` x rows, 128 bytes a
    /// row) and 1 KiB to align it to the swizzle's 1 KiB atoms.
    pub fn smem_bytes(self) -> usize {
        self.stages * (self.rows + self.mn) * 128 + 1024
    }
}

/// Weight rows a block by default: 256 (two m64 tiles a warpgroup share every x stage).
pub const DEFAULT_ROWS: usize = 256;

/// How one launch covers y[M, N]: `tiles` weight tiles (grid.y), each split over `splits`
/// blocks of one cluster (grid.x) taking `steps` 64-column stages of K each (the last possibly
/// fewer, none empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmWgPlan {
    pub tiles: usize,
    pub splits: usize,
    pub steps: usize,
}

/// A device's gemm_wg plans by (instance name, n, k, forced splits).
pub type WgPlanCache = std::sync::Mutex<std::collections::HashMap<(&'static str, usize, usize, Option<usize>), GemmWgPlan>>;

/// The plan for `n` x `k` in blocks of `rows` weight rows, with `splits` forced where given
/// (the op tests and the sweep), else the split that finishes soonest: with `capacity(s)`
/// clusters of s blocks resident at once (cuOccupancyMaxActiveClusters: a cluster's blocks must
/// share one GPC, so this is not SMs x blocks an SM / s), the tiles take ceil(tiles /
/// capacity) waves of ceil(stages / s) stages each; the fewest splits among the fastest (fewer
/// partial tiles to sum), within 1..=8 and at least MIN_SPLIT_STEPS stages a split.
pub fn gemm_wg_plan(n: usize, k: usize, rows: usize, capacity: &dyn Fn(usize) -> usize, splits: Option<usize>) -> GemmWgPlan {
    let tiles = n.div_ceil(rows).max(1);
    let total = k.div_ceil(GW_BK).max(1);
    let span = |s: usize| {
        let steps = total.div_ceil(s);
        (steps, total.div_ceil(steps))
    };
    let best = match splits {
        Some(s) => s.clamp(1, MAX_SPLITS).min(total),
        None => (1..=MAX_SPLITS.min((total / MIN_SPLIT_STEPS).max(1)))
            .min_by_key(|&s| (tiles.div_ceil(capacity(s).max(1)) * span(s).0, s))
            .unwrap_or(1),
    };
    let (steps, splits) = span(best);
    GemmWgPlan { tiles, splits, steps }
}

impl CudaDevice {
    /// Whether `linear` runs `m` x `k` on `gemm_wg` here: sm_90a code, `NINFER_WG_GEMM=1`,
    /// 9..=64 rows, K a multiple of 8 (16-byte rows).
    pub fn wg_gemm_fits(&self, m: usize, k: usize) -> bool {
        self.wg_gemm() && (WG_GEMM_MIN_M..=WG_GEMM_MAX_M).contains(&m) && k.is_multiple_of(8)
    }

    /// The plan of `inst` for `n` x `k` (`splits` forced or not), worked out once per shape
    /// and kept: a decode step launches the same few shapes every layer, and the plan asks the
    /// driver up to 8 questions.
    fn wg_plan(&self, f: &cudarc::driver::CudaFunction, inst: GemmWgInstance, n: usize, k: usize, splits: Option<usize>) -> GemmWgPlan {
        let mut plans = self.wg_plan_cache().lock().expect("gemm_wg plan cache poisoned");
        *plans
            .entry((inst.name(), n, k, splits))
            .or_insert_with(|| gemm_wg_plan(n, k, inst.rows, &|sp| self.wg_cluster_capacity(f, inst, sp), splits))
    }

    /// Clusters of `splits` blocks of `inst` resident at once (cuOccupancyMaxActiveClusters),
    /// or SMs / splits where the driver does not say.
    fn wg_cluster_capacity(&self, f: &cudarc::driver::CudaFunction, inst: GemmWgInstance, splits: usize) -> usize {
        // SAFETY: an all-zero attribute is plain old data; id and value are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim.x = splits as u32;
        attr.value.clusterDim.y = 1;
        attr.value.clusterDim.z = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: splits as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: GW_THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: inst.smem_bytes() as u32,
            hStream: self.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut clusters: std::ffi::c_int = 0;
        // SAFETY: `lc` and `attr` outlive the call, which only reads them.
        let ok = self.context().bind_to_thread().is_ok()
            && unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, f.cu_function(), &lc) }.result().is_ok();
        if ok && clusters > 0 {
            clusters as usize
        } else {
            (self.sm_count() / splits).max(1)
        }
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T on warpgroup tensor cores, for M of
    /// 1..=64 (`linear` sends 9..=64), in blocks of `rows` weight rows (None: DEFAULT_ROWS)
    /// with the plan's splits, or `splits` where given. sm_90a only; K a multiple of 8 and x,
    /// W 16-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_wg_with(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
        rows: Option<usize>,
        splits: Option<usize>,
    ) -> Result<()> {
        let (major, minor) = self.compute_capability();
        if !crate::backend::cuda::kernels::has_sm90a_code(major, minor) {
            return Err(NinferError::Device(format!("gemm_wg needs sm_90a code (wgmma); this device is {}", self.arch())));
        }
        check_wg_shape(m, k)?;
        let inst = GemmWgInstance::for_rows(m, rows)?;
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
        let name = inst.name();
        let smem = inst.smem_bytes();
        let f = self.function_with_smem(KernelFamily::GemmWg, name, smem)?;
        let plan = self.wg_plan(&f, inst, n, k, splits);
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

    /// The plan `gemm_wg_with` launches for these shapes (the sweep prints it).
    pub fn gemm_wg_plan_for(&self, m: usize, n: usize, k: usize, rows: Option<usize>, splits: Option<usize>) -> Result<GemmWgPlan> {
        let inst = GemmWgInstance::for_rows(m, rows)?;
        let f = self.function_with_smem(KernelFamily::GemmWg, inst.name(), inst.smem_bytes())?;
        Ok(self.wg_plan(&f, inst, n, k, splits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_take_the_fewest_waves_of_resident_clusters_and_keep_every_split_non_empty() {
        // An H200-like device: 132 SMs in 8 GPCs of 16-18, one 201 KiB block an SM, so
        // clusters of s blocks fit 8 x floor(16 / s) (the smallest GPCs).
        let h200 = |s: usize| 8 * (16 / s);
        // Llama-3-8B, 256-row tiles: qkv (24 tiles, 64 stages): 5 splits (24 clusters of 5 fit:
        // one wave of 13 stages; of 6 only 16 fit: two waves of 11); o (16 tiles): 8 splits;
        // down (16 tiles, 224 stages): 8; gate_up (112 tiles): 1 (no split finishes sooner).
        assert_eq!(gemm_wg_plan(6144, 4096, 256, &h200, None), GemmWgPlan { tiles: 24, splits: 5, steps: 13 });
        assert_eq!(gemm_wg_plan(4096, 4096, 256, &h200, None), GemmWgPlan { tiles: 16, splits: 8, steps: 8 });
        assert_eq!(gemm_wg_plan(4096, 14336, 256, &h200, None), GemmWgPlan { tiles: 16, splits: 8, steps: 28 });
        assert_eq!(gemm_wg_plan(28672, 4096, 256, &h200, None).tiles, 112);
        // Short K: at least MIN_SPLIT_STEPS stages a split; forced splits never leave one empty.
        assert_eq!(gemm_wg_plan(333, 1000, 128, &h200, None).splits, 4);
        for k in [8, 64, 65, 1000, 4096] {
            for forced in 1..=8 {
                let p = gemm_wg_plan(333, k, 128, &h200, Some(forced));
                let total = k.div_ceil(64);
                assert!(p.splits >= 1 && p.splits <= forced && (p.splits - 1) * p.steps < total && p.splits * p.steps >= total, "{k} {forced} {p:?}");
            }
        }
    }

    #[test]
    fn every_instance_has_a_name_and_fits_the_h200s_shared_memory() {
        for i in GemmWgInstance::ALL {
            assert!(i.name().starts_with("gemm_wg_n") && i.smem_bytes() <= 227 << 10, "{i:?}");
            assert_eq!(GemmWgInstance::for_rows(i.mn, Some(i.rows)).unwrap(), i);
        }
        assert_eq!(GemmWgInstance::for_rows(9, None).unwrap().mn, 16);
        assert_eq!(GemmWgInstance::for_rows(33, None).unwrap().mn, 64);
        assert!(GemmWgInstance::for_rows(16, Some(192)).unwrap_err().to_string().contains("192"));
    }

    #[test]
    fn the_switch_on_a_gpu_without_wgmma_is_an_error_naming_it_and_the_device() {
        assert!(wg_gemm_enabled((9, 0), Some("1")).unwrap());
        assert!(!wg_gemm_enabled((9, 0), None).unwrap());
        for cc in [(8, 0), (8, 9), (10, 0), (7, 0)] {
            assert!(!wg_gemm_enabled(cc, Some("0")).unwrap(), "{cc:?}");
            let e = wg_gemm_enabled(cc, Some("on")).unwrap_err().to_string();
            assert!(e.contains(WG_GEMM_SWITCH) && e.contains("sm_90a") && e.contains(&format!("{}.{}", cc.0, cc.1)), "{e}");
        }
        assert!(wg_gemm_enabled((8, 0), Some("maybe")).unwrap_err().to_string().contains("maybe"));
    }

    #[test]
    fn shapes_outside_1_to_64_rows_or_ragged_k_are_rejected_with_the_numbers() {
        for (m, k) in [(1, 8), (9, 4096), (64, 14336)] {
            check_wg_shape(m, k).unwrap();
        }
        for (m, k) in [(0, 4096), (65, 4096), (16, 1001), (16, 4)] {
            let e = check_wg_shape(m, k).unwrap_err().to_string();
            assert!(e.contains(&format!("m {m}, k {k}")), "{e}");
        }
    }

    #[test]
    fn the_switch_defaults_off_and_rejects_a_misspelt_value() {
        assert!(!parse_wg_gemm_switch(None).unwrap());
        assert!(parse_wg_gemm_switch(Some("1")).unwrap());
        assert!(!parse_wg_gemm_switch(Some("0")).unwrap());
        let e = parse_wg_gemm_switch(Some("cublas")).unwrap_err().to_string();
        assert!(e.contains(WG_GEMM_SWITCH) && e.contains("cublas"), "{e}");
    }
}
