//! Greedy sampling on the device (cuda/sampling.cu).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, KArg};
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
}
