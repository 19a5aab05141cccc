//! Decode attention whose splits grow with the context (`paged_attention_decode_as` Scaled,
//! cuda/decode_attention.cu): against the CPU op at the contexts around its layout's edges over
//! ragged block tables, in both storages and every head size; a token in batches of 5 tokens of
//! other contexts against the same token alone, bit for bit; a wider block table (a bigger grid,
//! as a graph bucket's) and a second launch on the same scratch, bit for bit, with every arrival
//! counter back at 0; the same for the direct tensor-core form (`flash_decode_direct_*`) where
//! it fits; the form `paged_attention_decode` picks by batch size; and TIMING lines
//! against the fixed-split form.

use ninfer_core::backend::cuda::ops::{decode_block_splits, decode_warp_keys, tc_direct_fits, tc_direct_splits, tc_direct_split_keys, DecodeAttentionForm, PagedAttentionShape, DECODE_MAX_SPLITS, DECODE_SCALED_MAX_TOKENS};
use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::StorageDType;

use super::harness::{check, gpu, rounded, tol16, upload, upload_raw, Out16, Rng, STORAGES};
use super::{assert_arrivals_reset, assert_bitwise, decode_scratch, paged_case, reference, AttnTimingCase};

/// One key; a partial first warp; 256 (8 splits of 4-key warps); 512 (16 splits, the most 4-key
/// warps take) and 513 (9 splits of 8-key warps, a 1-key last split); 1000 (16 splits, last one
/// partial); 4096 (32 splits of 16-key warps); 8191 (32 splits of 32-key warps, the last warp
/// one key short).
const CONTEXTS: [usize; 8] = [1, 7, 256, 512, 513, 1000, 4096, 8191];

/// Two batches of 5 tokens of different contexts (indices into CONTEXTS; a sequence each).
const BATCHES: [[usize; 5]; 2] = [[6, 0, 3, 7, 2], [1, 5, 4, 7, 6]];

/// The attention shape of `case` (a paged_case) for hq q heads: scale 1 / sqrt(d), the case's
/// block count and table width.
fn case_shape(hq: usize, hk: usize, d: usize, bs: usize, case: &super::PagedCase) -> PagedAttentionShape {
    PagedAttentionShape {
        n_q_heads: hq,
        n_kv_heads: hk,
        head_dim: d,
        q_stride: hq * d,
        block_size: bs,
        num_blocks: case.num_blocks,
        max_blocks_per_seq: case.max_blocks,
        scale: 1.0 / (d as f32).sqrt(),
        max_context: 0,
        partition: 0,
    }
}

/// CONTEXTS for (hq, hk, d) over ragged block tables of block size 16 (`paged_case`), then a q
/// row per context rounded to the storage (drawn in that order from `rng`): the case, q, its
/// shape, and the K / V caches and tables on the device.
fn contexts_case(
    dev: &ninfer_core::backend::cuda::CudaDevice,
    rng: &mut Rng,
    st: StorageDType,
    (hq, hk, d): (usize, usize, usize),
) -> (super::PagedCase, Vec<f32>, PagedAttentionShape, CudaSlice<u16>, CudaSlice<u16>, CudaSlice<i32>) {
    let bs = 16;
    let case = paged_case(rng, st, &CONTEXTS, hk, d, bs);
    let q = rounded(&rng.vec(CONTEXTS.len() * hq * d, -1.0, 1.0), st);
    let shape = case_shape(hq, hk, d, bs, &case);
    let (kd, vd, tables) = (upload(dev, &case.k_cache), upload(dev, &case.v_cache), upload_raw(dev, &case.tables));
    (case, q, shape, kd, vd, tables)
}

/// Which launcher a test run calls.
#[derive(Clone, Copy)]
enum Form {
    Scaled,
    Fixed,
    /// The direct tensor-core form with this many splits at most (`paged_attention_decode_layout`).
    TensorCoreDirect(usize),
    /// `paged_attention_decode`: the form the plan's route picks.
    Chosen,
}

