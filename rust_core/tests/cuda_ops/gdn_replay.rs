//! The GDN state replay kernels (`gdn_keep_rows`, `gdn_replay`; rollback of speculative
//! drafts): the kept rows are the projection's columns byte for byte, and the state replayed
//! over the first n kept tokens of a chunk (every n, whole and split in two) is the state the
//! forward's own kernels (`causal_conv1d`, `gdn_gates`, `gdn_recurrent`) leave over those
//! tokens, bit for bit, and the CPU recurrence's within f32 rounding.

use ninfer_core::backend::cuda::ops::{ConvShape, KeptShape, RecurrentShape};
use ninfer_core::backend::cuda::CudaDevice;

use super::harness::{tol16, gpu, rounded, upload, upload_raw, Out16, Out32, Rng, STORAGES};
use super::{assert_bitwise, reference};

/// One GDN layer's shape and inputs: a step projection of `rows` rows (conv channels, z, b,
/// a, then 3 unused columns), conv weights, gates' parameters and the states of `slots` slots.
struct Layer {
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    kern: usize,
    x: Vec<f32>,
    conv_w: Vec<f32>,
    conv_b: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    conv0: Vec<f32>,
    delta0: Vec<f32>,
}

const SLOTS: usize = 6;
const ROWS: usize = 9;

impl Layer {
    fn channels(&self) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv
    }
    fn width(&self) -> usize {
        self.channels() + self.nv * self.dv + 2 * self.nv + 3
    }
    fn ab_offset(&self) -> usize {
        self.channels() + self.nv * self.dv
    }
    fn shape(&self, n_tokens: usize) -> RecurrentShape {
        let c = self.channels();
        RecurrentShape { n_tokens, n_k_heads: self.nk, n_v_heads: self.nv, dk: self.dk, dv: self.dv, qk_stride: c, v_stride: c, n_slots: SLOTS }
    }
    #[allow(clippy::too_many_arguments)]
    fn new(rng: &mut Rng, st: ninfer_core::backend::cuda::StorageDType, nk: usize, nv: usize, dk: usize, dv: usize, kern: usize) -> Layer {
        let mut l = Layer { nk, nv, dk, dv, kern, x: Vec::new(), conv_w: Vec::new(), conv_b: Vec::new(), a_log: rng.vec(nv, -1.0, 1.0), dt_bias: rng.vec(nv, -1.0, 1.0), conv0: Vec::new(), delta0: Vec::new() };
        let c = l.channels();
        l.x = rounded(&rng.vec(ROWS * l.width(), -2.0, 2.0), st);
        l.conv_w = rounded(&rng.vec(c * kern, -0.6, 0.6), st);
        l.conv_b = rounded(&rng.vec(c, -0.2, 0.2), st);
        l.conv0 = rounded(&rng.vec(SLOTS * c * (kern - 1), -2.0, 2.0), st);
        l.delta0 = rng.vec(SLOTS * nv * dk * dv, -0.1, 0.1);
        l
    }
}

/// The forward's kernels over step rows first..first + n from slot 0's state into slot `dst`
/// (copied there first): (conv state, delta state) of every slot.
fn forward_kernels(dev: &CudaDevice, l: &Layer, first: usize, n: usize, dst: usize) -> (Vec<f32>, Vec<f32>) {
    let (c, w, nv) = (l.channels(), l.width(), l.nv);
    let per_conv = c * (l.kern - 1);
    let per_delta = nv * l.dk * l.dv;
    let mut conv0 = l.conv0.clone();
    conv0.copy_within(0..per_conv, dst * per_conv);
    let mut delta0 = l.delta0.clone();
    delta0.copy_within(0..per_delta, dst * per_delta);
    let (mut conv, mut delta) = (Out16::with(dev, &conv0), Out32::with(dev, &delta0));
    let x = upload(dev, &l.x[first * w..(first + n) * w]);
    let (wt, b) = (upload(dev, &l.conv_w), upload(dev, &l.conv_b));
    let (cu, slots) = (upload_raw(dev, &[0i32, n as i32]), upload_raw(dev, &[dst as i32]));
    let mut conv_out = Out16::new(dev, n * c);
    let shape = ConvShape { n_tokens: n, channels: c, x_stride: w, kernel_size: l.kern, n_slots: SLOTS };
    dev.causal_conv1d(&x, &mut conv.view(), &wt, Some(&b), &cu, &slots, &mut conv_out.view(), &shape).unwrap();
    let (al, dtb) = (upload_raw(dev, &l.a_log), upload_raw(dev, &l.dt_bias));
    let (mut g, mut beta) = (Out32::new(dev, n * nv), Out32::new(dev, n * nv));
    let ab = l.ab_offset();
    dev.gdn_gates(&x.slice(ab + nv..), &x.slice(ab..), w, &al, &dtb, &mut g.view(), &mut beta.view(), n, nv).unwrap();
    let co = conv_out.view();
    let kd = l.nk * l.dk;
    let mut core = Out16::new(dev, n * nv * l.dv);
    dev.gdn_recurrent(&co.slice(0..), &co.slice(kd..), &co.slice(2 * kd..), &g.view(), &beta.view(), &mut delta.view(), &cu, &slots, &mut core.view(), &l.shape(n)).unwrap();
    (conv.read(dev, "forward conv"), delta.read(dev, "forward delta"))
}

