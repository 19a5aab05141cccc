//! `_core.dequantize` / `_core.quantize` and the IQ3_S grid: the quantized formats' CPU
//! reference, for the tests that compare it with the `gguf` package and for tools.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::IntoPy;
use crate::quant::{self, QuantFormat, QuantTensor, QuantizeMode};
use crate::NinferError;

fn format_named(format: &str) -> PyResult<QuantFormat> {
    QuantFormat::from_name(format)
        .or_else(|| QuantizeMode::parse(format).ok().map(|m| m.format()))
        .ok_or_else(|| NinferError::Unsupported(format!("quantized format {format:?} in dequantize/quantize (self-contained formats only)")))
        .py()
}

/// The f32 `[N, K]` values of a self-contained quantized payload (`format` a canonical name such
/// as "Q4G64_F16S" or "GGUF_IQ3_S"), validated first; refusals raise `ModelLoadError`.
#[pyfunction]
#[pyo3(signature = (format, data, shape, name = "tensor"))]
fn dequantize<'py>(py: Python<'py>, format: &str, data: &[u8], shape: (usize, usize), name: &str) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let f = format_named(format)?;
    let values = quant::dequantize(&QuantTensor::packed(name, f, [shape.0, shape.1], data)).py()?;
    PyArray1::from_vec(py, values).reshape([shape.0, shape.1])
}

/// Encode a float32 `[N, K]` array into a `--quantize` format (a mode such as "q4" or the
/// format's name); NaN / infinity raise `ModelLoadError` naming `name` and the element.
#[pyfunction]
#[pyo3(signature = (format, values, name = "tensor"))]
fn quantize<'py>(py: Python<'py>, format: &str, values: PyReadonlyArray2<'py, f32>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
    let f = format_named(format)?;
    let shape = values.shape();
    let shape = [shape[0], shape[1]];
    let data = values.as_slice().map(|s| s.to_vec()).unwrap_or_else(|_| values.as_array().iter().copied().collect());
    let bytes = py.detach(|| quant::quantize(f, name, &data, shape)).py()?;
    Ok(PyBytes::new(py, &bytes))
}

/// The IQ3_S grid NInfer decodes with (512 u32 words, four magnitudes as bytes each).
#[pyfunction]
fn iq3s_grid() -> Vec<u32> {
    quant::iq3s_grid::IQ3S_GRID.to_vec()
}

/// The canonical format name of a GGUF ggml type id (None for F32 / F16 / BF16); an unknown or
/// unsupported id raises `ModelLoadError` naming `tensor`.
#[pyfunction]
#[pyo3(signature = (type_id, tensor = "tensor"))]
fn gguf_format(type_id: u32, tensor: &str) -> PyResult<Option<&'static str>> {
    Ok(QuantFormat::from_gguf_type(type_id, tensor).py()?.map(|f| f.name()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(iq3s_grid, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_format, m)?)?;
    let names: Vec<&str> = quant::FORMATS.iter().map(|f| f.name).collect();
    m.add("QUANT_FORMATS", names)?;
    m.add("QUANTIZE_MODES", quant::QUANTIZE_MODES.to_vec())?;
    Ok(())
}
