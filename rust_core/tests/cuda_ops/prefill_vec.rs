//! The prefill forms of the norms against the forms they replace, bit for bit: the 16-byte GDN
//! output norm `rmsnorm_gated_rows_v8_p*` (8 elements a lane, its sum of squares rebuilt as the
//! scalar warp kernel's reduction tree) against `rmsnorm_gated_rows_p*`, and the warp-per-row
//! `add_rmsnorm_rows_g*` against the block-per-row `add_rmsnorm`. The launcher takes the
//! 16-byte form on aligned rows and falls back on the other, so the test runs the same operands
//! once aligned and once one element past a 16-byte boundary, and checks the routed result
//! against the CPU reference too. (A 16-byte form of the tiled prefill conv, 8 channels a
//! thread, measured 378 us against the one-channel tiles' 226 at the 27B 8k shape and was
//! dropped: its 156 registers left 12 warps an SM for a kernel bound by SiLU's arithmetic.)

use ninfer_core::backend::cuda::StorageDType;

use super::assert_bitwise;
use super::harness::{check, gpu, rounded, tol16, upload, Out16, Rng, STORAGES};
use super::reference;

const EPS: f32 = 1e-6;

/// Values whose squares span 2^48: summed in another order their f32 sums differ in most rows,
/// so a reduction tree other than the scalar kernel's shows in rstd and, through it, in outputs.
fn spread(rng: &mut Rng, n: usize, st: StorageDType) -> Vec<f32> {
    let v: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0) * (2f32).powi(rng.below(24) as i32 - 12)).collect();
    rounded(&v, st)
}

/// `rmsnorm_gated_rows_p*`'s f32 sum of squares of one row of 32 * parts: part k's 32 squares
/// (lane l holding element 32k + l) through the xor butterfly 16, 8, 4, 2, 1, then the parts'
/// sums (lane k holding part k's, the others 0) through it again; lane 0's result.
fn scalar_tree_sum(x: &[f32]) -> f32 {
    fn butterfly(mut v: [f32; 32]) -> [f32; 32] {
        for o in [16, 8, 4, 2, 1] {
            let before = v;
            for (l, x) in v.iter_mut().enumerate() {
                *x = before[l] + before[l ^ o];
            }
        }
        assert!(v.iter().all(|s| s.to_bits() == v[0].to_bits()), "every lane ends with the same bits");
        v
    }
    let mut parts = [0f32; 32];
    for (k, p) in parts.iter_mut().take(x.len() / 32).enumerate() {
        *p = butterfly(std::array::from_fn(|l| x[32 * k + l] * x[32 * k + l]))[k];
    }
    butterfly(parts)[0]
}

/// `rmsnorm_gated_rows_v8_p*`'s f32 sum of squares of one row of dim = 8 * lanes (lane l holding
/// elements 8l .. 8l + 7): per element the xor shuffles 2 then 1, in the lane e + 4, e + 2,
/// e + 1, then the xor shuffles lanes / 2 down to 4; lane 0's result.
fn v8_tree_sum(x: &[f32]) -> f32 {
    let lanes = x.len() / 8;
    let mut sq: Vec<[f32; 8]> = (0..lanes).map(|l| std::array::from_fn(|e| x[8 * l + e] * x[8 * l + e])).collect();
    for o in [2, 1] {
        let before = sq.clone();
        for (l, s) in sq.iter_mut().enumerate() {
            for (e, v) in s.iter_mut().enumerate() {
                *v = before[l][e] + before[l ^ o][e];
            }
        }
    }
    let mut t: Vec<f32> = sq
        .iter()
        .map(|s| {
            let a: [f32; 4] = std::array::from_fn(|e| s[e] + s[e + 4]);
            (a[0] + a[2]) + (a[1] + a[3])
        })
        .collect();
    let mut o = lanes / 2;
    while o >= 4 {
        let before = t.clone();
        for (l, v) in t.iter_mut().enumerate() {
            *v = before[l] + before[l ^ o];
        }
        o /= 2;
    }
    assert!(t.iter().all(|s| s.to_bits() == t[0].to_bits()), "every lane of the row ends with the same bits");
    t[0]
}

/// The 16-byte norm's reduction (emulated on the host with IEEE f32 additions, as the GPU's
/// FADD rounds) is the scalar kernel's tree, bit for bit, at every dim it runs (32, 64, 128,
/// 256), on inputs where the order of the sum matters: a sequential sum of the same squares
/// differs from the tree in many rows. No GPU needed.
#[test]
fn gated_norm_v8_sum_order_is_the_scalar_tree_on_the_host() {
    let mut rng = Rng::new(71);
    for st in STORAGES {
        for dim in [32, 64, 128, 256] {
            let (rows, mut reordered) = (2000, 0);
            for _ in 0..rows {
                let x = spread(&mut rng, dim, st);
                let tree = scalar_tree_sum(&x);
                assert_eq!(v8_tree_sum(&x).to_bits(), tree.to_bits(), "{st:?} dim {dim}: {x:?}");
                let sequential: f32 = x.iter().map(|v| v * v).sum();
                reordered += (sequential.to_bits() != tree.to_bits()) as usize;
            }
            assert!(reordered > rows / 10, "{st:?} dim {dim}: only {reordered} of {rows} rows tell the orders apart");
        }
    }
}

