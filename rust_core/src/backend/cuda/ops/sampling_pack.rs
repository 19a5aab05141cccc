//! The host side of `sample_rows` (cuda/sampling.cu): one step's `RowSampling`s packed into
//! the single u32 buffer the kernel reads, and the kernel's output words decoded back into
//! `SampledToken`s. This file is the one place that knows the layout; the kernel's `P_*`
//! enum and `SAMPLE_*` defines must match the constants here.

use crate::sampling::{RowSampling, SampledToken, TokenLogprob};
use crate::{NinferError, Result};

/// Header words per row.
pub const SAMPLE_HDR: usize = 20;
/// Output words per row: token, raw logprob, top ids, top logprobs.
pub const SAMPLE_OUT: usize = 2 + 2 * SAMPLE_MAX_TOP;
/// Most top logprobs per row (the API's limit).
pub const SAMPLE_MAX_TOP: usize = 20;
/// Logits per `sample_scan` block (SCAN_SPAN in sampling.cu): a row of width `vocab` runs over
/// `sample_scan_blocks(vocab)` blocks.
pub const SAMPLE_SCAN_SPAN: usize = 2048;
/// Words of one (row, block) partial record of `sample_scan` (SCAN_REC).
pub const SAMPLE_SCAN_REC: usize = 48;

/// Blocks `sample_scan` runs per row of width `vocab` (63 at Llama-3's 128256, 122 at 248320).
pub fn sample_scan_blocks(vocab: usize) -> usize {
    vocab.div_ceil(SAMPLE_SCAN_SPAN).max(1)
}

/// Offset value for "no grammar mask".
const NONE: u32 = u32::MAX;

const P_SRC_ROW: usize = 0;
const P_FLAGS: usize = 1;
const P_TOP_K: usize = 2;
const P_N_TOP: usize = 3;
const P_TEMP: usize = 4;
const P_TOP_P: usize = 5;
const P_MIN_P: usize = 6;
const P_REP: usize = 7;
const P_PRES: usize = 8;
const P_FREQ: usize = 9;
const P_U_LO: usize = 10;
const P_U_HI: usize = 11;
const P_BIAS_OFF: usize = 12;
const P_BIAS_N: usize = 13;
const P_PEN_OFF: usize = 14;
const P_PEN_N: usize = 15;
const P_MASK_OFF: usize = 16;
const FLAG_GREEDY: u32 = 1;
const FLAG_LOGPROBS: u32 = 2;
/// `RowSampling::count_input`: the kernel reads the row's input token from its `fed` ids.
const FLAG_COUNT_INPUT: u32 = 4;

/// One step's sampling inputs in the kernel's layout: `rows` headers, then each row's bias
/// pairs, penalty pairs and allow-mask words.
#[derive(Clone, Debug, Default)]
pub struct PackedSampling {
    words: Vec<u32>,
    rows: usize,
    vocab: usize,
    /// The largest logits row any header reads (bounds-checked by the launcher).
    max_src_row: usize,
}

