//! The DFlash block-diffusion drafter (`--spec dflash --drafter DIR`) on the CUDA backend, row
//! for row what the CPU drafter does (model/cpu/dflash.rs, whose doc comment gives the method
//! and the checkpoint layout): context rows from the target's layer outputs through `fc`,
//! `hidden_norm` and each drafter layer's `k_proj`/`v_proj` (`k_norm`, RoPE), paged like the
//! target's KV under the same block tables; one forward of the anchor and `block_size - 1` mask
//! rows, each attending to the context and to every row of its block, drafts the block.
//!
//! Everything stays on the device. Every forward keeps the outputs of the target layers the
//! drafter reads, in one `[rows, n_layers * hidden]` buffer (a 2D copy after each such layer,
//! inside the decode and verify graphs too; the last layer's after the final norm, as
//! transformers reports it); `dflash_absorb` gathers the kept rows, projects them and writes
//! their K/V into the pool. Drafting writes the block rows' K/V beside the context and runs the
//! model's paged attention kernel with every block row's causal limit at the block's last
//! position, which makes it the non-causal attention DFlash wants: the kernel reads keys through
//! the block table, so a table that ends in the block's pages needs no kernel of its own. A
//! block row at or after the anchor lands in the anchor's page where it holds context (the
//! sequence's own page: its verify chunk writes the anchor there, so no prefix hit shares it,
//! and the rows past the context are never read before absorbing rewrites them), else in spare
//! pages past the pool's blocks, `ceil(block_size / page)` of them per sequence of a drafting
//! group. Greedy drafts are the device argmax of the LM head's rows; a sampled request's are
//! drawn on the host from its rows (`draw_draft`), as the CPU drafter draws them.

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::ops::PagedAttentionShape;
use crate::backend::cuda::CudaDevice;
use crate::model::cpu::dflash::DflashConfig;
use crate::model::runner::{DflashDraftSeq, DflashRows, MtpDraft};
use crate::spec::draw_draft;
use crate::{NinferError, Result};

use super::buffers::{alloc, buf, buf_mut};
use super::linear::Linear;
use super::CudaModel;

/// Sequences one drafting forward takes at most (more are drafted in several forwards): sizes
/// the spare pages the block rows use.
const DRAFT_GROUP: usize = 32;

/// One drafter layer on the device (norms applied as stored: the drafter is a Qwen3 model).
pub(super) struct DflashLayerWeights<W = CudaSlice<u16>> {
    pub(super) input_norm: W,
    pub(super) post_norm: W,
    pub(super) q: Linear<W>,
    /// Rows: keys then values, for context rows and block rows alike.
    pub(super) kv: Linear<W>,
    pub(super) o: Linear<W>,
    pub(super) q_norm: W,
    pub(super) k_norm: W,
    /// Rows: gate then up.
    pub(super) gate_up: Linear<W>,
    pub(super) down: Linear<W>,
}

/// The drafter's weights on the device, dense in the storage type (`load::build_dflash`).
pub(super) struct DflashWeights<W = CudaSlice<u16>> {
    /// `[hidden, n_target_layers * hidden]` over a context row's concatenated features.
    pub(super) fc: Linear<W>,
    pub(super) hidden_norm: W,
    /// The norm before the target's LM head.
    pub(super) norm: W,
    pub(super) layers: Vec<DflashLayerWeights<W>>,
    /// Device bytes of all of the above.
    pub(super) bytes: usize,
}

/// Step buffers of the drafter (grown, never shrunk).
#[derive(Default)]
struct Bufs {
    /// Gathered context features `[rows, n_target_layers * hidden]`.
    fin: Option<CudaSlice<u16>>,
    x: Option<CudaSlice<u16>>,
    hn: Option<CudaSlice<u16>>,
    tmp: Option<CudaSlice<u16>>,
    q: Option<CudaSlice<u16>>,
    qn: Option<CudaSlice<u16>>,
    kv: Option<CudaSlice<u16>>,
    kn: Option<CudaSlice<u16>>,
    mix: Option<CudaSlice<u16>>,
    gate_up: Option<CudaSlice<u16>>,
    act: Option<CudaSlice<u16>>,
    lin32: Option<CudaSlice<f32>>,
    /// The rows whose logits are wanted, gathered.
    sel: Option<CudaSlice<u16>>,
    ids: Option<CudaSlice<i32>>,
    lse: Option<CudaSlice<f32>>,
}

