//! The fused GDN decode kernel (`gdn_recurrent_gated`: gates + recurrent delta rule + gated
//! RMSNorm) against the three kernels it replaces (`gdn_gates`, `gdn_recurrent`,
//! `rmsnorm_gated`, expected bit for bit at dv <= 256) and the CPU reference; a sequence in a
//! mixed batch against the same sequence alone (bitwise); and a TIMING line at the Qwen3.5-27B
//! GDN shape.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::RecurrentShape;
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::harness::{check, gpu, rounded, tol16, upload, upload_raw, Out16, Out32, Rng, STORAGES, TOL32};
use super::{assert_bitwise, reference, time_ms};

const EPS: f32 = 1e-6;

/// One step's inputs, laid out as `gdn_layer` sees them: q | k | v rows of the conv output
/// (`qkv_stride` wide) and z | b | a columns of the input projection's rows (`zba_stride` wide,
/// wider than the three to check the kernel skips the rest).
struct Case {
    lens: Vec<usize>,
    slots: Vec<i32>,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    n_slots: usize,
    qkv: Vec<f32>,
    zba: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_w: Vec<f32>,
    state0: Vec<f32>,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(rng: &mut Rng, st: StorageDType, lens: &[usize], slots: &[i32], nk: usize, nv: usize, dk: usize, dv: usize, n_slots: usize) -> Case {
        let t: usize = lens.iter().sum();
        let qkv_stride = 2 * nk * dk + nv * dv;
        let zba_stride = nv * dv + 2 * nv + 5;
        let mut zba = rounded(&rng.vec(t * zba_stride, -4.0, 4.0), st);
        // a spans softplus's linear branch (> 20 after dt_bias) and its log1p branch.
        for r in 0..t {
            for h in 0..nv {
                zba[r * zba_stride + nv * dv + nv + h] = rounded(&[rng.range(-8.0, 24.0)], st)[0];
            }
        }
        Case {
            lens: lens.to_vec(),
            slots: slots.to_vec(),
            nk,
            nv,
            dk,
            dv,
            n_slots,
            qkv: rounded(&rng.vec(t * qkv_stride, -1.0, 1.0), st),
            zba,
            a_log: rng.vec(nv, -1.0, 1.0),
            dt_bias: rng.vec(nv, -1.0, 1.0),
            norm_w: rounded(&rng.vec(dv, 0.5, 1.5), st),
            state0: rng.vec(n_slots * nv * dk * dv, -0.1, 0.1),
        }
    }
    fn t(&self) -> usize {
        self.lens.iter().sum()
    }
    fn qkv_stride(&self) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv
    }
    fn zba_stride(&self) -> usize {
        self.nv * self.dv + 2 * self.nv + 5
    }
    fn cu(&self) -> Vec<i32> {
        let mut cu = vec![0i32];
        for l in &self.lens {
            cu.push(cu.last().unwrap() + *l as i32);
        }
        cu
    }
    fn shape(&self) -> RecurrentShape {
        let s = self.qkv_stride();
        RecurrentShape { n_tokens: self.t(), n_k_heads: self.nk, n_v_heads: self.nv, dk: self.dk, dv: self.dv, qk_stride: s, v_stride: s, n_slots: self.n_slots }
    }
    fn label(&self) -> String {
        format!("lens{:?}/nk{}/nv{}/dk{}/dv{}", self.lens, self.nk, self.nv, self.dk, self.dv).replace(' ', "")
    }
}

/// The case's buffers on the device.
struct DevCase {
    qkv: CudaSlice<u16>,
    zba: CudaSlice<u16>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    norm_w: CudaSlice<u16>,
    cu: CudaSlice<i32>,
    slots: CudaSlice<i32>,
}

impl DevCase {
    fn new(dev: &CudaDevice, c: &Case) -> DevCase {
        DevCase {
            qkv: upload(dev, &c.qkv),
            zba: upload(dev, &c.zba),
            a_log: upload_raw(dev, &c.a_log),
            dt_bias: upload_raw(dev, &c.dt_bias),
            norm_w: upload(dev, &c.norm_w),
            cu: upload_raw(dev, &c.cu()),
            slots: upload_raw(dev, &c.slots),
        }
    }
}

