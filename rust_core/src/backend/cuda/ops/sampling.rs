//! Sampling on the device (cuda/sampling.cu): greedy argmax + logsumexp, and the full sampler
//! (`sample_rows`) whose inputs `PackedSampling` lays out.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, PackedSampling, SAMPLE_OUT, SAMPLE_SCAN_REC};
use crate::backend::cuda::device::{driver_err, CudaDevice};
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

/// Threads of a `sample_scan` block (SCAN_THREADS in sampling.cu).
const SCAN_THREADS: u32 = 256;
/// Threads of a `sample_pick` block (SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;

/// Device scratch of `sample_rows` for up to `rows` rows of a `vocab`-wide logits buffer,
/// allocated once with the sampler's other buffers (no allocation inside a step): the processed
/// logits `work` f32 `[rows, vocab]` (written for non-greedy rows), the chunk partials u32
/// `[rows, sample_scan_blocks(vocab), SAMPLE_SCAN_REC]`, and one arrival counter per row, which
/// start zeroed and which every completed launch leaves at 0 (see sample_scan).
pub struct SampleScratch {
    work: CudaSlice<f32>,
    partials: CudaSlice<u32>,
    arrivals: CudaSlice<u32>,
    rows: usize,
    vocab: usize,
}

impl SampleScratch {
    /// Zeroed scratch for `rows` rows of width `vocab`.
    pub fn new(dev: &CudaDevice, rows: usize, vocab: usize) -> Result<Self> {
        let s = dev.stream();
        let rows = rows.max(1);
        Ok(SampleScratch {
            work: s.alloc_zeros::<f32>(rows * vocab).map_err(driver_err("allocating sampler scratch"))?,
            partials: s.alloc_zeros::<u32>(rows * super::sample_scan_blocks(vocab) * SAMPLE_SCAN_REC).map_err(driver_err("allocating sampler partials"))?,
            arrivals: s.alloc_zeros::<u32>(rows).map_err(driver_err("allocating sampler counters"))?,
            rows,
            vocab,
        })
    }

    /// Whether this scratch serves `rows` rows of width `vocab`.
    pub fn fits(&self, rows: usize, vocab: usize) -> bool {
        rows <= self.rows && vocab == self.vocab
    }

    /// Device bytes of the three buffers.
    pub fn bytes(&self) -> usize {
        self.work.len() * 4 + self.partials.len() * 4 + self.arrivals.len() * 4
    }
}

impl CudaDevice {
    /// For each of `rows` rows of f32 logits [rows, vocab]: ids[r] = argmax (lowest index on
    /// ties) and lse[r] = logsumexp, so the greedy token's logprob is logits[id] - lse and only
    /// 8 bytes per row cross to the host.
    pub fn argmax_logsumexp(
        &self,
        logits: &impl DevicePtr<f32>,
        ids: &mut impl DevicePtrMut<i32>,
        lse: &mut impl DevicePtrMut<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        check_len("argmax logits", logits.len(), rows * vocab)?;
        check_len("argmax ids", ids.len(), rows)?;
        check_len("argmax lse", lse.len(), rows)?;
        let f = self.function(KernelFamily::Sampling, "argmax_logsumexp")?;
        let s = self.stream();
        let (lp, _a) = logits.device_ptr(s);
        let (ip, _b) = ids.device_ptr_mut(s);
        let (sp, _c) = lse.device_ptr_mut(s);
        let args =
            kargs![lp, as_i32("vocab", vocab)?, ip, sp];
        self.launch(&f, cfg((as_i32("rows", rows)? as u32, 1, 1), 1024), "argmax_logsumexp", &args)
    }

    /// `ids[i]` = the token `sample_rows` wrote to `sampled` for row `i`, for `n` rows: the
    /// tokens of a decode step queued before the step ahead of it returned (asynchronous
    /// scheduling), taken on the device.
    pub fn feed_sampled_tokens(&self, sampled: &impl DevicePtr<u32>, ids: &mut impl DevicePtrMut<i32>, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_len("sampled tokens", sampled.len(), n * SAMPLE_OUT)?;
        check_len("fed token ids", ids.len(), n)?;
        let f = self.function(KernelFamily::Sampling, "feed_sampled_tokens")?;
        let s = self.stream();
        let (sp, _a) = sampled.device_ptr(s);
        let (ip, _b) = ids.device_ptr_mut(s);
        let args = kargs![sp, as_i32("sampler output words", SAMPLE_OUT)?, ip, as_i32("rows", n)?];
        self.launch(&f, cfg((n.div_ceil(128) as u32, 1, 1), 128), "feed_sampled_tokens", &args)
    }

