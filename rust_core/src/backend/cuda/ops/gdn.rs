//! Gated DeltaNet launchers (cuda/gdn.cu): causal conv1d with carried state, the decay and
//! beta gates, and the recurrent delta rule with fp32 state. Sequences are packed by
//! `cu_seqlens` ([n_seqs + 1] token offsets) and own state slot `slots[s]`.

use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{as_i32, cfg, check_len, strided_len};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Shapes of a causal conv1d call. conv_state is [n_slots, channels, kernel_size - 1] (the
/// CPU backend's per-sequence [c, k-1] layout, one block per slot).
#[derive(Debug, Clone, Copy)]
pub struct ConvShape {
    /// Packed tokens across all sequences.
    pub n_tokens: usize,
    /// Channels (the GDN conv dim: 2 * key_dim + value_dim).
    pub channels: usize,
    /// Elements between consecutive tokens' rows of x.
    pub x_stride: usize,
    /// Conv kernel size: 2, 3 or 4.
    pub kernel_size: usize,
    /// State slots in the pool (bounds-checks conv_state).
    pub n_slots: usize,
}

/// Shapes of a recurrent gated-delta-rule call. state is f32 [n_slots, n_v_heads, dk, dv].
#[derive(Debug, Clone, Copy)]
pub struct RecurrentShape {
    /// Packed tokens across all sequences.
    pub n_tokens: usize,
    /// Key (and query) heads.
    pub n_k_heads: usize,
    /// Value heads (a multiple of n_k_heads).
    pub n_v_heads: usize,
    /// Key head size: 64 or 128.
    pub dk: usize,
    /// Value head size (a multiple of 32).
    pub dv: usize,
    /// Elements between tokens' q rows (and k rows).
    pub qk_stride: usize,
    /// Elements between tokens' v rows.
    pub v_stride: usize,
    /// State slots in the pool.
    pub n_slots: usize,
}

/// Largest value head dim of `gdn_conv_recurrent_gated` (one thread per value column; the kernel's
/// __launch_bounds__(256, 1) in cuda/gdn.cu).
pub const GATED_MAX_DV: usize = 256;

/// Tokens per block of `causal_conv1d_tiled_k*` (CONV_TOKEN_TILE in cuda/gdn.cu).
const CONV_TOKEN_TILE: usize = 32;
/// The largest grid y dimension CUDA launches.
const MAX_GRID_Y: usize = 65535;

/// Which conv1d kernels run a step. Both compute each output with the same f32 operations in
/// the same order, so they give the same bytes (outputs and state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvPath {
    /// `causal_conv1d_k*`: one thread per (sequence, channel) walks the sequence's tokens and
    /// updates the state in the same pass. One launch; serial over time.
    PerSequence,
    /// `causal_conv1d_tiled_k*` (blocks own channel x token tiles, parallel over time) then
    /// `causal_conv1d_state_k*` (the new state, after every read of the old one).
    Tiled,
}

impl ConvPath {
    /// Decode steps (as many tokens as sequences: one each) keep the single launch; prefill
    /// and mixed steps tile time.
    pub fn for_step(n_tokens: usize, n_seqs: usize) -> ConvPath {
        if n_tokens > n_seqs {
            ConvPath::Tiled
        } else {
            ConvPath::PerSequence
        }
    }
}

fn check_slots(slots: usize, cu_seqlens: usize) -> Result<usize> {
    if cu_seqlens != slots + 1 {
        return Err(NinferError::Device(format!(
            "gdn: cu_seqlens has {cu_seqlens} entries for {slots} sequences (needs n_seqs + 1)"
        )));
    }
    Ok(slots)
}

/// The shape and buffer-length checks every delta-rule launch shares (`gdn_recurrent`,
/// `gdn_chunked`): lens are q, k, v, g, beta, state, cu_seqlens, slots, out in elements.
/// Returns the sequence count.
pub(super) fn check_delta_rule(sh: &RecurrentShape, lens: [usize; 9]) -> Result<usize> {
    let [q, k, v, g, beta, state, cu_seqlens, slots, out] = lens;
    let n_seqs = check_slots(slots, cu_seqlens)?;
    if !sh.dv.is_multiple_of(32) || sh.n_k_heads == 0 || !sh.n_v_heads.is_multiple_of(sh.n_k_heads) {
        return Err(NinferError::Device(format!(
            "gdn: dv {} must be a multiple of 32 and {} v heads a multiple of {} k heads",
            sh.dv, sh.n_v_heads, sh.n_k_heads
        )));
    }
    let t = sh.n_tokens;
    check_len("gdn q", q, strided_len(t, sh.n_k_heads * sh.dk, sh.qk_stride))?;
    check_len("gdn k", k, strided_len(t, sh.n_k_heads * sh.dk, sh.qk_stride))?;
    check_len("gdn v", v, strided_len(t, sh.n_v_heads * sh.dv, sh.v_stride))?;
    check_len("gdn g", g, t * sh.n_v_heads)?;
    check_len("gdn beta", beta, t * sh.n_v_heads)?;
    check_len("gdn state", state, sh.n_slots * sh.n_v_heads * sh.dk * sh.dv)?;
    check_len("gdn out", out, t * sh.n_v_heads * sh.dv)?;
    Ok(n_seqs)
}