/// (q heads, kv heads, head dim), one per lane layout of decode_attention.cu (elements a lane x
/// keys a warp load x loads an iteration): Llama-3-8B (4 heads a block; 8 x 2 x 2), Qwen3.5-27B
/// attention (groups of 6: 2 heads a block; 8 x 1 x 4), groups of 8 at d 64 (4 x 2 x 2), d 128
/// (4 x 1 x 2) and d 256 (8 x 1 x 2), MHA at d 96 (3 x 1 x 4), a group of 3 at d 128 (1 head a
/// block; 8 x 2 x 4), a group of 4 at d 64 (8 x 4 x 2).
const SHAPES: [(usize, usize, usize); 8] = [(32, 8, 128), (24, 4, 256), (16, 2, 64), (16, 2, 128), (8, 1, 256), (4, 4, 96), (6, 2, 128), (8, 2, 64)];

#[test]
fn scaled_decode_attention_matches_reference_alone_and_in_batches() {
    // The layout the contexts are chosen around (decode_attention.rs mirrors the kernel's).
    assert_eq!(CONTEXTS.map(decode_block_splits), [1, 1, 8, 16, 9, 16, 32, 32]);
    assert_eq!((decode_warp_keys(4096), decode_warp_keys(8191)), (16, 32));
    for st in STORAGES {
        let Some(dev) = gpu("decode_attention_scaled", st) else { return };
        let mut rng = Rng::new(41);
        for (hq, hk, d) in SHAPES {
            let bs = 16;
            let (case, q, shape, kd, vd, tables) = contexts_case(&dev, &mut rng, st, (hq, hk, d));
            let n = CONTEXTS.len();
            let row = |s: usize| s * hq * d..(s + 1) * hq * d;
            let scale = 1.0 / (d as f32).sqrt();
            let label = format!("hq{hq}hk{hk}/d{d}");
            // Token s of sequence s at its last position, for the chosen sequences.
            let run = |seqs: &[usize], shape: &PagedAttentionShape, tables: &cudarc::driver::CudaSlice<i32>, scratch: &ninfer_core::backend::cuda::ops::AttnScratch, form: Form| {
                let qs: Vec<f32> = seqs.iter().flat_map(|&s| q[row(s)].iter().copied()).collect();
                let seq: Vec<i32> = seqs.iter().map(|&s| s as i32).collect();
                let pos: Vec<i32> = seqs.iter().map(|&s| CONTEXTS[s] as i32 - 1).collect();
                let (qd, seq_d, pos_d) = (upload(&dev, &qs), upload_raw(&dev, &seq), upload_raw(&dev, &pos));
                let mut out = Out16::new(&dev, seqs.len() * hq * d);
                match form {
                    Form::Fixed => dev.paged_attention_decode_as(DecodeAttentionForm::Fixed, &qd, &kd, &vd, tables, &seq_d, &pos_d, &mut out.view(), None, shape, scratch),
                    Form::Scaled => dev.paged_attention_decode_as(DecodeAttentionForm::Scaled, &qd, &kd, &vd, tables, &seq_d, &pos_d, &mut out.view(), None, shape, scratch),
                    Form::TensorCoreDirect(splits) => dev.paged_attention_decode_layout(DecodeAttentionForm::TensorCoreDirect, splits, &qd, &kd, &vd, tables, &seq_d, &pos_d, &mut out.view(), None, shape, scratch),
                    Form::Chosen => dev.paged_attention_decode(&qd, &kd, &vd, tables, &seq_d, &pos_d, &mut out.view(), None, shape, scratch),
                }
                .unwrap();
                out.read(&dev, "decode attention")
            };
            let want: Vec<Vec<f32>> = (0..n)
                .map(|s| {
                    let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
                    reference::attention_seq(&q[row(s)], 1, hq, &case.k_cache, &case.v_cache, table, CONTEXTS[s] - 1, hk, d, bs, scale)
                })
                .collect();
            // Batch 1: each token alone, against the CPU op.
            let alone_scratch = decode_scratch(&dev, 1, &shape);
            let alone: Vec<Vec<f32>> = (0..n).map(|s| run(&[s], &shape, &tables, &alone_scratch, Form::Scaled)).collect();
            for s in 0..n {
                check("decode_attention_scaled", st, &format!("{label}/ctx{}/alone", CONTEXTS[s]), &alone[s], &want[s], tol16(st));
            }
            assert_arrivals_reset(&dev, &alone_scratch, &format!("{label} alone"));
            // Batches of 5: every row the bits of its token alone; a second launch on the same
            // scratch the same bits.
            let scratch = decode_scratch(&dev, 5, &shape);
            for batch in BATCHES {
                let got = run(&batch, &shape, &tables, &scratch, Form::Scaled);
                assert_arrivals_reset(&dev, &scratch, &format!("{label} batch {batch:?}"));
                for (i, &s) in batch.iter().enumerate() {
                    let what = format!("decode attention {label}: ctx {} in batch {batch:?} vs alone", CONTEXTS[s]);
                    assert_bitwise(&got[i * hq * d..(i + 1) * hq * d], &alone[s], &what);
                }
                let again = run(&batch, &shape, &tables, &scratch, Form::Scaled);
                assert_bitwise(&again, &got, &format!("decode attention {label} batch {batch:?}: second launch"));
                assert_arrivals_reset(&dev, &scratch, &format!("{label} batch {batch:?} relaunch"));
            }
            // Block tables twice as wide (a graph bucket's power-of-two stride): a taller grid
            // whose surplus blocks exit at once, the same bits.
            let wide = 2 * case.max_blocks;
            let mut wide_tables = vec![0i32; n * wide];
            for s in 0..n {
                wide_tables[s * wide..s * wide + case.max_blocks].copy_from_slice(&case.tables[s * case.max_blocks..(s + 1) * case.max_blocks]);
            }
            let wide_shape = PagedAttentionShape { max_blocks_per_seq: wide, ..shape };
            let got = run(&BATCHES[0], &wide_shape, &upload_raw(&dev, &wide_tables), &scratch, Form::Scaled);
            for (i, &s) in BATCHES[0].iter().enumerate() {
                assert_bitwise(&got[i * hq * d..(i + 1) * hq * d], &alone[s], &format!("decode attention {label}: ctx {} with wide tables", CONTEXTS[s]));
            }
            assert_arrivals_reset(&dev, &scratch, &format!("{label} wide tables"));
            // The fixed-split baseline the timing compares against, on the same scratch.
            let got = run(&BATCHES[1], &shape, &tables, &scratch, Form::Fixed);
            for (i, &s) in BATCHES[1].iter().enumerate() {
                let rows = i * hq * d..(i + 1) * hq * d;
                check("decode_attention_fixed", st, &format!("{label}/ctx{}", CONTEXTS[s]), &got[rows], &want[s], tol16(st));
            }
            assert_arrivals_reset(&dev, &scratch, &format!("{label} fixed"));
            // The direct tensor-core form (on sm_80+ where the shape fits): against the CPU op
            // alone, every row of a batch the bits of its token alone, a relaunch and wider
            // tables the same bits, counters back at 0.
            let sm80 = dev.compute_capability().0 >= 8;
            // The direct form at a launch of 1 token's splits (its layout depends on the
            // launch's token count, not on the other tokens: alone and in batches at that count).
            let direct = tc_direct_fits(&shape) && sm80;
            let direct1 = tc_direct_splits(1, hk, dev.sm_count());
            for (form, fits, what) in [(Form::TensorCoreDirect(direct1), direct, "direct tensor-core")] {
                if !fits {
                    continue;
                }
                let tc_alone: Vec<Vec<f32>> = (0..n).map(|s| run(&[s], &shape, &tables, &alone_scratch, form)).collect();
                for s in 0..n {
                    check("decode_attention_tensor_core", st, &format!("{what}/{label}/ctx{}/alone", CONTEXTS[s]), &tc_alone[s], &want[s], tol16(st));
                }
                assert_arrivals_reset(&dev, &alone_scratch, &format!("{label} {what} alone"));
                for batch in BATCHES {
                    let got = run(&batch, &shape, &tables, &scratch, form);
                    for (i, &s) in batch.iter().enumerate() {
                        assert_bitwise(&got[i * hq * d..(i + 1) * hq * d], &tc_alone[s], &format!("{what} decode attention {label}: ctx {} in batch {batch:?} vs alone", CONTEXTS[s]));
                    }
                    let again = run(&batch, &shape, &tables, &scratch, form);
                    assert_bitwise(&again, &got, &format!("{what} decode attention {label} batch {batch:?}: second launch"));
                    assert_arrivals_reset(&dev, &scratch, &format!("{label} {what} batch {batch:?}"));
                }
                let got = run(&BATCHES[0], &wide_shape, &upload_raw(&dev, &wide_tables), &scratch, form);
                for (i, &s) in BATCHES[0].iter().enumerate() {
                    assert_bitwise(&got[i * hq * d..(i + 1) * hq * d], &tc_alone[s], &format!("{what} decode attention {label}: ctx {} with wide tables", CONTEXTS[s]));
                }
                assert_arrivals_reset(&dev, &scratch, &format!("{label} {what} wide tables"));
            }
            // The form the model runs (`paged_attention_decode`): the direct tensor-core one at
            // its launch's splits where it fits, else the scaled one alone and the fixed one in a
            // batch of 5 (DECODE_SCALED_MAX_TOKENS); the scaled one in any batch under batch
            // invariance.
            assert!(BATCHES[1].len() > DECODE_SCALED_MAX_TOKENS);
            let fixed = got;
            let direct_on = direct && dev.plan().decode_attention.tensor_cores && !dev.batch_invariant();
            let s = BATCHES[1][0];
            let alone_want = if direct_on { run(&[s], &shape, &tables, &alone_scratch, Form::TensorCoreDirect(direct1)) } else { alone[s].clone() };
            assert_bitwise(&run(&[s], &shape, &tables, &alone_scratch, Form::Chosen), &alone_want, &format!("decode attention {label}: the form chosen for 1 token"));
            let chosen = run(&BATCHES[1], &shape, &tables, &scratch, Form::Chosen);
            let batched = if dev.batch_invariant() {
                run(&BATCHES[1], &shape, &tables, &scratch, Form::Scaled)
            } else if direct_on {
                run(&BATCHES[1], &shape, &tables, &scratch, Form::TensorCoreDirect(tc_direct_splits(BATCHES[1].len(), hk, dev.sm_count())))
            } else {
                fixed
            };
            assert_bitwise(&chosen, &batched, &format!("decode attention {label}: the form chosen for 5 tokens (batch invariant {})", dev.batch_invariant()));
            assert_arrivals_reset(&dev, &scratch, &format!("{label} chosen"));
        }
    }
}

