//! Gated DeltaNet (Qwen3.5 / Qwen3-Next linear-attention layers) on the CPU in f32.
//!
//! This is the reference every CUDA kernel of the GDN layer is checked against, so the math
//! follows transformers' `modeling_qwen3_5.py` step for step: `causal_conv1d_fn/update`,
//! `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule` (both with
//! `use_qk_l2norm_in_kernel=True`) and `Qwen3_5RMSNormGated`.
//!
//! Layouts are row-major and token-major, as the projections produce them. The recurrent state
//! of a value head is a `[k_dim, v_dim]` matrix `S`; per token, with `q`, `k` l2-normalized
//! (eps 1e-6 inside the square root) and `q` scaled by `1/sqrt(k_dim)`:
//! `S = exp(g) * S; S += k (beta * (v - k^T S)); o = q^T S`.
//! Value heads are independent, so every entry point parallelises over them with rayon.

use rayon::prelude::*;

mod chunked;
mod recurrent;

pub use chunked::gated_delta_rule_chunked;
pub use recurrent::gated_delta_rule_recurrent;

/// Positions per chunk of the chunked (prefill) form, as in transformers (`chunk_size=64`).
pub const GDN_CHUNK: usize = 64;

/// Epsilon added to the squared norm before the inverse square root of the q/k l2-norm.
const L2NORM_EPS: f32 = 1e-6;

/// Below this many multiply-adds a call runs on the calling thread (rayon costs more).
const PARALLEL_MIN_WORK: usize = 1 << 15;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Causal depthwise conv1d + SiLU over a chunk, carrying the last K-1 inputs.
///
/// The GDN layer runs its fused q/k/v projection through this short convolution before the
/// delta rule; carrying `conv_state` makes a prefill split into chunks (or decode, `t = 1`)
/// equal one call over the whole sequence. `out[i, ch] = silu(bias[ch] + sum_j weight[ch, j] *
/// xx[i + j, ch])` where `xx` is the state followed by `x` (cross-correlation, as `F.conv1d`).
///
/// x: `[t, c]` row-major; weight: `[c, k]` (HF `conv1d.weight [c, 1, k]` squeezed); bias:
/// optional `[c]`; conv_state: `[c, k-1]`, the previous k-1 inputs per channel, oldest first
/// (zeros for a new sequence), updated in place; out: `[t, c]`. Any `t >= 0` works, including
/// `t < k - 1`. Panics if a slice length does not match the dimensions.
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d_silu(
    x: &[f32],
    t: usize,
    c: usize,
    weight: &[f32],
    k: usize,
    bias: Option<&[f32]>,
    conv_state: &mut [f32],
    out: &mut [f32],
) {
    assert!(k >= 1, "conv kernel size must be at least 1");
    let hist = k - 1;
    assert_eq!(x.len(), t * c, "conv x must be [t={t}, c={c}]");
    assert_eq!(weight.len(), c * k, "conv weight must be [c={c}, k={k}]");
    assert_eq!(conv_state.len(), c * hist, "conv state must be [c={c}, k-1={hist}]");
    assert_eq!(out.len(), t * c, "conv out must be [t={t}, c={c}]");
    if let Some(b) = bias {
        assert_eq!(b.len(), c, "conv bias must be [c={c}]");
    }
    let state: &[f32] = conv_state;
    // Rows whose window reaches into the carried state (the first k-1; all of them for decode).
    let edge_row = |i: usize, out_row: &mut [f32]| {
        for (ch, o) in out_row.iter_mut().enumerate() {
            let w = &weight[ch * k..(ch + 1) * k];
            let mut acc = bias.map_or(0.0, |b| b[ch]);
            for (j, wj) in w.iter().enumerate() {
                let p = i + j;
                let xv = if p < hist {
                    state[ch * hist + p]
                } else {
                    x[(p - hist) * c + ch]
                };
                acc += wj * xv;
            }
            *o = silu(acc);
        }
    };
    let edge = hist.min(t);
    out[..edge * c]
        .chunks_mut(c)
        .enumerate()
        .for_each(|(i, o)| edge_row(i, o));
    if t > edge {
        // Rows whose window lies inside x: tap-major weights make every step a contiguous
        // multiply-add over channels.
        let mut taps = vec![0.0f32; k * c];
        for ch in 0..c {
            for j in 0..k {
                taps[j * c + ch] = weight[ch * k + j];
            }
        }
        let inner_row = |i: usize, o: &mut [f32]| {
            match bias {
                Some(b) => o.copy_from_slice(b),
                None => o.fill(0.0),
            }
            for j in 0..k {
                let xr = &x[(i + j - hist) * c..(i + j - hist + 1) * c];
                for ((oc, wc), xc) in o.iter_mut().zip(&taps[j * c..(j + 1) * c]).zip(xr) {
                    *oc += wc * xc;
                }
            }
            o.iter_mut().for_each(|v| *v = silu(*v));
        };
        let rows = &mut out[edge * c..];
        if (t - edge) * c * k >= PARALLEL_MIN_WORK {
            rows.par_chunks_mut(c)
                .enumerate()
                .for_each(|(i, o)| inner_row(edge + i, o));
        } else {
            rows.chunks_mut(c).enumerate().for_each(|(i, o)| inner_row(edge + i, o));
        }
    }
    // The new state is the last k-1 entries of [state, x]; reading index t + p >= p lets the
    // shift run forward in place.
    for ch in 0..c {
        for p in 0..hist {
            let src = t + p;
            conv_state[ch * hist + p] = if src < hist {
                conv_state[ch * hist + src]
            } else {
                x[(src - hist) * c + ch]
            };
        }
    }
}