/// The CPU recurrence over the same rows from slot 0's state: (conv state, delta state) of
/// that one slot.
fn cpu_reference(l: &Layer, first: usize, n: usize, st: ninfer_core::backend::cuda::StorageDType) -> (Vec<f32>, Vec<f32>) {
    let (c, w, nv, kd) = (l.channels(), l.width(), l.nv, l.nk * l.dk);
    let mut conv = l.conv0[..c * (l.kern - 1)].to_vec();
    let x: Vec<f32> = (first..first + n).flat_map(|r| l.x[r * w..r * w + c].to_vec()).collect();
    let out = rounded(&reference::conv1d_seq(&x, &mut conv, &l.conv_w, Some(&l.conv_b), n, c, l.kern), st);
    let ab = l.ab_offset();
    let g: Vec<f32> = (0..n * nv).map(|e| -l.a_log[e % nv].exp() * reference::softplus(l.x[(first + e / nv) * w + ab + nv + e % nv] + l.dt_bias[e % nv])).collect();
    let beta = rounded(&(0..n * nv).map(|e| reference::sigmoid(l.x[(first + e / nv) * w + ab + e % nv])).collect::<Vec<_>>(), st);
    let cols = |from: usize, len: usize| -> Vec<f32> { (0..n).flat_map(|i| out[i * c + from..i * c + from + len].to_vec()).collect() };
    let (q, k, v) = (cols(0, kd), cols(kd, kd), cols(2 * kd, nv * l.dv));
    let mut delta = l.delta0[..nv * l.dk * l.dv].to_vec();
    reference::gdn_recurrent_seq(&q, &k, &v, &g, &beta, &mut delta, n, l.nk, nv, l.dk, l.dv);
    (conv, delta)
}

