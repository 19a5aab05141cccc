//! `DeviceSampler`: the state of a `CudaModel`'s device-side sampling, so that a step copies
//! only token ids and logprobs to the host instead of `rows x vocab` f32 logits.
//!
//! Per step: the rows' `RowSampling`s are packed on the host (`PackedSampling`) and uploaded in
//! one copy, `sample_rows` runs on the step's logits buffer, and one copy brings back
//! `SAMPLE_OUT` words per row. `launch` queues all of it and `collect` waits for the results,
//! so a step can be sampled while the host still works on the one before (asynchronous
//! scheduling); `sample` is the two in a row. Every device buffer only grows.
//! With `device_sampling` off (`CudaOptions`) steps go through the host sampler instead, to
//! compare the two on one model.

use std::collections::VecDeque;

use cudarc::driver::{CudaSlice, CudaView};

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::ops::{PackedSampling, SampleScratch, SAMPLE_OUT};
use crate::backend::cuda::transfer::PinnedRing;
use crate::backend::cuda::CudaDevice;
use crate::model::runner::check_sampling_rows;
use crate::sampling::{RowSampling, SampledToken};
use crate::{NinferError, Result};

/// Device buffers and host staging of the device sampler.
pub struct DeviceSampler {
    enabled: bool,
    /// The packed rows of the last two launches (a launched step's results are unpacked with
    /// its own rows), used in turn.
    packed: [PackedSampling; 2],
    next_pack: usize,
    src_rows: Vec<usize>,
    params: Option<CudaSlice<u32>>,
    /// Processed logits, chunk partials and arrival counters of `sample_rows`.
    scratch: Option<SampleScratch>,
    out: Option<CudaSlice<u32>>,
    /// Sampler parameters up and results down, through page-locked staging (so that a step
    /// queued behind a running one waits for nothing).
    up: PinnedRing<u32>,
    down: PinnedRing<u32>,
    /// Launched and not yet collected: (pack index, staging index, rows), oldest first.
    pending: VecDeque<(usize, usize, usize)>,
}

impl DeviceSampler {
    /// The device sampler, used when `enabled` (the plan's `device_sampling`).
    pub fn new(enabled: bool) -> Self {
        DeviceSampler {
            enabled,
            packed: Default::default(),
            next_pack: 0,
            src_rows: Vec::new(),
            params: None,
            scratch: None,
            out: None,
            up: PinnedRing::new(2),
            down: PinnedRing::new(2),
            pending: VecDeque::new(),
        }
    }

    /// Whether steps sample on the device.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Sample the last logits row of every sequence with rows and wait for the tokens
    /// (`launch` then `collect`).
    pub fn sample(&mut self, dev: &CudaDevice, logits: &CudaSlice<f32>, counts: &[usize], rows: &[RowSampling], vocab: usize) -> Result<Vec<SampledToken>> {
        if !self.pending.is_empty() {
            return Err(NinferError::Device(format!("device sampler: a synchronous step while {} launched steps are uncollected", self.pending.len())));
        }
        self.launch(dev, logits, counts, rows, vocab, None)?;
        self.collect()
    }

    /// Queue the sampling of the last logits row of every sequence with rows (`counts[i]` rows
    /// for sequence `i`, packed in order in `logits`, f32 `[*, vocab]`; `rows[j]` goes with the
    /// j-th sequence that has rows) and the copy of its results to the host; `collect` returns
    /// them. At most two launches are uncollected at a time. `fed`: the step's input ids on the
    /// device when it is a fed decode step (its rows with penalties `count_input`).
    pub fn launch(&mut self, dev: &CudaDevice, logits: &CudaSlice<f32>, counts: &[usize], rows: &[RowSampling], vocab: usize, fed: Option<&CudaView<'_, i32>>) -> Result<()> {
        let mut src_rows = std::mem::take(&mut self.src_rows);
        src_rows.clear();
        let mut end = 0;
        for &c in counts {
            end += c;
            if c > 0 {
                src_rows.push(end - 1);
            }
        }
        let r = check_sampling_rows(src_rows.len(), rows.len()).and_then(|_| self.launch_rows(dev, logits, &src_rows, rows, vocab, fed));
        self.src_rows = src_rows;
        r
    }

