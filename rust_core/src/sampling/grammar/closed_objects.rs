//! Which keys a `json_schema` object admits beyond the ones it lists.
//!
//! JSON Schema's default admits any further key, so a schema without `"additionalProperties":
//! false` lets a constrained model keep adding keys after the required ones until `max_tokens`.
//! Client libraries (instructor, LangChain, litellm) send such schemas expecting OpenAI's
//! reading, where an object admits only its listed properties. [`close_objects`] rewrites a
//! schema to that reading before llguidance compiles it.

use serde_json::{Map, Value as Json};

/// How a `json_schema`'s objects treat keys they do not list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKeys {
    /// JSON Schema's default: an object without `additionalProperties` admits any other key
    /// (the server's `--json-schema-open-objects`).
    Open,
    /// An object that lists keys (`properties`, `patternProperties` or `required`) and says
    /// nothing of `additionalProperties` admits only those; one that lists none
    /// (`{"type": "object"}`) stays free-form, as that is all it can mean.
    Listed,
    /// `"strict": true`: every object admits only its listed keys, a bare `{"type": "object"}`
    /// only `{}`, and an `additionalProperties` other than false is refused (OpenAI's strict
    /// mode requires false there).
    Strict,
}

impl ObjectKeys {
    /// The reading for a request: `strict` always closes objects; otherwise the server's choice.
    pub fn for_request(strict: bool, open_objects: bool) -> Self {
        match (strict, open_objects) {
            (true, _) => ObjectKeys::Strict,
            (false, true) => ObjectKeys::Open,
            (false, false) => ObjectKeys::Listed,
        }
    }
}

/// Subschema maps (name -> schema) whose values are full schemas of their own.
const SCHEMA_MAPS: [&str; 5] = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];
/// Keywords holding one schema (or, for draft-4 `items`, a list of them).
const SCHEMA_SLOTS: [&str; 4] = ["additionalProperties", "items", "additionalItems", "contains"];
/// How deep `listed_names` follows `$ref`s and nested `allOf`s (a cycle stops here).
const MAX_NAME_DEPTH: usize = 8;

/// Rewrite `schema` in place so that its objects admit unlisted keys only as `keys` says: each
/// object to close gets `"additionalProperties": false`, and its `required` names (and those
/// listed by the branches it combines with through `allOf`, or `anyOf`/`oneOf` next to its own
/// properties) are added to `properties` so that closing it refuses none of them. Those branches
/// stay open themselves: closed, each would refuse the others' keys. The error names the JSON
/// pointer of an `additionalProperties` that strict mode cannot honour.
pub fn close_objects(schema: &mut Json, keys: ObjectKeys) -> Result<(), String> {
    if keys == ObjectKeys::Open {
        return Ok(());
    }
    let root = schema.clone();
    Closer { root: &root, strict: keys == ObjectKeys::Strict }.visit(schema, "#", false)
}

struct Closer<'a> {
    /// The schema as sent, for resolving local `$ref`s.
    root: &'a Json,
    strict: bool,
}

impl Closer<'_> {
    /// Close `node` and every subschema under it; `partial`: `node` is a branch its parent
    /// combines with its own keys, so it is not closed itself (its subschemas are).
    fn visit(&self, node: &mut Json, path: &str, partial: bool) -> Result<(), String> {
        let Some(map) = node.as_object_mut() else {
            return Ok(());
        };
        for key in SCHEMA_MAPS {
            if let Some(Json::Object(children)) = map.get_mut(key) {
                for (name, child) in children.iter_mut() {
                    self.visit(child, &format!("{path}/{key}/{}", pointer_escape(name)), false)?;
                }
            }
        }
        for key in SCHEMA_SLOTS.into_iter().chain(["prefixItems"]) {
            match map.get_mut(key) {
                Some(Json::Array(list)) => {
                    for (i, child) in list.iter_mut().enumerate() {
                        self.visit(child, &format!("{path}/{key}/{i}"), false)?;
                    }
                }
                Some(child) => self.visit(child, &format!("{path}/{key}"), false)?,
                None => {}
            }
        }
        let lists_own = ["properties", "patternProperties", "required"].iter().any(|k| map.contains_key(*k));
        let mut branch_names = Vec::new();
        for key in ["allOf", "anyOf", "oneOf"] {
            let combined = key == "allOf" || lists_own;
            if let Some(Json::Array(branches)) = map.get_mut(key) {
                for (i, branch) in branches.iter_mut().enumerate() {
                    self.visit(branch, &format!("{path}/{key}/{i}"), combined)?;
                    if combined {
                        self.listed_names(branch, 0, &mut branch_names);
                    }
                }
            }
        }
        match map.get("additionalProperties") {
            Some(Json::Bool(false)) => return Ok(()),
            Some(_) if self.strict => {
                return Err(format!(
                    "`additionalProperties` at {path}/additionalProperties admits keys beyond the listed properties, \
                     which a strict json_schema never does: set it to false or drop `strict`"
                ));
            }
            Some(_) => return Ok(()),
            None => {}
        }
        if partial {
            return Ok(());
        }
        let combines = ["allOf", "anyOf", "oneOf", "$ref"].iter().any(|k| map.contains_key(*k));
        let bare_object = self.strict && is_object_type(map.get("type")) && !combines;
        if !(lists_own || !branch_names.is_empty() || bare_object) {
            return Ok(());
        }
        let required: Vec<String> = match map.get("required") {
            Some(Json::Array(names)) => names.iter().filter_map(Json::as_str).map(str::to_string).collect(),
            _ => Vec::new(),
        };
        let names: Vec<String> = required.into_iter().chain(branch_names).collect();
        if !names.is_empty() {
            if let Json::Object(properties) = map.entry("properties").or_insert_with(|| Json::Object(Map::new())) {
                for name in names {
                    properties.entry(name).or_insert(Json::Bool(true));
                }
            }
        }
        map.insert("additionalProperties".into(), Json::Bool(false));
        Ok(())
    }

    /// The property names `branch` lists: its `properties` and `required`, and those of what it
    /// refers to (a local `$ref`) or combines (`allOf`).
    fn listed_names(&self, branch: &Json, depth: usize, out: &mut Vec<String>) {
        let Some(map) = branch.as_object() else {
            return;
        };
        if depth > MAX_NAME_DEPTH {
            return;
        }
        if let Some(Json::Object(properties)) = map.get("properties") {
            out.extend(properties.keys().cloned());
        }
        if let Some(Json::Array(required)) = map.get("required") {
            out.extend(required.iter().filter_map(Json::as_str).map(str::to_string));
        }
        if let Some(target) = map.get("$ref").and_then(Json::as_str).and_then(|r| r.strip_prefix('#')).and_then(|p| self.root.pointer(p)) {
            self.listed_names(target, depth + 1, out);
        }
        if let Some(Json::Array(parts)) = map.get("allOf") {
            for part in parts {
                self.listed_names(part, depth + 1, out);
            }
        }
    }
}

/// Whether a `type` keyword admits objects.
fn is_object_type(kind: Option<&Json>) -> bool {
    match kind {
        Some(Json::String(s)) => s == "object",
        Some(Json::Array(kinds)) => kinds.iter().any(|k| k == "object"),
        _ => false,
    }
}

/// A key as a JSON pointer segment (RFC 6901).
fn pointer_escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests;