impl CudaDevice {
    /// out[t] = silu(conv(window of x ending at t) + bias) per channel, with the window
    /// starting in conv_state; conv_state is left holding each sequence's last K-1 inputs.
    /// Decode is one token per sequence. bias may be absent. The kernel form is
    /// `ConvPath::for_step` (both give the same bytes).
    #[allow(clippy::too_many_arguments)]
    pub fn causal_conv1d(
        &self,
        x: &impl DevicePtr<u16>,
        conv_state: &mut impl DevicePtrMut<u16>,
        weight: &impl DevicePtr<u16>,
        bias: Option<&dyn DevicePtrDyn>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &ConvShape,
    ) -> Result<()> {
        let path = ConvPath::for_step(shape.n_tokens, slots.len());
        self.causal_conv1d_via(path, x, conv_state, weight, bias, cu_seqlens, slots, out, shape)
    }

    /// `causal_conv1d` with the kernel form chosen by the caller (the op-parity tests run
    /// both forms on the same inputs).
    #[allow(clippy::too_many_arguments)]
    pub fn causal_conv1d_via(
        &self,
        path: ConvPath,
        x: &impl DevicePtr<u16>,
        conv_state: &mut impl DevicePtrMut<u16>,
        weight: &impl DevicePtr<u16>,
        bias: Option<&dyn DevicePtrDyn>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &ConvShape,
    ) -> Result<()> {
        let sh = shape;
        let n_seqs = check_slots(slots.len(), cu_seqlens.len())?;
        let [per_seq, tiled, update] = match sh.kernel_size {
            2 => ["causal_conv1d_k2", "causal_conv1d_tiled_k2", "causal_conv1d_state_k2"],
            3 => ["causal_conv1d_k3", "causal_conv1d_tiled_k3", "causal_conv1d_state_k3"],
            4 => ["causal_conv1d_k4", "causal_conv1d_tiled_k4", "causal_conv1d_state_k4"],
            k => return Err(NinferError::Unsupported(format!("CUDA conv1d with kernel size {k}"))),
        };
        check_len("conv1d x", x.len(), strided_len(sh.n_tokens, sh.channels, sh.x_stride))?;
        check_len(
            "conv1d conv_state",
            conv_state.len(),
            sh.n_slots * (sh.kernel_size - 1) * sh.channels,
        )?;
        check_len("conv1d weight", weight.len(), sh.channels * sh.kernel_size)?;
        check_len("conv1d out", out.len(), sh.n_tokens * sh.channels)?;
        if let Some(b) = bias {
            check_len("conv1d bias", b.elems(), sh.channels)?;
        }
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (cp, _b) = conv_state.device_ptr_mut(s);
        let (wp, _c) = weight.device_ptr(s);
        let (qp, _d) = cu_seqlens.device_ptr(s);
        let (sp, _e) = slots.device_ptr(s);
        let (op, _f) = out.device_ptr_mut(s);
        let bp = bias.map(|b| b.raw_ptr(s)).unwrap_or(0);
        let channels = as_i32("channels", sh.channels)?;
        let seq_grid = (sh.channels.div_ceil(128) as u32, as_i32("n_seqs", n_seqs)? as u32, 1);
        match path {
            ConvPath::PerSequence => {
                let f = self.function(KernelFamily::Gdn, per_seq)?;
                let args = kargs![
                    xp,
                    sh.x_stride as i64,
                    cp,
                    wp,
                    bp,
                    qp,
                    sp,
                    channels,
                    op,
                ];
                self.launch_pdl(&f, cfg(seq_grid, 128), per_seq, &args)
            }
            ConvPath::Tiled => {
                let tiles = sh.n_tokens.div_ceil(CONV_TOKEN_TILE);
                if tiles > MAX_GRID_Y {
                    return Err(NinferError::Device(format!(
                        "conv1d: {} tokens in one step is {tiles} token tiles of {CONV_TOKEN_TILE} (grid limit {MAX_GRID_Y})",
                        sh.n_tokens
                    )));
                }
                let f = self.function(KernelFamily::Gdn, tiled)?;
                let args = kargs![
                    xp,
                    sh.x_stride as i64,
                    cp,
                    wp,
                    bp,
                    qp,
                    sp,
                    n_seqs as i32,
                    channels,
                    op,
                ];
                let grid = (sh.channels.div_ceil(128) as u32, tiles as u32, 1);
                self.launch_pdl(&f, cfg(grid, 128), tiled, &args)?;
                // Stream order (or the PDL wait, which returns once the conv grid has
                // completed) puts every read of the old state before these writes.
                let f = self.function(KernelFamily::Gdn, update)?;
                let args = kargs![
                    xp,
                    sh.x_stride as i64,
                    cp,
                    qp,
                    sp,
                    channels,
                ];
                self.launch_pdl(&f, cfg(seq_grid, 128), update, &args)
            }
        }
    }

