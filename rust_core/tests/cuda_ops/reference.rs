//! Adapters from the CUDA parity tests' shapes to the CPU backend's ops
//! (`ninfer_core::backend::cpu`), which are the reference every CUDA op must match. Inputs are
//! storage-rounded f32 values, so the only differences from the GPU are summation order and
//! the final rounding to storage precision.

use ninfer_core::backend::cpu::{activation, attention, gdn, matmul, norm, rope};

/// RMSNorm of `rows` rows of `dim` (x rows `x_stride` apart); `plus_one` folds w + 1 into the
/// weight first, as the model loader does for the (1 + w) convention.
pub fn rmsnorm(x: &[f32], w: &[f32], rows: usize, dim: usize, x_stride: usize, eps: f32, plus_one: bool) -> Vec<f32> {
    let w: Vec<f32> = if plus_one { w.iter().map(|v| 1.0 + v).collect() } else { w.to_vec() };
    if x_stride == dim {
        let mut out = vec![0.0; rows * dim];
        norm::rms_norm(x, rows, dim, &w, eps, &mut out);
        return out;
    }
    let mut y = x.to_vec();
    norm::rms_norm_heads_inplace(&mut y, rows, x_stride, 0, 1, dim, &w, eps);
    (0..rows).flat_map(|r| y[r * x_stride..r * x_stride + dim].to_vec()).collect()
}

/// Gated RMSNorm of the GDN output.
pub fn rmsnorm_gated(x: &[f32], z: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0.0; rows * dim];
    gdn::rms_norm_gated(x, z, rows, dim, w, eps, &mut out);
    out
}

/// sigmoid.
pub fn sigmoid(x: f32) -> f32 {
    activation::sigmoid(x)
}

/// softplus with torch's threshold.
pub fn softplus(x: f32) -> f32 {
    activation::softplus(x)
}

/// SwiGLU over a fused gate|up buffer [rows, 2n].
pub fn swiglu(gate_up: &[f32], rows: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; rows * n];
    activation::swiglu(gate_up, rows, n, &mut out);
    out
}

/// NeoX RoPE in place on `heads` heads of every row (rows `stride` apart).
#[allow(clippy::too_many_arguments)]
pub fn rope(x: &mut [f32], positions: &[i32], stride: usize, heads: usize, head_dim: usize, inv_freq: &[f32], scale: f32) {
    let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    rope::rope_tables(&pos, inv_freq, scale, &mut cos, &mut sin);
    rope::apply_rope(x, pos.len(), stride, 0, heads, head_dim, &cos, &sin, inv_freq.len());
}

/// y[M, N] = x[M, K] W[N, K]^T.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; m * n];
    matmul::linear(x, m, k, w, n, None, &mut y);
    y
}

/// The CPU paged attention for `t` consecutive query rows of one sequence starting at
/// `start_pos`; q rows are [n_heads * head_dim]; returns [t, n_heads, head_dim].
#[allow(clippy::too_many_arguments)]
pub fn attention_seq(
    q: &[f32],
    t: usize,
    n_heads: usize,
    k_cache: &[f32],
    v_cache: &[f32],
    table: &[i32],
    start_pos: usize,
    n_kv_heads: usize,
    d: usize,
    block_size: usize,
    scale: f32,
) -> Vec<f32> {
    let layout = attention::KvLayout { block_size, n_kv_heads, head_dim: d };
    let table: Vec<u32> = table.iter().map(|&b| b as u32).collect();
    let mut out = vec![0.0; t * n_heads * d];
    attention::paged_attention(q, n_heads * d, t, n_heads, k_cache, v_cache, &layout, &table, start_pos, scale, &mut out, n_heads * d);
    out
}

/// The CPU KV write of one token row at `pos` through a block table.
#[allow(clippy::too_many_arguments)]
pub fn write_kv(k_cache: &mut [f32], v_cache: &mut [f32], k: &[f32], v: &[f32], table: &[i32], pos: usize, n_kv_heads: usize, d: usize, block_size: usize) {
    let layout = attention::KvLayout { block_size, n_kv_heads, head_dim: d };
    let table: Vec<u32> = table.iter().map(|&b| b as u32).collect();
    attention::write_kv(k_cache, v_cache, &layout, &table, pos, 1, k, v, n_kv_heads * d);
}

/// Causal conv1d + SiLU of one sequence with carried state [c, k-1] (updated).
pub fn conv1d_seq(x: &[f32], state: &mut [f32], w: &[f32], bias: Option<&[f32]>, t: usize, c: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; t * c];
    gdn::causal_conv1d_silu(x, t, c, w, k, bias, state, &mut out);
    out
}

/// The recurrent gated delta rule of one sequence: q, k [t, nk, dk], v [t, nv, dv], g and beta
/// [t, nv], state [nv, dk, dv] (updated); returns [t, nv, dv].
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrent_seq(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    t: usize,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    let dims = gdn::GdnDims { t, num_k_heads: nk, num_v_heads: nv, k_dim: dk, v_dim: dv };
    let mut out = vec![0.0; t * nv * dv];
    gdn::gated_delta_rule_recurrent(&dims, q, k, v, g, beta, state, &mut out);
    out
}
