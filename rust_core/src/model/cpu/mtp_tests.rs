//! The MTP drafter's invariants on a synthetic hybrid checkpoint with a random MTP head:
//! absorbing in chunks equals one call, rolling back and redrafting equals drafting fresh, a
//! batch equals each sequence alone, the forward's hidden states leave its logits as they
//! were, and the runner's hook (`ModelRunner::mtp_absorb` / `mtp_draft`) drafts as the drafter
//! does from the same rows. Parity with a torch definition of the head is in tests/test_mtp_head.py.

use safetensors::tensor::Dtype;

use super::mtp::{Draft, MtpDrafter, MtpSeq, NO_MTP_WEIGHTS};
use super::tests::{load, max_rel, seq, write_hybrid};
use crate::model::*;
use crate::sampling::argmax;
use crate::NinferError;

const TOKENS: [u32; 16] = [3, 17, 99, 4, 56, 23, 8, 71, 100, 0, 42, 5, 64, 9, 31, 77];

/// The model (KV pool of 32 blocks of 4), a drafter on the same pool shape, and the target's
/// hidden states `[16, hidden]` of `TOKENS` (block table `table`).
fn setup(tag: &str, table: &[u32]) -> (CpuModel, MtpDrafter, Vec<f32>) {
    let dir = write_hybrid(tag, Dtype::F32, true);
    let mut m = load(&dir);
    let mut d = MtpDrafter::new(&m).unwrap();
    d.allocate(&m, 32, 4).unwrap();
    let mut hidden = Vec::new();
    m.forward_with_hidden(&StepBatch { seqs: vec![seq(&TOKENS, 0, table, 0, LogitsWanted::All)] }, &mut hidden).unwrap();
    (m, d, hidden)
}

/// Rows `from..to` of the sequence: hidden states at those positions, the tokens after them.
fn rows<'a>(table: &'a [u32], hidden: &'a [f32], h: usize, from: usize, to: usize) -> MtpSeq<'a> {
    MtpSeq { block_table: table, start_pos: from, hidden: &hidden[from * h..to * h], next_tokens: &TOKENS[from + 1..to + 1] }
}

fn greedy(m: &CpuModel, d: &mut MtpDrafter, seqs: &[MtpSeq<'_>], k: usize) -> Vec<Vec<Draft>> {
    d.draft(m, seqs, k, &mut |_, _, l| argmax(l)).unwrap()
}

fn assert_same(a: &[Draft], b: &[Draft]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.token, y.token, "draft {i}");
        assert!(max_rel(&x.logits, &y.logits) < 1e-5, "draft {i}: rel err {}", max_rel(&x.logits, &y.logits));
    }
}

#[test]
fn a_checkpoint_without_mtp_weights_is_refused_naming_the_flag() {
    let m = load(&write_hybrid("mtp_none", Dtype::F32, false));
    let e = MtpDrafter::new(&m).err().expect("refused").to_string();
    assert!(e.contains(NO_MTP_WEIGHTS), "{e}");
}