/// Per-call time of the scaled decode attention against the fixed-split form, at
/// the Llama-3-8B and Qwen3.5-27B attention shapes, batch 1, 2, 4 and 8, contexts 256 to 16384
/// (distinct K and V caches, every token at the full context). Prints one TIMING line per case;
/// `DECODE_SCALED_MAX_TOKENS` (ops/decode_attention.rs) cites them.
#[test]
fn scaled_decode_attention_timing() {
    let Some(dev) = gpu("decode_attention_timing", StorageDType::Bf16) else { return };
    for (name, hq, hk, d) in [("llama3-8b", 32, 8, 128), ("qwen3.5-27b", 24, 4, 256)] {
        for batch in [1, 2, 4, 8, 32, 64] {
            for ctx in [256, 512, 1024, 2048, 4096, 16384] {
                if batch * ctx > 64 * 4096 {
                    continue; // keeps the caches under ~2 GB and the report short
                }
                let mut case = AttnTimingCase::new(&dev, (hq, hk, d), batch, ctx, 0);
                let scratch = decode_scratch(&dev, batch, &case.shape);
                let mut time = |form: DecodeAttentionForm| {
                    case.time(&dev, 100, |c, kc, vc, out| dev.paged_attention_decode_as(form, &c.q, kc, vc, &c.tables, &c.seq, &c.pos, out, None, &c.shape, &scratch).unwrap())
                };
                let (t_fixed, t_scaled) = (time(DecodeAttentionForm::Fixed), time(DecodeAttentionForm::Scaled));
                assert_arrivals_reset(&dev, &scratch, &format!("timing {name} batch {batch} ctx {ctx}"));
                // K and V bytes read per call over the scaled time: its fraction of the copy rate.
                let kv_gb = case.kv_bytes as f64 / 1e9;
                println!(
                    "TIMING decode_attention {name} batch={batch} ctx={ctx}: fixed {:.2} us, scaled {:.2} us per call (scaled/fixed {:.3}, scaled K/V {:.0} GB/s)",
                    t_fixed * 1e3,
                    t_scaled * 1e3,
                    t_scaled / t_fixed,
                    kv_gb / (t_scaled * 1e-3)
                );
            }
        }
    }
}

