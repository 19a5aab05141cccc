//! The DFlash drafter's invariants on the synthetic hybrid checkpoint with a random drafter:
//! malformed drafters are refused naming what is wrong, absorbing in chunks equals one call,
//! rolling the context back and absorbing again equals absorbing fresh, a sequence sharing
//! another's blocks (a prefix hit) drafts as if it had absorbed them itself, a batch drafts as
//! each sequence alone, the forward's features leave its logits as they were, and the runner's
//! hooks draft as the drafter does, with the context paged in the KV pool's shape. Parity with the PyTorch reference (tools/dflash) is in
//! tests/test_dflash.py.

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::dflash::{DflashDrafter, DraftContext};
use super::tests::{load, max_rel, seq, write_hybrid};
use crate::model::test_checkpoint::centered_noise;
use crate::model::*;
use crate::sampling::{argmax, RowSampling};
use crate::spec::draw_draft;

const TOKENS: [u32; 16] = [3, 17, 99, 4, 56, 23, 8, 71, 100, 0, 42, 5, 64, 9, 31, 77];
/// The hybrid checkpoint's hidden size, vocabulary and layer count (tests.rs `write_hybrid`).
const H: usize = 40;
const VOCAB: usize = 101;
const BLOCK: usize = 5;

/// Write a random drafter for the hybrid checkpoint: `config` is merged over a valid config,
/// tensors named in `skip` are left out.
fn write_drafter(tag: &str, config: serde_json::Value, skip: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ninfer_dflash_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = serde_json::json!({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 24,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_target_layers": 3,
        "dflash_config": {"block_size": BLOCK, "mask_token_id": 100, "target_layer_ids": [0, 2]}});
    for (k, v) in config.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let (h, hd) = (cfg["hidden_size"].as_u64().unwrap() as usize, 8);
    let n_ids = cfg["dflash_config"]["target_layer_ids"].as_array().unwrap().len();
    let mut t: Vec<(String, Vec<usize>)> = vec![("fc.weight".into(), vec![h, n_ids * h]), ("hidden_norm.weight".into(), vec![h]), ("norm.weight".into(), vec![h])];
    for i in 0..2 {
        let p = format!("layers.{i}");
        t.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![4 * hd, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![2 * hd, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![2 * hd, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, 4 * hd]),
            (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
            (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
            (format!("{p}.mlp.gate_proj.weight"), vec![24, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![24, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, 24]),
        ]);
    }
    t.retain(|(n, _)| !skip.contains(&n.as_str()));
    let bufs: Vec<Vec<u8>> = t
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            // Norm weights near 1 (Qwen3 norms scale by the weight itself).
            let base = if name.contains("norm") { 1.0 } else { 0.0 };
            centered_noise(n, i as u64 + 101).iter().map(|x| base + x * 0.6).flat_map(|x: f32| x.to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, TensorView)> = t.iter().zip(&bufs).map(|((n, s), b)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).unwrap())).collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

fn refusal(dir: &Path, m: &CpuModel) -> String {
    DflashDrafter::load(dir, m.config()).err().expect("refused").to_string()
}

/// The model, a random drafter (its context pool: 32 blocks of 4) and the target's features
/// `[16, 2 * H]` of `TOKENS`.
fn setup(tag: &str) -> (CpuModel, DflashDrafter, Vec<f32>) {
    let mut m = load(&write_hybrid(&format!("dflash_{tag}"), Dtype::F32, false));
    m.allocate_caches(32, 4, 2).unwrap();
    let mut d = DflashDrafter::load(&write_drafter(tag, serde_json::json!({}), &[]), m.config()).unwrap();
    d.allocate(32, 4).unwrap();
    let mut features = Vec::new();
    let table: Vec<u32> = (0..4).collect();
    m.forward_with_features(&StepBatch { seqs: vec![seq(&TOKENS, 0, &table, 0, LogitsWanted::All)] }, &[0, 2], &mut features).unwrap();
    (m, d, features)
}

#[test]
fn malformed_drafters_are_refused_naming_what_is_wrong() {
    let m = load(&write_hybrid("dflash_bad", Dtype::F32, false));
    let cases: [(&str, serde_json::Value, &[&str], &str); 7] = [
        ("hidden", serde_json::json!({"hidden_size": 32}), &[], "hidden_size 32 does not match the target's 40"),
        ("layer", serde_json::json!({"dflash_config": {"block_size": 5, "mask_token_id": 1, "target_layer_ids": [0, 3]}}), &[], "names layer 3"),
        ("vocab", serde_json::json!({"vocab_size": 50}), &[], "vocab_size 50 does not match"),
        ("mask", serde_json::json!({"dflash_config": {"block_size": 5, "target_layer_ids": [0, 2]}}), &[], "mask_token_id"),
        ("arch", serde_json::json!({"architectures": ["DFlash2DraftModel"]}), &[], "\"DFlash2DraftModel\" is not supported"),
        ("tensor", serde_json::json!({}), &["layers.1.self_attn.k_proj.weight"], "layers.1.self_attn.k_proj.weight"),
        ("block", serde_json::json!({"dflash_config": {"block_size": 1, "mask_token_id": 1, "target_layer_ids": [0]}}), &[], "block_size 1"),
    ];
    for (tag, cfg, skip, want) in cases {
        let e = refusal(&write_drafter(&format!("bad_{tag}"), cfg, skip), &m);
        assert!(e.contains("--drafter") && e.contains(want), "{tag}: {e}");
    }
    let e = refusal(Path::new("/nonexistent/drafter"), &m);
    assert!(e.contains("--drafter") && e.contains("no such drafter directory"), "{e}");
}

#[test]
fn features_leave_the_logits_unchanged_and_the_last_layer_is_normed() {
    let mut m = load(&write_hybrid("dflash_features", Dtype::F32, false));
    m.allocate_caches(32, 4, 2).unwrap();
    let table: Vec<u32> = (0..4).collect();
    let batch = StepBatch { seqs: vec![seq(&TOKENS, 0, &table, 0, LogitsWanted::All)] };
    let plain = m.forward(&batch).unwrap();
    let (mut features, mut hidden) = (Vec::new(), Vec::new());
    let with = m.forward_with_features(&batch, &[2, 0], &mut features).unwrap();
    assert_eq!(plain.data, with.data);
    m.forward_with_hidden(&batch, &mut hidden).unwrap();
    assert_eq!(features.len(), TOKENS.len() * 2 * H);
    for r in 0..TOKENS.len() {
        assert_eq!(&features[r * 2 * H..r * 2 * H + H], &hidden[r * H..(r + 1) * H], "row {r}: layer 2 is the last, normed");
    }
}

/// Blocks `first..first + n` of the pool of 4-position blocks.
fn blocks(first: u32, n: u32) -> Vec<u32> {
    (first..first + n).collect()
}

fn ctx(block_table: &[u32], len: usize, anchor: u32) -> DraftContext<'_> {
    DraftContext { block_table, len, anchor }
}

