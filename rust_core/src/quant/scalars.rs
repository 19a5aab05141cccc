//! Exact codecs for the small floating-point words the quantized formats store: binary16,
//! bfloat16, E4M3FN and E2M1.
//!
//! Decoding is exact (every word of these types is a binary32 value). Encoding rounds to nearest,
//! ties to even, as the encoders in this module define; the format decoders never depend on how a
//! word was chosen.

use half::{bf16, f16};

/// binary16 word -> binary32, exact.
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// binary32 -> binary16 word, round to nearest even (infinity on overflow).
pub fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// bfloat16 word -> binary32, exact (the word is the high half of the binary32 word).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// binary32 -> bfloat16 word, round to nearest even.
pub fn f32_to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// Largest finite E4M3FN magnitude (word 0x7e).
pub const E4M3_MAX: f32 = 448.0;

/// E4M3FN word -> binary32, exact; `None` for the two NaN words (0x7f, 0xff). The format has no
/// infinity: exponent 15 with mantissa below 7 is an ordinary finite value.
pub fn e4m3_to_f32(bits: u8) -> Option<f32> {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((bits >> 3) & 0x0f) as i32;
    let m = (bits & 0x07) as f32;
    if e == 15 && bits & 0x07 == 7 {
        return None;
    }
    let mag = if e == 0 { m * (2.0f32).powi(-9) } else { (1.0 + m / 8.0) * (2.0f32).powi(e - 7) };
    Some(sign * mag)
}

/// The E4M3FN decode table; NaN words decode to NaN (callers that must refuse them check
/// `e4m3_to_f32`).
pub fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = e4m3_to_f32(i as u8).unwrap_or(f32::NAN);
    }
    t
}

/// Finite binary32 -> E4M3FN word, round to nearest even, saturating at +-448 (never emits NaN).
pub fn f32_to_e4m3(x: f32) -> u8 {
    debug_assert!(x.is_finite());
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    let min_normal = (2.0f32).powi(-6);
    let bits: u32 = if a < min_normal {
        // Subnormal step 2^-9; a code of 8 is exactly the smallest normal word 0x08.
        (a * 512.0).round_ties_even() as u32
    } else {
        let e = ((a.to_bits() >> 23) as i32) - 127;
        // a * 2^(3-e) lies in [8, 16) exactly (a power-of-two scaling); 16 carries into e + 1.
        let r = (a * (2.0f32).powi(3 - e)).round_ties_even() as u32;
        ((e + 7) as u32) * 8 + r - 8
    };
    sign | (bits.min(0x7e) as u8)
}

/// Magnitudes of the eight positive E2M1 words (sign bit 3 negates).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// E2M1 nibble -> binary32, exact.
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    let v = E2M1_VALUES[(nibble & 7) as usize];
    if nibble & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Finite binary32 -> E2M1 nibble, round to nearest with ties to the even word, saturating at 6.
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    // Midpoints between neighbouring magnitudes; at a tie the even word (mantissa bit 0) wins.
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_finite_word() {
        for w in 0..=255u8 {
            if let Some(v) = e4m3_to_f32(w) {
                let back = f32_to_e4m3(v);
                // +0 and -0 keep their sign; every finite word encodes to itself.
                assert_eq!(back, w, "word {w:#04x} value {v}");
            }
        }
        assert!(e4m3_to_f32(0x7f).is_none() && e4m3_to_f32(0xff).is_none());
        assert_eq!(e4m3_to_f32(0x7e), Some(448.0));
        assert_eq!(e4m3_to_f32(0x01), Some((2.0f32).powi(-9)));
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // Between 1.0 (0x38) and 1.125 (0x39): the tie goes to the even word 0x38.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        assert_eq!(f32_to_e4m3(1000.0), 0x7e);
        assert_eq!(f32_to_e4m3(-1000.0), 0xfe);
        // Half the smallest subnormal is a tie to zero.
        assert_eq!(f32_to_e4m3((2.0f32).powi(-10)), 0x00);
        // 15.5 * 2^-10 rounds up into the smallest normal word.
        assert_eq!(f32_to_e4m3(7.5 * (2.0f32).powi(-9)), 0x08);
    }

    #[test]
    fn e2m1_round_trips_and_breaks_ties_to_even() {
        for n in 0..16u8 {
            assert_eq!(f32_to_e2m1(e2m1_to_f32(n)), n);
        }
        assert_eq!(f32_to_e2m1(0.25), 0);
        assert_eq!(f32_to_e2m1(0.75), 2);
        assert_eq!(f32_to_e2m1(2.5), 4);
        assert_eq!(f32_to_e2m1(5.0), 6);
        assert_eq!(f32_to_e2m1(100.0), 7);
        assert_eq!(f32_to_e2m1(-3.4), 8 | 5);
    }

    #[test]
    fn bf16_and_f16_words_expand_exactly() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0x0001), f32::from_bits(0x0001_0000));
        assert_eq!(f16_to_f32(0x0001), (2.0f32).powi(-24));
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
    }
}