    /// Pick the token of every row of a verify step whose sequence is picked by argmax and
    /// wait for them: `picks[i]` is sequence `i`'s greedy row, applied to each of its `counts[i]`
    /// logits rows (packed in sequence order in `logits`); ids come back for those sequences
    /// only (empty for the others). The same kernel as a decode step's greedy rows, so a
    /// verify row's token is the one a plain decode step would pick from the same logits.
    pub fn argmax_rows(&mut self, dev: &CudaDevice, logits: &CudaSlice<f32>, counts: &[usize], picks: &[Option<RowSampling>], vocab: usize) -> Result<Vec<Vec<u32>>> {
        if !self.pending.is_empty() {
            return Err(NinferError::Device(format!("device sampler: a verify step while {} launched steps are uncollected", self.pending.len())));
        }
        let (mut src_rows, mut rows) = (Vec::new(), Vec::new());
        let mut start = 0;
        for (&c, pick) in counts.iter().zip(picks) {
            if let Some(row) = pick {
                src_rows.extend(start..start + c);
                rows.extend(std::iter::repeat_n(row.clone(), c));
            }
            start += c;
        }
        self.launch_rows(dev, logits, &src_rows, &rows, vocab, None)?;
        let mut tokens = self.collect()?.into_iter().map(|s| s.token);
        Ok(counts.iter().zip(picks).map(|(&c, pick)| if pick.is_some() { tokens.by_ref().take(c).collect() } else { Vec::new() }).collect())
    }

    /// `launch` of `rows[j]` on logits row `src_rows[j]`.
    fn launch_rows(&mut self, dev: &CudaDevice, logits: &CudaSlice<f32>, src_rows: &[usize], rows: &[RowSampling], vocab: usize, fed: Option<&CudaView<'_, i32>>) -> Result<()> {
        if self.pending.len() >= self.packed.len() {
            return Err(NinferError::Device(format!("device sampler: {} launches are already uncollected", self.pending.len())));
        }
        let k = self.next_pack;
        self.next_pack = (k + 1) % self.packed.len();
        let n = rows.len();
        if n == 0 {
            self.pending.push_back((k, usize::MAX, 0));
            return Ok(());
        }
        self.reserve(dev, n, vocab)?;
        let packed = &mut self.packed[k];
        packed.pack(rows, src_rows, vocab)?;
        let words = packed.words();
        if self.params.as_ref().is_none_or(|b| b.len() < words.len()) {
            self.params = Some(dev.stream().alloc_zeros::<u32>(words.len().next_power_of_two()).map_err(driver_err("allocating sampler params"))?);
        }
        let params = self.params.as_mut().expect("allocated above");
        self.up.upload(dev, words, &mut params.slice_mut(0..words.len()))?;
        let (scratch, out) = (self.scratch.as_mut().expect("allocated above"), self.out.as_mut().expect("allocated above"));
        dev.sample_rows(logits, packed, &params.slice(0..words.len()), fed, scratch, out)?;
        let staged = self.down.download(dev, &out.slice(0..n * SAMPLE_OUT))?;
        self.pending.push_back((k, staged, n));
        Ok(())
    }

    /// Grows the scratch and output buffers to serve `rows` rows of width `vocab` (to the next
    /// power of two; they never shrink). The model calls it at startup for the most rows a
    /// step samples, so that they are part of the memory plan and no step allocates them.
    pub fn reserve(&mut self, dev: &CudaDevice, rows: usize, vocab: usize) -> Result<()> {
        let grow = rows.next_power_of_two();
        if self.scratch.as_ref().is_none_or(|b| !b.fits(rows, vocab)) {
            self.scratch = None;
            self.scratch = Some(SampleScratch::new(dev, grow, vocab)?);
        }
        if self.out.as_ref().is_none_or(|b| b.len() < rows * SAMPLE_OUT) {
            self.out = Some(dev.stream().alloc_zeros::<u32>(grow * SAMPLE_OUT).map_err(driver_err("allocating sampler output"))?);
        }
        Ok(())
    }

    /// Device bytes of the sampler's buffers.
    pub fn bytes(&self) -> usize {
        self.scratch.as_ref().map_or(0, |s| s.bytes()) + self.params.as_ref().map_or(0, |b| b.len() * 4) + self.out.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// The tokens of the oldest uncollected launch (waits for its copy).
    pub fn collect(&mut self) -> Result<Vec<SampledToken>> {
        let (k, staged, n) = self.pending.pop_front().ok_or_else(|| NinferError::Device("device sampler: nothing launched to collect".into()))?;
        if n == 0 {
            return Ok(Vec::new());
        }
        self.packed[k].unpack(self.down.downloaded(staged, n * SAMPLE_OUT)?)
    }

    /// The device output of the last launch (`SAMPLE_OUT` words a row; token first), which a
    /// decode step queued behind it takes its tokens from.
    pub fn last_output(&self) -> Result<&CudaSlice<u32>> {
        self.out.as_ref().ok_or_else(|| NinferError::Device("device sampler: no step was sampled on the device to feed from".into()))
    }

    /// Forget launches that will not be collected (after a failed step).
    pub fn reset(&mut self) {
        self.pending.clear();
    }
}