/// Dimensions of one gated-delta-rule call for one sequence.
///
/// Grouped heads: value head `h` reads key/query head `h / (num_v_heads / num_k_heads)`, as
/// transformers' `repeat_interleave` on the head axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnDims {
    /// Tokens in this call.
    pub t: usize,
    /// Query/key heads (`linear_num_key_heads`).
    pub num_k_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of `num_k_heads`.
    pub num_v_heads: usize,
    /// Query/key head dimension (`linear_key_head_dim`).
    pub k_dim: usize,
    /// Value head dimension (`linear_value_head_dim`).
    pub v_dim: usize,
}

impl GdnDims {
    fn key_head(&self, h: usize) -> usize {
        h / (self.num_v_heads / self.num_k_heads)
    }
}

/// One gated-delta-rule call's inputs, borrowed by every head's task.
struct DeltaInputs<'a> {
    d: &'a GdnDims,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

impl DeltaInputs<'_> {
    /// Panics with the expected shape when a slice length does not match the dimensions.
    fn check(&self, state: &[f32], out: &[f32]) {
        let GdnDims {
            t,
            num_k_heads: nk,
            num_v_heads: nv,
            k_dim: kd,
            v_dim: vd,
        } = *self.d;
        assert!(
            nk > 0 && nv % nk == 0,
            "num_v_heads {nv} must be a multiple of num_k_heads {nk}"
        );
        assert_eq!(
            self.q.len(),
            t * nk * kd,
            "q must be [t={t}, num_k_heads={nk}, k_dim={kd}]"
        );
        assert_eq!(
            self.k.len(),
            t * nk * kd,
            "k must be [t={t}, num_k_heads={nk}, k_dim={kd}]"
        );
        assert_eq!(
            self.v.len(),
            t * nv * vd,
            "v must be [t={t}, num_v_heads={nv}, v_dim={vd}]"
        );
        assert_eq!(self.g.len(), t * nv, "g must be [t={t}, num_v_heads={nv}]");
        assert_eq!(self.beta.len(), t * nv, "beta must be [t={t}, num_v_heads={nv}]");
        assert_eq!(
            state.len(),
            nv * kd * vd,
            "state must be [num_v_heads={nv}, k_dim={kd}, v_dim={vd}]"
        );
        assert_eq!(
            out.len(),
            t * nv * vd,
            "out must be [t={t}, num_v_heads={nv}, v_dim={vd}]"
        );
    }
}

/// `1 / sqrt(sum(x^2) + 1e-6)`, the factor of transformers' (and FLA's) `l2norm`.
fn inv_l2(x: &[f32]) -> f32 {
    1.0 / (x.iter().map(|a| a * a).sum::<f32>() + L2NORM_EPS).sqrt()
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Gated RMSNorm of the GDN output: rmsnorm(x) * weight * silu(z), per head row of v_dim.
///
/// As transformers' `Qwen3_5RMSNormGated`: `weight * (x / sqrt(mean(x^2) + eps)) * silu(z)`.
/// The convention is a plain `weight` (initialised to ones), not the `1 + weight` of the
/// model's other RMSNorms. x, z: `[rows, v_dim]`; weight: `[v_dim]`; out: `[rows, v_dim]`.
/// Panics if a slice length does not match the dimensions.
pub fn rms_norm_gated(x: &[f32], z: &[f32], rows: usize, v_dim: usize, weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(
        x.len(),
        rows * v_dim,
        "gated norm x must be [rows={rows}, v_dim={v_dim}]"
    );
    assert_eq!(
        z.len(),
        rows * v_dim,
        "gated norm z must be [rows={rows}, v_dim={v_dim}]"
    );
    assert_eq!(weight.len(), v_dim, "gated norm weight must be [v_dim={v_dim}]");
    assert_eq!(
        out.len(),
        rows * v_dim,
        "gated norm out must be [rows={rows}, v_dim={v_dim}]"
    );
    if v_dim == 0 {
        return;
    }
    let row = |(o, (xr, zr)): (&mut [f32], (&[f32], &[f32]))| {
        let inv = 1.0 / (xr.iter().map(|a| a * a).sum::<f32>() / v_dim as f32 + eps).sqrt();
        for (((oj, xj), zj), wj) in o.iter_mut().zip(xr).zip(zr).zip(weight) {
            *oj = wj * (xj * inv) * silu(*zj);
        }
    };
    if rows * v_dim >= PARALLEL_MIN_WORK {
        out.par_chunks_mut(v_dim)
            .zip(x.par_chunks(v_dim).zip(z.par_chunks(v_dim)))
            .for_each(row);
    } else {
        out.chunks_mut(v_dim)
            .zip(x.chunks(v_dim).zip(z.chunks(v_dim)))
            .for_each(row);
    }
}
