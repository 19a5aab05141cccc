//! The one-kernel GDN core (`gdn_conv_recurrent_gated`: causal conv + gates + recurrent delta
//! rule + gated RMSNorm) against the four kernels it replaces (`causal_conv1d`, `gdn_gates`,
//! `gdn_recurrent`, `rmsnorm_gated`, expected bit for bit at dv <= 256: output, delta state and
//! conv state) and the CPU reference; its election counters left at zero; a sequence in a
//! mixed batch against the same sequence alone (bitwise); and a TIMING line at the Qwen3.5-27B
//! GDN shape.

use cudarc::driver::CudaSlice;
use ninfer_core::backend::cuda::ops::{ConvShape, DevicePtrDyn, RecurrentShape};
use ninfer_core::backend::cuda::{CudaDevice, StorageDType};

use super::harness::{check, gpu, rounded, tol16, upload, upload_raw, Out16, Out32, Rng, STORAGES, TOL32};
use super::{assert_bitwise, reference, time_ms};

const EPS: f32 = 1e-6;

/// One step's inputs, laid out as `gdn_layer` sees them: rows of the input projection, each the
/// conv channels q | k | v (`qkv_stride`), then z | b | a and 5 more columns the kernel must
/// skip (`row()` wide in all); the conv state, weight and bias of kernel size `kern`.
struct Case {
    lens: Vec<usize>,
    slots: Vec<i32>,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    n_slots: usize,
    kern: usize,
    /// Projection rows, `row()` wide.
    x: Vec<f32>,
    conv0: Vec<f32>,
    conv_w: Vec<f32>,
    conv_b: Option<Vec<f32>>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_w: Vec<f32>,
    state0: Vec<f32>,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(rng: &mut Rng, st: StorageDType, lens: &[usize], slots: &[i32], nk: usize, nv: usize, dk: usize, dv: usize, n_slots: usize, kern: usize, bias: bool) -> Case {
        let t: usize = lens.iter().sum();
        let cd = 2 * nk * dk + nv * dv;
        let row = cd + nv * dv + 2 * nv + 5;
        let mut x = rounded(&rng.vec(t * row, -4.0, 4.0), st);
        for r in 0..t {
            // The conv inputs in [-1, 1]; a spans softplus's linear branch (> 20 after dt_bias)
            // and its log1p branch.
            let conv_in = rounded(&rng.vec(cd, -1.0, 1.0), st);
            x[r * row..r * row + cd].copy_from_slice(&conv_in);
            for h in 0..nv {
                x[r * row + cd + nv * dv + nv + h] = rounded(&[rng.range(-8.0, 24.0)], st)[0];
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
            kern,
            x,
            conv0: rounded(&rng.vec(n_slots * cd * (kern - 1), -1.0, 1.0), st),
            conv_w: rounded(&rng.vec(cd * kern, -0.6, 0.6), st),
            conv_b: bias.then(|| rounded(&rng.vec(cd, -0.2, 0.2), st)),
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
    fn row(&self) -> usize {
        self.qkv_stride() + self.nv * self.dv + 2 * self.nv + 5
    }
    /// Column of z, then b at + nv * dv, a at + nv * dv + nv.
    fn z_col(&self) -> usize {
        self.qkv_stride()
    }
    fn cu(&self) -> Vec<i32> {
        let mut cu = vec![0i32];
        for l in &self.lens {
            cu.push(cu.last().unwrap() + *l as i32);
        }
        cu
    }
    /// The delta rule's shape over the conv output (`qkv_stride` wide rows).
    fn shape(&self) -> RecurrentShape {
        let s = self.qkv_stride();
        RecurrentShape { n_tokens: self.t(), n_k_heads: self.nk, n_v_heads: self.nv, dk: self.dk, dv: self.dv, qk_stride: s, v_stride: s, n_slots: self.n_slots }
    }
    fn conv_shape(&self) -> ConvShape {
        ConvShape { n_tokens: self.t(), channels: self.qkv_stride(), x_stride: self.row(), kernel_size: self.kern, n_slots: self.n_slots }
    }
    fn label(&self) -> String {
        format!("lens{:?}/nk{}/nv{}/dk{}/dv{}/k{}{}", self.lens, self.nk, self.nv, self.dk, self.dv, self.kern, if self.conv_b.is_some() { "/bias" } else { "" }).replace(' ', "")
    }
}

/// The case's buffers on the device.
struct DevCase {
    x: CudaSlice<u16>,
    conv_w: CudaSlice<u16>,
    conv_b: Option<CudaSlice<u16>>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    norm_w: CudaSlice<u16>,
    cu: CudaSlice<i32>,
    slots: CudaSlice<i32>,
}

impl DevCase {
    fn new(dev: &CudaDevice, c: &Case) -> DevCase {
        DevCase {
            x: upload(dev, &c.x),
            conv_w: upload(dev, &c.conv_w),
            conv_b: c.conv_b.as_ref().map(|b| upload(dev, b)),
            a_log: upload_raw(dev, &c.a_log),
            dt_bias: upload_raw(dev, &c.dt_bias),
            norm_w: upload(dev, &c.norm_w),
            cu: upload_raw(dev, &c.cu()),
            slots: upload_raw(dev, &c.slots),
        }
    }
}

/// The device states a step updates: (conv state, delta state).
struct States {
    conv: Out16,
    delta: Out32,
}

impl States {
    fn new(dev: &CudaDevice, c: &Case) -> States {
        States { conv: Out16::with(dev, &c.conv0), delta: Out32::with(dev, &c.state0) }
    }
    fn read(&self, dev: &CudaDevice, what: &str) -> (Vec<f32>, Vec<f32>) {
        (self.conv.read(dev, &format!("{what} conv state")), self.delta.read(dev, &format!("{what} delta state")))
    }
}

/// The one kernel: normed output [T, nv, dv] into `out`, both states in place; `tickets` one
/// counter per (sequence, key head).
fn run_fused(dev: &CudaDevice, c: &Case, d: &DevCase, states: &mut States, tickets: &mut CudaSlice<u32>, out: &mut Out16) {
    let (nv, dv, zc, row) = (c.nv, c.dv, c.z_col(), c.row());
    let bias = d.conv_b.as_ref().map(|b| b as &dyn DevicePtrDyn);
    dev.gdn_conv_recurrent_gated(
        &d.x,
        &mut states.conv.view(),
        &d.conv_w,
        bias,
        &c.conv_shape(),
        tickets,
        &d.x.slice(zc + nv * dv + nv..),
        &d.x.slice(zc + nv * dv..),
        row,
        &d.a_log,
        &d.dt_bias,
        &mut states.delta.view(),
        &d.cu,
        &d.slots,
        &d.x.slice(zc..),
        row,
        &d.norm_w,
        EPS,
        &mut out.view(),
        &c.shape(),
    )
    .unwrap();
}

/// Intermediate buffers of the four-kernel path.
struct Four {
    conv_out: Out16,
    g: Out32,
    beta: Out32,
    core: Out16,
}

impl Four {
    fn new(dev: &CudaDevice, c: &Case) -> Four {
        let (t, nv, dv) = (c.t(), c.nv, c.dv);
        Four { conv_out: Out16::new(dev, t * c.qkv_stride()), g: Out32::new(dev, t * nv), beta: Out32::new(dev, t * nv), core: Out16::new(dev, t * nv * dv) }
    }
}

/// causal_conv1d + gdn_gates + gdn_recurrent + rmsnorm_gated, as gdn_layer runs them where the
/// one kernel does not serve.
fn run_four(dev: &CudaDevice, c: &Case, d: &DevCase, states: &mut States, w: &mut Four, out: &mut Out16) {
    let (nk, nv, dk, dv, t) = (c.nk, c.nv, c.dk, c.dv, c.t());
    let (zc, row) = (c.z_col(), c.row());
    let bias = d.conv_b.as_ref().map(|b| b as &dyn DevicePtrDyn);
    dev.causal_conv1d(&d.x, &mut states.conv.view(), &d.conv_w, bias, &d.cu, &d.slots, &mut w.conv_out.view(), &c.conv_shape()).unwrap();
    let co = w.conv_out.view();
    dev.gdn_gates(&d.x.slice(zc + nv * dv + nv..), &d.x.slice(zc + nv * dv..), row, &d.a_log, &d.dt_bias, &mut w.g.view(), &mut w.beta.view(), t, nv).unwrap();
    dev.gdn_recurrent(&co, &co.slice(nk * dk..), &co.slice(2 * nk * dk..), &w.g.view(), &w.beta.view(), &mut states.delta.view(), &d.cu, &d.slots, &mut w.core.view(), &c.shape()).unwrap();
    dev.rmsnorm_gated(&w.core.view(), &d.x.slice(zc..), row, &d.norm_w, &mut out.view(), t, nv, dv, EPS).unwrap();
}

/// CPU reference: (conv output [T, qkv_stride], normed output, conv state, delta state). The
/// delta rule reads `conv_out`, the device conv's output (as the recurrent tests feed both sides
/// the same q / k / v: the CPU conv rounds once where the device rounds before and after SiLU,
/// and a one-ulp q / k / v moves the f32 state past TOL32); beta and the raw output are rounded
/// to storage as the device rounds them.
fn reference_step(c: &Case, st: StorageDType, conv_out: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nk, nv, dk, dv, t) = (c.nk, c.nv, c.dk, c.dv, c.t());
    let (cd, row, zc, km1) = (c.qkv_stride(), c.row(), c.z_col(), c.kern - 1);
    let col = |r: usize, i: usize| c.x[r * row + i];
    let g: Vec<f32> = (0..t * nv).map(|e| -c.a_log[e % nv].exp() * reference::softplus(col(e / nv, zc + nv * dv + nv + e % nv) + c.dt_bias[e % nv])).collect();
    let beta: Vec<f32> = rounded(&(0..t * nv).map(|e| reference::sigmoid(col(e / nv, zc + nv * dv + e % nv))).collect::<Vec<_>>(), st);
    let cu = c.cu();
    let mut conv = c.conv0.clone();
    let mut cpu_conv = vec![0.0f32; t * cd];
    let mut state = c.state0.clone();
    let mut core = vec![0.0f32; t * nv * dv];
    for (s, &slot) in c.slots.iter().enumerate() {
        let toks = cu[s] as usize..cu[s + 1] as usize;
        let xs: Vec<f32> = toks.clone().flat_map(|r| c.x[r * row..r * row + cd].to_vec()).collect();
        let cs = slot as usize * cd * km1;
        let co = reference::conv1d_seq(&xs, &mut conv[cs..cs + cd * km1], &c.conv_w, c.conv_b.as_deref(), toks.len(), cd, c.kern);
        cpu_conv[toks.start * cd..toks.end * cd].copy_from_slice(&co);
        let cols = |from: usize, len: usize| -> Vec<f32> { toks.clone().flat_map(|i| conv_out[i * cd + from..i * cd + from + len].to_vec()).collect() };
        let (q, k, v) = (cols(0, nk * dk), cols(nk * dk, nk * dk), cols(2 * nk * dk, nv * dv));
        let so = slot as usize * nv * dk * dv;
        let o = reference::gdn_recurrent_seq(&q, &k, &v, &g[toks.start * nv..toks.end * nv], &beta[toks.start * nv..toks.end * nv], &mut state[so..so + nv * dk * dv], toks.len(), nk, nv, dk, dv);
        core[toks.start * nv * dv..toks.end * nv * dv].copy_from_slice(&o);
    }
    let core = rounded(&core, st);
    let z: Vec<f32> = (0..t).flat_map(|r| c.x[r * row + zc..r * row + zc + nv * dv].to_vec()).collect();
    (rounded(&cpu_conv, st), reference::rmsnorm_gated(&core, &z, &c.norm_w, t * nv, dv, EPS), rounded(&conv, st), state)
}

/// Zeroed election counters for `c` (one per sequence and key head).
fn tickets(dev: &CudaDevice, c: &Case) -> CudaSlice<u32> {
    upload_raw(dev, &vec![0u32; c.lens.len() * c.nk])
}

#[test]
fn gdn_conv_recurrent_gated_equals_the_four_kernels_bitwise_and_matches_reference() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_conv_recurrent_gated", st) else { return };
        let mut rng = Rng::new(41);
        // Decode (one token per sequence) at small and 27B shapes, short prefill chunks mixed
        // with decode rows (a chunk shorter than the conv window too), dk 64 and a dv below dk,
        // conv kernels 2, 3 and 4 with and without bias; dk = dv = 128 runs the fixed-dv
        // instance, the others the dv-argument ones.
        #[allow(clippy::type_complexity)] // (chunk lengths, slots, nk, nv, dk, dv, conv kernel, bias), read in place
        let cases: [(&[usize], &[i32], usize, usize, usize, usize, usize, bool); 8] = [
            (&[1, 1], &[3, 0], 2, 4, 128, 128, 4, false),
            (&[5, 2], &[1, 6], 2, 4, 128, 128, 4, true),
            (&[3, 9, 1], &[3, 0, 4], 2, 4, 64, 64, 3, true),
            (&[16], &[1], 2, 4, 128, 64, 2, false),
            (&[2, 1], &[5, 2], 2, 2, 128, 96, 4, true),
            (&[1], &[2], 16, 48, 128, 128, 4, false),
            (&[1, 1, 1, 1, 1, 1, 1, 1], &[7, 6, 5, 4, 3, 2, 1, 0], 16, 48, 128, 128, 4, false),
            (&[1, 1, 1], &[0, 1, 2], 4, 4, 128, 128, 4, true),
        ];
        for (lens, slots, nk, nv, dk, dv, kern, bias) in cases {
            let n_slots = 8;
            let c = Case::new(&mut rng, st, lens, slots, nk, nv, dk, dv, n_slots, kern, bias);
            let d = DevCase::new(&dev, &c);
            let (t, label) = (c.t(), c.label());
            let mut fused = States::new(&dev, &c);
            let mut tk = tickets(&dev, &c);
            let mut out_f = Out16::new(&dev, t * nv * dv);
            run_fused(&dev, &c, &d, &mut fused, &mut tk, &mut out_f);
            let mut four = States::new(&dev, &c);
            let mut work = Four::new(&dev, &c);
            let mut out_u = Out16::new(&dev, t * nv * dv);
            run_four(&dev, &c, &d, &mut four, &mut work, &mut out_u);
            let out_f = out_f.read(&dev, "fused out");
            let (conv_f, delta_f) = fused.read(&dev, "fused");
            let (conv_u, delta_u) = four.read(&dev, "four-kernel");
            assert_bitwise(&out_f, &out_u.read(&dev, "four-kernel out"), &format!("gdn_conv_recurrent_gated out vs four kernels {} {label}", st.name()));
            assert_bitwise(&delta_f, &delta_u, &format!("gdn_conv_recurrent_gated delta state vs four kernels {} {label}", st.name()));
            assert_bitwise(&conv_f, &conv_u, &format!("gdn_conv_recurrent_gated conv state vs four kernels {} {label}", st.name()));
            let conv_out = work.conv_out.read(&dev, "four-kernel conv out");
            let (want_conv_out, want_out, want_conv, want_delta) = reference_step(&c, st, &conv_out);
            check("causal_conv1d.out", st, &label, &conv_out, &want_conv_out, tol16(st));
            check("gdn_conv_recurrent_gated.out", st, &label, &out_f, &want_out, tol16(st));
            check("gdn_conv_recurrent_gated.delta_state", st, &label, &delta_f, &want_delta, TOL32);
            assert_bitwise(&conv_f, &want_conv, &format!("gdn_conv_recurrent_gated conv state vs the reference {} {label}", st.name()));
            let left = dev.stream().clone_dtoh(&tk).expect("download tickets");
            assert!(left.iter().all(|&n| n == 0), "gdn_conv_recurrent_gated {label}: election counters left at {left:?}, not zero");
            println!("BITWISE op=gdn_conv_recurrent_gated storage={} shape={label} equal_to_four_kernels=true", st.name());
        }
    }
}

