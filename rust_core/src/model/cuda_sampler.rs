//! `DeviceSampler`: the state of a `CudaModel`'s device-side sampling, so that a step copies
//! only token ids and logprobs to the host instead of `rows x vocab` f32 logits.
//!
//! Per step: the rows' `RowSampling`s are packed on the host (`PackedSampling`) and uploaded in
//! one copy, `sample_rows` runs on the step's logits buffer, and one copy brings back
//! `SAMPLE_OUT` words per row. Every device buffer only grows. `NINFER_DEVICE_SAMPLING=0` (read
//! at load) sends steps through the host sampler instead, to compare the two on one model.

use cudarc::driver::CudaSlice;

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::ops::{PackedSampling, SampleScratch, SAMPLE_OUT};
use crate::backend::cuda::CudaDevice;
use crate::model::runner::check_sampling_rows;
use crate::sampling::{RowSampling, SampledToken};
use crate::Result;

/// Device buffers and host staging of the device sampler.
pub struct DeviceSampler {
    enabled: bool,
    packed: PackedSampling,
    src_rows: Vec<usize>,
    params: Option<CudaSlice<u32>>,
    /// Processed logits, chunk partials and arrival counters of `sample_rows`.
    scratch: Option<SampleScratch>,
    out: Option<CudaSlice<u32>>,
}

impl DeviceSampler {
    /// On unless the switch `NINFER_DEVICE_SAMPLING` is off (`config::env_switch`).
    pub fn from_env() -> crate::Result<Self> {
        let enabled = crate::config::env_switch("NINFER_DEVICE_SAMPLING", true)?;
        Ok(DeviceSampler { enabled, packed: PackedSampling::default(), src_rows: Vec::new(), params: None, scratch: None, out: None })
    }

    /// Whether steps sample on the device.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Sample the last logits row of every sequence with rows (`counts[i]` rows for sequence
    /// `i`, packed in order in `logits`, f32 `[*, vocab]`): `rows[j]` goes with the j-th
    /// sequence that has rows. Synchronizes on the copy of the results.
    pub fn sample(&mut self, dev: &CudaDevice, logits: &CudaSlice<f32>, counts: &[usize], rows: &[RowSampling], vocab: usize) -> Result<Vec<SampledToken>> {
        self.src_rows.clear();
        let mut end = 0;
        for &c in counts {
            end += c;
            if c > 0 {
                self.src_rows.push(end - 1);
            }
        }
        check_sampling_rows(self.src_rows.len(), rows.len())?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.packed.pack(rows, &self.src_rows, vocab)?;
        let n = rows.len();
        let words = self.packed.words();
        let stream = dev.stream();
        let grow = |len: usize| len.next_power_of_two();
        if self.params.as_ref().is_none_or(|b| b.len() < words.len()) {
            self.params = Some(stream.alloc_zeros::<u32>(grow(words.len())).map_err(driver_err("allocating sampler params"))?);
        }
        if self.scratch.as_ref().is_none_or(|b| !b.fits(n, vocab)) {
            self.scratch = None;
            self.scratch = Some(SampleScratch::new(dev, grow(n), vocab)?);
        }
        if self.out.as_ref().is_none_or(|b| b.len() < n * SAMPLE_OUT) {
            self.out = Some(stream.alloc_zeros::<u32>(grow(n) * SAMPLE_OUT).map_err(driver_err("allocating sampler output"))?);
        }
        let params = self.params.as_mut().expect("allocated above");
        stream.memcpy_htod(words, &mut params.slice_mut(0..words.len())).map_err(driver_err("uploading sampler params"))?;
        let (scratch, out) = (self.scratch.as_mut().expect("allocated above"), self.out.as_mut().expect("allocated above"));
        dev.sample_rows(logits, &self.packed, &params.slice(0..words.len()), scratch, out)?;
        let host = stream.clone_dtoh(&out.slice(0..n * SAMPLE_OUT)).map_err(driver_err("copying sampled tokens to the host"))?;
        self.packed.unpack(&host)
    }
}
