//! Decode attention with the step's q / k head norms, RoPE and KV cache write in it
//! (`paged_attention_decode_rope`, cuda/decode_attention.cu flash_decode_direct_rope_d*): bit
//! for bit `rope_kv_write_packed` (or `rope_kv_write_normed`) then the direct tensor-core form,
//! its output and both caches. Shapes: Llama-3-8B, Qwen3-8B (q/k norms), the Qwen3.5-27B
//! attention (gated, (1 + w) norms, 64 of 256 dims rotating), MHA at d 64, groups of 8, a whole
//! rotary d 256 and partial rotaries; cache blocks of 16 and 8 keys (tiles across blocks);
//! contexts from one key to past 4k, alone and in one batch; each token's newest slot poisoned
//! with NaN beforehand (a tile row the kernel failed to take from its own write shows); three
//! launches, every arrival counter back at 0. Shapes outside the direct form are refused.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::{AttnScratch, DecodeAttentionForm, DecodeGate, HeadNorms, PagedAttentionShape, RopeKvShape};
use ninfer_core::backend::cuda::CudaDevice;

use super::harness::{gpu, rounded, upload, upload_raw, Out16, Rng, STORAGES};
use super::{assert_arrivals_reset, assert_bitwise, decode_scratch, paged_case, PagedCase};

/// Contexts (keys a token sees, its own newest included): one key, a partial first tile, whole
/// tiles, a first split and one key past it, a few splits, many, and past 4k (long splits).
const CONTEXTS: [usize; 9] = [1, 7, 16, 17, 64, 65, 300, 1000, 4100];
const EPS: f32 = 1e-6;

/// One shape: q heads, kv heads, head size, rotary dims, gated queries, q/k norms, the (1 + w)
/// norm convention, RoPE's attn_scale.
#[derive(Clone, Copy)]
struct Heads {
    hq: usize,
    hk: usize,
    d: usize,
    rot: usize,
    gated: bool,
    normed: bool,
    plus_one: bool,
    scale: f32,
}

impl Heads {
    /// Columns of q (and the gate after it where gated), k and v in a projection row, and the
    /// row width (two spare columns: rows as wide as the model's are always even).
    fn layout(&self) -> (usize, usize, usize) {
        let (qd, kvd) = (self.hq * self.d, self.hk * self.d);
        let k_off = if self.gated { 2 * qd } else { qd };
        (k_off, k_off + kvd, k_off + 2 * kvd + 2)
    }
}

/// The device inputs of one shape over CONTEXTS.
struct Case {
    h: Heads,
    bs: usize,
    paged: PagedCase,

    tables: CudaSlice<i32>,
    qkv_host: Vec<f32>,
    qw: CudaSlice<u16>,
    kw: CudaSlice<u16>,
    freq: CudaSlice<f32>,
}

impl Case {
    fn shape(&self, q_stride: usize) -> PagedAttentionShape {
        let h = &self.h;
        PagedAttentionShape {
            n_q_heads: h.hq,
            n_kv_heads: h.hk,
            head_dim: h.d,
            q_stride,
            block_size: self.bs,
            num_blocks: self.paged.num_blocks,
            max_blocks_per_seq: self.paged.max_blocks,
            scale: 1.0 / (h.d as f32).sqrt(),
            max_context: 0,
            partition: 0,
        }
    }

    /// Sequence s's newest key's cache slot.
    fn newest_slot(&self, s: usize) -> i64 {
        let p = CONTEXTS[s] - 1;
        (self.paged.tables[s * self.paged.max_blocks + p / self.bs] as usize * self.bs + p % self.bs) as i64
    }

    /// The k and v caches before a launch for the tokens of `seqs`: each token's newest slot set
    /// to NaN (the kernels must write it, and read it from their own write).
    fn caches(&self, seqs: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let kvd = self.h.hk * self.h.d;
        let (mut k, mut v) = (self.paged.k_cache.clone(), self.paged.v_cache.clone());
        for &s in seqs {
            let at = self.newest_slot(s) as usize * kvd;
            k[at..at + kvd].fill(f32::NAN);
            v[at..at + kvd].fill(f32::NAN);
        }
        (k, v)
    }

    /// Projection rows of the tokens of `seqs` (a row a sequence, drawn once per case).
    fn rows(&self, seqs: &[usize]) -> Vec<f32> {
        let width = self.h.layout().2;
        seqs.iter().flat_map(|&s| self.qkv_host[s * width..(s + 1) * width].iter().copied()).collect()
    }
}

