//! Grammar-constrained decoding: `response_format` (JSON object, JSON schema, regex, Lark)
//! turned into a per-step token mask with llguidance.
//!
//! A [`GrammarCompiler`] is built once per tokenizer (it holds the vocabulary trie and
//! llguidance's token-set slices, which take a while for a large vocabulary) and compiles each
//! request's [`ResponseFormat`] into a [`GrammarConstraint`]: a matcher that says, at each
//! position, which token ids may come next ([`GrammarConstraint::compute_mask`]), advances with
//! every sampled token ([`GrammarConstraint::consume`]) and tells when the output is complete
//! ([`GrammarConstraint::is_finished`]). Requests without a response format never touch this
//! module, so unconstrained decoding pays nothing for it.

mod closed_objects;
mod vocab;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};
use toktrie::SimpleVob;

use crate::tokenizer::Tokenizer;
use crate::{NinferError, Result};

pub use closed_objects::{close_objects, ObjectKeys};
pub use vocab::GrammarVocab;

/// The request field every grammar error names.
const FIELD: &str = "response_format";

/// How the JSON grammars lay output out (llguidance's `x-guidance` options): `, ` between items,
/// `: ` after keys (json.dumps' default, the spacing models see most) and no other whitespace,
/// so that a weak model cannot pad an answer with runs of spaces and newlines. A schema can
/// override it with its own `x-guidance`.
fn json_layout() -> Json {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// What the output must look like, parsed from the OpenAI-style `response_format` object.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    /// `{"type": "text"}`: no constraint.
    Text,
    /// `{"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`:
    /// JSON that validates against `schema`, its objects admitting no keys they do not list
    /// unless they say so (`strict`: never; closed_objects.rs).
    JsonSchema { schema: Json, strict: bool },
    /// `{"type": "regex", "regex": "..."}` (an extension): text matching the whole regex.
    Regex { pattern: String },
    /// `{"type": "lark", "lark": "..."}` (an extension): text in a llguidance Lark grammar.
    Lark { grammar: String },
}

impl ResponseFormat {
    /// Parse and shape-check a `response_format` value; errors name the offending field.
    pub fn parse(value: &Json) -> Result<Self> {
        let object = value.as_object().ok_or_else(|| invalid(format!("must be an object with a \"type\", got {value}")))?;
        let kind = object.get("type").and_then(Json::as_str).ok_or_else(|| invalid("`type` is required: one of \"text\", \"json_object\", \"json_schema\", \"regex\", \"lark\""))?;
        let string_field = |name: &str| -> Result<String> {
            object
                .get(name)
                .and_then(Json::as_str)
                .map(str::to_string)
                .ok_or_else(|| invalid(format!("type \"{kind}\" needs a string field `{name}`")))
        };
        match kind {
            "text" => Ok(ResponseFormat::Text),
            "json_object" => Ok(ResponseFormat::JsonObject),
            "json_schema" => {
                let spec = object
                    .get("json_schema")
                    .and_then(Json::as_object)
                    .ok_or_else(|| invalid("type \"json_schema\" needs an object field `json_schema` with a `schema`"))?;
                let schema = spec.get("schema").ok_or_else(|| invalid("`json_schema.schema` is required"))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(invalid(format!("`json_schema.schema` must be a JSON schema object, got {schema}")));
                }
                let strict = match spec.get("strict") {
                    None | Some(Json::Null) => false,
                    Some(Json::Bool(strict)) => *strict,
                    Some(other) => return Err(invalid(format!("`json_schema.strict` must be a boolean, got {other}"))),
                };
                Ok(ResponseFormat::JsonSchema { schema: schema.clone(), strict })
            }
            "regex" => Ok(ResponseFormat::Regex { pattern: string_field("regex")? }),
            "lark" => Ok(ResponseFormat::Lark { grammar: string_field("lark")? }),
            other => Err(invalid(format!("unknown type \"{other}\"; supported: text, json_object, json_schema, regex, lark"))),
        }
    }

    /// Whether this format constrains decoding at all.
    pub fn is_constrained(&self) -> bool {
        !matches!(self, ResponseFormat::Text)
    }

    /// The llguidance grammar for this format (None for plain text); `open_objects`: a
    /// non-strict schema's objects keep JSON Schema's open default. A strict schema that admits
    /// unlisted keys is an error naming where.
    fn to_grammar(&self, open_objects: bool) -> Result<Option<TopLevelGrammar>> {
        let json = |mut schema: Json| {
            if let Some(map) = schema.as_object_mut() {
                map.entry("x-guidance").or_insert_with(json_layout);
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Ok(match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(json(json!({"type": "object"}))),
            ResponseFormat::JsonSchema { schema, strict } => {
                let mut schema = schema.clone();
                close_objects(&mut schema, ObjectKeys::for_request(*strict, open_objects)).map_err(|e| invalid(format!("json_schema.schema: {e}")))?;
                Some(json(schema))
            }
            ResponseFormat::Regex { pattern } => Some(TopLevelGrammar::from_regex(pattern)),
            ResponseFormat::Lark { grammar } => Some(TopLevelGrammar::from_lark(grammar.clone())),
        })
    }
}