/// The scaled form (and the direct tensor-core form, where it fits) requests its first keys' K/V rows before its PDL wait, while the kernel before
/// it (the model's rope_kv_write) may still be writing the newest key's row; it loads that row
/// again after the wait. Here each token's newest row starts as garbage (large values that would
/// dominate the softmax) and `kv_cache_write` writes the true row right before the attention, as
/// a decode step does; the output must equal the reference over the true rows, alone and in a
/// batch, on every one of several launches (the race the reload closes is timing-dependent).
#[test]
fn scaled_decode_attention_sees_the_newest_key_written_just_before_it() {
    for st in STORAGES {
        let Some(dev) = gpu("decode_attention_newest_key", st) else { return };
        let mut rng = Rng::new(43);
        for (hq, hk, d) in [(32, 8, 128), (24, 4, 256), (8, 2, 64)] {
            let bs = 16;
            let case = paged_case(&mut rng, st, &CONTEXTS, hk, d, bs);
            let n = CONTEXTS.len();
            let row_elems = hk * d;
            let scale = 1.0 / (d as f32).sqrt();
            let q = rounded(&rng.vec(n * hq * d, -1.0, 1.0), st);
            let shape = case_shape(hq, hk, d, bs, &case);
            // The newest key's slot of each sequence, its true rows, and caches holding garbage there.
            let slots: Vec<i64> = (0..n)
                .map(|s| {
                    let p = CONTEXTS[s] - 1;
                    case.tables[s * case.max_blocks + p / bs] as i64 * bs as i64 + (p % bs) as i64
                })
                .collect();
            let rows = |cache: &[f32]| -> Vec<f32> { slots.iter().flat_map(|&sl| cache[sl as usize * row_elems..(sl as usize + 1) * row_elems].iter().copied()).collect() };
            let (k_new, v_new) = (rows(&case.k_cache), rows(&case.v_cache));
            let (mut k_bad, mut v_bad) = (case.k_cache.clone(), case.v_cache.clone());
            for &sl in &slots {
                k_bad[sl as usize * row_elems..(sl as usize + 1) * row_elems].fill(8.0);
                v_bad[sl as usize * row_elems..(sl as usize + 1) * row_elems].fill(-8.0);
            }
            let want: Vec<f32> = (0..n)
                .flat_map(|s| {
                    let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
                    reference::attention_seq(&q[s * hq * d..(s + 1) * hq * d], 1, hq, &case.k_cache, &case.v_cache, table, CONTEXTS[s] - 1, hk, d, bs, scale)
                })
                .collect();
            let tables = upload_raw(&dev, &case.tables);
            let label = format!("hq{hq}hk{hk}/d{d}");
            for (what, seqs) in [("batch", (0..n).collect::<Vec<_>>()), ("alone", vec![n - 1]), ("alone", vec![3])] {
                let scratch = decode_scratch(&dev, seqs.len(), &shape);
                let pick = |v: &[f32], w: usize| -> Vec<f32> { seqs.iter().flat_map(|&s| v[s * w..(s + 1) * w].iter().copied()).collect() };
                let (qd, kn, vn) = (upload(&dev, &pick(&q, hq * d)), upload(&dev, &pick(&k_new, row_elems)), upload(&dev, &pick(&v_new, row_elems)));
                let sl = upload_raw(&dev, &seqs.iter().map(|&s| slots[s]).collect::<Vec<_>>());
                let seq_d = upload_raw(&dev, &seqs.iter().map(|&s| s as i32).collect::<Vec<_>>());
                let pos_d = upload_raw(&dev, &seqs.iter().map(|&s| CONTEXTS[s] as i32 - 1).collect::<Vec<_>>());
                let direct = tc_direct_fits(&shape) && dev.compute_capability().0 >= 8;
                let forms: &[DecodeAttentionForm] = if direct { &[DecodeAttentionForm::Scaled, DecodeAttentionForm::TensorCoreDirect] } else { &[DecodeAttentionForm::Scaled] };
                for (&form, launch) in forms.iter().flat_map(|f| std::iter::repeat_n(f, 4).zip(0..)) {
                    let (mut kd, mut vd) = (upload(&dev, &k_bad), upload(&dev, &v_bad));
                    let mut out = Out16::new(&dev, seqs.len() * hq * d);
                    dev.kv_cache_write(&kn, &vn, &mut kd, &mut vd, &sl, row_elems, row_elems, row_elems).unwrap();
                    dev.paged_attention_decode_as(form, &qd, &kd, &vd, &tables, &seq_d, &pos_d, &mut out.view(), None, &shape, &scratch).unwrap();
                    let got = out.read(&dev, "decode attention after kv_cache_write");
                    check("decode_attention_newest_key", st, &format!("{label}/{form:?}/{what}{seqs:?}/launch{launch}"), &got, &pick(&want, hq * d), tol16(st));
                }
                assert_arrivals_reset(&dev, &scratch, &format!("{label} newest key {what}"));
            }
        }
    }
}