/// The fused kernel: (normed output [T, nv, dv], state).
fn run_fused(dev: &CudaDevice, c: &Case, d: &DevCase, state: &mut Out32, out: &mut Out16) {
    let (nk, nv, dk, dv) = (c.nk, c.nv, c.dk, c.dv);
    let zs = c.zba_stride();
    dev.gdn_recurrent_gated(
        &d.qkv,
        &d.qkv.slice(nk * dk..),
        &d.qkv.slice(2 * nk * dk..),
        &d.zba.slice(nv * dv + nv..),
        &d.zba.slice(nv * dv..),
        zs,
        &d.a_log,
        &d.dt_bias,
        &mut state.view(),
        &d.cu,
        &d.slots,
        &d.zba,
        zs,
        &d.norm_w,
        EPS,
        &mut out.view(),
        &c.shape(),
    )
    .unwrap();
}

/// gdn_gates + gdn_recurrent + rmsnorm_gated, as gdn_layer ran them before the fused kernel.
#[allow(clippy::too_many_arguments)] // the three kernels' outputs, each its own buffer
fn run_three(dev: &CudaDevice, c: &Case, d: &DevCase, state: &mut Out32, g: &mut Out32, beta: &mut Out32, core: &mut Out16, out: &mut Out16) {
    let (nk, nv, dk, dv, t) = (c.nk, c.nv, c.dk, c.dv, c.t());
    let zs = c.zba_stride();
    dev.gdn_gates(&d.zba.slice(nv * dv + nv..), &d.zba.slice(nv * dv..), zs, &d.a_log, &d.dt_bias, &mut g.view(), &mut beta.view(), t, nv).unwrap();
    dev.gdn_recurrent(&d.qkv, &d.qkv.slice(nk * dk..), &d.qkv.slice(2 * nk * dk..), &g.view(), &beta.view(), &mut state.view(), &d.cu, &d.slots, &mut core.view(), &c.shape())
        .unwrap();
    dev.rmsnorm_gated(&core.view(), &d.zba, zs, &d.norm_w, &mut out.view(), t, nv, dv, EPS).unwrap();
}

/// CPU reference: (normed output, state), beta and the raw output rounded to storage (before
/// the rule and before the norm) as the device rounds them.
fn reference_step(c: &Case, st: StorageDType) -> (Vec<f32>, Vec<f32>) {
    let (nk, nv, dk, dv, t) = (c.nk, c.nv, c.dk, c.dv, c.t());
    let (qs, zs) = (c.qkv_stride(), c.zba_stride());
    let g: Vec<f32> = (0..t * nv).map(|e| -c.a_log[e % nv].exp() * reference::softplus(c.zba[(e / nv) * zs + nv * dv + nv + e % nv] + c.dt_bias[e % nv])).collect();
    let beta: Vec<f32> = rounded(&(0..t * nv).map(|e| reference::sigmoid(c.zba[(e / nv) * zs + nv * dv + e % nv])).collect::<Vec<_>>(), st);
    let cu = c.cu();
    let mut state = c.state0.clone();
    let mut core = vec![0.0f32; t * nv * dv];
    for (s, &slot) in c.slots.iter().enumerate() {
        let toks = cu[s] as usize..cu[s + 1] as usize;
        let cols = |from: usize, len: usize| -> Vec<f32> { toks.clone().flat_map(|i| c.qkv[i * qs + from..i * qs + from + len].to_vec()).collect() };
        let (q, k, v) = (cols(0, nk * dk), cols(nk * dk, nk * dk), cols(2 * nk * dk, nv * dv));
        let so = slot as usize * nv * dk * dv;
        let o = reference::gdn_recurrent_seq(&q, &k, &v, &g[toks.start * nv..toks.end * nv], &beta[toks.start * nv..toks.end * nv], &mut state[so..so + nv * dk * dv], toks.len(), nk, nv, dk, dv);
        core[toks.start * nv * dv..toks.end * nv * dv].copy_from_slice(&o);
    }
    let core = rounded(&core, st);
    let z: Vec<f32> = (0..t).flat_map(|r| c.zba[r * zs..r * zs + nv * dv].to_vec()).collect();
    (reference::rmsnorm_gated(&core, &z, &c.norm_w, t * nv, dv, EPS), state)
}

