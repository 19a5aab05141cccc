//! Decode attention with the gated-attention output gate in its final write (`DecodeGate`,
//! common.cuh gated_out): in every decode form (the direct tensor-core one at head sizes 64 /
//! 128 / 256 with one split and with many, the scaled and the fixed-split ones), both storages,
//! each token alone and in batches of tokens of different contexts (one block split up to a few
//! keys, many at long contexts), the gated launch must give the bits of the same launch without
//! the gate followed by `sigmoid_gate_mul`, the kernel the model ran after it before; the gate
//! rows are projection rows wider than the q heads (the gate at column qd), with values whose
//! sigmoid saturates to 0 and 1. The launch without the gate is checked against the CPU op.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::{tc_direct_fits, AttnScratch, DecodeAttentionForm, DecodeGate, PagedAttentionShape, DECODE_MAX_SPLITS};
use ninfer_core::backend::cuda::CudaDevice;

use super::harness::{check, gpu, rounded, tol16, upload, upload_raw, Out16, Rng, STORAGES};
use super::{assert_arrivals_reset, assert_bitwise, decode_scratch, paged_case, reference};

/// One key and 7 (one block split in every form), then contexts of many splits: 256 (8 scaled
/// splits), 1000, 4096 (32 scaled splits; the fixed form's 8).
const CONTEXTS: [usize; 5] = [1, 7, 256, 1000, 4096];

/// Runs of the test: each token alone, then two batches of tokens of different contexts.
const RUNS: [&[usize]; 7] = [&[0], &[1], &[2], &[3], &[4], &[4, 0, 2, 1, 3], &[1, 3]];

/// (q heads, kv heads, head dim): a group of 8 at d 64, Llama-3-8B (groups of 4 at d 128),
/// Qwen3.5-27B attention (groups of 6 at d 256), MHA at d 96 (no direct form).
const SHAPES: [(usize, usize, usize); 4] = [(16, 2, 64), (32, 8, 128), (24, 4, 256), (4, 4, 96)];

/// Gate values: uniform in [-12, 12), every 5th one from a set whose sigmoid saturates (to 0,
/// through expf's overflow to inf, and to 1).
fn gate_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    const SATURATING: [f32; 8] = [-200.0, -90.0, -30.0, -17.0, 17.0, 30.0, 90.0, 200.0];
    let mut v = rng.vec(n, -12.0, 12.0);
    for (i, x) in v.iter_mut().enumerate().step_by(5) {
        *x = SATURATING[(i / 5) % SATURATING.len()];
    }
    v
}

#[derive(Clone, Copy, Debug)]
enum Form {
    Scaled,
    Fixed,
    /// The direct tensor-core form with at most this many splits a token.
    Direct(usize),
}

#[test]
fn gated_decode_attention_is_attention_then_sigmoid_gate_mul() {
    for st in STORAGES {
        let Some(dev) = gpu("decode_attention_gate", st) else { return };
        let mut rng = Rng::new(67);
        for (hq, hk, d) in SHAPES {
            let bs = 16;
            let case = paged_case(&mut rng, st, &CONTEXTS, hk, d, bs);
            let n = CONTEXTS.len();
            let qd = hq * d;
            let q = rounded(&rng.vec(n * qd, -1.0, 1.0), st);
            let shape = PagedAttentionShape {
                n_q_heads: hq,
                n_kv_heads: hk,
                head_dim: d,
                q_stride: qd,
                block_size: bs,
                num_blocks: case.num_blocks,
                max_blocks_per_seq: case.max_blocks,
                scale: 1.0 / (d as f32).sqrt(),
                max_context: 0,
                partition: 0,
            };
            let (kd, vd, tables) = (upload(&dev, &case.k_cache), upload(&dev, &case.v_cache), upload_raw(&dev, &case.tables));
            let want: Vec<Vec<f32>> = (0..n)
                .map(|s| {
                    let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
                    reference::attention_seq(&q[s * qd..(s + 1) * qd], 1, hq, &case.k_cache, &case.v_cache, table, CONTEXTS[s] - 1, hk, d, bs, shape.scale)
                })
                .collect();
            let mut forms = vec![Form::Scaled, Form::Fixed];
            if tc_direct_fits(&shape) && dev.compute_capability().0 >= 8 {
                forms.extend([Form::Direct(1), Form::Direct(DECODE_MAX_SPLITS)]);
            }
            // Projection rows as the model's gated layout: q, gate, k, v (the gate at column
            // qd); a width that is a multiple of 8 (sigmoid_gate_mul's 16-byte form) and one that
            // is not (its scalar form).
            for width in [2 * qd + 2 * hk * d, 2 * qd + 2 * hk * d + 3] {
                let proj = upload(&dev, &rounded(&gate_values(&mut rng, n * width), st));
                let gate_rows = proj.slice(qd..);
                for form in &forms {
                    for &seqs in &RUNS {
                        let t = seqs.len();
                        let label = format!("hq{hq}hk{hk}/d{d}/{st:?}/{form:?}/width{width}/ctx{:?}", seqs.iter().map(|&s| CONTEXTS[s]).collect::<Vec<_>>());
                        let qs: Vec<f32> = seqs.iter().flat_map(|&s| q[s * qd..(s + 1) * qd].iter().copied()).collect();
                        let seq_d = upload_raw(&dev, &seqs.iter().map(|&s| s as i32).collect::<Vec<_>>());
                        let pos_d = upload_raw(&dev, &seqs.iter().map(|&s| CONTEXTS[s] as i32 - 1).collect::<Vec<_>>());
                        let qd_dev = upload(&dev, &qs);
                        // Token i of the launch takes gate row i, as row i of a model step.
                        let scratch = decode_scratch(&dev, t, &shape);
                        let run = |gate: Option<DecodeGate<'_, '_>>| -> Out16 {
                            let mut out = Out16::new(&dev, t * qd);
                            launch(&dev, *form, &qd_dev, &kd, &vd, &tables, &seq_d, &pos_d, &mut out, gate, &shape, &scratch);
                            out
                        };
                        // Without the gate: the attention (against the CPU op), then
                        // sigmoid_gate_mul in place over it, as the model ran them.
                        let mut plain = run(None);
                        let attn = plain.read(&dev, "decode attention without the gate");
                        for (i, &s) in seqs.iter().enumerate() {
                            check("decode_attention_gate/none", st, &format!("{label}/row{i}"), &attn[i * qd..(i + 1) * qd], &want[s], tol16(st));
                        }
                        dev.sigmoid_gate_mul(&mut plain.view(), &gate_rows, t, qd, width).unwrap();
                        let separate = plain.read(&dev, "decode attention then sigmoid_gate_mul");
                        // With the gate in the final write: the same bits.
                        let fused = run(Some(DecodeGate { rows: &gate_rows, stride: width })).read(&dev, "gated decode attention");
                        assert_bitwise(&fused, &separate, &format!("gated decode attention {label} vs attention then sigmoid_gate_mul"));
                        // And a second launch without the gate: the first one's bits.
                        let again = run(None).read(&dev, "decode attention without the gate, again");
                        assert_bitwise(&again, &attn, &format!("decode attention {label} without the gate, relaunched"));
                        assert_arrivals_reset(&dev, &scratch, &label);
                    }
                }
            }
        }
    }
}

