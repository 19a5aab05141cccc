//! Python values (None, bool, int, float, str, list, tuple, dict) as JSON values, without a
//! round trip through JSON text: how keyword arguments reach the serde structs of the core.

use pyo3::exceptions::{PyRecursionError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value as Json};

use crate::NinferError;

/// Deeper nesting is refused, as serde_json refuses it when parsing text.
const MAX_DEPTH: usize = 128;

/// A keyword-argument dict as a JSON object.
pub fn dict_to_json(dict: &Bound<'_, PyDict>, field: &str) -> PyResult<Map<String, Json>> {
    object(dict, field, 0)
}

/// `obj` as a JSON value; a value JSON cannot hold is a TypeError (a NaN an InvalidRequestError
/// naming `field`).
fn convert(obj: &Bound<'_, PyAny>, field: &str, depth: usize) -> PyResult<Json> {
    if depth > MAX_DEPTH {
        return Err(PyRecursionError::new_err(format!("`{field}` is nested more than {MAX_DEPTH} levels deep")));
    }
    if obj.is_none() {
        return Ok(Json::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Json::Bool(b.is_true()));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        if let Ok(v) = i.extract::<i64>() {
            return Ok(v.into());
        }
        if let Ok(v) = i.extract::<u64>() {
            return Ok(v.into());
        }
        return float(i.extract::<f64>()?, field);
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return float(f.value(), field);
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Json::String(s.extract::<String>()?));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        return Ok(Json::Object(object(d, field, depth)?));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l.iter().map(|v| convert(&v, field, depth + 1)).collect::<PyResult<Vec<_>>>().map(Json::Array);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().map(|v| convert(&v, field, depth + 1)).collect::<PyResult<Vec<_>>>().map(Json::Array);
    }
    Err(PyTypeError::new_err(format!("`{field}`: a {} is not a JSON value", obj.get_type().name()?)))
}

fn float(v: f64, field: &str) -> PyResult<Json> {
    Number::from_f64(v).map(Json::Number).ok_or_else(|| super::errors::to_py(NinferError::invalid(field, format!("{v} is not a finite number"))))
}

fn object(dict: &Bound<'_, PyDict>, field: &str, depth: usize) -> PyResult<Map<String, Json>> {
    let mut map = Map::new();
    for (k, v) in dict.iter() {
        // As json.dumps: int keys become their decimal text (token ids of logit_bias).
        let key = match k.cast::<PyString>() {
            Ok(s) => s.extract::<String>()?,
            Err(_) if k.cast::<PyInt>().is_ok() && k.cast::<PyBool>().is_err() => k.str()?.extract::<String>()?,
            Err(_) => return Err(PyTypeError::new_err(format!("`{field}`: keys must be strings or integers, got {}", k.repr()?))),
        };
        map.insert(key, convert(&v, field, depth + 1)?);
    }
    Ok(map)
}