    /// Sample every row of `packed`: `sample_scan` (many blocks per row) applies the row's
    /// grammar mask, bias and penalties, picks greedy tokens and computes the raw logprobs;
    /// `sample_pick` (one block per row, launched only when a row samples) draws the other
    /// rows' tokens from the processed logits in the scratch. Writes `SAMPLE_OUT` words per row
    /// to `out` (decode with `PackedSampling::unpack`). `params` must hold `packed.words()`
    /// (uploaded by the caller, so that it can batch the copy); `logits` is f32 `[*, vocab]`
    /// and stays unchanged. `fed`: the step's input ids, `fed[r]` row r's (a fed decode step's,
    /// whose row r is sequence r), which a row that `count_input`s counts as one more output
    /// occurrence; needed only when `packed.counts_input()`.
    pub fn sample_rows(
        &self,
        logits: &impl DevicePtr<f32>,
        packed: &PackedSampling,
        params: &impl DevicePtr<u32>,
        fed: Option<&CudaView<'_, i32>>,
        scratch: &mut SampleScratch,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let (rows, vocab) = (packed.rows(), packed.vocab());
        if rows == 0 {
            return Ok(());
        }
        check_len("sampler logits", logits.len(), (packed.max_src_row() + 1) * vocab)?;
        let fed = check_fed(packed, fed)?;
        if !scratch.fits(rows, vocab) {
            return Err(crate::NinferError::Device(format!(
                "sampler scratch holds {} rows of vocab {}, the step needs {rows} rows of vocab {vocab}",
                scratch.rows, scratch.vocab
            )));
        }
        check_len("sampler params", params.len(), packed.words().len())?;
        check_len("sampler output", out.len(), rows * SAMPLE_OUT)?;
        let blocks = super::sample_scan_blocks(vocab);
        let s = self.stream();
        let (lp, _a) = logits.device_ptr(s);
        let (wp, _b) = scratch.work.device_ptr_mut(s);
        let (pp, _c) = params.device_ptr(s);
        let (op, _d) = out.device_ptr_mut(s);
        let (xp, _e) = scratch.partials.device_ptr_mut(s);
        let (cp, _f) = scratch.arrivals.device_ptr_mut(s);
        let (fp, _g) = fed.map(|f| f.device_ptr(s)).unzip();
        let v = as_i32("vocab", vocab)?;
        let grid = (as_i32("sampler blocks", blocks)? as u32, as_i32("rows", rows)? as u32, 1);
        let scan = self.function(KernelFamily::Sampling, "sample_scan")?;
        let args = kargs![lp, wp, v, pp, fp.unwrap_or(0), xp, cp, op];
        self.launch(&scan, cfg(grid, SCAN_THREADS), "sample_scan", &args)?;
        if packed.all_greedy() {
            return Ok(());
        }
        let pick = self.function(KernelFamily::Sampling, "sample_pick")?;
        let args = kargs![lp, wp, v, pp, op];
        self.launch(&pick, cfg((grid.1, 1, 1), SAMPLE_THREADS), "sample_pick", &args)
    }
}

/// The input ids a sampler launch reads: none unless some row counts its input, then one per
/// row at least.
fn check_fed<'a, 'b>(packed: &PackedSampling, fed: Option<&'a CudaView<'b, i32>>) -> Result<Option<&'a CudaView<'b, i32>>> {
    if !packed.counts_input() {
        return Ok(None);
    }
    let fed = fed.ok_or_else(|| crate::NinferError::invalid("sampler fed ids", "a row counts its step's input token and no input ids were given"))?;
    check_len("sampler fed ids", fed.len(), packed.rows())?;
    Ok(Some(fed))
}