fn build(dev: &CudaDevice, rng: &mut Rng, h: Heads, bs: usize) -> Case {
    let st = dev.storage();
    let paged = paged_case(rng, st, &CONTEXTS, h.hk, h.d, bs);
    let width = h.layout().2;
    let qkv_host = rounded(&rng.vec(CONTEXTS.len() * width, -2.0, 2.0), st);
    let (lo, hi) = if h.plus_one { (-0.5, 0.5) } else { (0.5, 1.5) };
    let (qw, kw) = (rounded(&rng.vec(h.d, lo, hi), st), rounded(&rng.vec(h.d, lo, hi), st));
    let inv_freq: Vec<f32> = (0..h.rot / 2).map(|i| 1_000_000f32.powf(-(2.0 * i as f32) / h.rot as f32)).collect();
    let tables = upload_raw(dev, &paged.tables);
    Case { h, bs, paged, tables, qkv_host, qw: upload(dev, &qw), kw: upload(dev, &kw), freq: upload_raw(dev, &inv_freq) }
}

/// [output, k cache, v cache] of the tokens of `seqs` (one each, at its newest position).
type Result3 = [Vec<f32>; 3];

/// rope_kv_write_packed / rope_kv_write_normed, then the direct form.
fn two_kernels(dev: &CudaDevice, c: &Case, seqs: &[usize], scratch: &AttnScratch) -> Result3 {
    let h = &c.h;
    let (k_off, v_off, width) = h.layout();
    let (t, qd, kvd) = (seqs.len(), h.hq * h.d, h.hk * h.d);
    let (seq, pos, slots) = token_meta(dev, c, seqs);
    let mut qkv = upload(dev, &c.rows(seqs));
    let (k0, v0) = c.caches(seqs);
    let (mut kc, mut vc) = (Out16::with(dev, &k0), Out16::with(dev, &v0));
    let mut out = Out16::new(dev, t * qd);
    let rope = RopeKvShape { n_q_heads: h.hq, n_kv_heads: h.hk, head_dim: h.d, q_stride: width, k_stride: width, v_stride: width, attn_scale: h.scale };
    let mut qn = Out16::new(dev, t * qd);
    if h.normed {
        let mut kn = Out16::new(dev, t * kvd);
        dev.rope_kv_write_normed(&qkv, k_off, v_off, &c.qw, &c.kw, EPS, h.plus_one, &mut qn.view(), &mut kn.view(), &mut kc.view(), &mut vc.view(), &pos, &slots, &c.freq, &rope).unwrap();
    } else {
        dev.rope_kv_write_packed(&mut qkv, k_off, v_off, &mut kc.view(), &mut vc.view(), &pos, &slots, &c.freq, &rope).unwrap();
    }
    let gate_rows = qkv.slice(qd..);
    let gate = h.gated.then_some(DecodeGate { rows: &gate_rows, stride: width });
    let (kv, vv) = (kc.view(), vc.view());
    let form = DecodeAttentionForm::TensorCoreDirect;
    if h.normed {
        dev.paged_attention_decode_as(form, &qn.view(), &kv, &vv, &c.tables, &seq, &pos, &mut out.view(), gate, &c.shape(qd), scratch).unwrap();
    } else {
        dev.paged_attention_decode_as(form, &qkv, &kv, &vv, &c.tables, &seq, &pos, &mut out.view(), gate, &c.shape(width), scratch).unwrap();
    }
    drop((kv, vv));
    [out.read(dev, "two-kernel output"), kc.read(dev, "two-kernel k cache"), vc.read(dev, "two-kernel v cache")]
}

/// paged_attention_decode_rope, launched `launches` times on the same caches.
fn fused(dev: &CudaDevice, c: &Case, seqs: &[usize], scratch: &AttnScratch, launches: usize) -> Vec<Result3> {
    let h = &c.h;
    let (k_off, v_off, width) = h.layout();
    let (t, qd) = (seqs.len(), h.hq * h.d);
    let (seq, pos, slots) = token_meta(dev, c, seqs);
    let qkv = upload(dev, &c.rows(seqs));
    let (k0, v0) = c.caches(seqs);
    let (mut kc, mut vc) = (Out16::with(dev, &k0), Out16::with(dev, &v0));
    let gate_rows = qkv.slice(qd..);
    let norms = h.normed.then_some(HeadNorms { q: &c.qw, k: &c.kw, eps: EPS, plus_one: h.plus_one });
    (0..launches)
        .map(|_| {
            let mut out = Out16::new(dev, t * qd);
            let gate = h.gated.then_some(DecodeGate { rows: &gate_rows, stride: width });
            dev.paged_attention_decode_rope(&qkv, k_off, v_off, norms, &mut kc.view(), &mut vc.view(), &c.tables, &seq, &pos, &slots, &c.freq, h.scale, &mut out.view(), gate, &c.shape(width), scratch).unwrap();
            [out.read(dev, "fused output"), kc.read(dev, "fused k cache"), vc.read(dev, "fused v cache")]
        })
        .collect()
}

/// The tokens' sequences, positions (each sequence's newest key) and cache slots.
fn token_meta(dev: &CudaDevice, c: &Case, seqs: &[usize]) -> (CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i64>) {
    let seq: Vec<i32> = seqs.iter().map(|&s| s as i32).collect();
    let pos: Vec<i32> = seqs.iter().map(|&s| CONTEXTS[s] as i32 - 1).collect();
    let slots: Vec<i64> = seqs.iter().map(|&s| c.newest_slot(s)).collect();
    (upload_raw(dev, &seq), upload_raw(dev, &pos), upload_raw(dev, &slots))
}