fn bytes_of<T>(x: &Option<CudaSlice<T>>) -> usize {
    x.as_ref().map_or(0, |s| s.len() * std::mem::size_of::<T>())
}

impl Bufs {
    fn bytes(&self) -> usize {
        let u16s = [&self.fin, &self.x, &self.hn, &self.tmp, &self.q, &self.qn, &self.kv, &self.kn, &self.mix, &self.gate_up, &self.act, &self.sel];
        u16s.iter().map(|b| bytes_of(b)).sum::<usize>() + bytes_of(&self.lin32) + bytes_of(&self.ids) + bytes_of(&self.lse)
    }
}

/// Grows `b` to hold at least `n` elements (to the next power of two; never shrinks).
fn grow<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, b: &mut Option<CudaSlice<T>>, n: usize, what: &str) -> Result<()> {
    if b.as_ref().is_none_or(|s| s.len() < n) {
        *b = None;
        *b = Some(alloc(dev, n.next_power_of_two(), what)?);
    }
    Ok(())
}

/// The drafter, its paged context and what it keeps between calls.
pub(super) struct CudaDflash {
    pub(super) cfg: DflashConfig,
    w: DflashWeights,
    /// f32 `[head_dim / 2]`, the drafter's own RoPE frequencies.
    inv_freq: CudaSlice<f32>,
    /// Per drafter layer, `[num_blocks + spare, page, n_kv_heads * head_dim]`: block `b < num_blocks`
    /// holds the context rows of the positions the target's KV block `b` holds.
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    num_blocks: usize,
    page: usize,
    /// Spare pages past `num_blocks` (the block rows, `spare_per_seq` a sequence of a group).
    spare: usize,
    /// The kept target features of the last forward `[capacity, n_target_layers * hidden]`.
    features: Option<CudaSlice<u16>>,
    feature_rows: usize,
    /// First row of each chunk of the last forward, then its row count.
    chunk_rows: Vec<usize>,
    bufs: Bufs,
}

impl CudaDflash {
    /// Device bytes of the weights.
    pub(super) fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Context bytes one token of the pool takes (K and V of every drafter layer in the
    /// storage type), for the ledger.
    pub(super) fn context_bytes_per_token(&self) -> usize {
        self.cfg.num_layers * 2 * self.cfg.num_kv_heads * self.cfg.head_dim * 2
    }

    fn kvd(&self) -> usize {
        self.cfg.num_kv_heads * self.cfg.head_dim
    }

    fn width(&self) -> usize {
        self.cfg.target_layer_ids.len() * self.cfg.hidden_size
    }

    fn spare_per_seq(&self) -> usize {
        self.cfg.block_size.div_ceil(self.page.max(1))
    }

    /// Device bytes of the spare pages a pool of `page`-position blocks holds past the KV's
    /// blocks (`allocate`).
    pub(super) fn spare_bytes(&self, page: usize) -> usize {
        DRAFT_GROUP * self.cfg.block_size.div_ceil(page.max(1)) * page * self.context_bytes_per_token()
    }

    /// Device bytes of the step buffers, the kept features and the spare pages.
    pub(super) fn workspace_bytes(&self) -> usize {
        let spare = if self.page > 0 { self.spare_bytes(self.page) } else { 0 };
        bytes_of(&self.features) + self.bufs.bytes() + spare
    }

    /// Allocates the context pool for `num_blocks` blocks of `page` positions (the target's KV
    /// pool shape) and the spare pages of a drafting group; the old pool is freed first.
    pub(super) fn allocate(&mut self, dev: &CudaDevice, num_blocks: usize, page: usize) -> Result<()> {
        self.free_pool();
        self.page = page;
        self.num_blocks = num_blocks;
        self.spare = DRAFT_GROUP * self.spare_per_seq();
        let elems = (num_blocks + self.spare) * page * self.kvd();
        for _ in 0..self.cfg.num_layers {
            self.k.push(alloc(dev, elems, "DFlash drafter context")?);
            self.v.push(alloc(dev, elems, "DFlash drafter context")?);
        }
        Ok(())
    }

    /// Frees the context pool (before the caches are planned again: its memory is theirs).
    pub(super) fn free_pool(&mut self) {
        (self.k, self.v) = (Vec::new(), Vec::new());
        (self.num_blocks, self.page, self.spare) = (0, 0, 0);
    }

    /// Grows the kept features to `rows` rows (`CudaModel::ensure_rows`, which voids the step
    /// graphs that copy into them).
    pub(super) fn ensure_features(&mut self, dev: &CudaDevice, rows: usize) -> Result<()> {
        if rows > self.feature_rows {
            self.features = None;
            self.features = Some(alloc(dev, rows * self.width(), "DFlash target features")?);
            self.feature_rows = rows;
        }
        Ok(())
    }

    /// After target layer `li` of `n_layers` ran over `rows` rows, its output in `x` (the
    /// residual stream): copied into the feature slots that name it. The last layer's output is
    /// the final norm's (`keep_final`).
    pub(super) fn capture_layer(&mut self, dev: &CudaDevice, li: usize, n_layers: usize, x: &CudaSlice<u16>, rows: usize) -> Result<()> {
        if li + 1 == n_layers {
            return Ok(());
        }
        self.capture(dev, li, x, rows)
    }

    fn capture(&mut self, dev: &CudaDevice, li: usize, x: &CudaSlice<u16>, rows: usize) -> Result<()> {
        let (h, width) = (self.cfg.hidden_size, self.width());
        if self.target_slots(li).next().is_none() {
            return Ok(());
        }
        if rows > self.feature_rows {
            return Err(NinferError::Device(format!("DFlash features hold {} rows, the step has {rows}", self.feature_rows)));
        }
        let slots: Vec<usize> = self.target_slots(li).collect();
        let dst = buf_mut(&mut self.features);
        for slot in slots {
            copy_rows_2d(dev, x, h, dst, slot * h, width, h, rows)?;
        }
        Ok(())
    }

    fn target_slots(&self, li: usize) -> impl Iterator<Item = usize> + '_ {
        self.cfg.target_layer_ids.iter().enumerate().filter(move |(_, &id)| id == li).map(|(slot, _)| slot)
    }
}

