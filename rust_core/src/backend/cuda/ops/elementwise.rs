//! Launchers for the embedding gather (cuda/embedding.cu), RoPE (cuda/rope.cu) and the
//! activations (cuda/activation.cu).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, strided_len};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

/// Grid of 256-thread blocks for a grid-stride loop over `total` elements.
pub(super) fn elementwise_grid(total: usize) -> (u32, u32, u32) {
    (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1)
}

/// Whether a [rows, n] elementwise op can run its `_v8` kernel (activation.cu): every row of
/// every operand starts on a 16-byte boundary (n and the strides multiples of 8 elements, the
/// base pointers 16-byte aligned).
fn rows_in_chunks(n: usize, strides: &[usize], ptrs: &[u64]) -> bool {
    n.is_multiple_of(8) && strides.iter().all(|s| s.is_multiple_of(8)) && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// Grid of the `_v8` kernels: x over a row's 16-byte chunks (256 a block), y over the rows
/// (the kernels stride past 65535).
fn chunked_rows_grid(rows: usize, n: usize) -> (u32, u32, u32) {
    ((n / 8).div_ceil(256).max(1) as u32, rows.clamp(1, 65_535) as u32, 1)
}

impl CudaDevice {
    /// out[t] = table[ids[t]] for `ids.len()` tokens; table is [vocab, hidden].
    pub fn embedding(
        &self,
        table: &impl DevicePtr<u16>,
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        vocab: usize,
        hidden: usize,
    ) -> Result<()> {
        let n = ids.len();
        check_len("embedding table", table.len(), vocab * hidden)?;
        check_len("embedding out", out.len(), n * hidden)?;
        let f = self.function(KernelFamily::Embedding, "embedding_gather")?;
        let s = self.stream();
        let (tp, _a) = table.device_ptr(s);
        let (ip, _b) = ids.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        let args = kargs![
            tp,
            ip,
            op,
            as_i32("hidden", hidden)?,
            as_i32("vocab", vocab)?,
        ];
        self.launch(&f, cfg((as_i32("tokens", n)? as u32, 1, 1), 128), "embedding_gather", &args)
    }

    /// NeoX RoPE in place on q [T, q_stride] and k [T, k_stride] (heads of `head_dim` from the
    /// row start), rotating the first `inv_freq.len() * 2` elements of each head; positions
    /// per token; cos/sin scaled by `attn_scale` (1 unless the rope scaling says otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_neox(
        &self,
        q: &mut impl DevicePtrMut<u16>,
        k: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        inv_freq: &impl DevicePtr<f32>,
        n_q_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        q_stride: usize,
        k_stride: usize,
        attn_scale: f32,
    ) -> Result<()> {
        let t = positions.len();
        let rotary_dim = inv_freq.len() * 2;
        if rotary_dim > head_dim {
            return Err(crate::NinferError::Device(format!(
                "rope: rotary_dim {rotary_dim} exceeds head_dim {head_dim}"
            )));
        }
        check_len("rope q", q.len(), strided_len(t, n_q_heads * head_dim, q_stride))?;
        check_len("rope k", k.len(), strided_len(t, n_kv_heads * head_dim, k_stride))?;
        let f = self.function(KernelFamily::Rope, "rope_neox")?;
        let s = self.stream();
        let (qp, _a) = q.device_ptr_mut(s);
        let (kp, _b) = k.device_ptr_mut(s);
        let (pp, _c) = positions.device_ptr(s);
        let (fp, _d) = inv_freq.device_ptr(s);
        // A thread per (token, pair), each over a group of heads; as many groups as keep about
        // 2048 threads on every SM busy (a prefill's pairs alone fill it: few, large groups, so
        // each cos/sin serves many heads; a short launch gets a group per head).
        let heads = n_q_heads + n_kv_heads;
        let pairs = t * (rotary_dim / 2);
        if pairs == 0 || heads == 0 {
            return Ok(());
        }
        let groups = (self.sm_count() * 2048).div_ceil(pairs).clamp(1, heads.min(65_535));
        let heads_per_group = heads.div_ceil(groups);
        let threads = pairs.next_multiple_of(32).min(256);
        let blocks = pairs.div_ceil(threads);
        let grid = (as_i32("rope blocks", blocks)? as u32, heads.div_ceil(heads_per_group) as u32, 1);
        let args = kargs![
            qp,
            kp,
            pp,
            fp,
            as_i32("tokens", t)?,
            as_i32("n_q_heads", n_q_heads)?,
            as_i32("n_kv_heads", n_kv_heads)?,
            as_i32("head_dim", head_dim)?,
            as_i32("rotary_dim", rotary_dim)?,
            q_stride as i64,
            k_stride as i64,
            attn_scale,
            heads_per_group as i32,
        ];
        self.launch_pdl(&f, cfg(grid, threads as u32), "rope_neox", &args)
    }

    /// out[r, i] = silu(gate[r, i]) * up[r, i]; out is contiguous [rows, n], gate and up rows
    /// are `gate_stride` / `up_stride` apart (a fused gate_up output is read in place).
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        gate: &impl DevicePtr<u16>,
        up: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<u16>,
        rows: usize,
        n: usize,
        gate_stride: usize,
        up_stride: usize,
    ) -> Result<()> {
        check_len("swiglu gate", gate.len(), strided_len(rows, n, gate_stride))?;
        check_len("swiglu up", up.len(), strided_len(rows, n, up_stride))?;
        check_len("swiglu out", out.len(), rows * n)?;
        let s = self.stream();
        let (gp, _a) = gate.device_ptr(s);
        let (upp, _b) = up.device_ptr(s);
        let (op, _c) = out.device_ptr_mut(s);
        let args = kargs![
            gp,
            upp,
            op,
            as_i32("rows", rows)?,
            as_i32("n", n)?,
            gate_stride as i64,
            up_stride as i64,
        ];
        if rows_in_chunks(n, &[gate_stride, up_stride], &[gp, upp, op]) {
            let f = self.function(KernelFamily::Activation, "swiglu_v8")?;
            return self.launch_pdl(&f, cfg(chunked_rows_grid(rows, n), 256), "swiglu_v8", &args);
        }
        let f = self.function(KernelFamily::Activation, "swiglu")?;
        self.launch_pdl(&f, cfg(elementwise_grid(rows * n), 256), "swiglu", &args)
    }

    /// x[r, i] *= sigmoid(gate[r, i]) in place (the gated attention output of Qwen3.5); x is
    /// contiguous [rows, n], gate rows are `gate_stride` apart.
    pub fn sigmoid_gate_mul(
        &self,
        x: &mut impl DevicePtrMut<u16>,
        gate: &impl DevicePtr<u16>,
        rows: usize,
        n: usize,
        gate_stride: usize,
    ) -> Result<()> {
        check_len("sigmoid_gate_mul x", x.len(), rows * n)?;
        check_len("sigmoid_gate_mul gate", gate.len(), strided_len(rows, n, gate_stride))?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr_mut(s);
        let (gp, _b) = gate.device_ptr(s);
        let args = kargs![
            xp,
            gp,
            xp,
            as_i32("rows", rows)?,
            as_i32("n", n)?,
            gate_stride as i64,
        ];
        if rows_in_chunks(n, &[gate_stride], &[xp, gp]) {
            let f = self.function(KernelFamily::Activation, "sigmoid_gate_mul_v8")?;
            return self.launch_pdl(&f, cfg(chunked_rows_grid(rows, n), 256), "sigmoid_gate_mul_v8", &args);
        }
        let f = self.function(KernelFamily::Activation, "sigmoid_gate_mul")?;
        self.launch_pdl(&f, cfg(elementwise_grid(rows * n), 256), "sigmoid_gate_mul", &args)
    }
}