impl PackedSampling {
    /// Pack `rows[i]`, which samples row `src_rows[i]` of a `[*, vocab]` logits buffer. Reuses
    /// this value's allocation, so a sampler that keeps one packs every step without allocating.
    pub fn pack(&mut self, rows: &[RowSampling], src_rows: &[usize], vocab: usize) -> Result<()> {
        if rows.len() != src_rows.len() {
            return Err(NinferError::invalid("sampling rows", format!("{} rows but {} source rows", rows.len(), src_rows.len())));
        }
        if vocab == 0 || vocab > i32::MAX as usize {
            return Err(NinferError::invalid("vocab", format!("{vocab} is not a vocabulary size the sampler takes")));
        }
        let w = &mut self.words;
        w.clear();
        w.resize(rows.len() * SAMPLE_HDR, 0);
        for (r, (row, &src)) in rows.iter().zip(src_rows).enumerate() {
            if row.top_logprobs > SAMPLE_MAX_TOP {
                return Err(NinferError::invalid("top_logprobs", format!("{} exceeds {SAMPLE_MAX_TOP}", row.top_logprobs)));
            }
            if !row.is_greedy() && !(0.0..1.0).contains(&row.u) {
                return Err(NinferError::invalid("u", format!("{} is not a uniform draw in [0, 1)", row.u)));
            }
            let h = r * SAMPLE_HDR;
            w[h + P_SRC_ROW] = u32::try_from(src).map_err(|_| NinferError::invalid("src_row", src.to_string()))?;
            w[h + P_FLAGS] = (if row.is_greedy() { FLAG_GREEDY } else { 0 })
                | (if row.wants_logprobs() { FLAG_LOGPROBS } else { 0 })
                | (if row.count_input { FLAG_COUNT_INPUT } else { 0 });
            w[h + P_TOP_K] = if row.top_k < vocab { row.top_k as u32 } else { 0 };
            w[h + P_N_TOP] = row.top_logprobs as u32;
            w[h + P_TEMP] = row.temperature.to_bits();
            w[h + P_TOP_P] = row.top_p.to_bits();
            w[h + P_MIN_P] = row.min_p.to_bits();
            w[h + P_REP] = row.penalties.repetition.to_bits();
            w[h + P_PRES] = row.penalties.presence.to_bits();
            w[h + P_FREQ] = row.penalties.frequency.to_bits();
            let u = row.u.to_bits();
            w[h + P_U_LO] = u as u32;
            w[h + P_U_HI] = (u >> 32) as u32;
            w[h + P_BIAS_OFF] = offset(w.len())?;
            w[h + P_BIAS_N] = row.logit_bias.len() as u32;
            for &(t, b) in &row.logit_bias {
                w.extend([t, b.to_bits()]);
            }
            w[h + P_PEN_OFF] = offset(w.len())?;
            w[h + P_PEN_N] = row.penalized.len() as u32;
            for &(t, n) in &row.penalized {
                w.extend([t, n]);
            }
            w[h + P_MASK_OFF] = match &row.allow {
                Some(bits) => {
                    let off = offset(w.len())?;
                    let n = vocab.div_ceil(32);
                    w.extend((0..n).map(|i| bits.get(i).copied().unwrap_or(0)));
                    off
                }
                None => NONE,
            };
        }
        offset(w.len())?;
        self.rows = rows.len();
        self.vocab = vocab;
        self.max_src_row = src_rows.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    /// The words to upload.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Rows packed.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Vocabulary size the rows were packed for.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Whether every row is greedy (then `sample_rows` needs no `sample_pick` launch).
    pub fn all_greedy(&self) -> bool {
        (0..self.rows).all(|r| self.words[r * SAMPLE_HDR + P_FLAGS] & FLAG_GREEDY != 0)
    }

    /// Whether some row counts its step's input token (then the sampler needs the step's ids).
    pub fn counts_input(&self) -> bool {
        (0..self.rows).any(|r| self.words[r * SAMPLE_HDR + P_FLAGS] & FLAG_COUNT_INPUT != 0)
    }

    /// The largest source row index.
    pub fn max_src_row(&self) -> usize {
        self.max_src_row
    }

    /// Decode the kernel's output (`rows * SAMPLE_OUT` words) into one token per row, with the
    /// logprob entry each row asked for.
    pub fn unpack(&self, out: &[u32]) -> Result<Vec<SampledToken>> {
        if out.len() < self.rows * SAMPLE_OUT {
            return Err(NinferError::Device(format!("sampler output holds {} words, {} rows need {}", out.len(), self.rows, self.rows * SAMPLE_OUT)));
        }
        (0..self.rows)
            .map(|r| {
                let h = &self.words[r * SAMPLE_HDR..(r + 1) * SAMPLE_HDR];
                let o = &out[r * SAMPLE_OUT..(r + 1) * SAMPLE_OUT];
                let token = o[0];
                if token as usize >= self.vocab {
                    return Err(NinferError::Device(format!("device sampler returned token {token} for row {r} (vocab {})", self.vocab)));
                }
                let logprob = (h[P_FLAGS] & FLAG_LOGPROBS != 0).then(|| {
                    let n = (h[P_N_TOP] as usize).min(self.vocab);
                    let top = (0..n).map(|i| (o[2 + i], f32::from_bits(o[2 + SAMPLE_MAX_TOP + i]))).collect();
                    TokenLogprob { token_id: token, logprob: f32::from_bits(o[1]), top }
                });
                Ok(SampledToken { token, logprob })
            })
            .collect()
    }
}

/// A word offset into the params buffer (the kernel indexes with u32).
fn offset(len: usize) -> Result<u32> {
    u32::try_from(len).ok().filter(|&o| o != NONE).ok_or_else(|| NinferError::invalid("sampling params", format!("{len} words exceed the u32 offsets the sampler reads")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::PenaltyParams;

    #[test]
    fn pack_lays_out_headers_then_variable_sections_and_unpack_reads_outputs() {
        let a = RowSampling {
            temperature: 0.7,
            top_k: 5000,
            u: 0.25,
            penalties: PenaltyParams { repetition: 1.1, presence: 0.5, frequency: 0.0 },
            penalized: vec![(3, 0), (9, 2)],
            logit_bias: vec![(7, -1.5)],
            allow: Some(vec![0b1010]),
            top_logprobs: 2,
            ..Default::default()
        };
        let b = RowSampling { temperature: 0.0, ..Default::default() };
        let mut p = PackedSampling::default();
        p.pack(&[a.clone(), b.clone()], &[4, 1], 40).unwrap();
        assert!(!p.counts_input());
        let fed = RowSampling { count_input: true, ..a.clone() };
        p.pack(&[b.clone(), fed], &[1, 4], 40).unwrap();
        assert!(p.counts_input());
        assert_eq!(p.words()[SAMPLE_HDR + P_FLAGS], FLAG_LOGPROBS | FLAG_COUNT_INPUT);
        p.pack(&[a, b], &[4, 1], 40).unwrap();
        let w = p.words();
        assert_eq!(p.rows(), 2);
        assert_eq!(p.max_src_row(), 4);
        assert_eq!(w[P_SRC_ROW], 4);
        assert_eq!(w[P_TOP_K], 0, "top_k >= vocab disables the filter");
        assert_eq!(w[P_FLAGS], FLAG_LOGPROBS);
        assert_eq!(f64::from_bits(w[P_U_LO] as u64 | (w[P_U_HI] as u64) << 32), 0.25);
        let bias = w[P_BIAS_OFF] as usize;
        assert_eq!(&w[bias..bias + 2], &[7, (-1.5f32).to_bits()]);
        let pen = w[P_PEN_OFF] as usize;
        assert_eq!(&w[pen..pen + 4], &[3, 0, 9, 2]);
        let mask = w[P_MASK_OFF] as usize;
        assert_eq!(&w[mask..mask + 2], &[0b1010, 0], "the mask covers ceil(40 / 32) words");
        assert_eq!(w[SAMPLE_HDR + P_FLAGS], FLAG_GREEDY);
        assert!(!p.all_greedy(), "row 0 samples");
        assert_eq!(w[SAMPLE_HDR + P_MASK_OFF], NONE);
        let mut out = vec![0u32; 2 * SAMPLE_OUT];
        out[0] = 3;
        out[1] = (-0.5f32).to_bits();
        out[2] = 1;
        out[3] = 3;
        out[2 + SAMPLE_MAX_TOP] = (-0.25f32).to_bits();
        out[3 + SAMPLE_MAX_TOP] = (-0.5f32).to_bits();
        out[SAMPLE_OUT] = 39;
        let s = p.unpack(&out).unwrap();
        assert_eq!(s[0].token, 3);
        assert_eq!(s[0].logprob, Some(TokenLogprob { token_id: 3, logprob: -0.5, top: vec![(1, -0.25), (3, -0.5)] }));
        assert_eq!(s[1], SampledToken { token: 39, logprob: None });
        out[SAMPLE_OUT] = 40;
        assert!(matches!(p.unpack(&out), Err(NinferError::Device(_))), "a token outside the vocabulary is an error");
    }

    #[test]
    fn pack_rejects_a_draw_outside_the_unit_interval_and_too_many_top_logprobs() {
        let mut p = PackedSampling::default();
        let greedy = RowSampling { temperature: 0.0, ..Default::default() };
        p.pack(&[greedy.clone(), greedy], &[0, 0], 10).unwrap();
        assert!(p.all_greedy(), "temperature 0 rows are greedy");
        assert_eq!(sample_scan_blocks(128_256), 63);
        assert_eq!(sample_scan_blocks(2048), 1);
        assert_eq!(sample_scan_blocks(7), 1);
        for u in [1.0, -0.1, f64::NAN] {
            let bad_u = RowSampling { u, ..Default::default() };
            assert!(p.pack(&[bad_u], &[0], 10).is_err(), "u {u}");
        }
        p.pack(&[RowSampling { u: 0.0, ..Default::default() }], &[0], 10).unwrap();
        let bad_top = RowSampling { top_logprobs: 21, ..Default::default() };
        assert!(p.pack(&[bad_top], &[0], 10).is_err());
    }
}