#[test]
fn decode_attention_with_rope_equals_rope_kv_write_then_decode_attention_bitwise() {
    let heads = |hq, hk, d, rot, gated, normed, plus_one, scale| Heads { hq, hk, d, rot, gated, normed, plus_one, scale };
    let shapes = [
        heads(32, 8, 128, 128, false, false, false, 1.0), // Llama-3-8B
        heads(32, 8, 128, 128, false, true, false, 1.0),  // Qwen3-8B
        heads(24, 4, 256, 64, true, true, true, 1.0),     // Qwen3.5-27B
        heads(8, 8, 64, 64, false, false, false, 1.25),   // MHA, a rope scale
        heads(16, 2, 128, 128, true, false, false, 1.0),  // groups of 8, gated
        heads(8, 2, 256, 256, false, true, false, 1.0),   // a whole rotary of 256
        heads(8, 2, 128, 64, false, false, false, 1.0),   // partial rotary
        heads(8, 4, 64, 32, true, true, true, 1.0),       // partial rotary, normed, gated
    ];
    for st in STORAGES {
        let Some(dev) = gpu("decode_attention_rope", st) else { return };
        if dev.compute_capability().0 < 8 {
            eprintln!("SKIP decode_attention_rope: the direct tensor-core form needs sm_80+");
            return;
        }
        let mut rng = Rng::new(97);
        for (i, h) in shapes.iter().enumerate() {
            // Blocks of 8 keys for every other shape: a 16-key tile spans two cache blocks.
            let bs = if i % 2 == 0 { 16 } else { 8 };
            let c = build(&dev, &mut rng, *h, bs);
            let label = format!("{} hq{}/hk{}/d{}/rot{}/gated{}/normed{}/bs{bs}", st.name(), h.hq, h.hk, h.d, h.rot, h.gated as u8, h.normed as u8);
            let all: Vec<usize> = (0..CONTEXTS.len()).collect();
            let mut runs: Vec<Vec<usize>> = all.iter().map(|&s| vec![s]).collect();
            runs.push(all);
            for seqs in runs {
                let scratch = decode_scratch(&dev, seqs.len(), &c.shape(h.layout().2));
                let want = two_kernels(&dev, &c, &seqs, &scratch);
                assert_arrivals_reset(&dev, &scratch, &format!("{label} two kernels"));
                let what = format!("{label} contexts {:?}", seqs.iter().map(|&s| CONTEXTS[s]).collect::<Vec<_>>());
                for (n, got) in fused(&dev, &c, &seqs, &scratch, 3).iter().enumerate() {
                    for (j, part) in ["output", "k cache", "v cache"].iter().enumerate() {
                        assert_bitwise(&got[j], &want[j], &format!("decode attention with RoPE {what} launch {n}: {part}"));
                    }
                    assert_arrivals_reset(&dev, &scratch, &format!("{what} launch {n}"));
                }
            }
            println!("PARITY op=decode_attention_rope storage={} shape={label} bitwise=1", st.name());
        }
    }
}

#[test]
fn decode_attention_with_rope_refuses_heads_outside_the_direct_form() {
    let Some(dev) = gpu("decode_attention_rope_refusal", ninfer_core::backend::cuda::StorageDType::Bf16) else { return };
    let mut rng = Rng::new(5);
    // Heads of 96 (no direct form), groups of 16, an odd rotary part (inv_freq of 48 pairs in a
    // head of 64 rotates 96 dims: past the head).
    for (h, rot) in [((8, 8, 96), 96), ((32, 2, 128), 128), ((8, 8, 64), 96)] {
        let ((hq, hk, d), bs) = (h, 16);
        let base = Heads { hq, hk, d, rot, gated: false, normed: false, plus_one: false, scale: 1.0 };
        let c = build(&dev, &mut rng, base, bs);
        let (k_off, v_off, width) = base.layout();
        let (seq, pos, slots) = token_meta(&dev, &c, &[2]);
        let qkv = upload(&dev, &c.rows(&[2]));
        let (k0, v0) = c.caches(&[2]);
        let (mut kc, mut vc) = (Out16::with(&dev, &k0), Out16::with(&dev, &v0));
        let mut out = Out16::new(&dev, hq * d);
        let scratch = decode_scratch(&dev, 1, &c.shape(width));
        let err = dev
            .paged_attention_decode_rope(&qkv, k_off, v_off, None, &mut kc.view(), &mut vc.view(), &c.tables, &seq, &pos, &slots, &c.freq, 1.0, &mut out.view(), None, &c.shape(width), &scratch)
            .expect_err("a shape outside the direct form");
        let msg = err.to_string();
        assert!(msg.contains("direct tensor-core form only") && msg.contains(&format!("head size {d}")), "{msg}");
    }
}