/// The direct tensor-core form at other most splits a token (its kernels' layout argument; the
/// batch-1 launch's is covered above: 1 (one split up to any context), 4, 9 and 32, for the
/// Llama-3-8B shape, a group of 8 at d 64, a group of 3 at d 128, MHA at d 64 and Qwen3.5-27B's
/// groups of 6 at d 256 (a pair of warps a tile), both
/// storages: each token alone against the CPU op over ragged tables, every row of a batch of 5
/// the bits of its token alone, a block size of 8 (tiles across cache blocks) against the CPU
/// op, counters back at 0.
#[test]
fn direct_tensor_core_decode_attention_at_split_sizes_and_block_sizes() {
    for st in STORAGES {
        let Some(dev) = gpu("decode_attention_tc_direct", st) else { return };
        if dev.compute_capability().0 < 8 {
            eprintln!("SKIP decode_attention_tc_direct: the tensor-core form needs sm_80+");
            return;
        }
        let mut rng = Rng::new(59);
        for (hq, hk, d) in [(32, 8, 128), (16, 2, 64), (6, 2, 128), (4, 4, 64), (24, 4, 256)] {
            for bs in [16, 8] {
                let case = paged_case(&mut rng, st, &CONTEXTS, hk, d, bs);
                let q = rounded(&rng.vec(CONTEXTS.len() * hq * d, -1.0, 1.0), st);
                let shape = case_shape(hq, hk, d, bs, &case);
                let (kd, vd, tables) = (upload(&dev, &case.k_cache), upload(&dev, &case.v_cache), upload_raw(&dev, &case.tables));
                let n = CONTEXTS.len();
                let row = |s: usize| s * hq * d..(s + 1) * hq * d;
                let scale = 1.0 / (d as f32).sqrt();
                let run = |seqs: &[usize], scratch: &ninfer_core::backend::cuda::ops::AttnScratch, splits: usize| {
                    let qs: Vec<f32> = seqs.iter().flat_map(|&s| q[row(s)].iter().copied()).collect();
                    let seq: Vec<i32> = seqs.iter().map(|&s| s as i32).collect();
                    let pos: Vec<i32> = seqs.iter().map(|&s| CONTEXTS[s] as i32 - 1).collect();
                    let (qd, seq_d, pos_d) = (upload(&dev, &qs), upload_raw(&dev, &seq), upload_raw(&dev, &pos));
                    let mut out = Out16::new(&dev, seqs.len() * hq * d);
                    dev.paged_attention_decode_layout(DecodeAttentionForm::TensorCoreDirect, splits, &qd, &kd, &vd, &tables, &seq_d, &pos_d, &mut out.view(), None, &shape, scratch).unwrap();
                    out.read(&dev, "direct tensor-core decode attention")
                };
                let (alone_scratch, scratch) = (decode_scratch(&dev, 1, &shape), decode_scratch(&dev, 5, &shape));
                let split_set: &[usize] = if bs == 16 { &[1, 4, 9] } else { &[DECODE_MAX_SPLITS] };
                for &splits in split_set {
                    let label = format!("hq{hq}hk{hk}/d{d}/bs{bs}/splits{splits}");
                    let alone: Vec<Vec<f32>> = (0..n).map(|s| run(&[s], &alone_scratch, splits)).collect();
                    for (s, &c) in CONTEXTS.iter().enumerate() {
                        let table = &case.tables[s * case.max_blocks..(s + 1) * case.max_blocks];
                        let want = reference::attention_seq(&q[row(s)], 1, hq, &case.k_cache, &case.v_cache, table, c - 1, hk, d, bs, scale);
                        check("decode_attention_tc_direct", st, &format!("{label}/ctx{c}"), &alone[s], &want, tol16(st));
                    }
                    assert_arrivals_reset(&dev, &alone_scratch, &label);
                    let got = run(&BATCHES[1], &scratch, splits);
                    for (i, &s) in BATCHES[1].iter().enumerate() {
                        assert_bitwise(&got[i * hq * d..(i + 1) * hq * d], &alone[s], &format!("direct tensor-core decode attention {label}: ctx {} in a batch vs alone", CONTEXTS[s]));
                    }
                    assert_arrivals_reset(&dev, &scratch, &label);
                }
            }
        }
    }
}

