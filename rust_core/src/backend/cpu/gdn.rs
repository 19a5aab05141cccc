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

/// Positions per chunk of the chunked (prefill) form, as in transformers (`chunk_size=64`).
pub const GDN_CHUNK: usize = 64;

/// Epsilon added to the squared norm before the inverse square root of the q/k l2-norm.
const L2NORM_EPS: f32 = 1e-6;

/// Value columns processed together by the recurrent step (a stack scratch of this size).
const RECURRENT_TILE: usize = 64;

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
    assert_eq!(
        conv_state.len(),
        c * hist,
        "conv state must be [c={c}, k-1={hist}]"
    );
    assert_eq!(out.len(), t * c, "conv out must be [t={t}, c={c}]");
    if let Some(b) = bias {
        assert_eq!(b.len(), c, "conv bias must be [c={c}]");
    }
    let state: &[f32] = conv_state;
    let row = |i: usize, out_row: &mut [f32]| {
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
    if t * c * k >= PARALLEL_MIN_WORK {
        out.par_chunks_mut(c)
            .enumerate()
            .for_each(|(i, o)| row(i, o));
    } else {
        out.chunks_mut(c).enumerate().for_each(|(i, o)| row(i, o));
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
    fn check(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &[f32],
        out: &[f32],
    ) {
        let GdnDims {
            t,
            num_k_heads: nk,
            num_v_heads: nv,
            k_dim: kd,
            v_dim: vd,
        } = *self;
        assert!(
            nk > 0 && nv % nk == 0,
            "num_v_heads {nv} must be a multiple of num_k_heads {nk}"
        );
        assert_eq!(
            q.len(),
            t * nk * kd,
            "q must be [t={t}, num_k_heads={nk}, k_dim={kd}]"
        );
        assert_eq!(
            k.len(),
            t * nk * kd,
            "k must be [t={t}, num_k_heads={nk}, k_dim={kd}]"
        );
        assert_eq!(
            v.len(),
            t * nv * vd,
            "v must be [t={t}, num_v_heads={nv}, v_dim={vd}]"
        );
        assert_eq!(g.len(), t * nv, "g must be [t={t}, num_v_heads={nv}]");
        assert_eq!(beta.len(), t * nv, "beta must be [t={t}, num_v_heads={nv}]");
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

    fn key_head(&self, h: usize) -> usize {
        h / (self.num_v_heads / self.num_k_heads)
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

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Gated delta rule over t tokens with carried fp32 state (prefill), chunk by chunk.
///
/// Equal to transformers' `torch_chunk_gated_delta_rule(..., chunk_size=64,
/// use_qk_l2norm_in_kernel=True)` with `initial_state = state` and the final state written back
/// to `state`: l2-normalizes q and k, scales q by `1/sqrt(k_dim)`, and value head `h` uses key
/// head `h / (num_v_heads / num_k_heads)`. Within a chunk the sequential updates are condensed
/// by the UT transform (a unit lower-triangular solve by forward substitution); across chunks the
/// state is carried. Any `t` works (the last chunk is simply shorter; this equals the
/// reference's zero padding).
///
/// q, k: `[t, num_k_heads, k_dim]`; v: `[t, num_v_heads, v_dim]`; g: `[t, num_v_heads]` (log
/// decay, `-exp(A_log) * softplus(a + dt_bias)`); beta: `[t, num_v_heads]` (already sigmoid);
/// state: `[num_v_heads, k_dim, v_dim]` updated in place; out: `[t, num_v_heads, v_dim]`.
/// Panics if a slice length does not match `d`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_chunked(
    d: &GdnDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    d.check(q, k, v, g, beta, state, out);
    let GdnDims {
        t,
        num_v_heads: nv,
        k_dim: kd,
        v_dim: vd,
        ..
    } = *d;
    if t == 0 || nv == 0 {
        return;
    }
    let mut head_major = vec![0.0f32; nv * t * vd];
    head_major
        .par_chunks_mut(t * vd)
        .zip(state.par_chunks_mut(kd * vd))
        .enumerate()
        .for_each(|(h, (out_h, state_h))| {
            let mut scratch = ChunkScratch::new(kd, vd);
            for t0 in (0..t).step_by(GDN_CHUNK) {
                let len = GDN_CHUNK.min(t - t0);
                scratch.chunk(
                    d,
                    h,
                    t0,
                    len,
                    q,
                    k,
                    v,
                    g,
                    beta,
                    state_h,
                    &mut out_h[t0 * vd..(t0 + len) * vd],
                );
            }
        });
    out.par_chunks_mut(nv * vd)
        .enumerate()
        .for_each(|(i, row)| {
            for (h, dst) in row.chunks_mut(vd).enumerate() {
                dst.copy_from_slice(&head_major[(h * t + i) * vd..(h * t + i + 1) * vd]);
            }
        });
}

/// Per-head buffers of one chunk, reused across the chunks of a call.
struct ChunkScratch {
    /// Normalized, scaled queries `[C, k_dim]`.
    q: Vec<f32>,
    /// Normalized keys `[C, k_dim]`.
    k: Vec<f32>,
    /// `T^-1 (beta k exp(cum))`, the keys that read the old state `[C, k_dim]`.
    w: Vec<f32>,
    /// `T^-1 (beta v)`, then the state corrections `v_new` `[C, v_dim]`.
    u: Vec<f32>,
    /// Cumulative log decay within the chunk `[C]`.
    cum: Vec<f32>,
    /// Beta per position `[C]`.
    beta: Vec<f32>,
}

impl ChunkScratch {
    fn new(kd: usize, vd: usize) -> Self {
        ChunkScratch {
            q: vec![0.0; GDN_CHUNK * kd],
            k: vec![0.0; GDN_CHUNK * kd],
            w: vec![0.0; GDN_CHUNK * kd],
            u: vec![0.0; GDN_CHUNK * vd],
            cum: vec![0.0; GDN_CHUNK],
            beta: vec![0.0; GDN_CHUNK],
        }
    }

    /// One chunk of `len` tokens from `t0` for value head `h`: writes `out` (`[len, v_dim]`)
    /// and advances `s` (`[k_dim, v_dim]`).
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &mut self,
        d: &GdnDims,
        h: usize,
        t0: usize,
        len: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        s: &mut [f32],
        out: &mut [f32],
    ) {
        let GdnDims {
            num_k_heads: nk,
            num_v_heads: nv,
            k_dim: kd,
            v_dim: vd,
            ..
        } = *d;
        let kh = d.key_head(h);
        let scale = 1.0 / (kd as f32).sqrt();
        let mut acc = 0.0f32;
        for i in 0..len {
            let tok = t0 + i;
            let src = (tok * nk + kh) * kd;
            let (qi, ki) = (&q[src..src + kd], &k[src..src + kd]);
            let (iq, ik) = (inv_l2(qi), inv_l2(ki));
            let b = beta[tok * nv + h];
            acc += g[tok * nv + h];
            self.cum[i] = acc;
            self.beta[i] = b;
            let ed = acc.exp();
            for a in 0..kd {
                let kn = ki[a] * ik;
                self.q[i * kd + a] = qi[a] * iq * scale;
                self.k[i * kd + a] = kn;
                self.w[i * kd + a] = kn * b * ed;
            }
            let vs = (tok * nv + h) * vd;
            for (u, x) in self.u[i * vd..(i + 1) * vd].iter_mut().zip(&v[vs..vs + vd]) {
                *u = x * b;
            }
        }
        // UT transform: solve (I + A) [u w] = [beta v, beta k exp(cum)] with the strictly lower
        // A[i, j] = beta_i (k_i . k_j) exp(cum_i - cum_j), by forward substitution.
        for i in 1..len {
            let (k_prev, k_cur) = self.k.split_at(i * kd);
            let ki = &k_cur[..kd];
            let (u_prev, u_cur) = self.u.split_at_mut(i * vd);
            let (w_prev, w_cur) = self.w.split_at_mut(i * kd);
            for j in 0..i {
                let a = self.beta[i]
                    * dot(ki, &k_prev[j * kd..(j + 1) * kd])
                    * (self.cum[i] - self.cum[j]).exp();
                axpy(&mut u_cur[..vd], -a, &u_prev[j * vd..(j + 1) * vd]);
                axpy(&mut w_cur[..kd], -a, &w_prev[j * kd..(j + 1) * kd]);
            }
        }
        // v_new = u - w S (the part of each value the old state does not already predict).
        for i in 0..len {
            let ui = &mut self.u[i * vd..(i + 1) * vd];
            for a in 0..kd {
                axpy(ui, -self.w[i * kd + a], &s[a * vd..(a + 1) * vd]);
            }
        }
        // o_i = exp(cum_i) q_i^T S + sum_{j <= i} (q_i . k_j) exp(cum_i - cum_j) v_new_j.
        for i in 0..len {
            let oi = &mut out[i * vd..(i + 1) * vd];
            oi.fill(0.0);
            let qi = &self.q[i * kd..(i + 1) * kd];
            let ed = self.cum[i].exp();
            for a in 0..kd {
                axpy(oi, qi[a] * ed, &s[a * vd..(a + 1) * vd]);
            }
            for j in 0..=i {
                let a = dot(qi, &self.k[j * kd..(j + 1) * kd]) * (self.cum[i] - self.cum[j]).exp();
                axpy(oi, a, &self.u[j * vd..(j + 1) * vd]);
            }
        }
        // S = exp(cum_last) S + sum_j exp(cum_last - cum_j) k_j v_new_j^T.
        let last = self.cum[len - 1];
        let chunk_decay = last.exp();
        for a in 0..kd {
            let row = &mut s[a * vd..(a + 1) * vd];
            row.iter_mut().for_each(|x| *x *= chunk_decay);
            for j in 0..len {
                let coef = self.k[j * kd + a] * (last - self.cum[j]).exp();
                axpy(row, coef, &self.u[j * vd..(j + 1) * vd]);
            }
        }
    }
}

/// Same contract as [`gated_delta_rule_chunked`], token by token (decode).
///
/// Equal to transformers' `torch_recurrent_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`.
/// It allocates nothing: the normalization is folded into scalars and the state columns are
/// processed in tiles with a small stack scratch, because decode runs it once per GDN layer per
/// token. Panics if a slice length does not match `d`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_recurrent(
    d: &GdnDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    d.check(q, k, v, g, beta, state, out);
    let GdnDims {
        t,
        num_k_heads: nk,
        num_v_heads: nv,
        k_dim: kd,
        v_dim: vd,
    } = *d;
    if nv == 0 || kd == 0 || vd == 0 {
        return;
    }
    let scale = 1.0 / (kd as f32).sqrt();
    let parallel = nv * kd * vd >= PARALLEL_MIN_WORK;
    for tok in 0..t {
        let out_row = &mut out[tok * nv * vd..(tok + 1) * nv * vd];
        let step = |h: usize, s: &mut [f32], o: &mut [f32]| {
            let src = (tok * nk + d.key_head(h)) * kd;
            let (qh, kh) = (&q[src..src + kd], &k[src..src + kd]);
            let vs = (tok * nv + h) * vd;
            recurrent_head_step(
                qh,
                inv_l2(qh) * scale,
                kh,
                inv_l2(kh),
                &v[vs..vs + vd],
                g[tok * nv + h].exp(),
                beta[tok * nv + h],
                s,
                o,
            );
        };
        if parallel {
            state
                .par_chunks_mut(kd * vd)
                .zip(out_row.par_chunks_mut(vd))
                .enumerate()
                .for_each(|(h, (s, o))| step(h, s, o));
        } else {
            state
                .chunks_mut(kd * vd)
                .zip(out_row.chunks_mut(vd))
                .enumerate()
                .for_each(|(h, (s, o))| step(h, s, o));
        }
    }
}

/// One token of one value head: `S = decay S; S += k (beta (v - k^T S)); o = q^T S`, with
/// `k = k_raw * k_mul` and `q = q_raw * q_mul`. Columns of `S` evolve independently, so they are
/// processed in tiles of [`RECURRENT_TILE`] with the delta on the stack.
#[allow(clippy::too_many_arguments)]
fn recurrent_head_step(
    q: &[f32],
    q_mul: f32,
    k: &[f32],
    k_mul: f32,
    v: &[f32],
    decay: f32,
    beta: f32,
    s: &mut [f32],
    out: &mut [f32],
) {
    let vd = v.len();
    let mut delta = [0.0f32; RECURRENT_TILE];
    for j0 in (0..vd).step_by(RECURRENT_TILE) {
        let w = RECURRENT_TILE.min(vd - j0);
        let delta = &mut delta[..w];
        delta.fill(0.0);
        for (a, ka) in k.iter().enumerate() {
            let ka = ka * k_mul;
            axpy(delta, ka, &s[a * vd + j0..a * vd + j0 + w]);
        }
        for (dl, vj) in delta.iter_mut().zip(&v[j0..j0 + w]) {
            *dl = (vj - decay * *dl) * beta;
        }
        let o = &mut out[j0..j0 + w];
        o.fill(0.0);
        for (a, (ka, qa)) in k.iter().zip(q).enumerate() {
            let (ka, qa) = (ka * k_mul, qa * q_mul);
            let row = &mut s[a * vd + j0..a * vd + j0 + w];
            for ((x, dl), oj) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
                *x = *x * decay + ka * dl;
                *oj += qa * *x;
            }
        }
    }
}

/// Gated RMSNorm of the GDN output: rmsnorm(x) * weight * silu(z), per head row of v_dim.
///
/// As transformers' `Qwen3_5RMSNormGated`: `weight * (x / sqrt(mean(x^2) + eps)) * silu(z)`.
/// The convention is a plain `weight` (initialised to ones), not the `1 + weight` of the
/// model's other RMSNorms. x, z: `[rows, v_dim]`; weight: `[v_dim]`; out: `[rows, v_dim]`.
/// Panics if a slice length does not match the dimensions.
pub fn rms_norm_gated(
    x: &[f32],
    z: &[f32],
    rows: usize,
    v_dim: usize,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) {
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
    assert_eq!(
        weight.len(),
        v_dim,
        "gated norm weight must be [v_dim={v_dim}]"
    );
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
