//! Rotary position embedding in the `rotate_half` layout (first half of the rotated dims pairs
//! with the second half), over the first `rotary_dim` dims of each head (partial rotary).

/// Fill `cos`/`sin` (`[positions, inv_freq.len()]`) for the given positions, as transformers
/// does: `angle = f32(pos) * inv_freq` in f32, then `cos(angle) * scale`.
pub fn rope_tables(positions: &[usize], inv_freq: &[f32], scale: f32, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
    let half = inv_freq.len();
    cos.resize(positions.len() * half, 0.0);
    sin.resize(positions.len() * half, 0.0);
    for (r, &p) in positions.iter().enumerate() {
        for (i, f) in inv_freq.iter().enumerate() {
            let angle = p as f32 * f;
            cos[r * half + i] = angle.cos() * scale;
            sin[r * half + i] = angle.sin() * scale;
        }
    }
}

/// Rotate, in place, `heads` heads of width `head_dim` starting at `offset` in each of `rows`
/// rows of stride `stride`; row `r` uses `cos/sin[r * half..]` with `half = rotary_dim / 2`.
#[allow(clippy::too_many_arguments)]
pub fn apply_rope(x: &mut [f32], rows: usize, stride: usize, offset: usize, heads: usize, head_dim: usize, cos: &[f32], sin: &[f32], half: usize) {
    for r in 0..rows {
        let c = &cos[r * half..(r + 1) * half];
        let s = &sin[r * half..(r + 1) * half];
        for h in 0..heads {
            let base = r * stride + offset + h * head_dim;
            let (lo, hi) = x[base..base + 2 * half].split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (lo[i], hi[i]);
                lo[i] = x1 * c[i] - x2 * s[i];
                hi[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_and_keeps_the_pass_through_dims() {
        let inv = [1.0f32, 0.1];
        let (mut c, mut s) = (Vec::new(), Vec::new());
        rope_tables(&[3], &inv, 1.0, &mut c, &mut s);
        // head_dim 6, rotary 4: dims 4,5 pass through.
        let mut x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        apply_rope(&mut x, 1, 6, 0, 1, 6, &c, &s, 2);
        let (a0, a1) = (3.0f32, 0.3f32);
        assert!((x[0] - (1.0 * a0.cos() - 3.0 * a0.sin())).abs() < 1e-6);
        assert!((x[2] - (3.0 * a0.cos() + 1.0 * a0.sin())).abs() < 1e-6);
        assert!((x[1] - (2.0 * a1.cos() - 4.0 * a1.sin())).abs() < 1e-6);
        assert!((x[3] - (4.0 * a1.cos() + 2.0 * a1.sin())).abs() < 1e-6);
        assert_eq!((x[4], x[5]), (5.0, 6.0));
    }
}
