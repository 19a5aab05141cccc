//! Gated DeltaNet math (placeholder signatures; the GDN engineer's file replaces this one).

/// Causal depthwise conv1d + SiLU over a chunk, carrying the last K-1 inputs.
/// x: [t, c] row-major; weight: [c, k] (HF conv1d.weight [c,1,k] squeezed); bias: optional [c];
/// conv_state: [c, k-1], the previous k-1 inputs per channel, oldest first (zeros for a new
/// sequence), updated in place; out: [t, c].
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d_silu(_x: &[f32], _t: usize, _c: usize, _weight: &[f32], _k: usize, _bias: Option<&[f32]>, _conv_state: &mut [f32], _out: &mut [f32]) {
    unimplemented!("causal_conv1d_silu lands with the gdn branch")
}

/// Dimensions of one gated-delta-rule call for one sequence.
pub struct GdnDims {
    pub t: usize,
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// Gated delta rule over t tokens with carried fp32 state (chunked form).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_chunked(_d: &GdnDims, _q: &[f32], _k: &[f32], _v: &[f32], _g: &[f32], _beta: &[f32], _state: &mut [f32], _out: &mut [f32]) {
    unimplemented!("gated_delta_rule_chunked lands with the gdn branch")
}

/// Same contract, token by token (decode).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_recurrent(_d: &GdnDims, _q: &[f32], _k: &[f32], _v: &[f32], _g: &[f32], _beta: &[f32], _state: &mut [f32], _out: &mut [f32]) {
    unimplemented!("gated_delta_rule_recurrent lands with the gdn branch")
}

/// Gated RMSNorm of the GDN output: rmsnorm(x) * weight * silu(z), per head row of v_dim.
pub fn rms_norm_gated(_x: &[f32], _z: &[f32], _rows: usize, _v_dim: usize, _weight: &[f32], _eps: f32, _out: &mut [f32]) {
    unimplemented!("rms_norm_gated lands with the gdn branch")
}
