//! The PyO3 module `ninfer._core`: the only place that knows Python.
//!
//! Each submodule registers the classes of one area; errors are mapped in `errors`.

use pyo3::prelude::*;

mod chat;
mod delta;
mod engine;
mod errors;
mod generation;
mod json_value;
mod model;
mod dflash;
mod mtp;
mod plan;
mod quant;
mod sampling;
mod tokenizer;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    tokenizer::register(m)?;
    model::register(m)?;
    dflash::register(m)?;
    mtp::register(m)?;
    quant::register(m)?;
    delta::register(m)?;
    engine::register(m)?;
    plan::register(m)?;
    generation::register(m)?;
    sampling::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The CLI's --logits-dtype choices (python/ninfer/cli.py keeps a copy a test compares).
    m.add("LOGITS_DTYPES", crate::model::LOGITS_DTYPE_CHOICES.to_vec())?;
    // The CLI's --kv-dtype spellings and the quantized names it refuses as later work (copies
    // in python/ninfer/cli.py, compared by the same test).
    m.add("KV_DTYPES", crate::model::KV_DTYPE_CHOICES.to_vec())?;
    m.add("QUANTIZED_KV_DTYPES", crate::model::QUANTIZED_KV_DTYPES.to_vec())?;
    Ok(())
}
