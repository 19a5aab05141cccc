//! On/off switches read from the environment (`NINFER_*=1|0`): one spelling rule for
//! all of them, and a typo is an error that names the variable and its value instead of
//! silently leaving the default on. Route decisions are not switches: the CUDA device's plan
//! (backend/cuda/plan) makes them from the device, the model and `CudaOptions`.

use crate::{NinferError, Result};

/// The switch `name` from the environment: unset or empty gives `default`.
pub fn env_switch(name: &str, default: bool) -> Result<bool> {
    parse_switch(name, std::env::var(name).ok().as_deref(), default)
}

/// `value` of switch `name`: 1/true/on/yes or 0/false/off/no (any case, spaces trimmed).
pub fn parse_switch(name: &str, value: Option<&str>, default: bool) -> Result<bool> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(default) };
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(NinferError::config(name, format!("expected 1/true/on/yes or 0/false/off/no, got {v:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_map_to_on_off_and_unset_or_empty_keeps_the_default() {
        for v in ["1", "true", "ON", " yes "] {
            assert!(parse_switch("X", Some(v), false).unwrap(), "{v}");
        }
        for v in ["0", "False", "off", "no"] {
            assert!(!parse_switch("X", Some(v), true).unwrap(), "{v}");
        }
        assert!(parse_switch("X", None, true).unwrap());
        assert!(!parse_switch("X", Some("  "), false).unwrap());
    }

    #[test]
    fn an_unknown_value_is_an_error_naming_the_variable_and_the_value() {
        let e = parse_switch("NINFER_ASYNC_SCHEDULING", Some("maybe"), true).unwrap_err().to_string();
        assert!(e.contains("NINFER_ASYNC_SCHEDULING") && e.contains("maybe"), "{e}");
    }
}
