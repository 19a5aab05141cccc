//! The chunked (prefill) form of the gated delta rule: 64 positions at a time, each chunk's
//! sequential updates condensed into small matrix products by the UT transform, the state
//! carried from chunk to chunk. Mirrors transformers' `torch_chunk_gated_delta_rule`.

use rayon::prelude::*;

use super::recurrent::{gated_delta_rule_recurrent, head_token};
use super::{inv_l2, DeltaInputs, GdnDims, GDN_CHUNK};

/// Chunks shorter than this run token by token: at a few rows the matrix products cost more
/// than the recurrence (measured crossover near 12 rows with k_dim = v_dim = 128).
const MATRIX_MIN_ROWS: usize = 12;

/// Gated delta rule over t tokens with carried fp32 state (prefill), chunk by chunk.
///
/// Equal to transformers' `torch_chunk_gated_delta_rule(..., chunk_size=64,
/// use_qk_l2norm_in_kernel=True)` with `initial_state = state` and the final state written back
/// to `state`: l2-normalizes q and k, scales q by `1/sqrt(k_dim)`, and value head `h` uses key
/// head `h / (num_v_heads / num_k_heads)`. Any `t` works: the last chunk is simply shorter,
/// which equals the reference's zero padding. Chunks (and calls) of fewer than 12 tokens run the
/// per-token recurrence instead, which is the same function and cheaper at that size.
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
    let inputs = DeltaInputs { d, q, k, v, g, beta };
    inputs.check(state, out);
    let GdnDims {
        t,
        num_v_heads: nv,
        k_dim: kd,
        v_dim: vd,
        ..
    } = *d;
    if t == 0 || nv == 0 || kd == 0 || vd == 0 {
        return;
    }
    if t < MATRIX_MIN_ROWS {
        gated_delta_rule_recurrent(d, q, k, v, g, beta, state, out);
        return;
    }
    let mut head_major = vec![0.0f32; nv * t * vd];
    head_major
        .par_chunks_mut(t * vd)
        .zip(state.par_chunks_mut(kd * vd))
        .enumerate()
        .for_each(|(h, (out_h, state_h))| {
            let mut scratch = ChunkScratch::new(GDN_CHUNK.min(t), kd, vd);
            for t0 in (0..t).step_by(GDN_CHUNK) {
                let len = GDN_CHUNK.min(t - t0);
                let out_chunk = &mut out_h[t0 * vd..(t0 + len) * vd];
                if len < MATRIX_MIN_ROWS {
                    for (i, o) in out_chunk.chunks_mut(vd).enumerate() {
                        head_token(&inputs, h, t0 + i, state_h, o);
                    }
                } else {
                    scratch.run(&inputs, h, t0, len, state_h, out_chunk);
                }
            }
        });
    out.par_chunks_mut(nv * vd).enumerate().for_each(|(i, row)| {
        for (h, dst) in row.chunks_mut(vd).enumerate() {
            dst.copy_from_slice(&head_major[(h * t + i) * vd..(h * t + i + 1) * vd]);
        }
    });
}

/// Per-head buffers of one chunk (C rows: [`GDN_CHUNK`], or t when shorter), reused across a
/// call's chunks.
struct ChunkScratch {
    /// C, the row capacity and the row stride of the `[C, C]` buffers.
    rows: usize,
    /// Normalized, scaled queries `[C, k_dim]`; later scaled by `exp(cum_i)`.
    q: Vec<f32>,
    /// Normalized keys `[C, k_dim]`; later scaled by `exp(cum_last - cum_j)`.
    k: Vec<f32>,
    /// `q k^T`, then the causal intra-chunk attention `[C, C]`.
    qk: Vec<f32>,
    /// `k k^T`, then the inverse of the UT system `(I + A)^-1` `[C, C]`.
    kk: Vec<f32>,
    /// `beta v` `[C, v_dim]`.
    bv: Vec<f32>,
    /// `beta k exp(cum)` `[C, k_dim]`.
    bk: Vec<f32>,
    /// `(I + A)^-1 beta v`, then the state corrections `v_new` `[C, v_dim]`.
    u: Vec<f32>,
    /// `(I + A)^-1 beta k exp(cum)`, the keys that read the old state `[C, k_dim]`.
    w: Vec<f32>,
    /// Cumulative log decay within the chunk `[C]`.
    cum: Vec<f32>,
    /// Beta per position `[C]`.
    beta: Vec<f32>,
}

impl ChunkScratch {
    fn new(c: usize, kd: usize, vd: usize) -> Self {
        ChunkScratch {
            rows: c,
            q: vec![0.0; c * kd],
            k: vec![0.0; c * kd],
            qk: vec![0.0; c * c],
            kk: vec![0.0; c * c],
            bv: vec![0.0; c * vd],
            bk: vec![0.0; c * kd],
            u: vec![0.0; c * vd],
            w: vec![0.0; c * kd],
            cum: vec![0.0; c],
            beta: vec![0.0; c],
        }
    }