#[test]
fn absorbing_in_chunks_and_rolling_back_equal_one_fresh_call() {
    let (m, mut d, f) = setup("chunks");
    let w = 2 * H;
    let (t1, t2, t3) = (blocks(0, 4), blocks(4, 4), blocks(8, 4));
    d.absorb(&t1, 0, &f[..10 * w]).unwrap();
    d.absorb(&t2, 0, &f[..4 * w]).unwrap();
    d.absorb(&t2, 4, &f[4 * w..10 * w]).unwrap();
    // Sequence 3 absorbs rows past 10 (rejected drafts), then rows 8.. again; it drafts from 10.
    d.absorb(&t3, 0, &f[..13 * w]).unwrap();
    d.absorb(&t3, 8, &f[8 * w..10 * w]).unwrap();
    let one = d.draft_logits_with(&m, &[ctx(&t1, 10, TOKENS[10])]).unwrap();
    for t in [&t2, &t3] {
        let other = d.draft_logits_with(&m, &[ctx(t, 10, TOKENS[10])]).unwrap();
        assert!(max_rel(&other[0], &one[0]) < 1e-5, "{t:?}: rel err {}", max_rel(&other[0], &one[0]));
    }
    assert_eq!(one[0].len(), (BLOCK - 1) * VOCAB);
    // A table that does not cover the rows, or names a block outside the pool, is refused.
    let e = d.absorb(&t1[..2], 8, &f[8 * w..10 * w]).unwrap_err().to_string();
    assert!(e.contains("cover fewer than 10 positions"), "{e}");
    let e = d.draft_logits_with(&m, &[ctx(&[0, 40], 6, 1)]).unwrap_err().to_string();
    assert!(e.contains("block 40 >= num_blocks 32"), "{e}");
}

