//! The recurrent (decode) form of the gated delta rule: one token at a time, no allocation.
//! Mirrors transformers' `torch_recurrent_gated_delta_rule`.

use rayon::prelude::*;

use super::{axpy, inv_l2, DeltaInputs, GdnDims, PARALLEL_MIN_WORK};

/// Value columns processed together by the recurrent step (a stack scratch of this size).
const RECURRENT_TILE: usize = 64;

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
    let x = DeltaInputs { d, q, k, v, g, beta };
    x.check(state, out);
    let GdnDims {
        t,
        num_v_heads: nv,
        k_dim: kd,
        v_dim: vd,
        ..
    } = *d;
    if nv == 0 || kd == 0 || vd == 0 {
        return;
    }
    let parallel = nv * kd * vd >= PARALLEL_MIN_WORK;
    for tok in 0..t {
        let out_row = &mut out[tok * nv * vd..(tok + 1) * nv * vd];
        let heads = state
            .par_chunks_mut(kd * vd)
            .zip(out_row.par_chunks_mut(vd))
            .enumerate();
        if parallel {
            heads.for_each(|(h, (s, o))| head_token(&x, h, tok, s, o));
        } else {
            let heads = state.chunks_mut(kd * vd).zip(out_row.chunks_mut(vd)).enumerate();
            heads.for_each(|(h, (s, o))| head_token(&x, h, tok, s, o));
        }
    }
}

/// Advances value head `h` by token `tok` of `x`: updates its state `s` (`[k_dim, v_dim]`) and
/// writes its output `o` (`[v_dim]`). The chunked form uses it for chunks too short to gain from
/// matrix products.
pub(super) fn head_token(x: &DeltaInputs, h: usize, tok: usize, s: &mut [f32], o: &mut [f32]) {
    let GdnDims {
        num_k_heads: nk,
        num_v_heads: nv,
        k_dim: kd,
        v_dim: vd,
        ..
    } = *x.d;
    let src = (tok * nk + x.d.key_head(h)) * kd;
    let (qh, kh) = (&x.q[src..src + kd], &x.k[src..src + kd]);
    let vs = (tok * nv + h) * vd;
    let scale = 1.0 / (kd as f32).sqrt();
    recurrent_head_step(
        qh,
        inv_l2(qh) * scale,
        kh,
        inv_l2(kh),
        &x.v[vs..vs + vd],
        x.g[tok * nv + h].exp(),
        x.beta[tok * nv + h],
        s,
        o,
    );
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
