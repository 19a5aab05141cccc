//! Step invariants of `CpuModel` on synthetic hybrid checkpoints (no oracle needed): chunked
//! prefill, token-by-token decode and mixed batches all equal one whole-prompt forward, and a
//! copied state slot continues exactly like the original.

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use crate::model::test_checkpoint::{centered_noise, mtp_tensor_shapes, tensor_shapes, TinyDims};
use crate::model::*;
use crate::NinferError;

fn rand_vec(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    centered_noise(len, seed).iter().map(|x| x * 2.0 * scale).collect()
}

/// Write a random Qwen3.5-style hybrid checkpoint (layers: linear, full, linear) to a temp dir.
fn hybrid_checkpoint(tag: &str) -> PathBuf {
    hybrid_checkpoint_as(tag, Dtype::F32)
}

/// As `hybrid_checkpoint`, every tensor stored as `dtype` (F32 or BF16).
fn hybrid_checkpoint_as(tag: &str, dtype: Dtype) -> PathBuf {
    write_hybrid(tag, dtype, false)
}

/// The hybrid checkpoint, with a random MTP head (`mtp.*`, one layer) when `mtp`.
pub(super) fn write_hybrid(tag: &str, dtype: Dtype, mtp: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ninfer_model_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (h, v, inter, nh, nkv, hd) = (40usize, 101usize, 56usize, 4usize, 2usize, 12usize);
    let (nk, nv, kd, vd, kern) = (2usize, 4usize, 8usize, 6usize, 4usize);
    let cfg = serde_json::json!({"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": 3, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": v,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"], "linear_num_key_heads": nk,
        "linear_num_value_heads": nv, "linear_key_head_dim": kd, "linear_value_head_dim": vd, "linear_conv_kernel_dim": kern,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "mtp_num_hidden_layers": if mtp { 1 } else { 0 }});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let dims = TinyDims { h, v, inter, nh, nkv, hd, nk, nv, kd, vd, kern };
    let mut t = tensor_shapes(&dims, "model", &["linear_attention", "full_attention", "linear_attention"], true, false);
    if mtp {
        t.extend(mtp_tensor_shapes(&dims));
    }
    let bufs: Vec<Vec<u8>> = t
        .iter()
        .enumerate()
        .map(|(i, (_, shape))| {
            let n: usize = shape.iter().product();
            let v = rand_vec(n, i as u64 + 11, 0.3);
            match dtype {
                Dtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            }
        })
        .collect();
    let views: Vec<(String, TensorView)> =
        t.iter().zip(&bufs).map(|((n, s), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap())).collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

pub(super) fn load(dir: &Path) -> CpuModel {
    load_logits(dir, LogitsDtype::Auto)
}

fn load_logits(dir: &Path, logits_dtype: LogitsDtype) -> CpuModel {
    let mut m = CpuModel::load(dir, &LoadOptions { device: "cpu".into(), num_threads: Some(2), logits_dtype, ..Default::default() }).unwrap();
    m.allocate_caches(32, 4, 4).unwrap();
    m
}

pub(super) fn seq(tokens: &[u32], start: usize, table: &[u32], slot: usize, logits: LogitsWanted) -> SeqChunk {
    SeqChunk { tokens: tokens.to_vec(), start_pos: start, block_table: table.to_vec(), state_slot: slot, logits }
}

pub(super) fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |d, (x, y)| d.max((x - y).abs())) / m
}

const PROMPT: [u32; 13] = [3, 17, 99, 4, 56, 23, 8, 71, 100, 0, 42, 5, 64];

fn whole(m: &mut CpuModel, table: &[u32]) -> Vec<f32> {
    m.forward(&StepBatch { seqs: vec![seq(&PROMPT, 0, table, 0, LogitsWanted::All)] }).unwrap().data
}

#[test]
fn chunked_prefill_and_decode_match_whole_prompt() {
    let dir = hybrid_checkpoint("chunks");
    let mut m = load(&dir);
    let table: Vec<u32> = vec![7, 2, 9, 30];
    let full = whole(&mut m, &table);
    let v = m.config().vocab_size;
    // Chunks of 5 and 4, then the last 4 tokens one by one (decode path).
    let mut got = Vec::new();
    let mut pos = 0;
    for len in [5usize, 4, 1, 1, 1, 1] {
        let out = m.forward(&StepBatch { seqs: vec![seq(&PROMPT[pos..pos + len], pos, &table, 1, LogitsWanted::All)] }).unwrap();
        assert_eq!(out.rows, vec![len]);
        got.extend_from_slice(&out.data);
        pos += len;
    }
    assert_eq!(got.len(), PROMPT.len() * v);
    assert!(max_rel(&got, &full) < 1e-4, "rel err {}", max_rel(&got, &full));
}