#[test]
fn gdn_recurrent_gated_equals_the_three_kernels_bitwise_and_matches_reference() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_recurrent_gated", st) else { return };
        let mut rng = Rng::new(41);
        // Decode (one token per sequence) at small and 27B shapes, short prefill chunks mixed
        // with decode rows, dk 64 and a dv below dk; dk = dv = 128 runs the fixed-dv instance,
        // the others the dv-argument ones.
        #[allow(clippy::type_complexity)] // (chunk lengths, start positions, nk, nv, dk, dv), read in place
        let cases: [(&[usize], &[i32], usize, usize, usize, usize); 6] = [
            (&[1, 1], &[3, 0], 2, 4, 128, 128),
            (&[5, 2], &[1, 6], 2, 4, 128, 128),
            (&[3, 9, 1], &[3, 0, 4], 2, 4, 64, 64),
            (&[16], &[1], 2, 4, 128, 64),
            (&[1], &[2], 16, 48, 128, 128),
            (&[1, 1, 1, 1, 1, 1, 1, 1], &[7, 6, 5, 4, 3, 2, 1, 0], 16, 48, 128, 128),
        ];
        for (lens, slots, nk, nv, dk, dv) in cases {
            let n_slots = 8;
            let c = Case::new(&mut rng, st, lens, slots, nk, nv, dk, dv, n_slots);
            let d = DevCase::new(&dev, &c);
            let (t, label) = (c.t(), c.label());
            let mut state_f = Out32::with(&dev, &c.state0);
            let mut out_f = Out16::new(&dev, t * nv * dv);
            run_fused(&dev, &c, &d, &mut state_f, &mut out_f);
            let mut state_u = Out32::with(&dev, &c.state0);
            let (mut g, mut beta) = (Out32::new(&dev, t * nv), Out32::new(&dev, t * nv));
            let (mut core, mut out_u) = (Out16::new(&dev, t * nv * dv), Out16::new(&dev, t * nv * dv));
            run_three(&dev, &c, &d, &mut state_u, &mut g, &mut beta, &mut core, &mut out_u);
            let (out_f, state_f) = (out_f.read(&dev, "fused out"), state_f.read(&dev, "fused state"));
            let (want_out, want_state) = reference_step(&c, st);
            check("gdn_recurrent_gated.out", st, &label, &out_f, &want_out, tol16(st));
            check("gdn_recurrent_gated.state", st, &label, &state_f, &want_state, TOL32);
            assert_bitwise(&out_f, &out_u.read(&dev, "three-kernel out"), &format!("gdn_recurrent_gated out vs three kernels {} {label}", st.name()));
            assert_bitwise(&state_f, &state_u.read(&dev, "three-kernel state"), &format!("gdn_recurrent_gated state vs three kernels {} {label}", st.name()));
            println!("BITWISE op=gdn_recurrent_gated storage={} shape={label} equal_to_three_kernels=true", st.name());
        }
    }
}