/// Copies `rows` rows of `width` elements from `src` (rows `src_pitch` apart) into `dst` from
/// element `dst_off` (rows `dst_pitch` apart): one driver 2D copy, which a graph captures.
#[allow(clippy::too_many_arguments)]
fn copy_rows_2d(dev: &CudaDevice, src: &CudaSlice<u16>, src_pitch: usize, dst: &mut CudaSlice<u16>, dst_off: usize, dst_pitch: usize, width: usize, rows: usize) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let (src_need, dst_need) = ((rows - 1) * src_pitch + width, dst_off + (rows - 1) * dst_pitch + width);
    if src.len() < src_need || dst.len() < dst_need {
        return Err(NinferError::Device(format!("2D copy of {rows} x {width}: buffers of {} and {} elements, needed {src_need} and {dst_need}", src.len(), dst.len())));
    }
    let e = std::mem::size_of::<u16>();
    let s = dev.stream();
    let (sp, _a) = src.device_ptr(s);
    let (dp, _b) = dst.device_ptr_mut(s);
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: sp,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch * e,
        dstXInBytes: dst_off * e,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dp,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch * e,
        WidthInBytes: width * e,
        Height: rows,
    };
    // SAFETY: both ranges were checked against their buffers above; the copy is queued on the
    // stream every kernel of the step runs on.
    unsafe { sys::cuMemcpy2DAsync_v2(&copy, s.cu_stream()) }.result().map_err(driver_err("copying DFlash target features"))
}