/// Compiles response formats for one tokenizer; build it once and share it across requests.
pub struct GrammarCompiler {
    factory: ParserFactory,
    logits_width: usize,
    /// Non-strict `json_schema` objects keep JSON Schema's open default (`ObjectKeys::Open`).
    open_objects: bool,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("logits_width", &self.logits_width).finish()
    }
}

impl GrammarCompiler {
    /// `eos_token_ids` end a generation (the engine's stop tokens); `logits_width` is the length
    /// of the model's logits rows, which may exceed the tokenizer's vocabulary.
    pub fn new(tokenizer: &Tokenizer, eos_token_ids: &[u32], logits_width: usize) -> Result<Self> {
        let env = GrammarVocab::new(tokenizer, eos_token_ids, logits_width)?.into_env();
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| NinferError::Tokenizer(format!("cannot index the vocabulary for grammars: {e}")))?;
        factory.quiet();
        Ok(GrammarCompiler { factory, logits_width, open_objects: false })
    }

    /// Give non-strict `json_schema` objects JSON Schema's open default (any unlisted key)
    /// instead of OpenAI's reading (only the listed ones).
    pub fn with_open_objects(mut self, open_objects: bool) -> Self {
        self.open_objects = open_objects;
        self
    }

    /// Compile a request's format into a fresh matcher; None when the format is plain text.
    /// A schema or grammar llguidance rejects is an invalid `response_format` naming the cause.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Option<GrammarConstraint>> {
        let Some(grammar) = format.to_grammar(self.open_objects)? else {
            return Ok(None);
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| invalid(describe_compile_error(format, &e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(reason) = matcher.get_error() {
            return Err(invalid(describe_compile_error(format, &reason)));
        }
        Ok(Some(GrammarConstraint { matcher, logits_width: self.logits_width }))
    }

    /// Parse a raw `response_format` value and compile it.
    pub fn compile_value(&self, value: &Json) -> Result<Option<GrammarConstraint>> {
        self.compile(&ResponseFormat::parse(value)?)
    }
}

/// The engine's grammar compiler, built on first use: the vocabulary trie is only paid for by
/// engines that see a constrained request. Cheap to clone (shared), so request validation on a
/// submitting thread and the engine thread use the same one.
#[derive(Clone)]
pub struct SharedGrammarCompiler {
    inner: Arc<LazyCompiler>,
}

struct LazyCompiler {
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    logits_width: usize,
    open_objects: bool,
    built: OnceLock<std::result::Result<GrammarCompiler, String>>,
}

impl std::fmt::Debug for SharedGrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedGrammarCompiler").field("built", &self.inner.built.get().is_some()).finish()
    }
}

impl SharedGrammarCompiler {
    /// A compiler for `tokenizer` (None: constrained requests are rejected), stopping on
    /// `eos_token_ids`, masking logits rows `logits_width` long; `open_objects` as
    /// `GrammarCompiler::with_open_objects`.
    pub fn new(tokenizer: Option<Arc<Tokenizer>>, eos_token_ids: Vec<u32>, logits_width: usize, open_objects: bool) -> Self {
        SharedGrammarCompiler { inner: Arc::new(LazyCompiler { tokenizer, eos_token_ids, logits_width, open_objects, built: OnceLock::new() }) }
    }