#[test]
fn replayed_states_are_the_forward_kernels_states_bitwise() {
    for st in STORAGES {
        let Some(dev) = gpu("gdn_replay", st) else { return };
        let mut rng = Rng::new(47);
        // (nk, nv, dk, dv, conv kernel): a small head, dk 64, and the Qwen3.5 head of 128.
        for (nk, nv, dk, dv, kern) in [(2, 4, 64, 64, 4), (1, 2, 128, 128, 3), (2, 6, 128, 128, 4), (2, 4, 64, 96, 2)] {
            let l = Layer::new(&mut rng, st, nk, nv, dk, dv, kern);
            let label = format!("{st:?}/nk{nk}/nv{nv}/dk{dk}/dv{dv}/k{kern}");
            let (c, w) = (l.channels(), l.width());
            let ks = KeptShape { channels: c, n_v_heads: nv };
            // Two kept chunks of up to 6 tokens; the chunk at step rows 2..8 is kept chunk 1.
            let (first, len, tokens) = (2usize, 6usize, 6usize);
            let mut map = vec![-1i32; 2 * tokens];
            for r in 0..len {
                map[tokens + r] = (first + r) as i32;
            }
            let x = upload(&dev, &l.x);
            let rows = upload_raw(&dev, &map);
            let mut kept = Out16::with(&dev, &vec![0.0; 2 * tokens * ks.width()]);
            dev.gdn_keep_rows(&x, w, ROWS, &rows, l.ab_offset(), &ks, &mut kept.view()).unwrap();
            let got = kept.read(&dev, "kept rows");
            for r in 0..len {
                let want: Vec<f32> = l.x[(first + r) * w..(first + r) * w + c].iter().chain(&l.x[(first + r) * w + l.ab_offset()..(first + r) * w + l.ab_offset() + 2 * nv]).copied().collect();
                assert_bitwise(&got[(tokens + r) * ks.width()..(tokens + r + 1) * ks.width()], &want, &format!("{label}: kept row {r}"));
            }
            assert!(got[..tokens * ks.width()].iter().all(|&v| v == 0.0), "{label}: an unkept row was written");
            let (wt, b, al, dtb) = (upload(&dev, &l.conv_w), upload(&dev, &l.conv_b), upload_raw(&dev, &l.a_log), upload_raw(&dev, &l.dt_bias));
            let per_conv = c * (kern - 1);
            let per_delta = nv * dk * dv;
            for n in 1..=len {
                let (want_conv, want_delta) = forward_kernels(&dev, &l, first, n, 3);
                let (mut conv, mut delta) = (Out16::with(&dev, &l.conv0), Out32::with(&dev, &l.delta0));
                let bias = Some(&b as &dyn ninfer_core::backend::cuda::ops::DevicePtrDyn);
                // Whole: slot 0 -> 4. Split at 1: slot 0 -> 5 (1 token), then 5 -> 2.
                let whole = upload_raw(&dev, &[tokens as i32, n as i32, 0, 4]);
                dev.gdn_replay(&kept.view(), 2 * tokens, &whole, 1, &mut conv.view(), &wt, bias, kern, &al, &dtb, &mut delta.view(), &l.shape(0)).unwrap();
                if n > 1 {
                    let head = upload_raw(&dev, &[tokens as i32, 1, 0, 5]);
                    dev.gdn_replay(&kept.view(), 2 * tokens, &head, 1, &mut conv.view(), &wt, bias, kern, &al, &dtb, &mut delta.view(), &l.shape(0)).unwrap();
                    let rest = upload_raw(&dev, &[tokens as i32 + 1, n as i32 - 1, 5, 2]);
                    dev.gdn_replay(&kept.view(), 2 * tokens, &rest, 1, &mut conv.view(), &wt, bias, kern, &al, &dtb, &mut delta.view(), &l.shape(0)).unwrap();
                }
                let (got_conv, got_delta) = (conv.read(&dev, "replayed conv"), delta.read(&dev, "replayed delta"));
                let slot = |v: &[f32], per: usize, s: usize| v[s * per..(s + 1) * per].to_vec();
                assert_bitwise(&slot(&got_conv, per_conv, 4), &slot(&want_conv, per_conv, 3), &format!("{label}: conv state after {n}"));
                assert_bitwise(&slot(&got_delta, per_delta, 4), &slot(&want_delta, per_delta, 3), &format!("{label}: delta state after {n}"));
                if n > 1 {
                    assert_bitwise(&slot(&got_conv, per_conv, 2), &slot(&got_conv, per_conv, 4), &format!("{label}: split conv after {n}"));
                    assert_bitwise(&slot(&got_delta, per_delta, 2), &slot(&got_delta, per_delta, 4), &format!("{label}: split delta after {n}"));
                }
                assert_bitwise(&slot(&got_delta, per_delta, 0), &slot(&l.delta0, per_delta, 0), &format!("{label}: the source slot is only read"));
                let (cpu_conv, cpu_delta) = cpu_reference(&l, first, n, st);
                assert_bitwise(&slot(&got_conv, per_conv, 4), &cpu_conv, &format!("{label}: conv state against the CPU after {n}"));
                // The forward kernels' own distance from the f32 recurrence (the state above
                // equals theirs bit for bit), which in bf16 reaches the storage type's op
                // tolerance: bounded at twice it.
                let d = super::harness::rel_err(&slot(&got_delta, per_delta, 4), &cpu_delta);
                assert!(d < 2.0 * tol16(st), "{label}: delta state {d} from the CPU recurrence after {n}");
            }
        }
    }
}
