//! Python's text forms of template values: `json.dumps` (transformers' `tojson` filter) and
//! `str()`/`repr()` (what Jinja2 prints for `{{ value }}` and `|string`).
//!
//! Chat templates are written against Jinja2 running in Python, and the prompt text must match
//! what transformers renders byte for byte, or the model sees a different prompt (and prefix
//! caches miss). minijinja's own `tojson` escapes HTML characters and pretty-prints, and its
//! display of floats, lists and maps differs from Python's, so both are redone here.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Options of Python's `json.dumps` that transformers' `tojson` filter exposes.
#[derive(Debug, Clone, Default)]
pub struct JsonOptions {
    /// Escape every non-ASCII character as `\uXXXX` (transformers' default: false).
    pub ensure_ascii: bool,
    /// Pretty-print with this string per nesting level (`indent=4` is four spaces).
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; defaults depend on `indent` as in Python.
    pub separators: Option<(String, String)>,
    /// Sort map keys.
    pub sort_keys: bool,
}

/// `json.dumps(value, **options)` as Python writes it.
pub fn json_dumps(value: &Value, options: &JsonOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &options.separators {
        Some((item, key)) => (item.clone(), key.clone()),
        None if options.indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut writer = JsonWriter { options, item_sep, key_sep, out: String::new() };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct JsonWriter<'a> {
    options: &'a JsonOptions,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl JsonWriter<'_> {
    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.options.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.out.push_str(&json_number(value)),
            ValueKind::String => json_string(&mut self.out, value.as_str().unwrap_or_default(), self.options.ensure_ascii),
            ValueKind::Map => self.map(value, depth)?,
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.seq(&items, depth)?;
            }
            kind => {
                return Err(Error::new(ErrorKind::InvalidOperation, format!("Object of type {kind} is not JSON serializable")));
            }
        }
        Ok(())
    }

    fn seq(&mut self, items: &[Value], depth: usize) -> Result<(), Error> {
        if items.is_empty() {
            self.out.push_str("[]");
            return Ok(());
        }
        self.out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(depth + 1);
            self.value(item, depth + 1)?;
        }
        self.newline(depth);
        self.out.push(']');
        Ok(())
    }

    fn map(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        let mut pairs: Vec<(String, Value)> = Vec::new();
        for key in value.try_iter()? {
            let item = value.get_item(&key)?;
            pairs.push((json_key(&key)?, item));
        }
        if self.options.sort_keys {
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
        }
        if pairs.is_empty() {
            self.out.push_str("{}");
            return Ok(());
        }
        self.out.push('{');
        for (i, (key, item)) in pairs.iter().enumerate() {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(depth + 1);
            json_string(&mut self.out, key, self.options.ensure_ascii);
            let sep = self.key_sep.clone();
            self.out.push_str(&sep);
            self.value(item, depth + 1)?;
        }
        self.newline(depth);
        self.out.push('}');
        Ok(())
    }
}

/// Map keys become strings as in `json.dumps`: numbers and booleans are converted.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => Ok(json_number(key)),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        kind => Err(Error::new(ErrorKind::InvalidOperation, format!("keys must be str, int, float, bool or None, not {kind}"))),
    }
}

fn json_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) if f.is_nan() => "NaN".to_string(),
        Ok(f) if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string(),
        Ok(f) => float_repr(f),
        Err(_) => value.to_string(),
    }
}

/// A JSON string literal as Python's encoder writes it.
fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `repr(float)`: the shortest digits that round-trip, in fixed notation when the decimal
/// exponent is in [-4, 16), else `d.ddde+XX`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{:e}", f);
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let decpt = exp + 1;
    let n = digits.len() as i32;
    let body = if (-4..16).contains(&exp) {
        if decpt <= 0 {
            format!("0.{}{}", "0".repeat((-decpt) as usize), digits)
        } else if decpt < n {
            format!("{}.{}", &digits[..decpt as usize], &digits[decpt as usize..])
        } else {
            format!("{}{}.0", digits, "0".repeat((decpt - n) as usize))
        }
    } else {
        let mant = if n > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits.clone() };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{}{:02}", mant, exp_sign, exp.abs())
    };
    format!("{sign}{body}")
}