    /// The constraint for a request's `response_format`; None (and no work at all) when the
    /// request has none or asks for plain text.
    pub fn constraint_for(&self, response_format: Option<&Json>) -> Result<Option<GrammarConstraint>> {
        let Some(value) = response_format else {
            return Ok(None);
        };
        let format = ResponseFormat::parse(value)?;
        if !format.is_constrained() {
            return Ok(None);
        }
        let lazy = &self.inner;
        let Some(tokenizer) = &lazy.tokenizer else {
            return Err(NinferError::Unsupported("response_format on a model directory without tokenizer.json".into()));
        };
        let built = lazy
            .built
            .get_or_init(|| GrammarCompiler::new(tokenizer, &lazy.eos_token_ids, lazy.logits_width).map(|c| c.with_open_objects(lazy.open_objects)).map_err(|e| e.to_string()));
        match built {
            Ok(compiler) => compiler.compile(&format),
            Err(reason) => Err(NinferError::Unsupported(format!("response_format with this tokenizer ({reason})"))),
        }
    }
}

/// The grammar state of one constrained sequence.
pub struct GrammarConstraint {
    matcher: Matcher,
    logits_width: usize,
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint").field("finished", &self.is_finished()).finish()
    }
}

impl GrammarConstraint {
    /// The token ids allowed at the next position: EOS among them once the output is complete,
    /// only EOS once the grammar admits no further text.
    pub fn compute_mask(&mut self) -> Result<TokenMask> {
        let set = self.matcher.compute_mask_or_eos().map_err(|e| matcher_failed("computing the token mask", &e.to_string()))?;
        if set.is_zero() {
            return Err(matcher_failed("computing the token mask", "no token can continue the output"));
        }
        Ok(TokenMask { set, width: self.logits_width })
    }

    /// Compute the mask and apply it to one logits row: disallowed logits become -inf.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<()> {
        self.compute_mask()?.apply(logits);
        Ok(())
    }

    /// Advance past a sampled token (EOS included: it ends an accepting grammar); a token the
    /// mask did not allow is an error.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| matcher_failed(&format!("consuming token {token}"), &e.to_string()))
    }

    /// Whether the output is complete: EOS was consumed in an accepting state, or the grammar
    /// admits no further text. The engine then ends the sequence with finish_reason "stop".
    pub fn is_finished(&self) -> bool {
        !self.matcher.is_error() && self.matcher.is_stopped()
    }

    /// Whether the output so far is a complete match (EOS would be allowed now).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// The set of token ids allowed at one position.
pub struct TokenMask {
    set: SimpleVob,
    width: usize,
}

impl TokenMask {
    /// Whether `token` may be sampled.
    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.width && self.set.is_allowed(token)
    }

    /// The allowed ids in increasing order.
    pub fn allowed(&self) -> Vec<u32> {
        self.set.to_list().into_iter().filter(|&t| (t as usize) < self.width).collect()
    }

    /// How many ids are allowed.
    pub fn count(&self) -> usize {
        self.allowed().len()
    }

    /// The mask as `words` covering `vocab` ids: bit `t % 32` of word `t / 32` is set when `t`
    /// is allowed (the layout `RowSampling::allow` and the device sampler take).
    pub fn bitset(&self, vocab: usize) -> Vec<u32> {
        let words = self.set.as_slice();
        let mut out: Vec<u32> = (0..vocab.div_ceil(32)).map(|w| words.get(w).copied().unwrap_or(0)).collect();
        let limit = self.width.min(vocab);
        for (w, bits) in out.iter_mut().enumerate().skip(limit / 32) {
            let keep = limit.saturating_sub(w * 32).min(32);
            *bits &= if keep == 32 { u32::MAX } else { (1u32 << keep) - 1 };
        }
        out
    }

    /// Set every disallowed logit of `logits` (one row, `width` long) to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.set.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, logit) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }
}

fn invalid(reason: impl Into<String>) -> NinferError {
    NinferError::invalid(FIELD, reason)
}

/// A matcher failure midway; its reason cut to the first line: llguidance appends a dump of the
/// parser state, which reaches the client through the request's error and says nothing to it.
fn matcher_failed(what: &str, reason: &str) -> NinferError {
    let reason = reason.lines().next().unwrap_or(reason).trim();
    invalid(format!("grammar matcher failed {what}: {reason}"))
}

fn describe_compile_error(format: &ResponseFormat, reason: &str) -> String {
    let what = match format {
        ResponseFormat::Text | ResponseFormat::JsonObject => "JSON object grammar",
        ResponseFormat::JsonSchema { .. } => "json_schema.schema",
        ResponseFormat::Regex { .. } => "regex",
        ResponseFormat::Lark { .. } => "lark grammar",
    };
    format!("invalid {what}: {}", reason.trim())
}

#[cfg(test)]
mod tests;
