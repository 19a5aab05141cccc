//! The PyO3 module `ninfer._core`: the only place that knows Python.
//!
//! Each submodule registers the classes of one area; errors are mapped in `errors`.

use pyo3::prelude::*;

mod engine;
mod errors;
mod model;
mod tokenizer;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    tokenizer::register(m)?;
    model::register(m)?;
    engine::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The CLI's --logits-dtype choices (python/ninfer/cli.py keeps a copy a test compares).
    m.add("LOGITS_DTYPES", crate::model::LOGITS_DTYPE_CHOICES.to_vec())?;
    Ok(())
}
