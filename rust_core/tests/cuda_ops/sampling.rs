//! Device sampler (`sample_rows`) against the host reference sampler (`RowSampling::sample`):
//! greedy ids, tokens for the same uniform draw, raw logprobs, and the sampled distribution.
//!
//! Caveat tested around: the host sums f64 weights in order, the device sums 2^-44 fixed-point
//! weights computed with f32 `expf`, so a draw u within about 1e-6 of a CDF boundary may pick the
//! neighbouring token. The same-u test therefore compares only draws where the host gives the
//! same token at u - 1e-5 and u + 1e-5, and requires that to hold for nearly every draw.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::{sample_scan_blocks, PackedSampling, SampleScratch, SAMPLE_OUT, SAMPLE_SCAN_SPAN};
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};
use ninfer_core::sampling::{raw_logprobs, PenaltyParams, RowSampling, SampledToken};
use ninfer_core::NinferError;

use super::harness::{check, gpu, upload_raw, Rng, GUARD, TOL32};
use super::time_ms;

const OUT_GUARD: u32 = 0xdead_beef;

/// Run `sample_rows` for `rows` (row i samples logits row `src[i]`), checking the output guard.
fn device_sample(dev: &CudaDevice, logits: &CudaSlice<f32>, vocab: usize, rows: &[RowSampling], src: &[usize]) -> Vec<SampledToken> {
    device_sample_fed(dev, logits, vocab, rows, src, None)
}

/// `device_sample` of a step whose input ids are `fed` (row r's is `fed[r]`, which the rows
/// that `count_input` count as one more output).
fn device_sample_fed(dev: &CudaDevice, logits: &CudaSlice<f32>, vocab: usize, rows: &[RowSampling], src: &[usize], fed: Option<&[i32]>) -> Vec<SampledToken> {
    let mut packed = PackedSampling::default();
    packed.pack(rows, src, vocab).unwrap();
    let params = upload_raw(dev, packed.words());
    let fed = fed.map(|f| upload_raw(dev, f));
    let fed_view = fed.as_ref().map(|f| f.slice(0..f.len()));
    let fed = fed_view.as_ref();
    let mut scratch = SampleScratch::new(dev, rows.len(), vocab).unwrap();
    let n = rows.len() * SAMPLE_OUT;
    let mut out = upload_raw(dev, &vec![OUT_GUARD; n + GUARD]);
    dev.sample_rows(logits, &packed, &params, fed, &mut scratch, &mut out.slice_mut(0..n)).unwrap();
    dev.synchronize().unwrap();
    let host = dev.stream().clone_dtoh(&out).unwrap();
    assert!(host[n..].iter().all(|&g| g == OUT_GUARD), "sample_rows wrote past its output");
    packed.unpack(&host[..n]).unwrap()
}

/// A uniform draw in [0, 1) with 48 random bits.
fn draw(rng: &mut Rng) -> f64 {
    rng.unit() as f64 + rng.unit() as f64 / 16_777_216.0
}

/// Random logits processors for a row over `vocab`: bias, penalties with history, grammar mask.
fn processors(rng: &mut Rng, vocab: usize, row: &mut RowSampling, which: usize) {
    if which & 1 != 0 {
        row.logit_bias = rng.permutation(vocab).into_iter().take(5).map(|t| (t as u32, rng.range(-8.0, 8.0))).collect();
    }
    if which & 2 != 0 {
        row.penalties = PenaltyParams { repetition: 1.3, presence: 0.4, frequency: 0.3 };
        let mut pen: Vec<(u32, u32)> = rng.permutation(vocab).into_iter().take(vocab.min(40)).map(|t| (t as u32, rng.below(4) as u32)).collect();
        pen.sort_unstable();
        row.penalized = pen;
    }
    if which & 4 != 0 {
        let mut words: Vec<u32> = (0..vocab.div_ceil(32)).map(|_| (rng.unit() * u32::MAX as f32) as u32 & (rng.unit() * u32::MAX as f32) as u32).collect();
        let keep = rng.below(vocab);
        words[keep / 32] |= 1 << (keep % 32);
        row.allow = Some(words);
    }
}

