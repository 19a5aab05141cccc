//! Tensor names and shapes of tiny HF checkpoints for the model tests (the CPU step invariants
//! and the CUDA loader's packing), so that both write the layout the loaders read from one list.

/// Sizes of a tiny checkpoint: hidden, vocab, MLP width, attention heads / KV heads / head dim,
/// and the Gated DeltaNet key heads / value heads / key dim / value dim / conv kernel.
pub(crate) struct TinyDims {
    pub h: usize,
    pub v: usize,
    pub inter: usize,
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
    pub nk: usize,
    pub nv: usize,
    pub kd: usize,
    pub vd: usize,
    pub kern: usize,
}

/// Every tensor of a checkpoint with `layer_types` ("full_attention" or "linear_attention") under
/// `prefix`, in the order the tests seed them: embedding, final norm, untied lm_head, then per
/// layer its two norms, the SwiGLU MLP and its mixer. `qwen` gives attention the Qwen3.5 layout
/// (gated q projection, q/k norms); `conv_bias` adds the GDN conv1d bias.
pub(crate) fn tensor_shapes(d: &TinyDims, prefix: &str, layer_types: &[&str], qwen: bool, conv_bias: bool) -> Vec<(String, Vec<usize>)> {
    let TinyDims { h, v, inter, nh, nkv, hd, nk, nv, kd, vd, kern } = *d;
    let conv = 2 * nk * kd + nv * vd;
    let mut t: Vec<(String, Vec<usize>)> =
        vec![(format!("{prefix}.embed_tokens.weight"), vec![v, h]), (format!("{prefix}.norm.weight"), vec![h]), ("lm_head.weight".into(), vec![v, h])];
    for (i, kind) in layer_types.iter().enumerate() {
        let p = format!("{prefix}.layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h]));
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, h]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![inter, h]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, inter]));
        if *kind == "full_attention" {
            let a = format!("{p}.self_attn");
            t.push((format!("{a}.q_proj.weight"), vec![if qwen { 2 } else { 1 } * nh * hd, h]));
            t.push((format!("{a}.k_proj.weight"), vec![nkv * hd, h]));
            t.push((format!("{a}.v_proj.weight"), vec![nkv * hd, h]));
            t.push((format!("{a}.o_proj.weight"), vec![h, nh * hd]));
            if qwen {
                t.push((format!("{a}.q_norm.weight"), vec![hd]));
                t.push((format!("{a}.k_norm.weight"), vec![hd]));
            }
        } else {
            let a = format!("{p}.linear_attn");
            t.push((format!("{a}.in_proj_qkv.weight"), vec![conv, h]));
            t.push((format!("{a}.in_proj_z.weight"), vec![nv * vd, h]));
            t.push((format!("{a}.in_proj_b.weight"), vec![nv, h]));
            t.push((format!("{a}.in_proj_a.weight"), vec![nv, h]));
            t.push((format!("{a}.conv1d.weight"), vec![conv, 1, kern]));
            if conv_bias {
                t.push((format!("{a}.conv1d.bias"), vec![conv]));
            }
            t.push((format!("{a}.dt_bias"), vec![nv]));
            t.push((format!("{a}.A_log"), vec![nv]));
            t.push((format!("{a}.norm.weight"), vec![vd]));
            t.push((format!("{a}.out_proj.weight"), vec![h, nv * vd]));
        }
    }
    t
}

/// The tensors of a Qwen3.5 MTP head with one (gated) full-attention layer: `mtp.fc`, its two
/// input norms, `mtp.layers.0.*` and `mtp.norm`.
pub(crate) fn mtp_tensor_shapes(d: &TinyDims) -> Vec<(String, Vec<usize>)> {
    let h = d.h;
    let mut t = vec![
        ("mtp.fc.weight".to_string(), vec![h, 2 * h]),
        ("mtp.pre_fc_norm_embedding.weight".to_string(), vec![h]),
        ("mtp.pre_fc_norm_hidden.weight".to_string(), vec![h]),
    ];
    // `mtp.norm.weight` and the layer, without the embedding and lm_head the head shares.
    t.extend(tensor_shapes(d, "mtp", &["full_attention"], true, false).into_iter().filter(|(n, _)| n.starts_with("mtp.") && n != "mtp.embed_tokens.weight"));
    t
}

/// `len` xorshift values in [-0.5, 0.5), reproducible from `seed`.
pub(crate) fn centered_noise(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}