/// The gate's length and row stride are checked: rows too short for the launch's tokens, or a
/// stride below a row of gate columns, are an error, not a read past the buffer.
#[test]
fn decode_attention_rejects_a_short_gate() {
    let Some(dev) = gpu("decode_attention_gate_len", STORAGES[0]) else { return };
    let mut rng = Rng::new(71);
    let (hq, hk, d, bs) = (8, 2, 64, 16);
    let st = STORAGES[0];
    let case = paged_case(&mut rng, st, &[5, 9], hk, d, bs);
    let qd = hq * d;
    let shape = PagedAttentionShape {
        n_q_heads: hq,
        n_kv_heads: hk,
        head_dim: d,
        q_stride: qd,
        block_size: bs,
        num_blocks: case.num_blocks,
        max_blocks_per_seq: case.max_blocks,
        scale: 0.125,
        max_context: 0,
        partition: 0,
    };
    let (kd, vd, tables) = (upload(&dev, &case.k_cache), upload(&dev, &case.v_cache), upload_raw(&dev, &case.tables));
    let q = upload(&dev, &rng.vec(2 * qd, -1.0, 1.0));
    let (seq_d, pos_d) = (upload_raw(&dev, &[0i32, 1]), upload_raw(&dev, &[4i32, 8]));
    let scratch = decode_scratch(&dev, 2, &shape);
    let width = 2 * qd + 2 * hk * d;
    let proj = upload(&dev, &vec![0.5; 2 * width]);
    for (what, rows, stride) in [("rows short of the second token's", proj.slice(qd..width + qd - 1), width), ("a stride below the gate columns", proj.slice(qd..), qd - 8)] {
        let mut out = Out16::new(&dev, 2 * qd);
        let got = dev.paged_attention_decode_as(DecodeAttentionForm::Scaled, &q, &kd, &vd, &tables, &seq_d, &pos_d, &mut out.view(), Some(DecodeGate { rows: &rows, stride }), &shape, &scratch);
        assert!(got.is_err(), "a gate of {what} must be refused");
    }
}

#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &CudaDevice,
    form: Form,
    q: &CudaSlice<u16>,
    kd: &CudaSlice<u16>,
    vd: &CudaSlice<u16>,
    tables: &CudaSlice<i32>,
    seq: &CudaSlice<i32>,
    pos: &CudaSlice<i32>,
    out: &mut Out16,
    gate: Option<DecodeGate<'_, '_>>,
    shape: &PagedAttentionShape,
    scratch: &AttnScratch,
) {
    match form {
        Form::Scaled => dev.paged_attention_decode_as(DecodeAttentionForm::Scaled, q, kd, vd, tables, seq, pos, &mut out.view(), gate, shape, scratch),
        Form::Fixed => dev.paged_attention_decode_as(DecodeAttentionForm::Fixed, q, kd, vd, tables, seq, pos, &mut out.view(), gate, shape, scratch),
        Form::Direct(splits) => dev.paged_attention_decode_layout(DecodeAttentionForm::TensorCoreDirect, splits, q, kd, vd, tables, seq, pos, &mut out.view(), gate, shape, scratch),
    }
    .unwrap()
}