/// logits_dtype "auto" on a bf16 checkpoint: every logit (prefill rows and decode steps) is a
/// bf16 value (low 16 bits zero) and equals the "float32" logits rounded to nearest even, as
/// transformers' bf16 lm_head gives them; on an f32 checkpoint "auto" is f32.
#[test]
fn auto_logits_of_a_bf16_checkpoint_are_the_f32_logits_rounded_to_bf16() {
    let dir = hybrid_checkpoint_as("bf16logits", Dtype::BF16);
    let table: Vec<u32> = vec![7, 2, 9, 30];
    let steps = |m: &mut CpuModel| {
        let mut out = whole(m, &table);
        for (i, &t) in [5u32, 77, 13].iter().enumerate() {
            let s = seq(&[t], PROMPT.len() + i, &table, 0, LogitsWanted::Last);
            out.extend(m.forward(&StepBatch { seqs: vec![s] }).unwrap().data);
        }
        out
    };
    let auto = steps(&mut load_logits(&dir, LogitsDtype::Auto));
    let f32s = steps(&mut load_logits(&dir, LogitsDtype::Float32));
    assert_eq!(auto.len(), (PROMPT.len() + 3) * 101);
    assert!(auto.iter().all(|x| x.to_bits() & 0xffff == 0), "auto logits must be bf16 values");
    assert!(f32s.iter().any(|x| x.to_bits() & 0xffff != 0), "float32 logits must keep their low bits");
    for (i, (a, f)) in auto.iter().zip(&f32s).enumerate() {
        assert_eq!(a.to_bits(), half::bf16::from_f32(*f).to_f32().to_bits(), "logit {i}: auto {a} vs round(float32 {f})");
    }
    let dir32 = hybrid_checkpoint("f32logits");
    let a32 = whole(&mut load_logits(&dir32, LogitsDtype::Auto), &table);
    let f32b = whole(&mut load_logits(&dir32, LogitsDtype::Float32), &table);
    assert!(a32.iter().zip(&f32b).all(|(a, b)| a.to_bits() == b.to_bits()), "auto on an f32 checkpoint is f32");
}

#[test]
fn mixed_batch_matches_each_sequence_alone() {
    let dir = hybrid_checkpoint("batch");
    let mut m = load(&dir);
    let v = m.config().vocab_size;
    let (ta, tb): (Vec<u32>, Vec<u32>) = (vec![0, 1, 2, 3], vec![10, 11, 12, 13]);
    let full_a = whole(&mut m, &ta);
    let other: Vec<u32> = vec![9, 8, 7, 6, 5, 4];
    let alone_b = m.forward(&StepBatch { seqs: vec![seq(&other, 0, &tb, 2, LogitsWanted::All)] }).unwrap().data;
    // A: prefill 10 tokens then decode token 11; B in the same steps: prefill 5 then decode 1.
    let s1 = m
        .forward(&StepBatch { seqs: vec![seq(&PROMPT[..10], 0, &ta, 0, LogitsWanted::None), seq(&other[..5], 0, &tb, 3, LogitsWanted::Last)] })
        .unwrap();
    assert_eq!(s1.rows, vec![0, 1]);
    assert!(max_rel(s1.of_seq(1), &alone_b[4 * v..5 * v]) < 1e-4);
    let s2 = m
        .forward(&StepBatch { seqs: vec![seq(&other[5..6], 5, &tb, 3, LogitsWanted::Last), seq(&PROMPT[10..11], 10, &ta, 0, LogitsWanted::Last)] })
        .unwrap();
    assert!(max_rel(s2.of_seq(0), &alone_b[5 * v..6 * v]) < 1e-4);
    assert!(max_rel(s2.of_seq(1), &full_a[10 * v..11 * v]) < 1e-4);
}

#[test]
fn copied_state_slot_continues_like_the_original() {
    let dir = hybrid_checkpoint("copy");
    let mut m = load(&dir);
    let table: Vec<u32> = vec![4, 5, 6, 7];
    let full = whole(&mut m, &table);
    let v = m.config().vocab_size;
    m.forward(&StepBatch { seqs: vec![seq(&PROMPT[..8], 0, &table, 1, LogitsWanted::None)] }).unwrap();
    m.copy_state(1, 2).unwrap();
    // Clobber slot 1 with another sequence; slot 2 (the copy) must still hold the prefix state.
    m.forward(&StepBatch { seqs: vec![seq(&[1, 2, 3], 0, &[20], 1, LogitsWanted::None)] }).unwrap();
    let out = m.forward(&StepBatch { seqs: vec![seq(&PROMPT[8..], 8, &table, 2, LogitsWanted::All)] }).unwrap();
    assert!(max_rel(&out.data, &full[8 * v..]) < 1e-4);
    assert!(m.copy_state(1, 4).is_err());
}

