//! Behaviour of the CPU Gated DeltaNet kernels: the chunked and recurrent forms agree, state
//! carried across calls equals one call, and all of it matches transformers (golden fixture made
//! by tests/gdn_golden.py).

use ninfer_core::backend::cpu::gdn::{
    causal_conv1d_silu, gated_delta_rule_chunked, gated_delta_rule_recurrent, rms_norm_gated, GdnDims,
};
use serde_json::Value;

/// Small deterministic generator (SplitMix64) so inputs are reproducible without a rand API.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// max |a - b| / max |b|: the error relative to the size of the reference.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let size = want.iter().map(|b| b.abs()).fold(0.0f32, f32::max).max(1e-6);
    diff / size
}

/// Inputs of one delta-rule call, with GDN-like decays and gates.
struct DeltaInputs {
    d: GdnDims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

impl DeltaInputs {
    fn random(rng: &mut SplitMix, t: usize, nk: usize, nv: usize, kd: usize, vd: usize) -> Self {
        let d = GdnDims {
            t,
            num_k_heads: nk,
            num_v_heads: nv,
            k_dim: kd,
            v_dim: vd,
        };
        let g = (0..t * nv)
            .map(|i| {
                let a_log = 0.5 * (i % 3) as f32 - 1.0;
                let x = 2.0 * rng.uniform();
                -a_log.exp() * (1.0 + x.exp()).ln()
            })
            .collect();
        let beta = (0..t * nv)
            .map(|_| 1.0 / (1.0 + (-2.0 * rng.uniform()).exp()))
            .collect();
        DeltaInputs {
            d,
            q: rng.vec(t * nk * kd, 1.0),
            k: rng.vec(t * nk * kd, 1.0),
            v: rng.vec(t * nv * vd, 1.0),
            g,
            beta,
            state: rng.vec(nv * kd * vd, 0.5),
        }
    }

    /// Runs tokens `[t0, t0 + n)` with `form`, advancing `state`; returns their output.
    fn run_span(&self, form: DeltaForm, t0: usize, n: usize, state: &mut [f32]) -> Vec<f32> {
        let GdnDims {
            num_k_heads: nk,
            num_v_heads: nv,
            k_dim: kd,
            v_dim: vd,
            ..
        } = self.d;
        let d = GdnDims { t: n, ..self.d };
        let mut out = vec![f32::NAN; n * nv * vd];
        let (q, k) = (
            &self.q[t0 * nk * kd..(t0 + n) * nk * kd],
            &self.k[t0 * nk * kd..(t0 + n) * nk * kd],
        );
        let v = &self.v[t0 * nv * vd..(t0 + n) * nv * vd];
        let (g, beta) = (&self.g[t0 * nv..(t0 + n) * nv], &self.beta[t0 * nv..(t0 + n) * nv]);
        form(&d, q, k, v, g, beta, state, &mut out);
        out
    }

