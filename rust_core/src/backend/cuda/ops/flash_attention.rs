//! Prefill attention launcher (cuda/flash_attention.cu): causal flash attention on tensor
//! cores over the paged KV cache, for steps whose sequences bring chunks of query rows.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::attention::PagedAttentionShape;
use super::{as_i32, check_len};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::backend::cuda::plan::{DeviceFacts, Plan};
use crate::{NinferError, Result};

/// Shared-memory row padding in elements (FA_PAD).
const FA_PAD: usize = 8;

/// How a flash attention block covers its work (the two tilings of flash_attention.cu's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashTile {
    /// 4 warps = 64 query rows a block, one K/V tile loaded synchronously: every head size, on
    /// every sm_80+ device.
    Rows64,
    /// Head sizes 256 and 128: 8 warps = 128 query rows a block, two K/V tiles filled by
    /// cp.async (the copy of the next tile overlaps the products of this one, and each K/V tile
    /// crosses L2 once per 128 rows instead of 64). Needs 132 KiB (d 256) or 102 KiB (d 128) of
    /// shared memory a block: sm_80 and sm_90, not sm_86/sm_89 (99 KiB). At d 128 a block takes 182 registers a lane (166 before the unmasked-tile branch), one block (8 warps) an SM
    /// against the 64-row kernel's three (12 warps), and still wins: Llama-3-8B prefill at
    /// 2k / 8k / 32k +7% / +11% / +28% on the H200.
    Rows128Async,
    /// Head size 128: as Rows128Async with K/V tiles of 128 keys instead of 64 (half the
    /// barriers, softmax rescales and staging waits per key; 234 registers a lane at sm_90a (NVRTC 12.9), no spills;
    /// 174 KiB of shared memory a block: sm_90 only).
    Rows128AsyncKeys128,
    /// Head sizes 128 and 256 on Hopper (sm_90a code): 128-row blocks of two warpgroups whose
    /// products are wgmma (Q and K, then V, read from shared memory; P from registers), K/V
    /// tiles filled by cp.async (128 keys at d 128, 32 at d 256 where O alone takes 128
    /// registers a lane); P V of one tile overlaps the scores of the next. Built by NVRTC 13,
    /// P V reads V in place (three K/V buffers); by NVRTC 12, from two f16 V^T tiles (two K/V
    /// buffers). Either way 225 / 193 KiB of shared memory a block (flash_attention_sm90.cu).
    Rows128Wgmma,
    /// Rows128Wgmma at d 128 and d 256, warp-specialized (flash_wgmma_ws_body): a third warpgroup only
    /// stages K/V (three buffers, "full" / "empty" mbarriers) and the two consumer warpgroups
    /// meet at no block barrier, so one's softmax runs under the other's products (+18% at 8k
    /// on the H200). The direct form only: sm_90a code built by NVRTC 13. The same shared
    /// memory, 384 threads; outputs equal to Rows128Wgmma's bit for bit. Persistent: a block an
    /// SM taking the (row tile, head, sequence) work items from `CudaDevice::fa_work` (8k d 128
    /// 0.996 -> 0.916 ms on the H200).
    Rows128WgmmaWs,
}

impl FlashTile {
    /// Every tiling (the op tests run each one the device holds).
    pub const ALL: [FlashTile; 5] = [
        FlashTile::Rows64,
        FlashTile::Rows128Async,
        FlashTile::Rows128AsyncKeys128,
        FlashTile::Rows128Wgmma,
        FlashTile::Rows128WgmmaWs,
    ];

    /// The warp-specialized form (sm_90a code built by NVRTC 13 only: the plan's
    /// `prefill_warp_specialized`).
    pub fn warp_specialized(self) -> bool {
        self == FlashTile::Rows128WgmmaWs
    }
}