impl CudaModel {
    /// `ModelRunner::enable_dflash`: loads the drafter in `dir` (checked against this model;
    /// head sizes the attention kernels lack are refused) and allocates its context pool if the
    /// caches already are; from here on every forward keeps the features it reads.
    pub(super) fn enable_dflash_cuda(&mut self, dir: &std::path::Path) -> Result<usize> {
        const FLAG: &str = "drafter (--drafter)";
        if !dir.is_dir() {
            return Err(NinferError::config(FLAG, format!("{}: no such drafter directory", dir.display())));
        }
        let cfg = DflashConfig::from_dir(dir)?;
        cfg.check_target(dir, &self.cfg)?;
        if !matches!(cfg.head_dim, 64 | 96 | 128 | 256) {
            return Err(NinferError::config(FLAG, format!("{}: head_dim {} on the CUDA backend is not supported yet (its attention kernels: 64, 96, 128, 256)", dir.display(), cfg.head_dim)));
        }
        self.dflash = None;
        let store = crate::artifact::WeightStore::open(dir).map_err(|e| NinferError::config(FLAG, format!("{}: {e}", dir.display())))?;
        let w = DflashWeights::load(&self.dev, &self.cfg, &store, &cfg)?;
        let hd = cfg.head_dim;
        let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32)).collect();
        let inv_freq = self.dev.stream().clone_htod(&inv_freq).map_err(driver_err("uploading the drafter's rope frequencies"))?;
        eprintln!("ninfer: loaded the DFlash drafter {} on cuda:{} ({:.1} MiB)", dir.display(), self.dev.ordinal(), w.bytes as f64 / (1u64 << 20) as f64);
        let block_size = cfg.block_size;
        let mut d = CudaDflash {
            cfg,
            w,
            inv_freq,
            k: Vec::new(),
            v: Vec::new(),
            num_blocks: 0,
            page: 0,
            spare: 0,
            features: None,
            feature_rows: 0,
            chunk_rows: Vec::new(),
            bufs: Bufs::default(),
        };
        // Graphs captured before copy no features: they are captured again.
        self.graphs.clear();
        d.ensure_features(&self.dev, self.act.rows)?;
        if self.caches.block_size > 0 {
            d.allocate(&self.dev, self.caches.num_blocks, self.caches.block_size)?;
        }
        self.dflash = Some(Box::new(d));
        Ok(block_size)
    }

    /// After a forward of `batch` over `rows` rows whose final normed hidden states are in
    /// `act.h`: keeps the last target layer's features where the drafter reads it, and the
    /// chunks' rows for `dflash_absorb` (nothing without `--spec dflash`).
    pub(super) fn keep_dflash(&mut self, batch: &crate::model::runner::StepBatch, rows: usize) -> Result<()> {
        let Some(d) = self.dflash.as_mut() else { return Ok(()) };
        d.capture(&self.dev, self.cfg.num_layers - 1, buf(&self.act.h), rows)?;
        d.chunk_rows.clear();
        d.chunk_rows.push(0);
        for s in &batch.seqs {
            d.chunk_rows.push(d.chunk_rows.last().copied().unwrap_or(0) + s.tokens.len());
        }
        Ok(())
    }

    /// `ModelRunner::dflash_absorb`: the context rows of every sequence in one pass.
    pub(super) fn absorb_dflash(&mut self, rows: &[DflashRows]) -> Result<()> {
        let mut d = self.dflash.take().ok_or_else(|| NinferError::invalid("dflash_absorb", "DFlash drafting is not enabled"))?;
        let r = self.dflash_absorb_with(&mut d, rows);
        self.dflash = Some(d);
        r
    }

    fn dflash_absorb_with(&mut self, d: &mut CudaDflash, rows: &[DflashRows]) -> Result<()> {
        let (h, eps, width, kvd) = (d.cfg.hidden_size, d.cfg.rms_norm_eps, d.width(), d.kvd());
        let (nkv, hd, page) = (d.cfg.num_kv_heads, d.cfg.head_dim, d.page);
        if page == 0 {
            return Err(NinferError::invalid("dflash absorb", "the drafter's context pool is not allocated (allocate_caches)"));
        }
        let mut firsts = Vec::new();
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        for r in rows.iter().filter(|r| r.rows > 0) {
            let first = match (d.chunk_rows.get(r.chunk), d.chunk_rows.get(r.chunk + 1)) {
                (Some(&a), Some(&b)) if a + r.rows <= b => a,
                _ => return Err(NinferError::invalid("dflash_absorb", format!("{} rows of chunk {} are not in the last forward", r.rows, r.chunk))),
            };
            check_table(&r.block_table, r.start_pos + r.rows, page, d.num_blocks, "dflash absorb")?;
            for p in r.start_pos..r.start_pos + r.rows {
                positions.push(p as i32);
                slots.push((r.block_table[p / page] as usize * page + p % page) as i64);
            }
            firsts.push((first, r.rows));
        }
        let total = positions.len();
        if total == 0 {
            return Ok(());
        }
        let dev = &*self.dev;
        let b = &mut d.bufs;
        grow(dev, &mut b.fin, total * width, "DFlash activations")?;
        grow(dev, &mut b.x, total * h, "DFlash activations")?;
        grow(dev, &mut b.hn, total * h, "DFlash activations")?;
        grow(dev, &mut b.kv, total * 2 * kvd, "DFlash activations")?;
        grow(dev, &mut b.kn, total * kvd, "DFlash activations")?;
        grow(dev, &mut b.lin32, if d.cfg.attention_bias { total * 2 * kvd } else { 1 }, "DFlash activations")?;
        let mut off = 0;
        for &(first, n) in &firsts {
            let src = buf(&d.features).slice(first * width..(first + n) * width);
            let mut dst = buf_mut(&mut b.fin).slice_mut(off * width..(off + n) * width);
            dev.stream().memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering DFlash context rows"))?;
            off += n;
        }
        let s = dev.stream();
        let positions = s.clone_htod(&positions).map_err(driver_err("uploading DFlash positions"))?;
        let slots = s.clone_htod(&slots).map_err(driver_err("uploading DFlash slots"))?;
        d.w.fc.forward(dev, buf(&b.fin), buf_mut(&mut b.x), buf_mut(&mut b.lin32), total)?;
        dev.rmsnorm(buf(&b.x), &d.w.hidden_norm, buf_mut(&mut b.hn), total, h, h, h, eps, false)?;
        for (l, layer) in d.w.layers.iter().enumerate() {
            layer.kv.forward(dev, buf(&b.hn), buf_mut(&mut b.kv), buf_mut(&mut b.lin32), total)?;
            dev.rmsnorm_heads(buf(&b.kv), &layer.k_norm, buf_mut(&mut b.kn), total, nkv, hd, 2 * kvd, kvd, eps, false)?;
            dev.rope_neox(buf_mut(&mut b.kn), &mut self.dummy, &positions, &d.inv_freq, nkv, 0, hd, kvd, 0, 1.0)?;
            let v_rows = buf(&b.kv).slice(kvd..);
            dev.kv_cache_write(buf(&b.kn), &v_rows, &mut d.k[l], &mut d.v[l], &slots, kvd, kvd, 2 * kvd)?;
        }
        Ok(())
    }

    /// `ModelRunner::dflash_draft`: the sequences in drafting forwards of up to DRAFT_GROUP.
    pub(super) fn draft_dflash(&mut self, seqs: &[DflashDraftSeq]) -> Result<Vec<MtpDraft>> {
        let mut d = self.dflash.take().ok_or_else(|| NinferError::invalid("dflash_draft", "DFlash drafting is not enabled"))?;
        let r = self.dflash_draft_with(&mut d, seqs);
        self.dflash = Some(d);
        r
    }

    fn dflash_draft_with(&mut self, d: &mut CudaDflash, seqs: &[DflashDraftSeq]) -> Result<Vec<MtpDraft>> {
        let (bs, vocab) = (d.cfg.block_size, self.cfg.vocab_size);
        if d.page == 0 {
            return Err(NinferError::invalid("dflash draft", "the drafter's context pool is not allocated (allocate_caches)"));
        }
        for s in seqs {
            if s.k >= bs {
                return Err(NinferError::invalid("dflash_draft", format!("{} drafts asked; the drafter's block gives {}", s.k, bs - 1)));
            }
            if let Some(u) = s.sampling.as_ref().filter(|u| u.u.len() < s.k) {
                return Err(NinferError::invalid("dflash_draft", format!("{} draft draws for {} drafts", u.u.len(), s.k)));
            }
            if s.token as usize >= vocab {
                return Err(NinferError::invalid("dflash draft", format!("anchor token {} >= vocab_size {vocab}", s.token)));
            }
            check_table(&s.block_table, s.pos, d.page, d.num_blocks, "dflash draft")?;
        }
        let idx: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].k > 0).collect();
        let mut out = vec![MtpDraft::default(); seqs.len()];
        for group in idx.chunks(DRAFT_GROUP) {
            self.draft_group(d, seqs, group, &mut out)?;
        }
        Ok(out)
    }

    /// One drafting forward over the sequences `group` (at most DRAFT_GROUP, each `k > 0`).
    fn draft_group(&mut self, d: &mut CudaDflash, seqs: &[DflashDraftSeq], group: &[usize], out: &mut [MtpDraft]) -> Result<()> {
        let c = &d.cfg;
        let (h, hd, bs, eps, page) = (c.hidden_size, c.head_dim, c.block_size, c.rms_norm_eps, d.page);
        let (nh, nkv, inter) = (c.num_heads, c.num_kv_heads, c.intermediate_size);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let (n, rows, vocab) = (group.len(), group.len() * bs, self.cfg.vocab_size);
        // Each block row's page: the anchor's page where it holds context (the sequence's own),
        // else the group's spare pages; keys 0..=limit of every row are the context and the block.
        let max_blocks = group.iter().map(|&i| (seqs[i].pos + bs - 1) / page + 1).max().unwrap_or(1);
        let (mut ids, mut pos, mut limit, mut seq_of, mut slots) = (Vec::with_capacity(rows), Vec::with_capacity(rows), Vec::with_capacity(rows), Vec::with_capacity(rows), Vec::with_capacity(rows));
        let mut tables = vec![0i32; n * max_blocks];
        let mut max_context = 0;
        for (j, &i) in group.iter().enumerate() {
            let s = &seqs[i];
            let spare = d.num_blocks + j * d.spare_per_seq();
            let (table, row_slots) = block_pages(&s.block_table, s.pos, bs, page, spare);
            tables[j * max_blocks..j * max_blocks + table.len()].copy_from_slice(&table);
            slots.extend(row_slots);
            for r in 0..bs {
                ids.push(if r == 0 { s.token } else { c.mask_token_id } as i32);
                pos.push((s.pos + r) as i32);
                limit.push((s.pos + bs - 1) as i32);
                seq_of.push(j as i32);
            }
            max_context = max_context.max(s.pos + bs);
        }
        let dev = &*self.dev;
        let st = dev.stream();
        let up = |what: &'static str| driver_err(what);
        let ids = st.clone_htod(&ids).map_err(up("uploading DFlash block ids"))?;
        let pos = st.clone_htod(&pos).map_err(up("uploading DFlash positions"))?;
        let limit = st.clone_htod(&limit).map_err(up("uploading DFlash positions"))?;
        let seq_of = st.clone_htod(&seq_of).map_err(up("uploading DFlash positions"))?;
        let slots = st.clone_htod(&slots).map_err(up("uploading DFlash slots"))?;
        let tables = st.clone_htod(&tables).map_err(up("uploading DFlash block tables"))?;
        let b = &mut d.bufs;
        let what = "DFlash activations";
        grow(dev, &mut b.x, rows * h, what)?;
        grow(dev, &mut b.hn, rows * h, what)?;
        grow(dev, &mut b.tmp, rows * h, what)?;
        grow(dev, &mut b.q, rows * qd, what)?;
        grow(dev, &mut b.qn, rows * qd, what)?;
        grow(dev, &mut b.kv, rows * 2 * kvd, what)?;
        grow(dev, &mut b.kn, rows * kvd, what)?;
        grow(dev, &mut b.mix, rows * qd, what)?;
        grow(dev, &mut b.gate_up, rows * 2 * inter, what)?;
        grow(dev, &mut b.act, rows * inter, what)?;
        grow(dev, &mut b.lin32, if c.attention_bias { rows * qd.max(2 * kvd).max(h) } else { 1 }, what)?;
        grow(dev, &mut b.sel, rows * h, what)?;
        grow(dev, &mut b.ids, rows, what)?;
        grow(dev, &mut b.lse, rows, what)?;
        dev.embedding(&self.weights.embed, &ids, buf_mut(&mut b.x), vocab, h)?;
        dev.rmsnorm(buf(&b.x), &d.w.layers[0].input_norm, buf_mut(&mut b.hn), rows, h, h, h, eps, false)?;
        let shape = PagedAttentionShape {
            n_q_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            q_stride: qd,
            block_size: page,
            num_blocks: d.num_blocks + d.spare,
            max_blocks_per_seq: max_blocks,
            scale: 1.0 / (hd as f32).sqrt(),
            max_context,
            partition: 0,
        };
        for (l, layer) in d.w.layers.iter().enumerate() {
            layer.q.forward(dev, buf(&b.hn), buf_mut(&mut b.q), buf_mut(&mut b.lin32), rows)?;
            layer.kv.forward(dev, buf(&b.hn), buf_mut(&mut b.kv), buf_mut(&mut b.lin32), rows)?;
            dev.rmsnorm_heads(buf(&b.q), &layer.q_norm, buf_mut(&mut b.qn), rows, nh, hd, qd, qd, eps, false)?;
            dev.rmsnorm_heads(buf(&b.kv), &layer.k_norm, buf_mut(&mut b.kn), rows, nkv, hd, 2 * kvd, kvd, eps, false)?;
            dev.rope_neox(buf_mut(&mut b.qn), buf_mut(&mut b.kn), &pos, &d.inv_freq, nh, nkv, hd, qd, kvd, 1.0)?;
            let v_rows = buf(&b.kv).slice(kvd..);
            dev.kv_cache_write(buf(&b.kn), &v_rows, &mut d.k[l], &mut d.v[l], &slots, kvd, kvd, 2 * kvd)?;
            dev.paged_attention(buf(&b.qn), &d.k[l], &d.v[l], &tables, &seq_of, &limit, buf_mut(&mut b.mix), &shape)?;
            layer.o.forward(dev, buf(&b.mix), buf_mut(&mut b.tmp), buf_mut(&mut b.lin32), rows)?;
            dev.add_rmsnorm(buf_mut(&mut b.x), buf(&b.tmp), &layer.post_norm, buf_mut(&mut b.hn), rows, h, eps, false)?;
            layer.gate_up.forward(dev, buf(&b.hn), buf_mut(&mut b.gate_up), buf_mut(&mut b.lin32), rows)?;
            let gu = buf(&b.gate_up);
            dev.swiglu(&gu.slice(0..), &gu.slice(inter..), buf_mut(&mut b.act), rows, inter, 2 * inter, 2 * inter)?;
            layer.down.forward(dev, buf(&b.act), buf_mut(&mut b.tmp), buf_mut(&mut b.lin32), rows)?;
            let next = d.w.layers.get(l + 1).map_or(&d.w.norm, |nl| &nl.input_norm);
            dev.add_rmsnorm(buf_mut(&mut b.x), buf(&b.tmp), next, buf_mut(&mut b.hn), rows, h, eps, false)?;
        }
        // The rows after each anchor that are drafts, gathered for the LM head.
        let mut m = 0;
        let mut ends = Vec::with_capacity(n);
        for (j, &i) in group.iter().enumerate() {
            let k = seqs[i].k;
            let src = buf(&b.hn).slice((j * bs + 1) * h..(j * bs + 1 + k) * h);
            let mut dst = buf_mut(&mut b.sel).slice_mut(m * h..(m + k) * h);
            st.memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering DFlash draft rows"))?;
            m += k;
            ends.push(m);
        }
        self.ensure_logit_rows(m)?;
        let CudaModel { dev, weights, act, logits_round, .. } = self;
        weights.logits(dev, buf(&b.sel), buf_mut(&mut act.logits), m, vocab, h, *logits_round)?;
        dev.argmax_logsumexp(buf(&act.logits), &mut buf_mut(&mut b.ids).slice_mut(0..m), &mut buf_mut(&mut b.lse).slice_mut(0..m), m, vocab)?;
        let picked = dev.stream().clone_dtoh(&buf(&b.ids).slice(0..m)).map_err(driver_err("copying DFlash drafts to the host"))?;
        // A sampled sequence draws from its rows on the host: the logits up to the last of them.
        let host_rows = group.iter().zip(&ends).filter(|(&i, _)| seqs[i].sampling.is_some()).map(|(_, &e)| e).max().unwrap_or(0);
        let logits = if host_rows > 0 { self.logit_floats_to_host(host_rows * vocab)? } else { Vec::new() };
        self.dev.synchronize()?;
        for (j, &i) in group.iter().enumerate() {
            let (start, end) = (if j == 0 { 0 } else { ends[j - 1] }, ends[j]);
            out[i] = match &seqs[i].sampling {
                Some(s) => {
                    let rows = logits[start * vocab..end * vocab].chunks_exact(vocab);
                    let (tokens, q) = rows.zip(&s.u).map(|(row, &u)| draw_draft(row, &s.warpers, u)).unzip();
                    MtpDraft { tokens, q }
                }
                None => MtpDraft { tokens: picked[start..end].iter().map(|&t| t as u32).collect(), q: Vec::new() },
            };
            if let Some(t) = out[i].tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(NinferError::Device(format!("DFlash drafted token id {t} >= vocab_size {vocab}")));
            }
        }
        Ok(())
    }
}