/// `str(value)` as Python prints it: strings as they are, containers as their `repr`.
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(value),
    }
}

/// `repr(value)` as Python writes it (lists, dicts, quoted strings, `None`, `True`).
pub fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) => out.push_str(&float_repr(f)),
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::String => repr_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    write_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// A Python string literal: single quotes unless the text has `'` and no `"`.
fn repr_string(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_printable(c) => {
                let code = c as u32;
                let _ = if code <= 0xff {
                    write!(out, "\\x{code:02x}")
                } else if code <= 0xffff {
                    write!(out, "\\u{code:04x}")
                } else {
                    write!(out, "\\U{code:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character, over the ranges templates meet: control
/// characters, separators other than the space, format characters and private use.
fn is_printable(c: char) -> bool {
    let code = c as u32;
    !matches!(code,
        0x00..=0x1f | 0x7f..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f
        | 0x205f..=0x2064 | 0x2066..=0x206f | 0x3000 | 0xd800..=0xf8ff | 0xfeff | 0xfff9..=0xfffb
        | 0xe0001 | 0xe0020..=0xe007f | 0xf0000..=0x10ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_json(text: &str) -> Value {
        let parsed: serde_json::Value = serde_json::from_str(text).unwrap();
        Value::from(minijinja::value::Serde(&parsed))
    }

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "repr({f})");
        }
    }

    #[test]
    fn json_dumps_keeps_key_order_and_python_separators() {
        let v = from_json(r#"{"b": 1, "a": [1, 2.5, "x"], "c": {}, "d": []}"#);
        let out = json_dumps(&v, &JsonOptions::default()).unwrap();
        assert_eq!(out, r#"{"b": 1, "a": [1, 2.5, "x"], "c": {}, "d": []}"#);
    }

    #[test]
    fn json_dumps_does_not_escape_html_or_non_ascii_by_default() {
        let v = from_json(r#"{"t": "<b>&'\"é😀\u0001\n"}"#);
        let out = json_dumps(&v, &JsonOptions::default()).unwrap();
        assert_eq!(out, "{\"t\": \"<b>&'\\\"é😀\\u0001\\n\"}");
        let ascii = json_dumps(&v, &JsonOptions { ensure_ascii: true, ..Default::default() }).unwrap();
        assert_eq!(ascii, "{\"t\": \"<b>&'\\\"\\u00e9\\ud83d\\ude00\\u0001\\n\"}");
    }

    #[test]
    fn json_dumps_indents_with_comma_item_separator() {
        let v = from_json(r#"{"a": [1, {"b": null}], "e": []}"#);
        let out = json_dumps(&v, &JsonOptions { indent: Some("  ".into()), ..Default::default() }).unwrap();
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"e\": []\n}");
    }

    #[test]
    fn json_dumps_sorts_keys_and_takes_custom_separators() {
        let v = from_json(r#"{"b": true, "a": false}"#);
        let options = JsonOptions { sort_keys: true, separators: Some((",".into(), ":".into())), ..Default::default() };
        assert_eq!(json_dumps(&v, &options).unwrap(), r#"{"a":false,"b":true}"#);
    }

    #[test]
    fn repr_matches_python_for_containers_and_quotes() {
        let v = from_json(r#"{"city": "Paris", "n": 2, "f": 0.5, "ok": true, "none": null, "l": ["it's", "a\"b"]}"#);
        assert_eq!(py_repr(&v), r#"{'city': 'Paris', 'n': 2, 'f': 0.5, 'ok': True, 'none': None, 'l': ["it's", 'a"b']}"#);
        assert_eq!(py_repr(&Value::from("both ' and \"")), r#"'both \' and "'"#);
        assert_eq!(py_str(&Value::from("plain")), "plain");
    }
}
