//! The CPU reference matmul over quantized weights: `y = x W^T` with `W` decoded a tile of rows at
//! a time (never the whole matrix), the oracle the GPU GEMV / GEMM kernels are compared against.

use rayon::prelude::*;

use super::{dequantize_rows, validate, QuantFormat, QuantTensor, RawDtype, RawTensor};
use crate::{NinferError, Result};

/// Output rows decoded per tile: 64 rows of a 5120-wide weight is 1.3 MB of f32.
const TILE_ROWS: usize = 64;

/// An owned companion tensor (see [`RawTensor`]).
#[derive(Clone, Debug)]
pub struct OwnedRaw {
    pub name: String,
    pub dtype: RawDtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl OwnedRaw {
    fn view(&self) -> RawTensor<'_> {
        RawTensor { name: &self.name, dtype: self.dtype, shape: self.shape.clone(), bytes: &self.bytes }
    }
}

/// An owned quantized weight: what a loader hands to [`QuantLinear::new`].
#[derive(Clone, Debug)]
pub struct QuantWeight {
    pub name: String,
    pub format: QuantFormat,
    /// Logical `[N, K]`.
    pub shape: [usize; 2],
    pub data: Vec<u8>,
    pub scale: Option<OwnedRaw>,
    pub zero: Option<OwnedRaw>,
    pub g_idx: Option<OwnedRaw>,
}

impl QuantWeight {
    /// A self-contained payload (NInfer and GGUF formats).
    pub fn packed(name: impl Into<String>, format: QuantFormat, shape: [usize; 2], data: Vec<u8>) -> Self {
        QuantWeight { name: name.into(), format, shape, data, scale: None, zero: None, g_idx: None }
    }

    /// The borrowed form every decoder takes.
    pub fn view(&self) -> QuantTensor<'_> {
        QuantTensor {
            name: &self.name,
            format: self.format,
            shape: self.shape,
            data: &self.data,
            scale: self.scale.as_ref().map(OwnedRaw::view),
            zero: self.zero.as_ref().map(OwnedRaw::view),
            g_idx: self.g_idx.as_ref().map(OwnedRaw::view),
        }
    }
}

/// A linear layer whose weight stays packed; `forward` decodes row tiles on the fly.
#[derive(Clone, Debug)]
pub struct QuantLinear {
    weight: QuantWeight,
}

impl QuantLinear {
    /// Validate the weight (refusing it naming the tensor) and keep it packed.
    pub fn new(weight: QuantWeight) -> Result<Self> {
        validate(&weight.view())?;
        Ok(QuantLinear { weight })
    }

    /// Logical `[N, K]` of the weight.
    pub fn shape(&self) -> [usize; 2] {
        self.weight.shape
    }

    /// The packed weight.
    pub fn weight(&self) -> &QuantWeight {
        &self.weight
    }

    /// `y[m, N] = x[m, K] W^T`, each output a sequential f32 sum over K in order.
    pub fn forward(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let [n, k] = self.weight.shape;
        if x.len() != m * k {
            return Err(NinferError::config("x", format!("{} values for {m} rows of {k} ({} expected)", x.len(), m * k)));
        }
        let view = self.weight.view();
        let tiles: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(TILE_ROWS))
            .into_par_iter()
            .map(|t| {
                let rows = t * TILE_ROWS..((t + 1) * TILE_ROWS).min(n);
                let mut w = vec![0.0f32; rows.len() * k];
                dequantize_rows(&view, rows.clone(), &mut w);
                let mut y = vec![0.0f32; m * rows.len()];
                for i in 0..m {
                    let xi = &x[i * k..(i + 1) * k];
                    for (j, wr) in w.chunks_exact(k).enumerate() {
                        y[i * rows.len() + j] = dot(xi, wr);
                    }
                }
                (rows.start, y)
            })
            .collect();
        let mut out = vec![0.0f32; m * n];
        for (start, y) in tiles {
            let width = y.len() / m;
            for i in 0..m {
                out[i * n + start..i * n + start + width].copy_from_slice(&y[i * width..(i + 1) * width]);
            }
        }
        Ok(out)
    }
}

/// Sequential f32 dot product (the summation order the reference fixes).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}