#[test]
fn bad_block_table_and_slot_are_rejected() {
    let dir = hybrid_checkpoint("bad");
    let mut m = load(&dir);
    let short = m.forward(&StepBatch { seqs: vec![seq(&PROMPT, 0, &[0, 1], 0, LogitsWanted::Last)] });
    assert!(matches!(short, Err(NinferError::InvalidRequest { .. })));
    let slot = m.forward(&StepBatch { seqs: vec![seq(&PROMPT[..2], 0, &[0], 9, LogitsWanted::Last)] });
    assert!(matches!(slot, Err(NinferError::InvalidRequest { .. })));
    let twice = m.forward(&StepBatch { seqs: vec![seq(&[1], 0, &[0], 1, LogitsWanted::Last), seq(&[2], 0, &[1], 1, LogitsWanted::Last)] });
    assert!(matches!(twice, Err(NinferError::InvalidRequest { .. })));
    let tok = m.forward(&StepBatch { seqs: vec![seq(&[500], 0, &[0], 0, LogitsWanted::Last)] });
    assert!(matches!(tok, Err(NinferError::InvalidRequest { .. })));
    // No GPU here (or a checkpoint the CUDA kernels do not take): a typed error, never a panic.
    let cuda = load_model(&dir, &LoadOptions { device: "cuda".into(), num_threads: None, ..Default::default() });
    assert!(matches!(cuda, Err(NinferError::Device(_) | NinferError::Unsupported(_))));
}

/// The CPU keeps its KV cache in f32: kv_dtype float32 (and auto) load, bf16 is refused naming
/// float32, before the directory is read (a path with nothing in it gives the same error).
#[test]
fn cpu_kv_dtype_is_float32_and_another_is_refused_before_reading() {
    let dir = hybrid_checkpoint("kv_dtype");
    let opts = |kv_dtype| LoadOptions { device: "cpu".into(), num_threads: Some(2), kv_dtype, ..Default::default() };
    assert!(CpuModel::load(&dir, &opts(KvDtype::Float32)).is_ok());
    let e = CpuModel::load(&dir, &opts(KvDtype::Bf16)).err().expect("bf16 refused on the CPU").to_string();
    assert!(e.contains("bf16 is not supported on cpu: its KV cache is float32"), "{e}");
    let nothing = CpuModel::load(&dir.join("absent"), &opts(KvDtype::F16)).err().expect("refused").to_string();
    assert!(nothing.contains("f16 is not supported on cpu"), "{nothing}");
}

/// The recurrent state (conv and delta, every GDN layer) of `slot`, bit patterns.
fn state_bits(m: &CpuModel, slot: usize) -> Vec<u32> {
    let c = &m.caches;
    c.conv.iter().chain(&c.delta).flat_map(|buf| {
        let per = buf.len() / c.num_slots;
        buf[slot * per..(slot + 1) * per].iter().map(|x| x.to_bits())
    }).collect()
}

/// Speculative rollback by recompute (engine/speculation.rs): a verify chunk of the input token
/// and 3 drafts, then the state kept before it restored and the input plus the one accepted
/// draft run again, leaves exactly the state of running those two tokens without the detour,
/// bit for bit; and the KV of the rejected positions does not leak into what follows.
#[test]
fn rollback_after_a_rejected_draft_restores_the_exact_state_of_a_plain_run() {
    let dir = hybrid_checkpoint("rollback");
    let mut m = load(&dir);
    let table: Vec<u32> = vec![4, 5, 6, 7];
    let prefix = &PROMPT[..8];
    // Plain: the prefix, then input 71 and accepted draft 100 as one chunk, then the next token.
    m.forward(&StepBatch { seqs: vec![seq(prefix, 0, &table, 0, LogitsWanted::None)] }).unwrap();
    m.forward(&StepBatch { seqs: vec![seq(&[71, 100], 8, &table, 0, LogitsWanted::None)] }).unwrap();
    let plain_state = state_bits(&m, 0);
    let plain_next = m.forward(&StepBatch { seqs: vec![seq(&[9], 10, &table, 0, LogitsWanted::All)] }).unwrap().data;
    // Speculative: verify [71, 100, 33, 44] in slot 1, keep slot 1 in slot 3 first.
    let table2: Vec<u32> = vec![10, 11, 12, 13];
    m.forward(&StepBatch { seqs: vec![seq(prefix, 0, &table2, 1, LogitsWanted::None)] }).unwrap();
    m.copy_state(1, 3).unwrap();
    let verify = m.forward(&StepBatch { seqs: vec![seq(&[71, 100, 33, 44], 8, &table2, 1, LogitsWanted::All)] }).unwrap();
    assert_eq!(verify.rows, vec![4]);
    assert_ne!(state_bits(&m, 1), plain_state, "the verify pass ran past the accepted tokens");
    m.copy_state(3, 1).unwrap();
    m.forward(&StepBatch { seqs: vec![seq(&[71, 100], 8, &table2, 1, LogitsWanted::None)] }).unwrap();
    assert_eq!(state_bits(&m, 1), plain_state, "the rolled-back state is the plain run's, bit for bit");
    let spec_next = m.forward(&StepBatch { seqs: vec![seq(&[9], 10, &table2, 1, LogitsWanted::All)] }).unwrap().data;
    assert!(spec_next.iter().zip(&plain_next).all(|(a, b)| a.to_bits() == b.to_bits()), "the next token's logits are the plain run's");
}

