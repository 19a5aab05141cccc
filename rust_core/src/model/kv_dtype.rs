//! The `kv_dtype` option: the type the KV cache is kept in.
//!
//! Each backend keeps its KV cache in one type, the one it stores activations in: float32 on
//! the CPU, the device's 16-bit storage type on CUDA (bf16 on sm_80+, f16 on sm_70/sm_75,
//! `StorageDType::for_arch`). "auto" asks for that type; naming it (`--kv-dtype bf16`, as
//! users of vLLM and llama.cpp type) is accepted where it is that type and refused, before any
//! weight is read, where it is not, so a flag that is accepted always does what it says.
//! Quantized caches (int8, rk8v4, rk4v4) are later work and refused by name.

use crate::{NinferError, Result};

/// What the user asked for (`kv_dtype=` / `--kv-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    /// The type the backend keeps its KV cache in, whatever it is.
    #[default]
    Auto,
    /// bfloat16: CUDA on sm_80 and newer.
    Bf16,
    /// IEEE half: CUDA on sm_70/sm_75.
    F16,
    /// float32: the CPU backend.
    Float32,
}

/// The accepted spellings (case-insensitive), for error messages and the CLI's copy
/// (python/ninfer/cli.py `KV_DTYPES`): each type by its short name and by the names torch,
/// vLLM and llama.cpp give it.
pub const KV_DTYPE_CHOICES: [&str; 8] = ["auto", "bf16", "bfloat16", "f16", "float16", "half", "f32", "float32"];

/// Quantized KV formats the original offers: refused as later work rather than as unknown.
pub const QUANTIZED_KV_DTYPES: [&str; 3] = ["int8", "rk8v4", "rk4v4"];

impl KvDtype {
    /// One of `KV_DTYPE_CHOICES`; a quantized format is an `Unsupported` error saying it is
    /// later work, anything else one naming the value and the choices (as a misspelt `device=`).
    pub fn parse(text: &str) -> Result<Self> {
        let lower = text.trim().to_ascii_lowercase();
        match lower.as_str() {
            "auto" => Ok(KvDtype::Auto),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            "f32" | "float32" => Ok(KvDtype::Float32),
            q if QUANTIZED_KV_DTYPES.contains(&q) => {
                Err(NinferError::Unsupported(format!("kv_dtype `{text}` (quantized KV caches, {}, are later work)", QUANTIZED_KV_DTYPES.join(", "))))
            }
            _ => Err(NinferError::Unsupported(format!("kv_dtype `{text}` (available: {})", KV_DTYPE_CHOICES.join(", ")))),
        }
    }

    /// The short name ("bf16", "f16", "float32"; "auto").
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Auto => "auto",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
            KvDtype::Float32 => "float32",
        }
    }

    /// Ok when this request is met by a backend (`backend`, e.g. "cpu" or
    /// "cuda:0 (NVIDIA H200, sm_90a)") that keeps its KV cache in `kept`; else a config error
    /// naming the value, the backend, its type and the values that it accepts.
    pub fn check(self, backend: &str, kept: KvDtype) -> Result<()> {
        if self == KvDtype::Auto || self == kept {
            return Ok(());
        }
        let kept = kept.name();
        Err(NinferError::config(
            "kv_dtype (--kv-dtype)",
            format!(
                "{} is not supported on {backend}: its KV cache is {kept} (use auto or {kept}); quantized KV caches ({}) are later work",
                self.name(),
                QUANTIZED_KV_DTYPES.join(", ")
            ),
        ))
    }
}

#[cfg(feature = "cuda")]
impl From<crate::backend::cuda::StorageDType> for KvDtype {
    /// The CUDA KV cache is kept in the device's storage type.
    fn from(storage: crate::backend::cuda::StorageDType) -> Self {
        match storage {
            crate::backend::cuda::StorageDType::Bf16 => KvDtype::Bf16,
            crate::backend::cuda::StorageDType::F16 => KvDtype::F16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_maps_every_spelling_to_its_type() {
        let expected = [
            ("auto", KvDtype::Auto),
            ("bf16", KvDtype::Bf16),
            ("bfloat16", KvDtype::Bf16),
            ("f16", KvDtype::F16),
            ("float16", KvDtype::F16),
            ("half", KvDtype::F16),
            ("f32", KvDtype::Float32),
            ("float32", KvDtype::Float32),
        ];
        assert_eq!(expected.map(|(s, _)| s), KV_DTYPE_CHOICES);
        for (text, dtype) in expected {
            assert_eq!(KvDtype::parse(text).unwrap(), dtype, "{text}");
        }
        assert_eq!(KvDtype::parse(" BF16 ").unwrap(), KvDtype::Bf16);
    }

    #[test]
    fn parse_refuses_quantized_formats_as_later_work_and_names_an_unknown_value() {
        for q in QUANTIZED_KV_DTYPES {
            let e = KvDtype::parse(q).unwrap_err().to_string();
            assert!(e.contains(&format!("kv_dtype `{q}`")) && e.contains("later work"), "{e}");
        }
        let e = KvDtype::parse("fp8").unwrap_err().to_string();
        assert!(e.contains("kv_dtype `fp8`") && e.contains(&KV_DTYPE_CHOICES.join(", ")), "{e}");
    }

    #[test]
    fn check_accepts_auto_and_the_kept_type_only() {
        assert!(KvDtype::Auto.check("cpu", KvDtype::Float32).is_ok());
        assert!(KvDtype::Float32.check("cpu", KvDtype::Float32).is_ok());
        assert!(KvDtype::Bf16.check("cuda:0 (H200, sm_90a)", KvDtype::Bf16).is_ok());
        let e = KvDtype::Bf16.check("cpu", KvDtype::Float32).unwrap_err().to_string();
        assert!(e.contains("--kv-dtype") && e.contains("bf16 is not supported on cpu") && e.contains("its KV cache is float32"), "{e}");
        let e = KvDtype::F16.check("cuda:0 (H200, sm_90a)", KvDtype::Bf16).unwrap_err().to_string();
        assert!(e.contains("f16 is not supported on cuda:0 (H200, sm_90a): its KV cache is bf16 (use auto or bf16)"), "{e}");
    }
}