    /// One chunk of `len` tokens from `t0` for value head `h`: writes `out` (`[len, v_dim]`)
    /// and advances `s` (`[k_dim, v_dim]`).
    fn run(&mut self, x: &DeltaInputs, h: usize, t0: usize, len: usize, s: &mut [f32], out: &mut [f32]) {
        let GdnDims {
            num_k_heads: nk,
            num_v_heads: nv,
            k_dim: kd,
            v_dim: vd,
            ..
        } = *x.d;
        let n = len;
        let kh = x.d.key_head(h);
        let scale = 1.0 / (kd as f32).sqrt();
        let mut acc = 0.0f32;
        for i in 0..n {
            let tok = t0 + i;
            let src = (tok * nk + kh) * kd;
            let (qi, ki) = (&x.q[src..src + kd], &x.k[src..src + kd]);
            let (iq, ik) = (inv_l2(qi), inv_l2(ki));
            let b = x.beta[tok * nv + h];
            acc += x.g[tok * nv + h];
            self.cum[i] = acc;
            self.beta[i] = b;
            let ed = acc.exp();
            let vs = (tok * nv + h) * vd;
            for (r, vj) in self.bv[i * vd..(i + 1) * vd].iter_mut().zip(&x.v[vs..vs + vd]) {
                *r = vj * b;
            }
            for a in 0..kd {
                let kn = ki[a] * ik;
                self.q[i * kd + a] = qi[a] * iq * scale;
                self.k[i * kd + a] = kn;
                self.bk[i * kd + a] = kn * b * ed;
            }
        }
        let c = self.rows;
        // q k^T and k k^T over the chunk's rows ([n, n] inside [C, C] buffers).
        gemm(
            n,
            kd,
            n,
            1.0,
            (&self.q, kd, 1),
            (&self.k, 1, kd),
            0.0,
            (&mut self.qk, c),
        );
        gemm(
            n,
            kd,
            n,
            1.0,
            (&self.k, kd, 1),
            (&self.k, 1, kd),
            0.0,
            (&mut self.kk, c),
        );
        // Causal attention with pairwise decay, and the UT system A[i, j] = beta_i (k_i . k_j)
        // exp(cum_i - cum_j) (j < i), inverted in place: T = (I + A)^-1.
        for i in 0..n {
            for j in 0..n {
                let decay = if j <= i { (self.cum[i] - self.cum[j]).exp() } else { 0.0 };
                self.qk[i * c + j] *= decay;
                let a = self.beta[i] * self.kk[i * c + j] * decay;
                self.kk[i * c + j] = if j < i { a } else { 0.0 };
            }
        }
        invert_unit_lower(&mut self.kk, n, c);
        // u = T beta v; w = T beta k exp(cum).
        gemm(
            n,
            n,
            vd,
            1.0,
            (&self.kk, c, 1),
            (&self.bv, vd, 1),
            0.0,
            (&mut self.u, vd),
        );
        gemm(
            n,
            n,
            kd,
            1.0,
            (&self.kk, c, 1),
            (&self.bk, kd, 1),
            0.0,
            (&mut self.w, kd),
        );
        // v_new = u - w S: the part of each value the old state does not already predict.
        gemm(n, kd, vd, -1.0, (&self.w, kd, 1), (&*s, vd, 1), 1.0, (&mut self.u, vd));
        // o = (q exp(cum)) S + attn v_new.
        for i in 0..n {
            let ed = self.cum[i].exp();
            self.q[i * kd..(i + 1) * kd].iter_mut().for_each(|x| *x *= ed);
        }
        gemm(n, kd, vd, 1.0, (&self.q, kd, 1), (&*s, vd, 1), 0.0, (&mut *out, vd));
        gemm(n, n, vd, 1.0, (&self.qk, c, 1), (&self.u, vd, 1), 1.0, (out, vd));
        // S = exp(cum_last) S + (k exp(cum_last - cum))^T v_new.
        let last = self.cum[n - 1];
        for j in 0..n {
            let kdec = (last - self.cum[j]).exp();
            self.k[j * kd..(j + 1) * kd].iter_mut().for_each(|x| *x *= kdec);
        }
        gemm(kd, n, vd, 1.0, (&self.k, 1, kd), (&self.u, vd, 1), last.exp(), (s, vd));
    }
}

/// Replaces the strictly lower `a` (`[n, n]` with row stride `rs`, unit diagonal implied, upper
/// ignored) by `(I + a)^-1`, unit lower triangular with zeros above the diagonal.
fn invert_unit_lower(a: &mut [f32], n: usize, rs: usize) {
    // Row i of the inverse: e_i - sum_{j < i} a[i, j] inv[j, :], using rows already inverted.
    for i in 0..n {
        let (done, rest) = a.split_at_mut(i * rs);
        let row = &mut rest[..n];
        let coefs: [f32; GDN_CHUNK] = std::array::from_fn(|j| if j < i { row[j] } else { 0.0 });
        row.fill(0.0);
        row[i] = 1.0;
        for (j, &cj) in coefs.iter().enumerate().take(i) {
            if cj != 0.0 {
                for (r, x) in row[..=j].iter_mut().zip(&done[j * rs..j * rs + j + 1]) {
                    *r -= cj * x;
                }
            }
        }
    }
}

/// `c = alpha a b + beta c` for `a [m, k]`, `b [k, n]` given as (slice, row stride, column
/// stride) and `c [m, n]` as (slice, row stride) with unit column stride; checks every view lies
/// inside its slice, then runs `matrixmultiply`'s blocked kernel (single-threaded at these sizes,
/// so it nests inside the per-head rayon tasks).
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    beta: f32,
    c: (&mut [f32], usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let end = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols.max(1) - 1) * cs + 1;
    if k > 0 {
        assert!(a.0.len() >= end(m, k, a.1, a.2), "gemm: a view out of bounds");
        assert!(b.0.len() >= end(k, n, b.1, b.2), "gemm: b view out of bounds");
    }
    assert!(c.0.len() >= end(m, n, c.1, 1), "gemm: c view out of bounds");
    // SAFETY: the asserts above keep every element matrixmultiply reads from a and b and writes
    // to c inside its slice; c is uniquely borrowed and does not alias a or b.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.0.as_ptr(),
            a.1 as isize,
            a.2 as isize,
            b.0.as_ptr(),
            b.1 as isize,
            b.2 as isize,
            beta,
            c.0.as_mut_ptr(),
            c.1 as isize,
            1,
        );
    }
}