/// A prefix hit: a second sequence whose table starts with the first one's two full blocks
/// absorbs only its own rows after them and drafts as with every row absorbed fresh (the
/// context rows of a position depend on that position's features alone).
#[test]
fn a_sequence_sharing_anothers_blocks_drafts_as_if_it_absorbed_them() {
    let (m, mut d, f) = setup("shared");
    let w = 2 * H;
    let first = blocks(0, 4);
    d.absorb(&first, 0, &f[..13 * w]).unwrap();
    let hit = [0, 1, 20, 21];
    d.absorb(&hit, 8, &f[8 * w..11 * w]).unwrap();
    let fresh = blocks(10, 4);
    d.absorb(&fresh, 0, &f[..11 * w]).unwrap();
    let got = d.draft_logits_with(&m, &[ctx(&hit, 11, TOKENS[11])]).unwrap();
    let want = d.draft_logits_with(&m, &[ctx(&fresh, 11, TOKENS[11])]).unwrap();
    // To float rounding: the rows came from projections of other row counts.
    assert!(max_rel(&got[0], &want[0]) < 1e-5, "rel err {}", max_rel(&got[0], &want[0]));
    // Without the shared blocks' rows (other blocks at 0..8, never written) the drafts differ:
    // the hit's context is really read from the shared blocks.
    let stale = d.draft_logits_with(&m, &[ctx(&[30, 31, 20, 21], 11, TOKENS[11])]).unwrap();
    assert!(max_rel(&stale[0], &want[0]) > 1e-3);
}

#[test]
fn a_batch_drafts_as_each_sequence_alone() {
    let (m, mut d, f) = setup("batch");
    let w = 2 * H;
    let (t1, t2) = (blocks(0, 4), blocks(4, 4));
    d.absorb(&t1, 0, &f[..7 * w]).unwrap();
    d.absorb(&t2, 0, &f[..12 * w]).unwrap();
    let both = d.draft_logits_with(&m, &[ctx(&t1, 7, TOKENS[7]), ctx(&t2, 12, TOKENS[12])]).unwrap();
    let a = d.draft_logits_with(&m, &[ctx(&t1, 7, TOKENS[7])]).unwrap();
    let b = d.draft_logits_with(&m, &[ctx(&t2, 12, TOKENS[12])]).unwrap();
    assert!(max_rel(&both[0], &a[0]) < 1e-5 && max_rel(&both[1], &b[0]) < 1e-5);
    // The anchor matters: another anchor drafts from other logits.
    let other = d.draft_logits_with(&m, &[ctx(&t1, 7, TOKENS[3])]).unwrap();
    assert!(max_rel(&other[0], &a[0]) > 1e-3);
}