/// Per-call time of the direct tensor-core form at its launch's splits (`tc_direct_splits`, and
/// at half and twice that many) against the forms the model runs where it does not fit (scaled
/// at 1-2 tokens, fixed from 3), Llama-3-8B and Qwen3.5-27B attention shapes, batch 1
/// to 64, contexts 256 to 32768, each call on the next of enough distinct K/V caches to pass
/// 256 MB (AttnTimingCase). One TIMING line a case.
#[test]
fn direct_tensor_core_decode_attention_timing() {
    let Some(dev) = gpu("decode_attention_tc_direct_timing", StorageDType::Bf16) else { return };
    if dev.compute_capability().0 < 8 {
        return;
    }
    for (name, hq, hk, d, batch, ctx) in [("llama3-8b", 32, 8, 128), ("qwen3.5-27b", 24, 4, 256)]
        .into_iter()
        .flat_map(|(n, hq, hk, d)| [1, 2, 4, 8, 16, 32, 64].into_iter().flat_map(move |b| [256, 1024, 4096, 16384, 32768].map(|c| (n, hq, hk, d, b, c))))
    {
        if batch * ctx > 16 * 16384 || (d == 256 && (ctx == 256 || batch == 4 || batch == 32)) {
            continue; // caches under ~2 GB; the 27B shape at fewer cases
        }
        let mut case = AttnTimingCase::new(&dev, (hq, hk, d), batch, ctx, 256 << 20);
        let scratch = decode_scratch(&dev, batch, &case.shape);
        let copies = case.caches.len();
        let iters = 40 * copies.min(4);
        let mut time = |form: DecodeAttentionForm, arg: Option<usize>| {
            case.time(&dev, iters, |c, kc, vc, out| match arg {
                Some(a) => dev.paged_attention_decode_layout(form, a, &c.q, kc, vc, &c.tables, &c.seq, &c.pos, out, None, &c.shape, &scratch).unwrap(),
                None => dev.paged_attention_decode_as(form, &c.q, kc, vc, &c.tables, &c.seq, &c.pos, out, None, &c.shape, &scratch).unwrap(),
            })
        };
        let base = time(if batch <= DECODE_SCALED_MAX_TOKENS { DecodeAttentionForm::Scaled } else { DecodeAttentionForm::Fixed }, None);
        let gbs = |t: f64| case_gbs(t, batch, ctx, hk, d);
        let mut line = format!("TIMING decode_attention_tc_direct {name} batch={batch} ctx={ctx} ({copies} caches): CUDA-core form {:.2} us {:.0} GB/s;", base * 1e3, gbs(base));
        let chosen = tc_direct_splits(batch, hk, dev.sm_count());
        for (what, splits) in [("default", chosen), ("half", chosen.div_ceil(2)), ("twice", (2 * chosen).min(DECODE_MAX_SPLITS))] {
            let per_token = ctx.div_ceil(tc_direct_split_keys(ctx, splits));
            let t = time(DecodeAttentionForm::TensorCoreDirect, Some(splits));
            line += &format!(" direct {what} (max {splits}: {per_token} splits) {:.2} us {:.0} GB/s ({:.3});", t * 1e3, gbs(t), t / base);
        }
        assert_arrivals_reset(&dev, &scratch, &format!("direct timing batch {batch} ctx {ctx}"));
        println!("{line}");
    }
}

/// K and V GB/s of a decode attention call of `ms` milliseconds over `batch` tokens of `ctx` keys.
fn case_gbs(ms: f64, batch: usize, ctx: usize, hk: usize, d: usize) -> f64 {
    (2 * batch * ctx * hk * d * 2) as f64 / 1e9 / (ms * 1e-3)
}