    /// Runs the whole sequence in spans of `span` tokens; returns (out, final state).
    fn run_split(&self, form: DeltaForm, span: usize) -> (Vec<f32>, Vec<f32>) {
        let mut state = self.state.clone();
        let mut out = Vec::new();
        let mut t0 = 0;
        while t0 < self.d.t {
            let n = span.min(self.d.t - t0);
            out.extend(self.run_span(form, t0, n, &mut state));
            t0 += n;
        }
        (out, state)
    }
}

type DeltaForm = fn(&GdnDims, &[f32], &[f32], &[f32], &[f32], &[f32], &mut [f32], &mut [f32]);

const CHUNKED: DeltaForm = gated_delta_rule_chunked;
const RECURRENT: DeltaForm = gated_delta_rule_recurrent;

#[test]
fn recurrent_equals_chunked_from_nonzero_state() {
    let mut rng = SplitMix(7);
    // (num_k_heads, num_v_heads, k_dim, v_dim): equal heads, 3x grouped, a v_dim past one tile.
    let shapes = [(2, 2, 24, 40), (1, 3, 24, 40), (2, 6, 16, 72)];
    for &(nk, nv, kd, vd) in &shapes {
        for &t in &[1usize, 5, 63, 64, 65, 90, 130, 200] {
            let inp = DeltaInputs::random(&mut rng, t, nk, nv, kd, vd);
            let (out_c, state_c) = inp.run_split(CHUNKED, t);
            let (out_r, state_r) = inp.run_split(RECURRENT, t);
            let (eo, es) = (rel_err(&out_c, &out_r), rel_err(&state_c, &state_r));
            assert!(
                eo < 1e-4,
                "out differs: t={t} nk={nk} nv={nv} kd={kd} vd={vd} rel err {eo}"
            );
            assert!(
                es < 1e-4,
                "final state differs: t={t} nk={nk} nv={nv} kd={kd} vd={vd} rel err {es}"
            );
        }
    }
}

#[test]
fn extreme_decays_stay_finite_and_forms_agree() {
    let mut rng = SplitMix(19);
    for &g_value in &[0.0f32, -30.0] {
        let mut inp = DeltaInputs::random(&mut rng, 150, 1, 2, 16, 24);
        inp.g.iter_mut().for_each(|g| *g = g_value);
        inp.beta.iter_mut().for_each(|b| *b = 1.0);
        let (out_c, state_c) = inp.run_split(CHUNKED, 150);
        let (out_r, state_r) = inp.run_split(RECURRENT, 150);
        assert!(
            out_c.iter().chain(&state_c).all(|x| x.is_finite()),
            "g={g_value}: non-finite output"
        );
        let (eo, es) = (rel_err(&out_c, &out_r), rel_err(&state_c, &state_r));
        assert!(
            eo < 1e-4 && es < 1e-4,
            "g={g_value}: out rel err {eo}, state rel err {es}"
        );
    }
}

#[test]
fn split_calls_with_carried_state_equal_one_call() {
    let mut rng = SplitMix(11);
    let inp = DeltaInputs::random(&mut rng, 150, 1, 2, 24, 40);
    let (out_one, state_one) = inp.run_split(CHUNKED, 150);
    for &span in &[1usize, 7, 64] {
        for form in [CHUNKED, RECURRENT] {
            let (out, state) = inp.run_split(form, span);
            let (eo, es) = (rel_err(&out, &out_one), rel_err(&state, &state_one));
            assert!(eo < 1e-4, "span {span}: out rel err {eo}");
            assert!(es < 1e-4, "span {span}: final state rel err {es}");
        }
    }
}

/// Zero-padded causal depthwise conv + SiLU over a whole sequence, written the plain way.
fn naive_conv(x: &[f32], t: usize, c: usize, w: &[f32], k: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let mut out = vec![0.0; t * c];
    for i in 0..t {
        for ch in 0..c {
            let mut acc = bias.map_or(0.0, |b| b[ch]);
            for j in 0..k {
                let src = i as isize + j as isize - (k as isize - 1);
                if src >= 0 {
                    acc += w[ch * k + j] * x[src as usize * c + ch];
                }
            }
            out[i * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    out
}

#[test]
fn conv1d_chunks_with_carried_state_equal_one_call_and_naive() {
    let mut rng = SplitMix(3);
    let (t, c, k) = (23, 10, 4);
    let x = rng.vec(t * c, 1.0);
    let w = rng.vec(c * k, 0.7);
    let bias = rng.vec(c, 0.3);
    for b in [None, Some(bias.as_slice())] {
        let want = naive_conv(&x, t, c, &w, k, b);
        let mut state = vec![0.0; c * (k - 1)];
        let mut one = vec![f32::NAN; t * c];
        causal_conv1d_silu(&x, t, c, &w, k, b, &mut state, &mut one);
        assert!(rel_err(&one, &want) < 1e-6, "one call differs from naive conv");
        let last_inputs: Vec<f32> = (0..c)
            .flat_map(|ch| (t - (k - 1)..t).map(move |i| (i, ch)))
            .map(|(i, ch)| x[i * c + ch])
            .collect();
        assert_eq!(
            state, last_inputs,
            "state must hold the last k-1 inputs per channel, oldest first"
        );
        // Chunks shorter than k-1 (1, 2) exercise the state-only history path.
        for spans in [vec![1usize; t], vec![2, 1, 5, 3, 12], vec![7, 16]] {
            let mut state = vec![0.0; c * (k - 1)];
            let mut out = Vec::new();
            let mut t0 = 0;
            for n in spans {
                let mut o = vec![f32::NAN; n * c];
                causal_conv1d_silu(&x[t0 * c..(t0 + n) * c], n, c, &w, k, b, &mut state, &mut o);
                out.extend(o);
                t0 += n;
            }
            assert_eq!(t0, t);
            assert!(rel_err(&out, &one) < 1e-6, "chunked conv differs from one call");
            assert_eq!(state, last_inputs, "chunked conv state differs");
        }
    }
}

#[test]
fn conv1d_shorter_than_kernel_history_keeps_older_inputs() {
    let (c, k) = (2, 4);
    let w = vec![0.1, 0.2, 0.3, 0.4, -0.5, 0.6, -0.7, 0.8];
    let mut state = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let x = vec![7.0, 8.0];
    let mut out = vec![f32::NAN; c];
    causal_conv1d_silu(&x, 1, c, &w, k, None, &mut state, &mut out);
    assert_eq!(state, vec![2.0, 3.0, 7.0, 5.0, 6.0, 8.0]);
    let full = naive_conv(&[1.0, 4.0, 2.0, 5.0, 3.0, 6.0, 7.0, 8.0], 4, c, &w, k, None);
    assert!(rel_err(&out, &full[3 * c..]) < 1e-6);
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn usize_of(v: &Value, key: &str) -> usize {
    v[key].as_u64().unwrap_or_else(|| panic!("missing {key}")) as usize
}

fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gdn_golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read golden fixture")).expect("parse golden fixture")
}

#[test]
fn delta_rule_matches_transformers_golden() {
    let golden = golden();
    for case in golden["delta_rule"].as_array().expect("delta_rule cases") {
        let d = GdnDims {
            t: usize_of(case, "t"),
            num_k_heads: usize_of(case, "num_k_heads"),
            num_v_heads: usize_of(case, "num_v_heads"),
            k_dim: usize_of(case, "k_dim"),
            v_dim: usize_of(case, "v_dim"),
        };
        let (q, k, v) = (floats(&case["q"]), floats(&case["k"]), floats(&case["v"]));
        let (g, beta) = (floats(&case["g"]), floats(&case["beta"]));
        let (want_out, want_state) = (floats(&case["out"]), floats(&case["final_state"]));
        for (name, form) in [("chunked", CHUNKED), ("recurrent", RECURRENT)] {
            let mut state = floats(&case["initial_state"]);
            let mut out = vec![f32::NAN; want_out.len()];
            form(&d, &q, &k, &v, &g, &beta, &mut state, &mut out);
            let (eo, es) = (rel_err(&out, &want_out), rel_err(&state, &want_state));
            assert!(eo < 1e-4, "{name} out vs transformers ({d:?}): rel err {eo}");
            assert!(es < 1e-4, "{name} final state vs transformers ({d:?}): rel err {es}");
        }
    }
}

#[test]
fn conv1d_matches_transformers_golden() {
    let golden = golden();
    for case in golden["conv1d"].as_array().expect("conv1d cases") {
        let (t, c, k) = (usize_of(case, "t"), usize_of(case, "c"), usize_of(case, "k"));
        let bias = case["bias"].as_array().map(|_| floats(&case["bias"]));
        let want = floats(&case["out"]);
        let mut state = vec![0.0; c * (k - 1)];
        let mut out = vec![f32::NAN; t * c];
        causal_conv1d_silu(
            &floats(&case["x"]),
            t,
            c,
            &floats(&case["weight"]),
            k,
            bias.as_deref(),
            &mut state,
            &mut out,
        );
        let e = rel_err(&out, &want);
        assert!(e < 1e-4, "conv1d vs transformers (t={t}, c={c}, k={k}): rel err {e}");
    }
}

#[test]
fn rms_norm_gated_matches_transformers_golden() {
    let golden = golden();
    for case in golden["rms_norm_gated"].as_array().expect("rms_norm_gated cases") {
        let (rows, v_dim) = (usize_of(case, "rows"), usize_of(case, "v_dim"));
        let eps = case["eps"].as_f64().expect("eps") as f32;
        let want = floats(&case["out"]);
        let mut out = vec![f32::NAN; rows * v_dim];
        rms_norm_gated(
            &floats(&case["x"]),
            &floats(&case["z"]),
            rows,
            v_dim,
            &floats(&case["weight"]),
            eps,
            &mut out,
        );
        let e = rel_err(&out, &want);
        assert!(e < 1e-4, "gated rmsnorm vs transformers: rel err {e}");
    }
}