#[test]
fn the_runner_hooks_draft_as_the_drafter_does() {
    let (_, mut d, f) = setup("hooks");
    let dir = write_drafter("hooks_runner", serde_json::json!({}), &[]);
    let mut m = load(&write_hybrid("dflash_hooks_target", Dtype::F32, false));
    assert_eq!(m.enable_dflash(&dir).unwrap(), BLOCK);
    let per_token = m.cache_spec().kv_bytes_per_token;
    m.allocate_caches(32, 4, 2).unwrap();
    let table: Vec<u32> = (0..4).collect();
    // A prompt in two chunks, as the engine absorbs them.
    for (start, end) in [(0, 6), (6, 11)] {
        m.forward(&StepBatch { seqs: vec![seq(&TOKENS[start..end], start, &table, 0, LogitsWanted::Last)] }).unwrap();
        m.dflash_absorb(&[DflashRows { chunk: 0, start_pos: start, rows: end - start, block_table: table.clone() }]).unwrap();
    }
    let draft_seq = |pos: usize, token: u32, k: usize, sampling: Option<DraftSampling>| DflashDraftSeq { pos, token, block_table: table.clone(), k, sampling };
    let drafts = m.dflash_draft(&[draft_seq(11, TOKENS[11], 3, None)]).unwrap();
    d.absorb(&table, 0, &f[..11 * 2 * H]).unwrap();
    let logits = d.draft_logits_with(&m, &[ctx(&table, 11, TOKENS[11])]).unwrap().remove(0);
    let want: Vec<u32> = (0..3).map(|j| argmax(&logits[j * VOCAB..(j + 1) * VOCAB])).collect();
    assert_eq!(drafts[0], MtpDraft { tokens: want, q: Vec::new() });
    // A sampled request's drafts: each depth drawn with its own uniform from the same logits
    // (to float rounding: the runner's context came from its forward in two chunks), with the
    // distribution it was drawn from.
    let warpers = RowSampling { temperature: 0.9, top_k: 7, ..Default::default() };
    let u = vec![0.1, 0.5, 0.93];
    let sampling = Some(DraftSampling { warpers: warpers.clone(), u: u.clone() });
    let sampled = m.dflash_draft(&[draft_seq(11, TOKENS[11], 3, sampling)]).unwrap().remove(0);
    let (tokens, q): (Vec<u32>, Vec<Vec<f32>>) = (0..3).map(|j| draw_draft(&logits[j * VOCAB..(j + 1) * VOCAB], &warpers, u[j])).unzip();
    assert_eq!((sampled.tokens.as_slice(), sampled.q.len()), (tokens.as_slice(), 3));
    for (got, want) in sampled.q.iter().zip(&q) {
        assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5), "{got:?} {want:?}");
    }
    assert!(sampled.q.iter().all(|q| q.iter().filter(|&&x| x > 0.0).count() <= 7), "top-k shapes q");
    let short = Some(DraftSampling { warpers, u: vec![0.5] });
    let e = m.dflash_draft(&[draft_seq(11, 1, 3, short)]).unwrap_err().to_string();
    assert!(e.contains("1 draft draws for 3 drafts"), "{e}");
    // The drafter's context counts in every token's KV bytes: 2 layers, K and V, 2 heads of 8.
    let mut plain = load(&write_hybrid("dflash_hooks_plain", Dtype::F32, false));
    plain.allocate_caches(32, 4, 2).unwrap();
    assert_eq!(per_token - plain.cache_spec().kv_bytes_per_token, 2 * 2 * 2 * 8 * 4);
    // ... and it is allocated with the pool, in its shape: 32 blocks of 4 positions, and
    // nothing per sequence beside it.
    assert_eq!(m.dflash_context_bytes(), Some(32 * 4 * 2 * 2 * 2 * 8 * 4));
    let e = m.dflash_draft(&[draft_seq(17, 1, 3, None)]).unwrap_err().to_string();
    assert!(e.contains("cover fewer than 17 positions"), "{e}");
    let e = m.dflash_draft(&[draft_seq(11, 1, BLOCK, None)]).unwrap_err().to_string();
    assert!(e.contains("block gives 4"), "{e}");
    // A one-token prompt drafts from an empty context.
    assert_eq!(m.dflash_draft(&[draft_seq(0, TOKENS[0], 2, None)]).unwrap()[0].tokens.len(), 2);
}