/// The tilings in the order `flash_tile` prefers them (each measured faster than the next where
/// both fit: `flash_attention_prefill_timing_at_2k_and_8k` fails otherwise).
const ROUTE_ORDER: [FlashTile; 5] = [
    FlashTile::Rows128WgmmaWs,
    FlashTile::Rows128Wgmma,
    FlashTile::Rows128AsyncKeys128,
    FlashTile::Rows128Async,
    FlashTile::Rows64,
];

/// One kernel instance (FA_INSTANCE in flash_attention.cu, FA_WGMMA_INSTANCE and
/// FA_WGMMA_WS_INSTANCE in flash_attention_sm90.cu, whose lists this repeats).
struct Instance {
    name: &'static str,
    /// Keys per K/V tile.
    bn: usize,
    /// Warps per block that own 16 query rows each.
    warps: usize,
    /// Warps per block that only stage K/V (the warp-specialized form's producer warpgroup).
    producer_warps: usize,
    /// K/V tile buffers in shared memory.
    buffers: usize,
    /// wgmma products (sm_90a code only): unpadded tiles in the 128-byte swizzle layout plus a
    /// V^T tile a buffer (the bytes the NVRTC 13 form uses for its third K/V buffer).
    wgmma: bool,
}

impl Instance {
    fn rows(&self) -> usize {
        16 * self.warps
    }

    /// Dynamic shared memory: the Q tile and each buffer's K and V tiles, rows of 16 bits
    /// (padded for the mma.sync kernels; the wgmma kernel's swizzled layout needs no padding and
    /// adds an f16 V^T tile a buffer).
    fn smem_bytes(&self, d: usize) -> usize {
        if self.wgmma {
            // + 1 KiB: the kernel aligns its tiles to the 1024-byte swizzle atoms.
            (self.rows() + 2 * self.buffers * self.bn + self.buffers * self.bn.max(64)) * d * 2 + 1024
        } else {
            (self.rows() + 2 * self.buffers * self.bn) * (d + FA_PAD) * 2
        }
    }
}

fn instance(d: usize, tile: FlashTile) -> Result<Instance> {
    let producer_warps = if tile.warp_specialized() { 4 } else { 0 };
    let (name, bn, warps, buffers, wgmma) = match (d, tile) {
        (64, FlashTile::Rows64) => ("flash_attention_d64", 64, 4, 1, false),
        (96, FlashTile::Rows64) => ("flash_attention_d96", 64, 4, 1, false),
        (128, FlashTile::Rows64) => ("flash_attention_d128", 64, 4, 1, false),
        (256, FlashTile::Rows64) => ("flash_attention_d256", 32, 4, 1, false),
        (256, FlashTile::Rows128Async) => ("flash_attention_d256_r128", 32, 8, 2, false),
        (128, FlashTile::Rows128Async) => ("flash_attention_d128_r128", 64, 8, 2, false),
        (128, FlashTile::Rows128AsyncKeys128) => ("flash_attention_d128_r128_k128", 128, 8, 2, false),
        (128, FlashTile::Rows128Wgmma) => ("flash_attention_d128_wgmma", 128, 8, 2, true),
        (256, FlashTile::Rows128Wgmma) => ("flash_attention_d256_wgmma", 32, 8, 2, true),
        (128, FlashTile::Rows128WgmmaWs) => ("flash_attention_d128_wgmma_ws", 128, 8, 2, true),
        (256, FlashTile::Rows128WgmmaWs) => ("flash_attention_d256_wgmma_ws", 32, 8, 2, true),
        _ => {
            return Err(NinferError::Unsupported(format!("CUDA flash attention with head_dim {d} and tiling {tile:?}")))
        }
    };
    Ok(Instance { name, bn, warps, producer_warps, buffers, wgmma })
}

/// The tiling prefill attention takes for head size `d` under `plan`: the first of ROUTE_ORDER
/// that exists for `d`, whose shared memory a block may take and (the warp-specialized form)
/// that the plan allows (the 128-key tiles at d 128 on sm_90, the 128-row cp.async form at d 256
/// and d 128 on sm_80 / sm_90, else 64-row blocks).
pub fn flash_tile_for(plan: &Plan, d: usize) -> FlashTile {
    ROUTE_ORDER
        .into_iter()
        .find(|&t| (plan.prefill_warp_specialized || !t.warp_specialized()) && tile_fits(&plan.facts, d, t))
        .unwrap_or(FlashTile::Rows64)
}

