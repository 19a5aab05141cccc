//! Elementwise activations of the MLP and the attention output gate.

use rayon::prelude::*;

/// `silu(x) = x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `sigmoid(x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `softplus(x) = log(1 + exp(x))`, linear above 20 as torch's default threshold.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// SwiGLU over a fused gate|up projection: `gate_up` is `[rows, 2 * inter]` (gate first),
/// `out[rows, inter] = silu(gate) * up`.
pub fn swiglu(gate_up: &[f32], rows: usize, inter: usize, out: &mut [f32]) {
    out[..rows * inter].par_chunks_mut(inter).zip(gate_up[..rows * 2 * inter].par_chunks(2 * inter)).for_each(|(o, gu)| {
        let (g, u) = gu.split_at(inter);
        for ((oi, gi), ui) in o.iter_mut().zip(g).zip(u) {
            *oi = silu(*gi) * ui;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swiglu_multiplies_silu_gate_by_up() {
        let gu = [1.0f32, -2.0, 3.0, 0.5];
        let mut out = [0f32; 2];
        swiglu(&gu, 1, 2, &mut out);
        assert!((out[0] - 3.0 * (1.0 / (1.0 + (-1.0f32).exp()))).abs() < 1e-6);
        assert!((out[1] - 0.5 * (-2.0 / (1.0 + 2.0f32.exp()))).abs() < 1e-6);
        assert!((softplus(30.0) - 30.0).abs() < 1e-6 && (softplus(0.0) - 2f32.ln()).abs() < 1e-6);
    }
}