#[test]
fn gdn_recurrent_gated_sequence_in_a_batch_equals_it_alone() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_recurrent_gated batch", st) else { return };
        let mut rng = Rng::new(42);
        // Decode rows and short chunks in one step, slots out of order.
        let (lens, slots): (&[usize], &[i32]) = (&[1, 1, 3, 1, 2, 1, 1, 5], &[5, 2, 7, 0, 1, 6, 3, 4]);
        let (nk, nv, dk, dv, n_slots) = (4, 12, 128, 128, 8);
        let c = Case::new(&mut rng, st, lens, slots, nk, nv, dk, dv, n_slots);
        let d = DevCase::new(&dev, &c);
        let mut state = Out32::with(&dev, &c.state0);
        let mut out = Out16::new(&dev, c.t() * nv * dv);
        run_fused(&dev, &c, &d, &mut state, &mut out);
        let (out, state) = (out.read(&dev, "batch out"), state.read(&dev, "batch state"));
        let cu = c.cu();
        let (qs, zs, row, slot_len) = (c.qkv_stride(), c.zba_stride(), nv * dv, nv * dk * dv);
        for (s, &slot) in slots.iter().enumerate() {
            let toks = cu[s] as usize..cu[s + 1] as usize;
            let alone = Case {
                lens: vec![lens[s]],
                slots: vec![slot],
                qkv: c.qkv[toks.start * qs..toks.end * qs].to_vec(),
                zba: c.zba[toks.start * zs..toks.end * zs].to_vec(),
                a_log: c.a_log.clone(),
                dt_bias: c.dt_bias.clone(),
                norm_w: c.norm_w.clone(),
                state0: c.state0.clone(),
                ..c
            };
            let da = DevCase::new(&dev, &alone);
            let mut state_a = Out32::with(&dev, &alone.state0);
            let mut out_a = Out16::new(&dev, alone.t() * row);
            run_fused(&dev, &alone, &da, &mut state_a, &mut out_a);
            let what = format!("{} sequence {s} (slot {slot}, {} tokens)", st.name(), lens[s]);
            assert_bitwise(&out[toks.start * row..toks.end * row], &out_a.read(&dev, "alone out"), &format!("gdn_recurrent_gated out {what}"));
            let so = slot as usize * slot_len;
            assert_bitwise(&state[so..so + slot_len], &state_a.read(&dev, "alone state")[so..so + slot_len], &format!("gdn_recurrent_gated state {what}"));
        }
    }
}

/// TIMING (read on the GPU; asserts nothing about speed): one decode step's GDN core at the
/// Qwen3.5-27B shape (16 k heads, 48 v heads, dk = dv = 128), fused against the three kernels;
/// GB/s counts the state read and written.
#[test]
fn gdn_recurrent_gated_timing_at_27b_shape() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gdn_recurrent_gated timing", st) else { return };
    let mut rng = Rng::new(43);
    let (nk, nv, dk, dv) = (16, 48, 128, 128);
    for batch in [1usize, 8, 16, 64] {
        let lens = vec![1; batch];
        let slots: Vec<i32> = (0..batch as i32).collect();
        let c = Case::new(&mut rng, st, &lens, &slots, nk, nv, dk, dv, batch);
        let d = DevCase::new(&dev, &c);
        let t = c.t();
        let mut state = Out32::with(&dev, &c.state0);
        let mut out = Out16::new(&dev, t * nv * dv);
        let fused = time_ms(&dev, 200, || run_fused(&dev, &c, &d, &mut state, &mut out));
        let (mut g, mut beta) = (Out32::new(&dev, t * nv), Out32::new(&dev, t * nv));
        let mut core = Out16::new(&dev, t * nv * dv);
        let three = time_ms(&dev, 200, || run_three(&dev, &c, &d, &mut state, &mut g, &mut beta, &mut core, &mut out));
        let gbs = |ms: f64| (batch * nv * dk * dv * 4 * 2) as f64 / (ms * 1e-3) / 1e9;
        println!(
            "TIMING gdn_recurrent_gated 27B shape batch={batch}: fused {:.2} us ({:.0} GB/s of state), gates+recurrent+rmsnorm_gated {:.2} us ({:.0} GB/s) per step-layer (saves {:.2} us x 48 layers = {:.1} us per step)",
            fused * 1e3,
            gbs(fused),
            three * 1e3,
            gbs(three),
            (three - fused) * 1e3,
            (three - fused) * 1e3 * 48.0
        );
    }
}