#[test]
fn gdn_conv_recurrent_gated_sequence_in_a_batch_equals_it_alone() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_conv_recurrent_gated batch", st) else { return };
        let mut rng = Rng::new(42);
        // Decode rows and short chunks in one step, slots out of order.
        let (lens, slots): (&[usize], &[i32]) = (&[1, 1, 3, 1, 2, 1, 1, 5], &[5, 2, 7, 0, 1, 6, 3, 4]);
        let (nk, nv, dk, dv, n_slots) = (4, 12, 128, 128, 8);
        let c = Case::new(&mut rng, st, lens, slots, nk, nv, dk, dv, n_slots, 4, true);
        let d = DevCase::new(&dev, &c);
        let mut tk = tickets(&dev, &c);
        let mut out = Out16::new(&dev, c.t() * nv * dv);
        // Twice over the same counters from the same states: the first launch must leave the
        // counters ready for the next.
        run_fused(&dev, &c, &d, &mut States::new(&dev, &c), &mut tk, &mut out);
        let mut states = States::new(&dev, &c);
        run_fused(&dev, &c, &d, &mut states, &mut tk, &mut out);
        let out = out.read(&dev, "batch out");
        let (conv, delta) = states.read(&dev, "batch");
        let cu = c.cu();
        let (row, out_row, slot_len, conv_len) = (c.row(), nv * dv, nv * dk * dv, c.qkv_stride() * 3);
        for (s, &slot) in slots.iter().enumerate() {
            let toks = cu[s] as usize..cu[s + 1] as usize;
            let alone = Case {
                lens: vec![lens[s]],
                slots: vec![slot],
                x: c.x[toks.start * row..toks.end * row].to_vec(),
                conv0: c.conv0.clone(),
                conv_w: c.conv_w.clone(),
                conv_b: c.conv_b.clone(),
                a_log: c.a_log.clone(),
                dt_bias: c.dt_bias.clone(),
                norm_w: c.norm_w.clone(),
                state0: c.state0.clone(),
                ..c
            };
            let da = DevCase::new(&dev, &alone);
            let mut sa = States::new(&dev, &alone);
            let mut ta = tickets(&dev, &alone);
            let mut out_a = Out16::new(&dev, alone.t() * out_row);
            run_fused(&dev, &alone, &da, &mut sa, &mut ta, &mut out_a);
            let (conv_a, delta_a) = sa.read(&dev, "alone");
            let what = format!("{} sequence {s} (slot {slot}, {} tokens)", st.name(), lens[s]);
            assert_bitwise(&out[toks.start * out_row..toks.end * out_row], &out_a.read(&dev, "alone out"), &format!("gdn_conv_recurrent_gated out {what}"));
            let so = slot as usize * slot_len;
            assert_bitwise(&delta[so..so + slot_len], &delta_a[so..so + slot_len], &format!("gdn_conv_recurrent_gated delta state {what}"));
            let co = slot as usize * conv_len;
            assert_bitwise(&conv[co..co + conv_len], &conv_a[co..co + conv_len], &format!("gdn_conv_recurrent_gated conv state {what}"));
        }
    }
}