    /// g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), per token and value
    /// head; a and b are n_heads storage-type values per token, token t's at t * ab_stride
    /// (columns of the fused input projection's rows), A_log and dt_bias f32 [n_heads], g and
    /// beta [T, n_heads].
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_gates(
        &self,
        a: &impl DevicePtr<u16>,
        b: &impl DevicePtr<u16>,
        ab_stride: usize,
        a_log: &impl DevicePtr<f32>,
        dt_bias: &impl DevicePtr<f32>,
        g: &mut impl DevicePtrMut<f32>,
        beta: &mut impl DevicePtrMut<f32>,
        n_tokens: usize,
        n_heads: usize,
    ) -> Result<()> {
        let n = n_tokens * n_heads;
        if ab_stride < n_heads {
            return Err(NinferError::Device(format!("gdn_gates: row stride {ab_stride} below the {n_heads} heads")));
        }
        check_len("gdn_gates a", a.len(), strided_len(n_tokens, n_heads, ab_stride))?;
        check_len("gdn_gates b", b.len(), strided_len(n_tokens, n_heads, ab_stride))?;
        check_len("gdn_gates A_log", a_log.len(), n_heads)?;
        check_len("gdn_gates dt_bias", dt_bias.len(), n_heads)?;
        check_len("gdn_gates g", g.len(), n)?;
        check_len("gdn_gates beta", beta.len(), n)?;
        let f = self.function(KernelFamily::Gdn, "gdn_gates")?;
        let s = self.stream();
        let (ap, _a) = a.device_ptr(s);
        let (bp, _b) = b.device_ptr(s);
        let (lp, _c) = a_log.device_ptr(s);
        let (dp, _d) = dt_bias.device_ptr(s);
        let (gp, _e) = g.device_ptr_mut(s);
        let (ep, _f) = beta.device_ptr_mut(s);
        let args = kargs![
            ap,
            bp,
            ab_stride as i64,
            lp,
            dp,
            as_i32("tokens", n_tokens)?,
            as_i32("heads", n_heads)?,
            gp,
            ep,
        ];
        let grid = (as_i32("gates", n.div_ceil(256))? as u32, 1, 1);
        self.launch_pdl(&f, cfg(grid, 256), "gdn_gates", &args)
    }

