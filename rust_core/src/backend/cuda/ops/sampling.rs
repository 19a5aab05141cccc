//! Sampling on the device (cuda/sampling.cu): greedy argmax + logsumexp, and the full sampler
//! (`sample_rows`) whose inputs `PackedSampling` lays out.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, KArg, PackedSampling, SAMPLE_OUT};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

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
            [KArg::Ptr(lp), KArg::I32(as_i32("vocab", vocab)?), KArg::Ptr(ip), KArg::Ptr(sp)];
        self.launch(&f, cfg((as_i32("rows", rows)? as u32, 1, 1), 1024), "argmax_logsumexp", &args)
    }

    /// Sample every row of `packed`: the kernel applies the row's grammar mask, bias and
    /// penalties into `work` (f32 `[rows, vocab]`, scratch), picks the token (greedy or with the
    /// row's u) and writes `SAMPLE_OUT` words per row to `out` (decode with
    /// `PackedSampling::unpack`). `params` must hold `packed.words()` (uploaded by the caller,
    /// so that it can batch the copy); `logits` is f32 `[*, vocab]` and stays unchanged.
    pub fn sample_rows(
        &self,
        logits: &impl DevicePtr<f32>,
        work: &mut impl DevicePtrMut<f32>,
        packed: &PackedSampling,
        params: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let (rows, vocab) = (packed.rows(), packed.vocab());
        if rows == 0 {
            return Ok(());
        }
        check_len("sampler logits", logits.len(), (packed.max_src_row() + 1) * vocab)?;
        check_len("sampler work", work.len(), rows * vocab)?;
        check_len("sampler params", params.len(), packed.words().len())?;
        check_len("sampler output", out.len(), rows * SAMPLE_OUT)?;
        let f = self.function(KernelFamily::Sampling, "sample_rows")?;
        let s = self.stream();
        let (lp, _a) = logits.device_ptr(s);
        let (wp, _b) = work.device_ptr_mut(s);
        let (pp, _c) = params.device_ptr(s);
        let (op, _d) = out.device_ptr_mut(s);
        let args = [KArg::Ptr(lp), KArg::Ptr(wp), KArg::I32(as_i32("vocab", vocab)?), KArg::Ptr(pp), KArg::Ptr(op)];
        self.launch(&f, cfg((as_i32("rows", rows)? as u32, 1, 1), 1024), "sample_rows", &args)
    }
}
