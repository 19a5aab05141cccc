//! The batch-1 qkv projection with the decode step's RoPE and KV cache write in its epilogue
//! (cuda/gemv.cu `gemv_qkv_rope_m1`): bit for bit the CUDA-core `gemv_m1` followed by
//! `rope_kv_write_packed`, in one kernel.
//!
//! Why: at batch 1 every attention layer ran the qkv GEMV, then `rope_kv_write` (2.8 us of
//! kernel time, mostly the kernel boundary on the step's critical path: 32 a Llama-3-8B step),
//! then decode attention. A warp of the CUDA-core GEMV owns one output row; here it owns the two
//! rows of a head that RoPE rotates together (elements i and i + head_dim / 2), so its epilogue
//! has both sums and does rope_kv_write's work, and attention follows the GEMV directly.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gemv_route::GemvKernel;
use super::rope_kv::{check_kv_caches, RopeKvShape};
use super::{as_i32, cfg, check_len};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::backend::cuda::plan::Plan;
use crate::{NinferError, Result};

/// Whether a qkv projection can run `gemv_qkv_rope_kv_write` instead of the GEMV and
/// `rope_kv_write_packed`: one token (`rows`), the weight's plain GEMV at M = 1 on CUDA cores
/// (`kernel`, `CudaDevice::gemv_kernel`: the fused kernel's sums are `gemv_m1`'s, so a weight
/// that runs on tensor cores would change bits), full rotary, K a multiple of 8 (16-byte loads).
/// The model adds what depends on its layout (q, k, v packed with nothing between q and k, no
/// q/k norm) and the plan's `fused_rope`.
pub fn qkv_rope_fits(kernel: GemvKernel, rows: usize, head_dim: usize, rotary_dim: usize, k: usize) -> bool {
    kernel == GemvKernel::CudaCores && rows == 1 && rotary_dim == head_dim && head_dim > 0 && k.is_multiple_of(8)
}

/// The fused kernel's launch for a packed qkv row of `rows` rows over K = `k` under `plan`: a
/// warp per RoPE pair and the plan's CUDA-core GEMV block, as gemv_m1 has a warp per row, with
/// the qkv GEMV's K split and prefetch (its weight's), so the two forms sum alike. Grid, block
/// and the int arguments (pairs, k, prefetch vectors, K split).
pub fn qkv_rope_launch(plan: &Plan, rows: usize, k: usize) -> Result<(u32, u32, [i32; 4])> {
    let pairs = rows / 2;
    let (warps, ksplit) = (plan.cc_warps, plan.cc_ksplit);
    let grid = as_i32("gemv_qkv_rope blocks", pairs.div_ceil(warps / ksplit))? as u32;
    let ints = [as_i32("gemv_qkv_rope pairs", pairs)?, as_i32("gemv_qkv_rope k", k)?, plan.cc_prefetch_vectors(rows, k) as i32, ksplit as i32];
    Ok((grid, (warps * 32) as u32, ints))
}