/// Whether tiling `tile` exists for head size `d`, fits the device's shared memory and (for
/// wgmma) runs there: sm_90a code, which the kernels are compiled to on compute capability 9.0
/// only (kernels.rs `has_sm90a_code`), the warp-specialized form built by NVRTC 13 only.
pub fn tile_fits(facts: &DeviceFacts, d: usize, tile: FlashTile) -> bool {
    instance(d, tile).is_ok_and(|i| {
        let (major, minor) = facts.compute_capability;
        i.smem_bytes(d) <= facts.smem_optin
            && (!i.wgmma || crate::backend::cuda::kernels::has_sm90a_code(major, minor))
            && (!tile.warp_specialized() || facts.nvrtc_major >= 13)
    })
}

impl CudaDevice {
    /// Whether this device runs `flash_attention` on tensor cores (sm_80+); below that the
    /// launcher computes the same result with the scalar `paged_attention` kernel.
    pub fn has_flash_attention(&self) -> bool {
        self.compute_capability().0 >= 8
    }

    /// The tiling `flash_attention` uses for head size `d` here (`flash_tile_for` of the plan).
    pub fn flash_tile(&self, d: usize) -> FlashTile {
        flash_tile_for(self.plan(), d)
    }

    /// Whether tiling `tile` exists for head size `d`, fits this device's shared memory and (for
    /// wgmma) runs here (`tile_fits`).
    pub fn flash_tile_fits(&self, d: usize, tile: FlashTile) -> bool {
        tile_fits(&self.plan().facts, d, tile)
    }

    /// The persistent prefill attention's work counters as they stand after the stream's
    /// work so far: both zero whenever no launch is running (its last block zeroes them; a
    /// nonzero pair would make the next launch skip work). For tests and diagnostics.
    pub fn flash_work_counters(&self) -> Result<[u32; 2]> {
        let v = self
            .stream()
            .clone_dtoh(self.fa_work())
            .map_err(|e| NinferError::Device(format!("reading the attention work counters: {e:?}")))?;
        Ok([v[0], v[1]])
    }