/// The pages a drafting forward reads for a sequence whose context is positions `..len` of
/// `table` (blocks of `page` positions) and whose block is the `bs` positions after it: the
/// table's pages that hold context, then spare pages from `spare` on; and the flat slot of each
/// block row. A block row shares the anchor's page where that page holds context (the
/// sequence's own page), else takes a spare one (at most `ceil(bs / page)`).
fn block_pages(table: &[u32], len: usize, bs: usize, page: usize, spare: usize) -> (Vec<i32>, Vec<i64>) {
    let ctx_pages = len.div_ceil(page);
    let pages: Vec<i32> = (0..(len + bs - 1) / page + 1).map(|b| if b < ctx_pages { table[b] as i32 } else { (spare + b - ctx_pages) as i32 }).collect();
    let slots = (len..len + bs).map(|p| pages[p / page] as i64 * page as i64 + (p % page) as i64).collect();
    (pages, slots)
}

/// Whether `table` covers positions `..end` with blocks of `page` inside the pool's `num_blocks`.
fn check_table(table: &[u32], end: usize, page: usize, num_blocks: usize, what: &str) -> Result<()> {
    let need = end.div_ceil(page);
    if table.len() < need {
        return Err(NinferError::invalid(what, format!("{} blocks cover fewer than {end} positions (block size {page})", table.len())));
    }
    if let Some(b) = table[..need].iter().find(|&&b| b as usize >= num_blocks) {
        return Err(NinferError::invalid(what, format!("block {b} >= num_blocks {num_blocks}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block rows after a context that ends inside a page share that page (the sequence's own,
    /// past its context), the rest take spare pages; a page-aligned context leaves every row to
    /// the spare pages, never to a page of the table it was not given; context pages are the
    /// table's. At most `ceil(bs / page)` spare pages a sequence.
    #[test]
    fn block_rows_land_past_the_context_in_the_anchors_page_or_in_spare_pages() {
        let table = [7, 3, 9, 4];
        // Context of 21 positions in pages of 16: page 1 (block 3) holds 16..21, rows 21..29.
        let (pages, slots) = block_pages(&table, 21, 8, 16, 100);
        assert_eq!(pages, vec![7, 3]);
        assert_eq!(slots, (21..29).map(|p| 3 * 16 + p as i64 - 16).collect::<Vec<_>>());
        // Rows 27..35 cross into a spare page.
        let (pages, slots) = block_pages(&table, 27, 8, 16, 100);
        assert_eq!(pages, vec![7, 3, 100]);
        assert_eq!(slots[..5], (27..32).map(|p| 3 * 16 + p as i64 - 16).collect::<Vec<_>>()[..]);
        assert_eq!(slots[5..], [1600, 1601, 1602]);
        // A page-aligned context of 32: the table's third page is not the drafter's to write.
        let (pages, slots) = block_pages(&table[..2], 32, 8, 16, 100);
        assert_eq!(pages, vec![7, 3, 100]);
        assert_eq!(slots, (1600..1608).collect::<Vec<_>>());
        // No context; pages of 4 positions: a block of 8 takes two spare pages.
        let (pages, slots) = block_pages(&[], 0, 8, 4, 50);
        assert_eq!(pages, vec![50, 51]);
        assert_eq!(slots, (200..208).collect::<Vec<_>>());
        for (len, bs, page) in [(0usize, 16usize, 16usize), (15, 16, 16), (17, 5, 4), (33, 16, 1), (5, 8, 16)] {
            let table: Vec<u32> = (0..len.div_ceil(page) as u32).collect();
            let (pages, _) = block_pages(&table, len, bs, page, 1000);
            assert!(pages.iter().filter(|&&b| b >= 1000).count() <= bs.div_ceil(page), "{len} {bs} {page}");
        }
    }
}