/// The packed qkv row the fused kernel computes: n_q_heads q heads, then n_kv_heads k heads,
/// then n_kv_heads v heads, head_dim elements each; a warp per RoPE pair of rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QkvRopeLayout {
    n_q_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl QkvRopeLayout {
    /// The layout of `shape`, or a typed error naming what the kernel does not cover: more than
    /// one token, a partial rotary (`rotary_dim`, twice the frequencies), K not a multiple of 8,
    /// no heads, or a grid past i32.
    fn new(shape: &RopeKvShape, rotary_dim: usize, k: usize, tokens: usize) -> Result<Self> {
        let err = |m: String| Err(NinferError::Device(format!("gemv_qkv_rope: {m}")));
        if tokens != 1 {
            return err(format!("one token only (the batch-1 decode GEMV), got {tokens}"));
        }
        if rotary_dim != shape.head_dim || shape.head_dim == 0 {
            return err(format!("full rotary only: rotary_dim {rotary_dim} with head_dim {}", shape.head_dim));
        }
        if k == 0 || !k.is_multiple_of(8) {
            return err(format!("K must be a positive multiple of 8 (16-byte loads), got K = {k}"));
        }
        if shape.n_q_heads == 0 || shape.n_kv_heads == 0 {
            return err(format!("{} q heads and {} kv heads", shape.n_q_heads, shape.n_kv_heads));
        }
        let l = QkvRopeLayout { n_q_heads: shape.n_q_heads, n_kv_heads: shape.n_kv_heads, head_dim: shape.head_dim };
        as_i32("gemv_qkv_rope rows", l.rows())?;
        Ok(l)
    }

    /// Elements of the qkv row (rows of the weight).
    fn rows(&self) -> usize {
        (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim
    }

    /// RoPE pairs of the row: the kernel's warps.
    #[cfg(test)]
    fn pairs(&self) -> usize {
        self.rows() / 2
    }
}

impl CudaDevice {
    /// qkv[1, rows] = x[1, k] * W[rows, k]^T (rows = (n_q_heads + 2 n_kv_heads) * head_dim, the
    /// packed q | k | v row) with q and k rotated in place at `positions[0]` and the rotated k
    /// and the v heads written into the paged caches at flat slot `slot_mapping[0]` (skipped
    /// where negative): `gemv_with(GemvForm::Simt, ..)` followed by `rope_kv_write_packed(qkv,
    /// qd, qd + kvd, ..)`, bit for bit, in one kernel. One token, full rotary (`inv_freq` holds
    /// head_dim / 2 frequencies); the shape's strides are not read (one row). The caches are
    /// [slots, n_kv_heads * head_dim].
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_qkv_rope_kv_write(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        qkv: &mut impl DevicePtrMut<u16>,
        k_cache: &mut impl DevicePtrMut<u16>,
        v_cache: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        slot_mapping: &impl DevicePtr<i64>,
        inv_freq: &impl DevicePtr<f32>,
        shape: &RopeKvShape,
        k: usize,
    ) -> Result<()> {
        let l = QkvRopeLayout::new(shape, inv_freq.len() * 2, k, positions.len())?;
        check_len("gemv_qkv_rope x", x.len(), k)?;
        check_len("gemv_qkv_rope w", w.len(), l.rows() * k)?;
        check_len("gemv_qkv_rope qkv", qkv.len(), l.rows())?;
        check_len("gemv_qkv_rope slot_mapping", slot_mapping.len(), 1)?;
        check_kv_caches("gemv_qkv_rope", k_cache.len(), v_cache.len(), shape)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = qkv.device_ptr_mut(s);
        let (kc, _d) = k_cache.device_ptr_mut(s);
        let (vc, _e) = v_cache.device_ptr_mut(s);
        let (pp, _f) = positions.device_ptr(s);
        let (sp, _g) = slot_mapping.device_ptr(s);
        let (fp, _h) = inv_freq.device_ptr(s);
        let name = "gemv_qkv_rope_m1";
        let f = self.function(KernelFamily::Gemv, name)?;
        let (grid, block, [pairs, kk, prefetch, ksplit]) = qkv_rope_launch(self.plan(), l.rows(), k)?;
        let args = kargs![
            xp,
            wp,
            yp,
            pairs,
            kk,
            prefetch,
            ksplit,
            kc,
            vc,
            pp,
            sp,
            fp,
            as_i32("n_q_heads", l.n_q_heads)?,
            as_i32("n_kv_heads", l.n_kv_heads)?,
            as_i32("head_dim", l.head_dim)? / 2,
            shape.attn_scale,
        ];
        self.launch_pdl(&f, cfg((grid, 1, 1), block), name, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_q_heads: usize, n_kv_heads: usize, head_dim: usize) -> RopeKvShape {
        RopeKvShape { n_q_heads, n_kv_heads, head_dim, q_stride: 0, k_stride: 0, v_stride: 0, attn_scale: 1.0 }
    }

    /// The two qkv rows of pair p, as the kernel maps them (qkv_pair_row in cuda/gemv.cu):
    /// pair i of head h is p = h * half + i, rows h * head_dim + i and that + half.
    fn pair_rows(l: &QkvRopeLayout, p: usize) -> (usize, usize) {
        let half = l.head_dim / 2;
        let r0 = (p / half) * l.head_dim + p % half;
        (r0, r0 + half)
    }

    #[test]
    fn every_row_of_the_packed_qkv_row_belongs_to_exactly_one_rope_pair() {
        for (hq, hkv, hd) in [(32, 8, 128), (8, 2, 64), (4, 4, 128), (1, 1, 2), (40, 8, 256)] {
            let l = QkvRopeLayout::new(&shape(hq, hkv, hd), hd, 4096, 1).unwrap();
            assert_eq!(l.rows(), (hq + 2 * hkv) * hd);
            let mut owner = vec![usize::MAX; l.rows()];
            for p in 0..l.pairs() {
                let (r0, r1) = pair_rows(&l, p);
                // Both rows in one head, i and i + head_dim / 2 of it: the elements rope_pair
                // rotates together.
                assert_eq!(r0 / hd, r1 / hd, "pair {p}");
                assert_eq!((r0 % hd, r1 % hd), (p % (hd / 2), p % (hd / 2) + hd / 2), "pair {p}");
                for r in [r0, r1] {
                    assert_eq!(owner[r], usize::MAX, "row {r} of pairs {} and {p}", owner[r]);
                    owner[r] = p;
                }
            }
            assert!(owner.iter().all(|&p| p != usize::MAX), "{hq}/{hkv}/{hd}: a row without a pair");
        }
        // The kernel maps pairs by the same arithmetic.
        let src = include_str!("../../../../../cuda/gemv.cu");
        assert!(src.contains("return (long long)(p / half) * (2 * half) + p % half;"));
        assert!(src.contains("gemv_qkv_rope_m1("));
    }

    #[test]
    fn the_layout_refuses_what_the_kernel_does_not_cover_with_the_value() {
        let e = |r: Result<QkvRopeLayout>| r.unwrap_err().to_string();
        let s = shape(32, 8, 128);
        let m = e(QkvRopeLayout::new(&s, 128, 4096, 2));
        assert!(m.contains("one token") && m.contains('2'), "{m}");
        let m = e(QkvRopeLayout::new(&s, 64, 4096, 1));
        assert!(m.contains("rotary_dim 64") && m.contains("head_dim 128"), "{m}");
        let m = e(QkvRopeLayout::new(&s, 128, 1001, 1));
        assert!(m.contains("K = 1001"), "{m}");
        let m = e(QkvRopeLayout::new(&shape(4, 0, 128), 128, 4096, 1));
        assert!(m.contains("0 kv heads"), "{m}");
        let m = e(QkvRopeLayout::new(&shape(1 << 24, 8, 256), 256, 4096, 1));
        assert!(m.contains("exceeds i32"), "{m}");
        let l = QkvRopeLayout::new(&s, 128, 4096, 1).unwrap();
        assert_eq!((l.rows(), l.pairs()), (6144, 3072));
    }

    #[test]
    fn only_the_batch_one_cuda_core_gemv_with_full_rotary_fuses() {
        let tc = GemvKernel::TensorCores(super::super::GemvTcConfig::DEFAULT);
        assert!(qkv_rope_fits(GemvKernel::CudaCores, 1, 128, 128, 4096));
        assert!(!qkv_rope_fits(tc, 1, 128, 128, 4096), "tensor-core sums differ from gemv_m1's");
        assert!(!qkv_rope_fits(GemvKernel::CudaCores, 2, 128, 128, 4096));
        assert!(!qkv_rope_fits(GemvKernel::CudaCores, 1, 128, 64, 4096), "partial rotary");
        assert!(!qkv_rope_fits(GemvKernel::CudaCores, 1, 128, 128, 4100));
    }

    #[test]
    fn caches_that_do_not_hold_whole_rows_are_refused() {
        let s = shape(8, 2, 64);
        assert!(check_kv_caches("gemv_qkv_rope", 128 * 4, 128 * 4, &s).is_ok());
        let m = check_kv_caches("gemv_qkv_rope", 128 * 4 + 1, 128 * 4 + 1, &s).unwrap_err().to_string();
        assert!(m.contains("gemv_qkv_rope") && m.contains("513") && m.contains("rows of 128"), "{m}");
        assert!(check_kv_caches("gemv_qkv_rope", 128 * 4, 128 * 3, &s).is_err());
    }
}