    /// Causal attention of packed query rows over the paged cache: rows
    /// cu_seqlens[s]..cu_seqlens[s+1] are sequence s (token_seq[r] = s), row r at position
    /// token_pos[r] sees keys 0..=token_pos[r]; positions are consecutive within a sequence
    /// (a chunk after any cached prefix; 1-row decode sequences are fine). `max_rows` is the
    /// largest row count of a sequence. out is [rows, n_q_heads * head_dim].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        cu_seqlens: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &PagedAttentionShape,
        max_rows: usize,
    ) -> Result<()> {
        let tile = self.flash_tile(shape.head_dim);
        self.flash_attention_tiled(q, k_cache, v_cache, block_tables, token_seq, token_pos, cu_seqlens, out, shape, max_rows, tile)
    }

    /// `flash_attention` with the block tiling chosen by the caller (tests run every tiling
    /// the device can hold against the same reference). An error if `tile` does not exist for
    /// the head size or needs more shared memory than the device gives a block.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_tiled(
        &self,
        q: &impl DevicePtr<u16>,
        k_cache: &impl DevicePtr<u16>,
        v_cache: &impl DevicePtr<u16>,
        block_tables: &impl DevicePtr<i32>,
        token_seq: &impl DevicePtr<i32>,
        token_pos: &impl DevicePtr<i32>,
        cu_seqlens: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        shape: &PagedAttentionShape,
        max_rows: usize,
        tile: FlashTile,
    ) -> Result<()> {
        if !self.has_flash_attention() {
            return self.paged_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape);
        }
        self.check_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, out, shape)?;
        let sh = shape;
        let d = sh.head_dim;
        let inst = instance(d, tile)?;
        let name = inst.name;
        let n_seqs = cu_seqlens.len().saturating_sub(1);
        if !sh.q_stride.is_multiple_of(8) {
            return Err(NinferError::Device(format!(
                "flash attention: q stride {} is not a multiple of 8 elements (16-byte rows)",
                sh.q_stride
            )));
        }
        if n_seqs == 0 || max_rows == 0 {
            return Ok(());
        }
        check_len("flash attention block_tables", block_tables.len(), n_seqs * sh.max_blocks_per_seq)?;
        let smem = inst.smem_bytes(d);
        // The wgmma tilings are flash_attention_sm90.cu's, the mma.sync ones flash_attention.cu's.
        let family = if inst.wgmma { KernelFamily::FlashAttentionSm90 } else { KernelFamily::FlashAttention };
        let f = self.function_with_smem(family, name, smem)?;
        let s = self.stream();
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k_cache.device_ptr(s);
        let (vp, _c) = v_cache.device_ptr(s);
        let (bp, _d) = block_tables.device_ptr(s);
        let (cp, _e) = cu_seqlens.device_ptr(s);
        let (pp, _f) = token_pos.device_ptr(s);
        let (op, _g) = out.device_ptr_mut(s);
        let mut args = Vec::from(kargs![
            qp,
            sh.q_stride as i64,
            kp,
            vp,
            bp,
            as_i32("max_blocks_per_seq", sh.max_blocks_per_seq)?,
            cp,
            pp,
            as_i32("n_q_heads", sh.n_q_heads)?,
            as_i32("n_kv_heads", sh.n_kv_heads)?,
            as_i32("block_size", sh.block_size)?,
            sh.scale * std::f32::consts::LOG2_E,
            op,
        ]);
        let row_tiles = as_i32("flash attention row tiles", max_rows.div_ceil(inst.rows()))? as u32;
        let heads = as_i32("n_q_heads", sh.n_q_heads)? as u32;
        let seqs = as_i32("n_seqs", n_seqs)? as u32;
        let (grid, _w) = if tile.warp_specialized() {
            // Persistent: a block an SM (its shared memory allows no second) taking the
            // (row tile, head, sequence) work items from the device's counters.
            let (wp, w) = self.fa_work().device_ptr(s);
            args.extend(kargs![wp, row_tiles as i32, seqs as i32]);
            let items = row_tiles as u64 * heads as u64 * seqs as u64;
            if items > u32::MAX as u64 {
                return Err(NinferError::Device(format!("flash attention: {items} work items exceed the 32-bit counter")));
            }
            (((items as u32).min(self.sm_count() as u32), 1, 1), Some(w))
        } else {
            ((row_tiles, heads, seqs), None)
        };
        let threads = 32 * (inst.warps + inst.producer_warps) as u32;
        let config = LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
        self.launch(&f, config, name, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per-block shared-memory opt-in limits (bytes) of the architectures the 128-row tiling is
    /// meant for and the ones it must stay off (CUDA programming guide, compute capabilities).
    const OPTIN_SM80: usize = 163 * 1024;
    const OPTIN_SM86: usize = 99 * 1024;
    const OPTIN_SM90: usize = 227 * 1024;

    #[test]
    fn the_128_row_tiling_fits_sm80_and_sm90_but_not_sm86() {
        let wide = instance(256, FlashTile::Rows128Async).unwrap();
        assert_eq!((wide.rows(), wide.bn, wide.buffers), (128, 32, 2));
        assert_eq!(wide.smem_bytes(256), (128 + 2 * 2 * 32) * (256 + 8) * 2);
        assert!(wide.smem_bytes(256) <= OPTIN_SM80 && wide.smem_bytes(256) <= OPTIN_SM90);
        assert!(wide.smem_bytes(256) > OPTIN_SM86);
        // d 128 (Llama-3-8B): 64-key tiles, ~102 KiB, so it fits sm_80 and sm_90 but not sm_86.
        let wide128 = instance(128, FlashTile::Rows128Async).unwrap();
        assert_eq!((wide128.rows(), wide128.bn, wide128.buffers), (128, 64, 2));
        assert_eq!(wide128.smem_bytes(128), (128 + 2 * 2 * 64) * (128 + 8) * 2);
        assert!(wide128.smem_bytes(128) <= OPTIN_SM80 && wide128.smem_bytes(128) > OPTIN_SM86);
        // d 128 with 128-key tiles: ~174 KiB, sm_90 only (sm_80 keeps the 64-key tiles).
        let keys128 = instance(128, FlashTile::Rows128AsyncKeys128).unwrap();
        assert_eq!((keys128.rows(), keys128.bn, keys128.buffers), (128, 128, 2));
        assert!(keys128.smem_bytes(128) <= OPTIN_SM90 && keys128.smem_bytes(128) > OPTIN_SM80);
        // The wgmma form at d 128: Q and two buffers of K, V and V^T, unpadded, aligned to 1 KiB:
        // 225 KiB, sm_90 only.
        let wg = instance(128, FlashTile::Rows128Wgmma).unwrap();
        assert_eq!((wg.rows(), wg.bn, wg.buffers, wg.wgmma), (128, 128, 2, true));
        assert_eq!(wg.smem_bytes(128), 225 * 1024);
        assert!(wg.smem_bytes(128) <= OPTIN_SM90 && wg.smem_bytes(128) > OPTIN_SM80);
        // At d 256: 32-key tiles (O alone is 128 registers a lane), V^T rows padded to 64 keys.
        let wg256 = instance(256, FlashTile::Rows128Wgmma).unwrap();
        assert_eq!((wg256.rows(), wg256.bn, wg256.buffers), (128, 32, 2));
        assert_eq!(wg256.smem_bytes(256), (128 * 256 + 4 * 32 * 256 + 2 * 64 * 256) * 2 + 1024);
        assert!(wg256.smem_bytes(256) <= OPTIN_SM90 && wg256.smem_bytes(256) > OPTIN_SM80);
        // The warp-specialized form: the wgmma form's rows and shared memory, plus a producer
        // warpgroup (384 threads).
        let ws = instance(128, FlashTile::Rows128WgmmaWs).unwrap();
        assert_eq!((ws.rows(), ws.bn, ws.warps + ws.producer_warps), (128, 128, 12));
        assert_eq!(ws.smem_bytes(128), wg.smem_bytes(128));
        let ws256 = instance(256, FlashTile::Rows128WgmmaWs).unwrap();
        assert_eq!((ws256.rows(), ws256.bn, ws256.warps + ws256.producer_warps), (128, 32, 12));
        assert_eq!(ws256.smem_bytes(256), wg256.smem_bytes(256));
        // The 64-row kernels fit every sm_80+ device, so they remain the fallback everywhere.
        for d in [64, 96, 128, 256] {
            let narrow = instance(d, FlashTile::Rows64).unwrap();
            assert!(narrow.smem_bytes(d) <= OPTIN_SM86, "d{d}: {} bytes", narrow.smem_bytes(d));
        }
    }

    #[test]
    fn tilings_without_a_kernel_are_unsupported() {
        for (d, tile) in [(96, FlashTile::Rows128Async), (80, FlashTile::Rows64), (64, FlashTile::Rows128Async), (256, FlashTile::Rows128AsyncKeys128), (64, FlashTile::Rows128Wgmma), (64, FlashTile::Rows128WgmmaWs)] {
            match instance(d, tile) {
                Err(NinferError::Unsupported(msg)) => assert!(msg.contains(&d.to_string()), "{msg}"),
                Err(e) => panic!("d{d} {tile:?}: expected Unsupported, got {e:?}"),
                Ok(i) => panic!("d{d} {tile:?}: unexpected kernel {}", i.name),
            }
        }
    }
}