    /// The recurrent gated delta rule over each sequence's tokens in order, updating its fp32
    /// state in place; q/k are L2-normalised inside and q scaled by dk^-1/2. out is
    /// [T, n_v_heads, dv]. Used for decode and short prefill chunks (`gdn_chunked` for long ones).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_recurrent(
        &self,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        let name = match shape.dk {
            64 => "gdn_recurrent_dk64",
            128 => "gdn_recurrent_dk128",
            d => return Err(NinferError::Unsupported(format!("CUDA GDN with key head dim {d}"))),
        };
        let f = self.function(KernelFamily::Gdn, name)?;
        self.delta_rule_launch(&f, name, 32, 0, q, k, v, g, beta, state, cu_seqlens, slots, out, shape)
    }

    /// A GDN layer's core in one kernel, for decode and chunks shorter than the chunked
    /// kernel's: per token, the causal conv of the q / k / v channels (as `causal_conv1d`, the
    /// conv state updated in place), the gates from the projection's `a` / `b` columns (as
    /// `gdn_gates`), the recurrent delta rule (as `gdn_recurrent`, state updated in place) and
    /// the gated output norm out = rmsnorm(o) * norm_w * silu(z) (as `rmsnorm_gated`, eps
    /// `eps`). x rows (`conv.x_stride` apart) hold the conv channels q | k | v from column 0;
    /// a / b hold n_v_heads values per token at t * ab_stride, z n_v_heads * dv at
    /// t * z_stride; out is [T, n_v_heads, dv]. For dv <= 256 the output and both states are
    /// the four-kernel path's bits. `tickets` holds one zeroed counter per (sequence, key
    /// head), left zeroed (the kernel's election of the block that writes a key head's conv
    /// state). One block of dv threads per (value head, sequence), so dv is at most 256.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_conv_recurrent_gated(
        &self,
        x: &impl DevicePtr<u16>,
        conv_state: &mut impl DevicePtrMut<u16>,
        conv_w: &impl DevicePtr<u16>,
        conv_b: Option<&dyn DevicePtrDyn>,
        conv: &ConvShape,
        tickets: &mut impl DevicePtrMut<u32>,
        a: &impl DevicePtr<u16>,
        b: &impl DevicePtr<u16>,
        ab_stride: usize,
        a_log: &impl DevicePtr<f32>,
        dt_bias: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        z: &impl DevicePtr<u16>,
        z_stride: usize,
        norm_w: &impl DevicePtr<u16>,
        eps: f32,
        out: &mut impl DevicePtrMut<u16>,
        sh: &RecurrentShape,
    ) -> Result<()> {
        // At dk = dv = 128 (every Qwen3.5 / Qwen3-Next GDN head) an instance with dv fixed,
        // whose state addresses are immediate offsets and whose launch bounds fit three blocks
        // an SM; same arithmetic.
        let name = match (sh.dk, sh.dv) {
            (128, 128) => "gdn_conv_recurrent_gated_dk128_dv128",
            (64, _) => "gdn_conv_recurrent_gated_dk64",
            (128, _) => "gdn_conv_recurrent_gated_dk128",
            (d, _) => return Err(NinferError::Unsupported(format!("CUDA GDN with key head dim {d}"))),
        };
        if sh.dv > GATED_MAX_DV {
            return Err(NinferError::Unsupported(format!("fused GDN decode with value head dim {} (at most {GATED_MAX_DV})", sh.dv)));
        }
        if !(2..=4).contains(&conv.kernel_size) {
            return Err(NinferError::Unsupported(format!("CUDA conv1d with kernel size {}", conv.kernel_size)));
        }
        let (t, nv) = (sh.n_tokens, sh.n_v_heads);
        let channels = 2 * sh.n_k_heads * sh.dk + nv * sh.dv;
        if conv.channels != channels || conv.n_tokens != t || conv.n_slots != sh.n_slots {
            return Err(NinferError::Device(format!(
                "gdn_conv_recurrent_gated: conv shape {conv:?} does not match {channels} q / k / v channels of {t} tokens and {} slots",
                sh.n_slots
            )));
        }
        if ab_stride < nv || z_stride < nv * sh.dv {
            return Err(NinferError::Device(format!(
                "gdn_conv_recurrent_gated: row strides a/b {ab_stride}, z {z_stride} below {nv} heads x {}",
                sh.dv
            )));
        }
        // q / k / v are read from x (checked here) and the gates computed inside, so those
        // five have no buffers of their own to check.
        let qkv = strided_len(t, channels, conv.x_stride);
        let n_seqs = check_delta_rule(sh, [qkv, qkv, qkv, t * nv, t * nv, state.len(), cu_seqlens.len(), slots.len(), out.len()])?;
        check_len("gdn_conv_recurrent_gated x", x.len(), qkv)?;
        check_len("gdn_conv_recurrent_gated conv_state", conv_state.len(), sh.n_slots * channels * (conv.kernel_size - 1))?;
        check_len("gdn_conv_recurrent_gated conv weight", conv_w.len(), channels * conv.kernel_size)?;
        if let Some(cb) = conv_b {
            check_len("gdn_conv_recurrent_gated conv bias", cb.elems(), channels)?;
        }
        check_len("gdn_conv_recurrent_gated tickets", tickets.len(), n_seqs * sh.n_k_heads)?;
        check_len("gdn_conv_recurrent_gated a", a.len(), strided_len(t, nv, ab_stride))?;
        check_len("gdn_conv_recurrent_gated b", b.len(), strided_len(t, nv, ab_stride))?;
        check_len("gdn_conv_recurrent_gated A_log", a_log.len(), nv)?;
        check_len("gdn_conv_recurrent_gated dt_bias", dt_bias.len(), nv)?;
        check_len("gdn_conv_recurrent_gated z", z.len(), strided_len(t, nv * sh.dv, z_stride))?;
        check_len("gdn_conv_recurrent_gated norm", norm_w.len(), sh.dv)?;
        if n_seqs == 0 {
            return Ok(());
        }
        let f = self.function(KernelFamily::Gdn, name)?;
        let s = self.stream();
        let (xp, _x) = x.device_ptr(s);
        let (csp, _cs) = conv_state.device_ptr_mut(s);
        let (cwp, _cw) = conv_w.device_ptr(s);
        let cbp = conv_b.map(|cb| cb.raw_ptr(s)).unwrap_or(0);
        let (tp, _t) = tickets.device_ptr_mut(s);
        let (ap, _d) = a.device_ptr(s);
        let (bp, _e) = b.device_ptr(s);
        let (alp, _f) = a_log.device_ptr(s);
        let (dtp, _g) = dt_bias.device_ptr(s);
        let (sp, _h) = state.device_ptr_mut(s);
        let (cp, _i) = cu_seqlens.device_ptr(s);
        let (lp, _j) = slots.device_ptr(s);
        let (zp, _k) = z.device_ptr(s);
        let (wp, _l) = norm_w.device_ptr(s);
        let (op, _m) = out.device_ptr_mut(s);
        let args = kargs![
            xp,
            conv.x_stride as i64,
            csp,
            cwp,
            cbp,
            conv.kernel_size as i32,
            tp,
            ap,
            bp,
            ab_stride as i64,
            alp,
            dtp,
            sp,
            cp,
            lp,
            zp,
            z_stride as i64,
            wp,
            eps,
            as_i32("n_k_heads", sh.n_k_heads)?,
            as_i32("n_v_heads", nv)?,
            as_i32("dv", sh.dv)?,
            op,
        ];
        let grid = (nv as u32, as_i32("n_seqs", n_seqs)? as u32, 1);
        let config = LaunchConfig { grid_dim: grid, block_dim: (sh.dv as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch_pdl(&f, config, name, &args)
    }

    /// The checked launch of a one-pass delta-rule kernel: the arguments of `gdn_recurrent`
    /// and a grid of (dv / 32 value columns, v heads, sequences).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_rule_launch(
        &self,
        f: &CudaFunction,
        name: &str,
        block: u32,
        smem: u32,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        sh: &RecurrentShape,
    ) -> Result<()> {
        let n_seqs = check_delta_rule(sh, [q.len(), k.len(), v.len(), g.len(), beta.len(), state.len(), cu_seqlens.len(), slots.len(), out.len()])?;
        let s = self.stream();
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k.device_ptr(s);
        let (vp, _c) = v.device_ptr(s);
        let (gp, _d) = g.device_ptr(s);
        let (bp, _e) = beta.device_ptr(s);
        let (sp, _f) = state.device_ptr_mut(s);
        let (cp, _g) = cu_seqlens.device_ptr(s);
        let (lp, _h) = slots.device_ptr(s);
        let (op, _i) = out.device_ptr_mut(s);
        let args = kargs![
            qp,
            kp,
            sh.qk_stride as i64,
            vp,
            sh.v_stride as i64,
            gp,
            bp,
            sp,
            cp,
            lp,
            as_i32("n_k_heads", sh.n_k_heads)?,
            as_i32("n_v_heads", sh.n_v_heads)?,
            as_i32("dv", sh.dv)?,
            op,
        ];
        let grid = ((sh.dv / 32) as u32, sh.n_v_heads as u32, as_i32("n_seqs", n_seqs)? as u32);
        let config = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem };
        self.launch(f, config, name, &args)
    }
}

/// An optional read-only storage buffer passed by reference (conv bias): object-safe
/// counterpart of `DevicePtr<u16>`.
pub trait DevicePtrDyn {
    /// Element count.
    fn elems(&self) -> usize;
    /// The raw device address, ordered after pending writes on `stream`.
    fn raw_ptr(&self, stream: &cudarc::driver::CudaStream) -> u64;
}

impl<T: DevicePtr<u16>> DevicePtrDyn for T {
    fn elems(&self) -> usize {
        self.len()
    }
    fn raw_ptr(&self, stream: &cudarc::driver::CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}