/// TIMING (read on the GPU; asserts nothing about speed): one decode step's GDN core at the
/// Qwen3.5-27B shape (16 k heads, 48 v heads, dk = dv = 128, conv kernel 4), the one kernel
/// against the four; GB/s counts the delta state read and written.
#[test]
fn gdn_conv_recurrent_gated_timing_at_27b_shape() {
    let st = StorageDType::Bf16;
    let Some(dev) = gpu("gdn_conv_recurrent_gated timing", st) else { return };
    let mut rng = Rng::new(43);
    let (nk, nv, dk, dv) = (16, 48, 128, 128);
    for batch in [1usize, 8, 16, 64] {
        let lens = vec![1; batch];
        let slots: Vec<i32> = (0..batch as i32).collect();
        let c = Case::new(&mut rng, st, &lens, &slots, nk, nv, dk, dv, batch, 4, false);
        let d = DevCase::new(&dev, &c);
        let t = c.t();
        let mut states = States::new(&dev, &c);
        let mut tk = tickets(&dev, &c);
        let mut out = Out16::new(&dev, t * nv * dv);
        let fused = time_ms(&dev, 200, || run_fused(&dev, &c, &d, &mut states, &mut tk, &mut out));
        let mut work = Four::new(&dev, &c);
        let four = time_ms(&dev, 200, || run_four(&dev, &c, &d, &mut states, &mut work, &mut out));
        let gbs = |ms: f64| (batch * nv * dk * dv * 4 * 2) as f64 / (ms * 1e-3) / 1e9;
        println!(
            "TIMING gdn_conv_recurrent_gated 27B shape batch={batch}: one kernel {:.2} us ({:.0} GB/s of state), conv+gates+recurrent+rmsnorm_gated {:.2} us ({:.0} GB/s) per step-layer (saves {:.2} us x 48 layers = {:.1} us per step)",
            fused * 1e3,
            gbs(fused),
            four * 1e3,
            gbs(four),
            (four - fused) * 1e3,
            (four - fused) * 1e3 * 48.0
        );
    }
}