#[test]
fn device_greedy_equals_host_argmax_after_every_processor() {
    let Some(dev) = gpu("sample_rows greedy", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(40);
    for vocab in [7, 1000, 151_936] {
        let n_src = 3;
        let mut logits = rng.vec(n_src * vocab, -10.0, 10.0);
        // Row 0: two equal maxima; the lower id must win.
        logits[vocab / 2] = 30.0;
        logits[vocab - 1] = 30.0;
        let dlogits = upload_raw(&dev, &logits);
        let mut rows = Vec::new();
        let mut src = Vec::new();
        for which in 0..8 {
            let mut row = RowSampling { temperature: 0.0, ..Default::default() };
            processors(&mut rng, vocab, &mut row, which);
            rows.push(row);
            src.push(which % n_src);
        }
        let got = device_sample(&dev, &dlogits, vocab, &rows, &src);
        for (i, (row, s)) in rows.iter().zip(&src).enumerate() {
            let raw = &logits[s * vocab..(s + 1) * vocab];
            assert_eq!(got[i].token, row.sample(raw).token, "vocab {vocab}, row {i} (processors {i:03b})");
        }
        assert_eq!(got[0].token, (vocab / 2) as u32, "ties go to the lowest id");
    }
}

/// Greedy over deliberately tied maxima, as bf16-rounded logits (logits_dtype "auto") make them:
/// the lowest id must win wherever the tied ids sit: the same thread's consecutive elements of a
/// sample_scan chunk, neighbouring lanes, other warps, other chunks (merged in chunk order), the
/// last ragged chunk; and on a row that is one value everywhere (id 0). Same as the host sampler.
#[test]
fn device_greedy_breaks_exact_ties_by_the_lowest_id() {
    let Some(dev) = gpu("sample_rows greedy ties", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(41);
    let vocab = 151_936;
    let span = SAMPLE_SCAN_SPAN;
    let base: Vec<f32> = rng.vec(vocab, -8.0, 8.0).into_iter().map(|x| half::bf16::from_f32(x).to_f32()).collect();
    let last_chunk = (vocab - 1) / span * span;
    let ties: Vec<Vec<usize>> = vec![
        vec![3 * span + 5, 3 * span + 6],
        vec![3 * span + 40, 3 * span + 7],
        vec![3 * span + 1000, 3 * span + 1000 - 256, 3 * span + 1000 + 512],
        vec![5 * span + 9, 2 * span + 2047, 60 * span],
        vec![vocab - 1, last_chunk + 1, vocab - 2],
        vec![0, vocab - 1],
        vec![span - 1, span],
    ];
    let mut logits = Vec::new();
    for t in &ties {
        let mut row = base.clone();
        for &i in t {
            row[i] = 16.0;
        }
        logits.extend(row);
    }
    logits.extend(vec![half::bf16::from_f32(0.3).to_f32(); vocab]);
    let n = ties.len() + 1;
    let dlogits = upload_raw(&dev, &logits);
    let rows: Vec<RowSampling> = (0..n).map(|_| RowSampling { temperature: 0.0, ..Default::default() }).collect();
    let got = device_sample(&dev, &dlogits, vocab, &rows, &(0..n).collect::<Vec<_>>());
    for (i, t) in ties.iter().enumerate() {
        let want = *t.iter().min().unwrap() as u32;
        assert_eq!(got[i].token, want, "row {i}: tied ids {t:?}");
        assert_eq!(rows[i].sample(&logits[i * vocab..(i + 1) * vocab]).token, want, "host, row {i}");
    }
    assert_eq!(got[n - 1].token, 0, "a flat row is greedy id 0");
}

#[test]
fn device_token_equals_host_token_for_the_same_draw() {
    let Some(dev) = gpu("sample_rows same u", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(41);
    let (mut compared, mut skipped) = (0, 0);
    for vocab in [50, 1000, 151_936] {
        let n_src = 4;
        let logits = rng.vec(n_src * vocab, -8.0, 8.0);
        let dlogits = upload_raw(&dev, &logits);
        let mut rows = Vec::new();
        let mut src = Vec::new();
        for temperature in [0.4f32, 1.0, 1.8] {
            for top_k in [0, 1, 7, 60] {
                for (top_p, min_p) in [(1.0f32, 0.0f32), (0.9, 0.0), (0.3, 0.0), (1.0, 0.05), (0.8, 0.2)] {
                    let reps = if vocab > 100_000 { 1 } else { 3 };
                    for rep in 0..reps {
                        let mut row = RowSampling { temperature, top_k, top_p, min_p, u: draw(&mut rng), ..Default::default() };
                        processors(&mut rng, vocab, &mut row, (rows.len() + rep) % 8);
                        rows.push(row);
                        src.push(rng.below(n_src));
                    }
                }
            }
        }
        let got = device_sample(&dev, &dlogits, vocab, &rows, &src);
        for (i, (row, s)) in rows.iter().enumerate().map(|(i, r)| (i, (r, src[i]))) {
            let raw = &logits[s * vocab..(s + 1) * vocab];
            let at = |u: f64| RowSampling { u: u.clamp(0.0, 1.0 - 1e-12), ..row.clone() }.sample(raw).token;
            let want = at(row.u);
            if at(row.u - 1e-5) != want || at(row.u + 1e-5) != want {
                skipped += 1;
                continue;
            }
            compared += 1;
            assert_eq!(got[i].token, want, "vocab {vocab}, row {i}: T {} top_k {} top_p {} min_p {} u {}", row.temperature, row.top_k, row.top_p, row.min_p, row.u);
        }
    }
    println!("PARITY op=sample_rows.same_u compared={compared} skipped_near_boundary={skipped}");
    assert!(skipped * 20 <= compared, "{skipped} of {} draws near a CDF boundary", compared + skipped);
}

#[test]
fn device_logprobs_are_log_softmax_of_the_raw_row_with_sorted_top() {
    let Some(dev) = gpu("sample_rows logprobs", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(42);
    for vocab in [5, 1000, 151_936] {
        let mut logits = rng.vec(2 * vocab, -12.0, 12.0);
        // Row 1: a tie at the top; the lower id comes first.
        logits[vocab + vocab - 1] = 40.0;
        logits[vocab + 1] = 40.0;
        let dlogits = upload_raw(&dev, &logits);
        let mut rows = Vec::new();
        let mut src = Vec::new();
        for (i, n) in [0usize, 1, 5, 20].into_iter().enumerate() {
            for temperature in [0.0f32, 1.0] {
                let mut row = RowSampling { temperature, top_logprobs: n, logprobs: true, u: draw(&mut rng), ..Default::default() };
                processors(&mut rng, vocab, &mut row, i * 2 + 1);
                rows.push(row);
                src.push(rows.len() % 2);
            }
        }
        let got = device_sample(&dev, &dlogits, vocab, &rows, &src);
        for (i, row) in rows.iter().enumerate() {
            let raw = &logits[src[i] * vocab..(src[i] + 1) * vocab];
            let lp = got[i].logprob.as_ref().expect("logprobs asked for");
            let want = raw_logprobs(raw, got[i].token, row.top_logprobs);
            assert_eq!(lp.token_id, got[i].token);
            let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, want.top.iter().map(|t| t.0).collect::<Vec<_>>(), "vocab {vocab}, row {i}: top ids");
            let mut g = vec![lp.logprob];
            g.extend(lp.top.iter().map(|t| t.1));
            let mut w = vec![want.logprob];
            w.extend(want.top.iter().map(|t| t.1));
            let shape = format!("v{vocab}/n{}", row.top_logprobs);
            check("sample_rows.logprobs", StorageDType::Bf16, &shape, &g, &w, TOL32);
            if src[i] == 1 && row.top_logprobs >= 2 {
                assert_eq!(&ids[..2], &[1, (vocab - 1) as u32], "ties in the top go lower id first");
            }
        }
        let plain = device_sample(&dev, &dlogits, vocab, &[RowSampling { temperature: 0.0, ..Default::default() }], &[0]);
        assert_eq!(plain[0].logprob, None, "no logprobs unless asked");
    }
}

#[test]
fn device_samples_follow_the_host_filtered_distribution() {
    let Some(dev) = gpu("sample_rows distribution", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(43);
    let vocab = 40;
    let logits = rng.vec(vocab, -3.0, 3.0);
    let dlogits = upload_raw(&dev, &logits);
    let cases = [
        RowSampling { temperature: 0.8, ..Default::default() },
        RowSampling { temperature: 1.0, top_k: 6, ..Default::default() },
        RowSampling { temperature: 1.3, top_p: 0.7, ..Default::default() },
        RowSampling { temperature: 1.0, min_p: 0.25, top_k: 20, top_p: 0.95, ..Default::default() },
        RowSampling { temperature: 1.0, allow: Some(vec![0xf0f0_f0f0]), logit_bias: vec![(4, 2.0)], ..Default::default() },
    ];
    let draws = 20_000;
    for (c, case) in cases.iter().enumerate() {
        // The host's distribution, read off a fine grid of u.
        let grid = 200_000;
        let mut want = vec![0f64; vocab];
        for j in 0..grid {
            let t = RowSampling { u: (j as f64 + 0.5) / grid as f64, ..case.clone() }.sample(&logits).token;
            want[t as usize] += 1.0 / grid as f64;
        }
        let rows: Vec<RowSampling> = (0..draws).map(|_| RowSampling { u: draw(&mut rng), ..case.clone() }).collect();
        let got = device_sample(&dev, &dlogits, vocab, &rows, &vec![0; draws]);
        let mut freq = vec![0f64; vocab];
        for s in &got {
            freq[s.token as usize] += 1.0 / draws as f64;
        }
        for t in 0..vocab {
            let sigma = (want[t] * (1.0 - want[t]) / draws as f64).sqrt();
            assert!((freq[t] - want[t]).abs() <= 5.0 * sigma + 2e-4, "case {c}, token {t}: device {:.4} vs host {:.4}", freq[t], want[t]);
            if want[t] == 0.0 {
                assert_eq!(freq[t], 0.0, "case {c}: token {t} is filtered out on the host");
            }
        }
    }
}

#[test]
fn device_breaks_ties_in_the_sorted_order_by_lower_id() {
    let Some(dev) = gpu("sample_rows ties", StorageDType::Bf16) else { return };
    let vocab = 100_003;
    let flat = vec![0.5f32; vocab];
    let dlogits = upload_raw(&dev, &flat);
    let mut rows = Vec::new();
    for u in [0.0, 0.2, 0.34, 0.55, 0.7, 0.99] {
        rows.push(RowSampling { top_k: 3, u, ..Default::default() });
        rows.push(RowSampling { top_p: 0.5, u, ..Default::default() });
        // Three allowed tokens, top-k larger than the allowed set: -inf ties fill it.
        let mut allow = vec![0u32; vocab.div_ceil(32)];
        for t in [7usize, 70_000, 100_002] {
            allow[t / 32] |= 1 << (t % 32);
        }
        rows.push(RowSampling { top_k: 10, u, allow: Some(allow), ..Default::default() });
    }
    let got = device_sample(&dev, &dlogits, vocab, &rows, &vec![0; rows.len()]);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(got[i].token, row.sample(&flat).token, "row {i}: top_k {} top_p {} u {}", row.top_k, row.top_p, row.u);
    }
}

#[test]
fn device_sampler_rejects_buffers_too_small_for_the_rows() {
    let Some(dev) = gpu("sample_rows buffers", StorageDType::Bf16) else { return };
    let vocab = 100;
    let mut packed = PackedSampling::default();
    packed.pack(&[RowSampling::default(), RowSampling::default()], &[0, 3], vocab).unwrap();
    let params = upload_raw(&dev, packed.words());
    let logits = dev.stream().alloc_zeros::<f32>(3 * vocab).unwrap();
    let mut scratch = SampleScratch::new(&dev, 2, vocab).unwrap();
    let mut out = dev.stream().alloc_zeros::<u32>(2 * SAMPLE_OUT).unwrap();
    let err = dev.sample_rows(&logits, &packed, &params, None, &mut scratch, &mut out).unwrap_err();
    assert!(matches!(err, NinferError::Device(ref m) if m.contains("sampler logits")), "{err}");
    packed.pack(&[RowSampling::default(), RowSampling::default()], &[0, 2], vocab).unwrap();
    let mut small = SampleScratch::new(&dev, 1, vocab).unwrap();
    let err = dev.sample_rows(&logits, &packed, &params, None, &mut small, &mut out).unwrap_err();
    assert!(matches!(err, NinferError::Device(ref m) if m.contains("sampler scratch")), "{err}");
}

/// The many-block merge of `sample_scan` at the chunk boundaries (SAMPLE_SCAN_SPAN logits a
/// block), on a vocabulary that is not a multiple of the span: equal maxima in different
/// blocks go to the lowest id, a maximum in the last (partial) block is found, a grammar mask
/// that leaves one token in the last block, top logprobs tied across a boundary, and the
/// Qwen3.5 vocabulary with 20 top logprobs (more candidates than the merge stages in shared
/// memory). Every case runs twice on one scratch with the output reset in between: the second
/// launch is right only if the first left every arrival counter at 0.
#[test]
fn many_block_sampler_merges_chunks_in_order_and_resets_its_counters() {
    let Some(dev) = gpu("sample_rows many blocks", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(44);
    let span = SAMPLE_SCAN_SPAN;
    for vocab in [3 * span + 77, 248_320] {
        assert!(vocab % span != 0 && sample_scan_blocks(vocab) > 1);
        let n_src = 4;
        let mut logits = rng.vec(n_src * vocab, -10.0, 10.0);
        // Row 0: equal maxima in blocks 2, 1 and the last one; the block-1 id must win.
        for id in [2 * span + 3, span + 9, vocab - 1] {
            logits[id] = 50.0;
        }
        // Row 1: the maximum is the last id (in the partial last block).
        logits[2 * vocab - 1] = 50.0;
        // Row 2: ties that straddle the block-0 / block-1 boundary, below a single maximum
        // in the last block; the top lists order the ties by id.
        let r2 = 2 * vocab;
        logits[r2 + vocab - 2] = 60.0;
        for id in [span, span - 1, 3 * span + 1, 1] {
            logits[r2 + id] = 40.0;
        }
        let dlogits = upload_raw(&dev, &logits);
        // Row 3 with a mask that allows one token of the last block only.
        let last_tok = vocab - 5;
        let mut allow = vec![0u32; vocab.div_ceil(32)];
        allow[last_tok / 32] |= 1 << (last_tok % 32);
        let greedy = RowSampling { temperature: 0.0, ..Default::default() };
        let with_lp = |n: usize| RowSampling { temperature: 0.0, logprobs: true, top_logprobs: n, ..Default::default() };
        let rows = vec![
            greedy.clone(),
            with_lp(1),
            with_lp(5),
            RowSampling { allow: Some(allow), ..with_lp(20) },
            with_lp(20),
            RowSampling { temperature: 0.9, top_k: 40, u: 0.37, logprobs: true, top_logprobs: 3, ..Default::default() },
        ];
        let src = [0usize, 1, 2, 3, 0, 2];
        let mut packed = PackedSampling::default();
        packed.pack(&rows, &src, vocab).unwrap();
        let params = upload_raw(&dev, packed.words());
        let mut scratch = SampleScratch::new(&dev, rows.len(), vocab).unwrap();
        let n = rows.len() * SAMPLE_OUT;
        for launch in 0..2 {
            let mut out = upload_raw(&dev, &vec![OUT_GUARD; n]);
            dev.sample_rows(&dlogits, &packed, &params, None, &mut scratch, &mut out).unwrap();
            let got = packed.unpack(&dev.stream().clone_dtoh(&out).unwrap()).unwrap();
            let what = |i: usize| format!("vocab {vocab}, launch {launch}, row {i}");
            assert_eq!(got[0].token, (span + 9) as u32, "{}: equal maxima in three blocks", what(0));
            assert_eq!(got[1].token, (vocab - 1) as u32, "{}: maximum in the last block", what(1));
            assert_eq!(got[2].token, (vocab - 2) as u32, "{}", what(2));
            assert_eq!(got[3].token, last_tok as u32, "{}: the only allowed token", what(3));
            let top2: Vec<u32> = got[2].logprob.as_ref().unwrap().top.iter().map(|t| t.0).collect();
            assert_eq!(top2, vec![(vocab - 2) as u32, 1, (span - 1) as u32, span as u32, (3 * span + 1) as u32], "{}: ties by id across blocks", what(2));
            for (i, row) in rows.iter().enumerate() {
                let raw = &logits[src[i] * vocab..(src[i] + 1) * vocab];
                assert_eq!(got[i].token, row.sample(raw).token, "{}: token vs host", what(i));
                let lp = got[i].logprob.as_ref();
                if let Some(lp) = lp {
                    let want = raw_logprobs(raw, got[i].token, row.top_logprobs);
                    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), want.top.iter().map(|t| t.0).collect::<Vec<_>>(), "{}: top ids vs host", what(i));
                    let mut g = vec![lp.logprob];
                    g.extend(lp.top.iter().map(|t| t.1));
                    let mut w = vec![want.logprob];
                    w.extend(want.top.iter().map(|t| t.1));
                    check("sample_rows.many_block", StorageDType::Bf16, &format!("v{vocab}/r{i}/l{launch}"), &g, &w, TOL32);
                }
            }
        }
    }
}

/// Asynchronous scheduling with penalties: a row that `count_input`s (a step queued ahead,
/// whose input token is the request's newest output, not in the pairs the host built) counts
/// `fed[r]` as one more output occurrence, exactly as the host reference
/// `RowSampling::with_input` (`PenaltyHistory::with_pending_output`) + `apply_penalties`: the
/// token already in the pairs with a count > 0 (its count + 1), in them with count 0 (a
/// prompt-only token under the repetition penalty: count 1), or absent (penalized as (t, 1)),
/// under each penalty scope, with a bias on it, greedy and seeded, at vocabularies of one and
/// many `sample_scan` chunks (the token in the first, a middle and the last, ragged chunk).
/// Each row's logits make the extra occurrence decide the greedy token: the input token's raw
/// logit is the largest, and a runner-up sits halfway between its processed logit with and
/// without the extra count. Rows without the flag ignore their `fed` entry.
#[test]
fn device_sampler_counts_the_fed_input_token_as_one_more_output() {
    let Some(dev) = gpu("sample_rows count_input", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(46);
    let span = SAMPLE_SCAN_SPAN;
    let scopes = [
        PenaltyParams { repetition: 1.3, presence: 0.0, frequency: 0.0 },
        PenaltyParams { repetition: 1.0, presence: 0.4, frequency: 0.3 },
        PenaltyParams { repetition: 1.2, presence: 0.5, frequency: 0.7 },
        PenaltyParams { repetition: 0.8, presence: 0.0, frequency: 0.9 },
    ];
    let (mut decisive, mut compared, mut skipped) = (0, 0, 0);
    for vocab in [1000, 3 * span + 77, 151_936] {
        let mut rows = Vec::new();
        let mut fed = Vec::new();
        let mut logits = Vec::new();
        for (si, scope) in scopes.iter().enumerate() {
            // (a) in the pairs with count 2, (b) with count 0, (c) absent.
            for case in 0..3 {
                for seeded in [false, true] {
                    let r = rows.len();
                    let input = match r % 3 {
                        0 => rng.below(vocab.min(span)),
                        1 => vocab / 2,
                        _ => vocab - 1 - rng.below(20),
                    } as u32;
                    let mut pen: Vec<(u32, u32)> = rng.permutation(vocab).into_iter().map(|t| t as u32).filter(|&t| t != input).take(30).map(|t| (t, rng.below(4) as u32)).collect();
                    match case {
                        0 => pen.insert(rng.below(pen.len()), (input, 2)),
                        1 => pen.push((input, 0)),
                        _ => {}
                    }
                    let mut row = RowSampling {
                        temperature: if seeded { 0.7 } else { 0.0 },
                        top_k: if seeded && si % 2 == 1 { 5 } else { 0 },
                        u: if seeded { draw(&mut rng) } else { 0.0 },
                        penalties: *scope,
                        penalized: pen,
                        count_input: true,
                        logit_bias: if case == 1 { vec![(input, 1.0)] } else { Vec::new() },
                        logprobs: seeded,
                        top_logprobs: if seeded { 2 } else { 0 },
                        ..Default::default()
                    };
                    if si == 3 && case == 2 {
                        row.logit_bias.push(((input + 1) % vocab as u32, -2.0));
                    }
                    let mut raw = rng.vec(vocab, -4.0, 4.0);
                    raw[input as usize] = 10.0;
                    let unpenalized = |t: u32| t != input && !row.penalized.iter().any(|p| p.0 == t) && !row.logit_bias.iter().any(|b| b.0 == t);
                    let runner = loop {
                        let t = rng.below(vocab) as u32;
                        if unpenalized(t) {
                            break t;
                        }
                    };
                    let stale = RowSampling { count_input: false, ..row.clone() }.processed(&raw)[input as usize];
                    let counted = row.with_input(input).processed(&raw)[input as usize];
                    raw[runner as usize] = 0.5 * (stale + counted);
                    if stale != counted {
                        decisive += 1;
                    }
                    rows.push(row);
                    fed.push(input as i32);
                    logits.extend(raw);
                }
            }
        }
        // Rows that do not count their input: their fed entry (a token of theirs) is not read.
        for temperature in [0.0f32, 0.9] {
            let mut row = RowSampling { temperature, u: draw(&mut rng), ..Default::default() };
            processors(&mut rng, vocab, &mut row, 2);
            let t = row.penalized[0].0;
            let mut raw = rng.vec(vocab, -4.0, 4.0);
            raw[t as usize] = 10.0;
            rows.push(row);
            fed.push(t as i32);
            logits.extend(raw);
        }
        let src: Vec<usize> = (0..rows.len()).collect();
        let dlogits = upload_raw(&dev, &logits);
        let got = device_sample_fed(&dev, &dlogits, vocab, &rows, &src, Some(&fed));
        for (i, row) in rows.iter().enumerate() {
            let raw = &logits[i * vocab..(i + 1) * vocab];
            let host = row.with_input(fed[i] as u32);
            let at = |u: f64| RowSampling { u: u.clamp(0.0, 1.0 - 1e-12), ..host.clone() }.sample(raw).token;
            let want = at(host.u);
            if !host.is_greedy() && (at(host.u - 1e-5) != want || at(host.u + 1e-5) != want) {
                skipped += 1;
                continue;
            }
            compared += 1;
            assert_eq!(got[i].token, want, "vocab {vocab}, row {i}: input {} counted {}, penalties {:?}, T {}", fed[i], row.count_input, row.penalties, row.temperature);
            if let Some(lp) = &got[i].logprob {
                let w = raw_logprobs(raw, got[i].token, row.top_logprobs);
                check("sample_rows.count_input", StorageDType::Bf16, &format!("v{vocab}/r{i}"), &[lp.logprob], &[w.logprob], TOL32);
            }
        }
        // A counting row without the step's ids (or too few of them) is refused.
        let mut packed = PackedSampling::default();
        packed.pack(&rows, &src, vocab).unwrap();
        let params = upload_raw(&dev, packed.words());
        let mut scratch = SampleScratch::new(&dev, rows.len(), vocab).unwrap();
        let mut out = dev.stream().alloc_zeros::<u32>(rows.len() * SAMPLE_OUT).unwrap();
        let err = dev.sample_rows(&dlogits, &packed, &params, None, &mut scratch, &mut out).unwrap_err();
        assert!(err.to_string().contains("sampler fed ids"), "{err}");
        let short = upload_raw(&dev, &fed[..rows.len() - 1]);
        let err = dev.sample_rows(&dlogits, &packed, &params, Some(&short.slice(0..rows.len() - 1)), &mut scratch, &mut out).unwrap_err();
        assert!(err.to_string().contains("sampler fed ids"), "{err}");
    }
    println!("PARITY op=sample_rows.count_input compared={compared} skipped_near_boundary={skipped} decisive_rows={decisive}");
    assert!(skipped * 10 <= compared, "{skipped} of {} draws near a CDF boundary", compared + skipped);
    assert!(decisive >= 3 * 18, "{decisive} rows where the extra occurrence changes the input's logit");
}

/// TIMING (read on the GPU; asserts nothing about speed): `sample_rows` at Llama-3's
/// vocabulary, greedy with and without logprobs (the benchmarks' and most agents' case), logits
/// resident in L2 as after the LM head.
#[test]
fn sample_rows_timing_at_llama3_vocab() {
    let Some(dev) = gpu("sample_rows timing", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(45);
    let vocab = 128_256;
    for n_rows in [1usize, 8] {
        let dlogits = upload_raw(&dev, &rng.vec(n_rows * vocab, -10.0, 10.0));
        let src: Vec<usize> = (0..n_rows).collect();
        for (label, row) in [
            ("greedy", RowSampling { temperature: 0.0, ..Default::default() }),
            ("greedy+logprobs", RowSampling { temperature: 0.0, logprobs: true, ..Default::default() }),
            ("greedy+top5", RowSampling { temperature: 0.0, logprobs: true, top_logprobs: 5, ..Default::default() }),
        ] {
            let mut packed = PackedSampling::default();
            packed.pack(&vec![row; n_rows], &src, vocab).unwrap();
            let params = upload_raw(&dev, packed.words());
            let mut scratch = SampleScratch::new(&dev, n_rows, vocab).unwrap();
            let mut out = dev.stream().alloc_zeros::<u32>(n_rows * SAMPLE_OUT).unwrap();
            let t = time_ms(&dev, 200, || dev.sample_rows(&dlogits, &packed, &params, None, &mut scratch, &mut out).unwrap());
            println!("TIMING sample_rows vocab={vocab} rows={n_rows} {label}: {:.1} us", t * 1e3);
        }
    }
}

/// Asynchronous scheduling's feed: each row's token (word 0 of its `SAMPLE_OUT` words) lands in
/// the next step's ids, exactly and nowhere else.
#[test]
fn feed_sampled_tokens_copies_each_rows_token_into_the_step_ids() {
    let Some(dev) = gpu("feed_sampled_tokens", StorageDType::Bf16) else { return };
    let mut rng = Rng::new(41);
    for n in [1usize, 3, 129, 300] {
        let words: Vec<u32> = (0..n * SAMPLE_OUT).map(|_| (rng.unit() * 1.0e9) as u32).collect();
        let mut ids = super::harness::OutI32::new(&dev, n);
        dev.feed_sampled_tokens(&upload_raw(&dev, &words), &mut ids.view(), n).unwrap();
        let got = ids.read(&dev, "fed ids");
        let want: Vec<i32> = (0..n).map(|i| words[i * SAMPLE_OUT] as i32).collect();
        assert_eq!(got, want, "{n} rows");
    }
    let short = upload_raw(&dev, &[0u32; SAMPLE_OUT]);
    let mut ids = super::harness::OutI32::new(&dev, 2);
    let err = dev.feed_sampled_tokens(&short, &mut ids.view(), 2).unwrap_err();
    assert!(err.to_string().contains("sampled tokens"), "{err}");
}

/// The page-locked staging ring: uploads and downloads of changing lengths round-trip through
/// two buffers used in turn, with copies queued back to back before any is waited for.
#[test]
fn pinned_ring_round_trips_queued_uploads_and_downloads() {
    use ninfer_core::backend::cuda::transfer::PinnedRing;
    let Some(dev) = gpu("pinned_ring", StorageDType::Bf16) else { return };
    let (mut up, mut down) = (PinnedRing::<u32>::new(2), PinnedRing::<u32>::new(2));
    let mut bufs: Vec<CudaSlice<u32>> = (0..4).map(|_| dev.stream().alloc_zeros::<u32>(5000).unwrap()).collect();
    let mut pending = Vec::new();
    for (round, len) in [7usize, 4096, 33, 5000, 1, 2500].into_iter().enumerate() {
        let host: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ round as u32).collect();
        let buf = &mut bufs[round % 4];
        up.upload(&dev, &host, &mut buf.slice_mut(0..len)).unwrap();
        let slot = down.download(&dev, &buf.slice(0..len)).unwrap();
        pending.push((slot, host));
        if pending.len() == 2 {
            for (slot, want) in pending.drain(..) {
                assert_eq!(down.downloaded(slot, want.len()).unwrap(), &want[..], "round {round}");
            }
        }
    }
}