/// `rmsnorm_gated` from aligned buffers (`rmsnorm_gated_rows_v8_p*`) equals the same rows with x
/// one element past a 16-byte boundary (the launcher falls back to `rmsnorm_gated_rows_p*`), bit
/// for bit, and matches the CPU reference: every 16-byte dim, row counts that leave a warp's last
/// load group partly or wholly past the end (rows not a multiple of 2, 4, 8 or 16), z as a column
/// range of wider rows, and a prefill's 700 x 48 rows (more than one wave of the grid).
#[test]
fn rmsnorm_gated_v8_equals_scalar_bit_for_bit() {
    for st in STORAGES {
        let Some(dev) = gpu("rmsnorm_gated v8 vs scalar", st) else { return };
        let mut rng = Rng::new(72);
        // (tokens, heads, dim, z row stride)
        for (tokens, heads, dim, z_stride) in [(1, 1, 128, 128), (7, 3, 128, 3 * 128 + 8), (700, 48, 128, 16480), (13, 5, 32, 5 * 32 + 24), (3, 1, 32, 32), (9, 1, 64, 64), (11, 3, 64, 200), (37, 2, 256, 520), (5, 1, 256, 256), (1, 48, 128, 16480)] {
            let rows = tokens * heads;
            let x = spread(&mut rng, rows * dim, st);
            let z_wide = rounded(&rng.vec((tokens - 1) * z_stride + heads * dim, -4.0, 4.0), st);
            let z: Vec<f32> = (0..tokens).flat_map(|t| z_wide[t * z_stride..t * z_stride + heads * dim].to_vec()).collect();
            let w = rounded(&rng.vec(dim, 0.5, 1.5), st);
            let (z_dev, w_dev) = (upload(&dev, &z_wide), upload(&dev, &w));
            let x_aligned = upload(&dev, &x);
            let x_skewed = upload(&dev, &std::iter::once(0.0).chain(x.iter().copied()).collect::<Vec<_>>());
            let mut v8 = Out16::new(&dev, rows * dim);
            dev.rmsnorm_gated(&x_aligned, &z_dev, z_stride, &w_dev, &mut v8.view(), tokens, heads, dim, EPS).unwrap();
            let mut scalar = Out16::new(&dev, rows * dim);
            dev.rmsnorm_gated(&x_skewed.slice(1..), &z_dev, z_stride, &w_dev, &mut scalar.view(), tokens, heads, dim, EPS).unwrap();
            let label = format!("{st:?} {tokens}x{heads}x{dim}/zs{z_stride}");
            let v8 = v8.read(&dev, "rmsnorm_gated v8");
            assert_bitwise(&v8, &scalar.read(&dev, "rmsnorm_gated scalar"), &format!("rmsnorm_gated v8 vs scalar {label}"));
            let want = reference::rmsnorm_gated(&x, &z, &w, rows, dim, EPS);
            check("rmsnorm_gated_v8", st, &label, &v8, &want, tol16(st));
            println!("PARITY op=rmsnorm_gated_v8_vs_scalar storage={} shape={label} bitwise=1", st.name());
        }
    }
}


/// `add_rmsnorm` over a prefill's rows (`add_rmsnorm_rows_g*`: a warp a row, taken on aligned
/// rows of the instanced sizes from 128 rows on) equals the block-per-row kernel (x one element
/// past a 16-byte boundary sends the same call there) bit for bit, residual and output, and
/// matches the CPU reference: every instanced size, row counts that leave the last block part
/// empty, both weight conventions, and values whose squares span 2^48, so that a summation
/// order other than the block kernel's shows.
#[test]
fn add_rmsnorm_rows_equal_the_block_per_row_kernel_bit_for_bit() {
    for st in STORAGES {
        let Some(dev) = gpu("add_rmsnorm rows vs block", st) else { return };
        let mut rng = Rng::new(73);
        for (rows, dim) in [(128, 2048), (131, 3072), (130, 4096), (129, 5120), (700, 5120)] {
            for plus_one in [false, true] {
                let res = spread(&mut rng, rows * dim, st);
                let x = spread(&mut rng, rows * dim, st);
                let w = rounded(&rng.vec(dim, 0.5, 1.5), st);
                let w_dev = upload(&dev, &w);
                let x_aligned = upload(&dev, &x);
                let x_skewed = upload(&dev, &std::iter::once(0.0).chain(x.iter().copied()).collect::<Vec<_>>());
                let (mut res_rows, mut out_rows) = (Out16::with(&dev, &res), Out16::new(&dev, rows * dim));
                dev.add_rmsnorm(&mut res_rows.view(), &x_aligned, &w_dev, &mut out_rows.view(), rows, dim, EPS, plus_one).unwrap();
                let (mut res_block, mut out_block) = (Out16::with(&dev, &res), Out16::new(&dev, rows * dim));
                dev.add_rmsnorm(&mut res_block.view(), &x_skewed.slice(1..), &w_dev, &mut out_block.view(), rows, dim, EPS, plus_one)
                    .unwrap();
                let label = format!("{st:?} {rows}x{dim}/p{}", plus_one as u8);
                let (out, res_got) = (out_rows.read(&dev, "add_rmsnorm rows"), res_rows.read(&dev, "add_rmsnorm rows residual"));
                assert_bitwise(&out, &out_block.read(&dev, "add_rmsnorm block"), &format!("add_rmsnorm rows vs block {label}"));
                assert_bitwise(&res_got, &res_block.read(&dev, "add_rmsnorm block residual"), &format!("add_rmsnorm residual rows vs block {label}"));
                let sum = rounded(&res.iter().zip(&x).map(|(a, b)| a + b).collect::<Vec<_>>(), st);
                check("add_rmsnorm_rows.residual", st, &label, &res_got, &sum, tol16(st));
                check("add_rmsnorm_rows.out", st, &label, &out, &reference::rmsnorm(&sum, &w, rows, dim, dim, EPS, plus_one), tol16(st));
                println!("PARITY op=add_rmsnorm_rows_vs_block storage={} shape={label} bitwise=1", st.name());
            }
        }
    }
}