/// Rollback by replay (model/cpu/replay.rs): the state rebuilt from the inputs a verify forward
/// kept, for every accepted length of the chunk (the input token alone up to all drafts), is
/// recompute's within f32 rounding (a projection's sums over the verify step's rows and over
/// the recompute's fewer rows differ in the last bits, so exact equality is not to be had),
/// and bit for bit the verify forward's own state after the whole chunk; split at a boundary as
/// a snapshot splits it, it is the unsplit replay bit for bit. The verify chunk shares its step
/// with another sequence's decode.
#[test]
fn replayed_states_equal_recompute_for_every_accepted_length() {
    let dir = hybrid_checkpoint("replay");
    let mut m = CpuModel::load(&dir, &LoadOptions { device: "cpu".into(), num_threads: Some(2), ..Default::default() }).unwrap();
    m.allocate_caches(32, 4, 8).unwrap();
    let before = m.workspace_bytes();
    assert!(m.enable_state_replay(2, 5).unwrap());
    assert!(m.workspace_bytes() > before, "the kept inputs count in the workspace");
    let (table, other): (Vec<u32>, Vec<u32>) = (vec![4, 5, 6, 7], vec![10, 11, 12, 13]);
    let prefix = &PROMPT[..8];
    m.forward(&StepBatch { seqs: vec![seq(prefix, 0, &table, 0, LogitsWanted::None), seq(&PROMPT[..5], 0, &other, 1, LogitsWanted::None)] }).unwrap();
    m.copy_state(0, 6).unwrap();
    let chunk = [71, 100, 33, 44, 2];
    m.keep_replay_inputs(&[1]).unwrap();
    m.forward(&StepBatch { seqs: vec![seq(&[9], 5, &other, 1, LogitsWanted::Last), seq(&chunk, 8, &table, 0, LogitsWanted::All)] }).unwrap();
    let verified = state_bits(&m, 0);
    let floats = |bits: &[u32]| bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>();
    let replay = |src, dst, start, tokens| StateReplay { kept: 0, src, dst, start, tokens };
    for n in 1..=chunk.len() {
        m.copy_state(6, 2).unwrap();
        m.forward(&StepBatch { seqs: vec![seq(&chunk[..n], 8, &table, 2, LogitsWanted::None)] }).unwrap();
        let recomputed = state_bits(&m, 2);
        m.replay_states(&[replay(6, 3, 0, n)]).unwrap();
        let replayed = state_bits(&m, 3);
        assert_ne!(replayed, state_bits(&m, 6), "{n} tokens moved the state");
        let d = max_rel(&floats(&replayed), &floats(&recomputed));
        assert!(d < 1e-5, "{n} tokens replayed: {d} from recompute");
        if n == chunk.len() {
            assert_eq!(replayed, verified, "the whole chunk replayed is the verify forward's state");
        }
        for at in 1..n {
            m.replay_states(&[replay(6, 4, 0, at)]).unwrap();
            m.replay_states(&[replay(4, 5, at, n - at)]).unwrap();
            assert_eq!(state_bits(&m, 5), replayed, "{n} tokens replayed in two parts at {at}");
        }
    }
    // Replays of one call run at once: a destination is never a source, nor kept twice.
    assert!(m.replay_states(&[replay(6, 3, 0, 2), replay(3, 4, 2, 1)]).is_err());
    assert!(m.replay_states(&[replay(6, 3, 0, 6)]).is_err(), "past the kept chunk");
    assert!(m.replay_states(&[StateReplay { kept: 1, ..replay(6, 3, 0, 1) }]).is_err(), "one chunk was kept");
}