#[test]
fn hidden_states_leave_the_logits_unchanged_and_feed_the_lm_head() {
    let table: Vec<u32> = vec![7, 2, 9, 30];
    let (mut m, _, hidden) = setup("mtp_hidden", &table);
    let h = m.config().hidden_size;
    let plain = m.forward(&StepBatch { seqs: vec![seq(&TOKENS, 0, &table, 0, LogitsWanted::All)] }).unwrap();
    let mut again = Vec::new();
    let with = m.forward_with_hidden(&StepBatch { seqs: vec![seq(&TOKENS, 0, &table, 0, LogitsWanted::All)] }, &mut again).unwrap();
    assert_eq!(plain.rows, with.rows);
    assert!(plain.data.iter().zip(&with.data).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(hidden.len(), TOKENS.len() * h);
    assert_eq!(hidden, again);
    // Every row's hidden state times the lm_head is that row's logits.
    let v = m.config().vocab_size;
    let mut logits = vec![0f32; TOKENS.len() * v];
    m.weights.lm_head_forward(&hidden, TOKENS.len(), h, v, &mut logits);
    assert!(max_rel(&logits, &plain.data) < 1e-5, "rel err {}", max_rel(&logits, &plain.data));
}

#[test]
fn absorbing_in_chunks_equals_one_call() {
    let table: Vec<u32> = vec![7, 2, 9, 30, 11];
    let (m, mut one, hidden) = setup("mtp_chunks", &table);
    let h = m.config().hidden_size;
    let whole = greedy(&m, &mut one, &[rows(&table, &hidden, h, 0, 12)], 3);
    let mut chunked = MtpDrafter::new(&m).unwrap();
    chunked.allocate(&m, 32, 4).unwrap();
    assert!(greedy(&m, &mut chunked, &[rows(&table, &hidden, h, 0, 5)], 0)[0].is_empty());
    greedy(&m, &mut chunked, &[rows(&table, &hidden, h, 5, 9)], 0);
    let last = greedy(&m, &mut chunked, &[rows(&table, &hidden, h, 9, 12)], 3);
    assert_eq!(whole[0].len(), 3);
    assert_same(&whole[0], &last[0]);
}

/// Drafting writes speculative MTP rows past the accepted length; drafting again from an
/// earlier position (a rejected draft) gives what a drafter that never saw them gives.
#[test]
fn rolling_back_and_redrafting_equals_drafting_fresh() {
    let table: Vec<u32> = vec![4, 5, 6, 7, 8];
    let (m, mut rolled, hidden) = setup("mtp_rollback", &table);
    let h = m.config().hidden_size;
    let first = greedy(&m, &mut rolled, &[rows(&table, &hidden, h, 0, 8)], 5);
    assert_eq!(first[0].len(), 5);
    // One draft "accepted": the target's rows 8..10 replace the speculative rows from 8 on.
    let redrafted = greedy(&m, &mut rolled, &[rows(&table, &hidden, h, 8, 10)], 3);
    let mut fresh = MtpDrafter::new(&m).unwrap();
    fresh.allocate(&m, 32, 4).unwrap();
    let expected = greedy(&m, &mut fresh, &[rows(&table, &hidden, h, 0, 10)], 3);
    assert_same(&redrafted[0], &expected[0]);
}

#[test]
fn a_batch_of_sequences_drafts_as_each_alone() {
    let (ta, tb): (Vec<u32>, Vec<u32>) = (vec![0, 1, 2, 3, 4], vec![10, 11, 12, 13, 14]);
    let (mut m, mut d, ha) = setup("mtp_batch", &ta);
    let h = m.config().hidden_size;
    let mut hb = Vec::new();
    m.forward_with_hidden(&StepBatch { seqs: vec![seq(&TOKENS, 0, &tb, 1, LogitsWanted::None)] }, &mut hb).unwrap();
    assert_eq!(ha, hb, "the hidden states do not depend on where the KV lives");
    let alone_a = greedy(&m, &mut d, &[rows(&ta, &ha, h, 0, 11)], 4);
    let alone_b = greedy(&m, &mut d, &[rows(&tb, &hb, h, 0, 6)], 4);
    // Different lengths in one batch, the pool's earlier contents overwritten where re-used.
    let both = greedy(&m, &mut d, &[rows(&ta, &ha, h, 0, 11), rows(&tb, &hb, h, 0, 6)], 4);
    assert_same(&both[0], &alone_a[0]);
    assert_same(&both[1], &alone_b[0]);
    let mut picked = Vec::new();
    d.draft(&m, &[rows(&ta, &ha, h, 10, 11), rows(&tb, &hb, h, 5, 6)], 2, &mut |s, depth, l| {
        picked.push((s, depth));
        argmax(l)
    })
    .unwrap();
    assert_eq!(picked, vec![(0, 0), (1, 0), (0, 1), (1, 1)]);
}

#[test]
fn bad_rows_and_short_block_tables_are_rejected() {
    let table: Vec<u32> = vec![0, 1, 2];
    let (m, mut d, hidden) = setup("mtp_bad", &[0, 1, 2, 3]);
    let h = m.config().hidden_size;
    let mut pick = |_: usize, _: usize, l: &[f32]| argmax(l);
    // 10 rows then 4 drafts write positions 0..=12 (the last draft writes none): three blocks
    // of 4 hold 12 positions.
    let short = d.draft(&m, &[rows(&table, &hidden, h, 0, 10)], 4, &mut pick);
    assert!(matches!(short, Err(NinferError::InvalidRequest { .. })), "{short:?}");
    assert!(d.draft(&m, &[rows(&table, &hidden, h, 0, 10)], 3, &mut pick).is_ok());
    let wrong = MtpSeq { block_table: &table, start_pos: 0, hidden: &hidden[..h], next_tokens: &[1, 2] };
    assert!(d.draft(&m, &[wrong], 1, &mut pick).is_err());
    let tok = MtpSeq { block_table: &table, start_pos: 0, hidden: &hidden[..h], next_tokens: &[500] };
    assert!(d.draft(&m, &[tok], 1, &mut pick).is_err());
    let mut unallocated = MtpDrafter::new(&m).unwrap();
    assert!(unallocated.draft(&m, &[rows(&table, &hidden, h, 0, 2)], 1, &mut pick).is_err());
}

/// The runner's hook: rows absorbed from a prompt chunk's forward, then from the kept rows of a
/// verify chunk, draft what a drafter given all those rows at once drafts.
#[test]
fn the_runners_hook_drafts_as_the_drafter_given_the_same_rows() {
    let table: Vec<u32> = vec![7, 2, 9, 30, 11];
    let (fresh_model, mut fresh, hidden) = setup("mtp_hook", &table);
    let h = fresh_model.config().hidden_size;
    let mut m = load(&write_hybrid("mtp_hook_runner", Dtype::F32, true));
    let plain_kv = m.cache_spec().kv_bytes_per_token;
    m.enable_mtp().unwrap();
    assert_eq!(m.cache_spec().kv_bytes_per_token, plain_kv + MtpDrafter::kv_bytes_per_token(&m), "the ledger counts the MTP KV");
    m.allocate_caches(32, 4, 2).unwrap();
    let at = |pos: usize, k: usize| MtpDraftSeq { key: 9, pos, token: TOKENS[pos], block_table: table.clone(), k, sampling: None };
    // Nothing absorbed yet: no row to draft from.
    assert!(m.mtp_draft(&[at(10, 3)]).is_err());
    // The prompt TOKENS[..10] in one chunk; every row absorbed with the token after it.
    m.forward(&StepBatch { seqs: vec![seq(&TOKENS[..10], 0, &table, 0, LogitsWanted::Last)] }).unwrap();
    m.mtp_absorb(&[MtpRows { key: 9, chunk: 0, start_pos: 0, next_tokens: TOKENS[1..11].to_vec(), block_table: table.clone() }]).unwrap();
    let drafts = m.mtp_draft(&[at(10, 3)]).unwrap();
    let expected = greedy(&fresh_model, &mut fresh, &[rows(&table, &hidden, h, 0, 10)], 3);
    assert_eq!(drafts[0].tokens, expected[0].iter().map(|d| d.token).collect::<Vec<_>>());
    assert!(drafts[0].q.is_empty(), "greedy drafts carry no distribution");
    // A verify chunk at 10 of which two rows are kept (the input and one accepted draft): the
    // next drafts start at 12, past the recursion's rows of the round before.
    m.forward(&StepBatch { seqs: vec![seq(&TOKENS[10..14], 10, &table, 0, LogitsWanted::All)] }).unwrap();
    m.mtp_absorb(&[MtpRows { key: 9, chunk: 0, start_pos: 10, next_tokens: TOKENS[11..13].to_vec(), block_table: table.clone() }]).unwrap();
    assert!(m.mtp_draft(&[at(11, 2)]).is_err(), "drafts start after the last absorbed row only");
    let both = m.mtp_draft(&[at(12, 2), MtpDraftSeq { k: 0, ..at(12, 0) }]).unwrap();
    let mut fresh = MtpDrafter::new(&fresh_model).unwrap();
    fresh.allocate(&fresh_model, 32, 4).unwrap();
    let expected = greedy(&fresh_model, &mut fresh, &[rows(&table, &hidden, h, 0, 12)], 2);
    assert_eq!(both[0].tokens, expected[0].iter().map(|d| d.token).collect::<Vec<_>>());
    assert!(both[1].tokens.is_empty());
    // Sampled drafts: each drawn with its uniform from the head's logits under the warpers,
    // as `spec::draw_draft` draws from the logits the drafter gives.
    let warpers = crate::spec::draft_warpers(&crate::sampling::SamplingParams { temperature: 1.5, top_k: 40, ..Default::default() });
    let u = vec![0.9, 0.1];
    let sampled = m.mtp_draft(&[MtpDraftSeq { sampling: Some(DraftSampling { warpers: warpers.clone(), u: u.clone() }), ..at(12, 2) }]).unwrap();
    let mut depth = 0;
    let mut fresh = MtpDrafter::new(&fresh_model).unwrap();
    fresh.allocate(&fresh_model, 32, 4).unwrap();
    let mut pick = |_: usize, _: usize, l: &[f32]| {
        let t = crate::spec::draw_draft(l, &warpers, u[depth]).0;
        depth += 1;
        t
    };
    let expected = fresh.draft(&fresh_model, &[rows(&table, &hidden, h, 0, 12)], 2, &mut pick).unwrap();
    assert_eq!(sampled[0].tokens, expected[0].iter().map(|d| d.token).collect::<Vec<_>>());
    assert_eq!(sampled[0].q.len(), 2);
    for (q, d) in sampled[0].q.iter().zip(&expected[0]) {
        let want = crate::spec::draw_draft(&d.logits, &warpers, 0.0).1;
        assert!(q.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "q is the warped distribution of the head's logits");
        assert!((q.iter().map(|&x| x as f64).sum::<f64>() - 1.0).abs() < 1e-4 && q.iter().filter(|&&x| x > 0.0).count() <= 40);
    }
    let e = m.mtp_draft(&[MtpDraftSeq { sampling: Some(DraftSampling { warpers, u: vec![0.5] }), ..at(12, 2) }]).unwrap_err().to_string();
    assert!(e.contains("draws"), "{e}");
    // Rows past the last forward's chunk are refused; a released sequence has no row left.
    let too_many = MtpRows { key: 9, chunk: 0, start_pos: 10, next_tokens: TOKENS[11..16].to_vec(), block_table: table.clone() };
    assert!(m.mtp_absorb(&[too_many]).is_err());
    m.mtp_release(9);
    assert!(m.mtp_draft(&[at(12, 2)]).is_err());
}

#[test]
fn the_runner_refuses_mtp_without_mtp_weights() {
    let mut m = load(&write_hybrid("mtp_hook_none", Dtype::F32, false));
    let e = m.enable_mtp().unwrap_err().to_string();
    assert!(e.contains(NO_MTP_WEIGHTS), "{e}");
    assert!(m.mtp_absorb(&[]).is_err() && m.mtp_draft(&[]).is_err());
}

/// `--lm-head-draft`: the MTP logits over a draft vocabulary are the full head's at those ids
/// (-inf elsewhere), so the draft is the argmax among them; a vocabulary of every id drafts as
/// the full head does.
#[test]
fn a_reduced_draft_vocabulary_drafts_the_argmax_among_its_ids() {
    let table: Vec<u32> = (0..8).collect();
    let (m, mut d, hidden) = setup("mtp_reduced", &table);
    let (h, v) = (m.config().hidden_size, m.config().vocab_size);
    let full = greedy(&m, &mut d, &[rows(&table, &hidden, h, 0, 10)], 3);
    let every: Vec<u32> = (0..v as u32).rev().collect();
    d.set_draft_vocab(&m, &every).unwrap();
    assert_same(&greedy(&m, &mut d, &[rows(&table, &hidden, h, 0, 10)], 3)[0], &full[0]);
    // Every third id: the first draft is the full head's argmax among them.
    let some: Vec<u32> = (0..v as u32).step_by(3).collect();
    d.set_draft_vocab(&m, &some).unwrap();
    let reduced = greedy(&m, &mut d, &[rows(&table, &hidden, h, 0, 10)], 3);
    let first = &full[0][0].logits;
    let best = *some.iter().max_by(|&&a, &&b| first[a as usize].total_cmp(&first[b as usize]).then(b.cmp(&a))).unwrap();
    assert_eq!(reduced[0][0].token, best);
    for (t, l) in full[0][0].logits.iter().enumerate() {
        let r = reduced[0][0].logits[t];
        if t % 3 == 0 {
            assert!((r - l).abs() <= 1e-5 * l.abs().max(1.0), "id {t}: {r} vs {l}");
        } else {
            assert_eq!(r, f32::NEG_INFINITY, "id {t}");
        }
    }
    assert!(reduced[0].iter().all(|x| x.token % 3 == 0));
    for bad in [vec![], vec![1, 1], vec![v as u32]] {
        assert!(d.set_draft_vocab(&m, &bad).unwrap_err().to_string().contains("--lm-head-draft"), "{bad:?}");
    }
}

/// `--lm-head-draft` over a quantized LM head (`--quantize-lm-head`): the head's rows of the
/// draft vocabulary are decoded once, so the drafts are the full quantized head's argmax among
/// those ids with its logits there, and a vocabulary of every id drafts as the full head does.
#[test]
fn a_reduced_draft_vocabulary_over_a_quantized_head_drafts_as_the_full_head_among_its_ids() {
    use crate::quant::QuantizeMode;
    let dir = write_hybrid("mtp_reduced_quant", Dtype::F32, true);
    let table: Vec<u32> = (0..8).collect();
    for mode in [QuantizeMode::W8, QuantizeMode::Q4, QuantizeMode::Fp8] {
        let opts = LoadOptions { device: "cpu".into(), num_threads: Some(2), quantize: Some(mode), quantize_lm_head: true, ..Default::default() };
        let mut m = CpuModel::load(&dir, &opts).unwrap();
        m.allocate_caches(32, 4, 4).unwrap();
        assert!(m.weights.lm_head_dense().is_none(), "{mode:?}: the head is quantized");
        let mut d = MtpDrafter::new(&m).unwrap();
        d.allocate(&m, 32, 4).unwrap();
        let mut hidden = Vec::new();
        m.forward_with_hidden(&StepBatch { seqs: vec![seq(&TOKENS, 0, &table, 0, LogitsWanted::All)] }, &mut hidden).unwrap();
        let (h, v) = (m.config().hidden_size, m.config().vocab_size);
        let full = greedy(&m, &mut d, &[rows(&table, &hidden, h, 0, 10)], 3);
        let some: Vec<u32> = (1..v as u32).step_by(3).collect();
        d.set_draft_vocab(&m, &some).unwrap();
        let reduced = greedy(&m, &mut d, &[rows(&table, &hidden, h, 0, 10)], 3);
        let first = &full[0][0].logits;
        let best = *some.iter().max_by(|&&a, &&b| first[a as usize].total_cmp(&first[b as usize]).then(b.cmp(&a))).unwrap();
        assert_eq!(reduced[0][0].token, best, "{mode:?}");
        for (t, l) in first.iter().enumerate() {
            let r = reduced[0][0].logits[t];
            if t % 3 == 1 {
                assert!((r - l).abs() <= 1e-5 * l.abs().max(1.0), "{mode:?} id {t}: {r} vs {l}");
            } else {
                assert_eq!(r, f32::NEG_INFINITY, "{mode:?} id {t}");
            }
        }
        assert!(reduced[0].iter().all(|x| x.token % 3 == 1), "{mode:?}");
        let every: Vec<u32> = (0..v as u32).rev().collect();
        d.set_draft_vocab(&m, &every).unwrap();
        assert_same(&greedy(&m, &mut d, &[rows(&table, &hidden, h, 0, 10)], 3)[0], &full[0]);
        // A step wanting no logits (a round's recomputed rows) runs no head.
        let none = m.forward(&StepBatch { seqs: vec![seq(&TOKENS[..4], 0, &table, 1, LogitsWanted::None)] }).unwrap();
        assert!(none.data.is_empty(), "{mode:?}");
    }
}
