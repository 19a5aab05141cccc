//! Naive f32 CPU references for the CUDA ops, written from the transformers formulas (the
//! oracle of the model math). They take storage-rounded inputs, so the only difference from
//! the GPU is f32 summation order and the final rounding.

/// RMSNorm of `rows` rows of `dim` (x rows `x_stride` apart); w or (1 + w).
pub fn rmsnorm(x: &[f32], w: &[f32], rows: usize, dim: usize, x_stride: usize, eps: f32, plus_one: bool) -> Vec<f32> {
    let mut out = vec![0.0; rows * dim];
    for r in 0..rows {
        let xr = &x[r * x_stride..r * x_stride + dim];
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let rstd = 1.0 / (ms + eps).sqrt();
        for i in 0..dim {
            let wi = if plus_one { 1.0 + w[i] } else { w[i] };
            out[r * dim + i] = xr[i] * rstd * wi;
        }
    }
    out
}

/// silu.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// sigmoid.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// NeoX RoPE of one head in place: pairs (i, i + rot/2) for i < rot/2.
pub fn rope_head(h: &mut [f32], pos: i32, inv_freq: &[f32], attn_scale: f32) {
    let half = inv_freq.len();
    for i in 0..half {
        let ang = pos as f32 * inv_freq[i];
        let (s, c) = ((ang as f64).sin() as f32 * attn_scale, (ang as f64).cos() as f32 * attn_scale);
        let (a, b) = (h[i], h[i + half]);
        h[i] = a * c - b * s;
        h[i + half] = b * c + a * s;
    }
}

/// y[M, N] = x[M, K] W[N, K]^T in f64 accumulation.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for t in 0..k {
                acc += x[i * k + t] as f64 * w[j * k + t] as f64;
            }
            y[i * n + j] = acc as f32;
        }
    }
    y
}

/// Paged causal attention for one query row: keys 0..=pos of sequence `seq`.
#[allow(clippy::too_many_arguments)]
pub fn attention_row(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    table: &[i32],
    pos: usize,
    kvh: usize,
    n_kv_heads: usize,
    d: usize,
    block_size: usize,
    scale: f32,
) -> Vec<f32> {
    let row = |j: usize| {
        let blk = table[j / block_size] as usize;
        ((blk * block_size + j % block_size) * n_kv_heads + kvh) * d
    };
    let scores: Vec<f64> = (0..=pos)
        .map(|j| {
            let o = row(j);
            (0..d).map(|e| q[e] as f64 * k_cache[o + e] as f64).sum::<f64>() * scale as f64
        })
        .collect();
    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
    let sum: f64 = p.iter().sum();
    let mut out = vec![0.0f32; d];
    for (j, pj) in p.iter().enumerate() {
        let o = row(j);
        for e in 0..d {
            out[e] += (pj / sum * v_cache[o + e] as f64) as f32;
        }
    }
    out
}

/// Causal depthwise conv1d with carried state for one sequence; state is [C, K-1]
/// (oldest first) and is updated. Returns silu(conv) per token, [T, C].
pub fn conv1d_seq(x: &[f32], state: &mut [f32], w: &[f32], bias: Option<&[f32]>, t: usize, c: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; t * c];
    for ch in 0..c {
        let mut win: Vec<f32> = (0..k - 1).map(|i| state[ch * (k - 1) + i]).collect();
        for tok in 0..t {
            let xv = x[tok * c + ch];
            let mut y = bias.map_or(0.0, |b| b[ch]);
            for i in 0..k - 1 {
                y += w[ch * k + i] * win[i];
            }
            y += w[ch * k + k - 1] * xv;
            out[tok * c + ch] = silu(y);
            win.remove(0);
            win.push(xv);
        }
        for i in 0..k - 1 {
            state[ch * (k - 1) + i] = win[i];
        }
    }
    out
}

/// The recurrent gated delta rule for one sequence and one value head, as
/// transformers' torch_recurrent_gated_delta_rule (l2norm of q and k with eps 1e-6, q scaled
/// by dk^-1/2). `state` is [dk, dv], updated. q/k/v are per token [dk] / [dv].
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrent_head(
    q: &[Vec<f32>],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    dk: usize,
    dv: usize,
) -> Vec<Vec<f32>> {
    let l2 = |x: &[f32]| {
        let inv = 1.0 / (x.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
        x.iter().map(|a| a * inv).collect::<Vec<f32>>()
    };
    let mut outs = Vec::new();
    for t in 0..q.len() {
        let qn: Vec<f32> = l2(&q[t]).iter().map(|a| a / (dk as f32).sqrt()).collect();
        let kn = l2(&k[t]);
        let decay = g[t].exp();
        state.iter_mut().for_each(|s| *s *= decay);
        let mut o = vec![0.0; dv];
        for j in 0..dv {
            let mem: f32 = (0..dk).map(|i| state[i * dv + j] * kn[i]).sum();
            let delta = (v[t][j] - mem) * beta[t];
            for i in 0..dk {
                state[i * dv + j] += kn[i] * delta;
            }
            o[j] = (0..dk).map(|i| state[i * dv + j] * qn[i]).sum();
        }
        outs.push(o);
    }
    outs
}