/// `ninfer plan --spec dflash --drafter DIR` counts the drafter as the engine's ledger does
/// (`plan::drafter`, which `DflashDrafter`'s own figures are): its weights by a hand count of
/// the tensors written, its context K/V in every token's bytes; a bad drafter is refused
/// naming `--drafter` before any ledger.
#[test]
fn the_memory_plan_counts_the_drafter_as_the_engine_does() {
    use crate::engine::EngineConfig;
    use crate::plan::{model_tensors, plan, PlanInput, PoolRule, Target};
    use crate::spec::SpecConfig;
    let target = write_hybrid("dflash_plan_target", Dtype::F32, false);
    let dir = write_drafter("plan", serde_json::json!({}), &[]);
    let mut m = load(&target);
    let plain = m.cache_spec();
    m.enable_dflash(&dir).unwrap();
    let cfg = m.config().clone();
    let store = crate::artifact::WeightStore::open(&target).unwrap();
    let tensors = model_tensors(&cfg, Some(&store)).unwrap();
    let engine = |drafter: &Path| EngineConfig { spec: Some(SpecConfig::with_drafter("dflash", Some(4), Some(drafter.to_path_buf())).unwrap()), ..Default::default() };
    let at = |t: Target, drafter: &Path| plan(&PlanInput { cfg: &cfg, tensors: &tensors, target: t, engine: engine(drafter), quantize: None, quantize_lm_head: false, memory: None, pool: PoolRule::PerSequence });
    let p = at(Target::Cpu, &dir).unwrap();
    assert_eq!(p.spec, m.cache_spec(), "the plan's ledger is the engine's");
    // fc [40, 80], two norms of 40; per layer two norms of 40, q [32, 40], k and v [16, 40],
    // o [40, 32], q/k norms of 8, gate and up [24, 40], down [40, 24]: f32 on the CPU.
    let layer = 2 * H + 32 * H + 2 * 16 * H + H * 32 + 2 * 8 + 2 * 24 * H + H * 24;
    let weights = 4 * (H * 2 * H + 2 * H + 2 * layer);
    let line = p.weights.iter().find(|w| w.format == "F32 DFlash drafter").expect("a drafter line");
    assert_eq!((line.bytes, line.tensors), (weights as u64, 3 + 2 * 11));
    assert_eq!(p.ledger.weight_bytes - plain.weight_bytes as u64, weights as u64);
    // Context: K and V of 2 layers of 2 KV heads of 8, f32.
    assert_eq!(p.spec.kv_bytes_per_token - plain.kv_bytes_per_token, 2 * 2 * 2 * 8 * 4);
    // A GPU holds them in bf16.
    let g = at(Target::Gpu, &dir).unwrap();
    assert_eq!(g.weights.iter().find(|w| w.format == "BF16 DFlash drafter").unwrap().bytes, weights as u64 / 2);
    // Drafts beyond the block (5 rows: at most 4) are refused as the engine refuses them.
    let over = EngineConfig { spec: Some(SpecConfig::with_drafter("dflash", Some(5), Some(dir.clone())).unwrap()), ..Default::default() };
    let e = plan(&PlanInput { cfg: &cfg, tensors: &tensors, target: Target::Cpu, engine: over, quantize: None, quantize_lm_head: false, memory: None, pool: PoolRule::PerSequence }).unwrap_err().to_string();
    assert!(e.contains("--draft-tokens") && e.contains("block of 5"), "{e}");
    for (bad, needle) in [(dir.join("missing"), "no such drafter directory"), (write_drafter("plan_short", serde_json::json!({}), &["norm.weight"]), "norm.weight")] {
        let e = at(Target::Cpu, &bad).unwrap_err().to_string();
        assert!(e.contains("--drafter") && e.contains(needle), "{e}");
    }
}
