//! Causal grouped-query attention of one sequence over its paged KV cache.
//!
//! Cache layout per layer (K and V alike): `[num_blocks, block_size, n_kv_heads, head_dim]`;
//! a sequence's position `p` lives in block `block_table[p / block_size]` at slot
//! `p % block_size`. Query heads `h` use KV head `h / (n_heads / n_kv_heads)` (HF `repeat_kv`).

use std::cell::RefCell;

use rayon::prelude::*;

use super::simd;
use super::SharedMut;

/// Shape of one layer's paged cache.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads per token.
    pub n_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Offset of (position, kv head) in a layer's K or V buffer.
    #[inline]
    pub fn offset(&self, block_table: &[u32], pos: usize, kv_head: usize) -> usize {
        let block = block_table[pos / self.block_size] as usize;
        ((block * self.block_size + pos % self.block_size) * self.n_kv_heads + kv_head) * self.head_dim
    }
}

/// Store `t` rows of K and V (each row `n_kv_heads * head_dim` wide, read at `k_src[r *
/// src_stride..]`) at positions `start_pos..start_pos + t`.
#[allow(clippy::too_many_arguments)]
pub fn write_kv(
    cache_k: &mut [f32],
    cache_v: &mut [f32],
    layout: &KvLayout,
    block_table: &[u32],
    start_pos: usize,
    t: usize,
    k_src: &[f32],
    v_src: &[f32],
    src_stride: usize,
) {
    let width = layout.n_kv_heads * layout.head_dim;
    for r in 0..t {
        let dst = layout.offset(block_table, start_pos + r, 0);
        cache_k[dst..dst + width].copy_from_slice(&k_src[r * src_stride..r * src_stride + width]);
        cache_v[dst..dst + width].copy_from_slice(&v_src[r * src_stride..r * src_stride + width]);
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention of the `t` query rows of one sequence (positions `start_pos..start_pos + t`, each
/// row `n_heads * head_dim` wide at `q[r * q_stride..]`) over cache positions `0..=pos`.
/// Writes `out[r * out_stride + h * head_dim..]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    q_stride: usize,
    t: usize,
    n_heads: usize,
    cache_k: &[f32],
    cache_v: &[f32],
    layout: &KvLayout,
    block_table: &[u32],
    start_pos: usize,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let ptr = SharedMut(out.as_mut_ptr());
    let out_len = out.len();
    (0..t * n_heads).into_par_iter().for_each(|task| {
        #[allow(clippy::redundant_locals)] // capture the Send wrapper whole, not its raw-pointer field
        let ptr = ptr;
        let (r, h) = (task / n_heads, task % n_heads);
        let pos = start_pos + r;
        let kvh = h / group;
        let qv = &q[r * q_stride + h * hd..r * q_stride + (h + 1) * hd];
        let o_off = r * out_stride + h * hd;
        assert!(o_off + hd <= out_len);
        // SAFETY: each (row, head) task owns out[o_off..o_off + hd]; tasks are distinct.
        let o = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(o_off), hd) };
        SCORES.with(|cell| {
            let mut scores = cell.borrow_mut();
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for s in 0..=pos {
                let off = layout.offset(block_table, s, kvh);
                let sc = simd::dot(qv, &cache_k[off..off + hd]) * scale;
                max = max.max(sc);
                scores.push(sc);
            }
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            let inv = 1.0 / sum;
            o.fill(0.0);
            for (s, p) in scores.iter().enumerate() {
                let off = layout.offset(block_table, s, kvh);
                simd::axpy(o, p * inv, &cache_v[off..off + hd]);
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(7);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    /// Dense causal GQA attention over contiguous K/V, in f64.
    #[allow(clippy::too_many_arguments)] // the shape, spelled out as the kernel takes it
    fn naive(q: &[f32], k: &[f32], v: &[f32], t: usize, nh: usize, nkv: usize, hd: usize, scale: f32) -> Vec<f32> {
        let mut out = vec![0f32; t * nh * hd];
        for r in 0..t {
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let scores: Vec<f64> = (0..=r)
                    .map(|s| (0..hd).map(|d| q[(r * nh + h) * hd + d] as f64 * k[(s * nkv + kvh) * hd + d] as f64).sum::<f64>() * scale as f64)
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    out[(r * nh + h) * hd + d] = (0..=r).map(|s| e[s] / z * v[(s * nkv + kvh) * hd + d] as f64).sum::<f64>() as f32;
                }
            }
        }
        out
    }

    #[test]
    fn paged_attention_in_two_chunks_matches_dense_reference() {
        let (t, nh, nkv, hd, bs) = (11, 6, 2, 12, 4);
        let layout = KvLayout { block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let q = rand_vec(t * nh * hd, 1);
        let k = rand_vec(t * nkv * hd, 2);
        let v = rand_vec(t * nkv * hd, 3);
        let table = [5u32, 0, 3];
        let mut ck = vec![f32::NAN; 6 * bs * nkv * hd];
        let mut cv = ck.clone();
        let mut out = vec![f32::NAN; t * nh * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        // Prefill 7 tokens, then 4 more (chunked), each chunk attending over the cache.
        for (start, len) in [(0usize, 7usize), (7, 4)] {
            let w = nkv * hd;
            write_kv(&mut ck, &mut cv, &layout, &table, start, len, &k[start * w..], &v[start * w..], w);
            paged_attention(&q[start * nh * hd..], nh * hd, len, nh, &ck, &cv, &layout, &table, start, scale, &mut out[start * nh * hd..], nh * hd);
        }
        let r = naive(&q, &k, &v, t, nh, nkv, hd, scale);
        for (a, e) in out.iter().zip(&r) {
            assert!((a - e).abs() < 1e-5, "{a} vs {e}");
        }
    }
}
