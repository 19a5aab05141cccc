//! The schema rewrite alone: which objects get `"additionalProperties": false`, under each
//! reading, across the places a schema can hold an object.

use serde_json::{json, Value as Json};

use super::*;

fn closed(mut schema: Json, keys: ObjectKeys) -> Json {
    close_objects(&mut schema, keys).unwrap();
    schema
}

fn listed(schema: Json) -> Json {
    closed(schema, ObjectKeys::Listed)
}

fn strict(schema: Json) -> Json {
    closed(schema, ObjectKeys::Strict)
}

fn strict_error(mut schema: Json) -> String {
    close_objects(&mut schema, ObjectKeys::Strict).unwrap_err()
}

#[test]
fn nested_objects_are_closed_at_every_level() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "geo": {"properties": {"lat": {"type": "number"}}}}}
        },
        "required": ["name"]
    });
    let got = listed(schema);
    assert_eq!(got["additionalProperties"], json!(false));
    assert_eq!(got["properties"]["address"]["additionalProperties"], json!(false));
    assert_eq!(got["properties"]["address"]["properties"]["geo"]["additionalProperties"], json!(false), "an object known by its properties alone");
    assert_eq!(got["properties"]["name"], json!({"type": "string"}), "non-object schemas untouched");
}

#[test]
fn defs_and_definitions_are_closed_and_refs_left_alone() {
    let schema = json!({
        "type": "object",
        "properties": {"pet": {"$ref": "#/$defs/Pet"}, "owner": {"anyOf": [{"$ref": "#/definitions/Owner"}, {"type": "null"}]}},
        "required": ["pet", "owner"],
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}},
        "definitions": {"Owner": {"type": "object", "properties": {"name": {"type": "string"}}}}
    });
    let got = listed(schema);
    assert_eq!(got["$defs"]["Pet"]["additionalProperties"], json!(false));
    assert_eq!(got["definitions"]["Owner"]["additionalProperties"], json!(false));
    assert_eq!(got["properties"]["pet"], json!({"$ref": "#/$defs/Pet"}));
    assert_eq!(got["properties"]["owner"], json!({"anyOf": [{"$ref": "#/definitions/Owner"}, {"type": "null"}]}));
}

#[test]
fn objects_inside_arrays_are_closed() {
    let schema = json!({
        "type": "object",
        "properties": {
            "people": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
            "pair": {"type": "array", "prefixItems": [{"properties": {"a": {}}}, {"type": "integer"}], "items": false},
            "old_style": {"type": "array", "items": [{"properties": {"b": {}}}], "additionalItems": {"properties": {"c": {}}}}
        }
    });
    let got = listed(schema);
    let p = &got["properties"];
    assert_eq!(p["people"]["items"]["additionalProperties"], json!(false));
    assert_eq!(p["pair"]["prefixItems"][0]["additionalProperties"], json!(false));
    assert_eq!(p["pair"]["prefixItems"][1], json!({"type": "integer"}));
    assert_eq!(p["pair"]["items"], json!(false));
    assert_eq!(p["old_style"]["items"][0]["additionalProperties"], json!(false));
    assert_eq!(p["old_style"]["additionalItems"]["additionalProperties"], json!(false));
}

#[test]
fn an_explicit_additional_properties_is_kept_and_its_schema_closed() {
    let schema = json!({
        "type": "object",
        "properties": {
            "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": true},
            "shut": {"type": "object", "properties": {"a": {}}, "additionalProperties": false},
            "map": {"type": "object", "additionalProperties": {"type": "object", "properties": {"x": {"type": "integer"}}}}
        }
    });
    let got = listed(schema);
    let p = &got["properties"];
    assert_eq!(p["open"]["additionalProperties"], json!(true));
    assert_eq!(p["shut"]["additionalProperties"], json!(false));
    assert_eq!(p["map"]["additionalProperties"]["additionalProperties"], json!(false), "the values of a map are closed objects");
    assert!(p["map"]["additionalProperties"].get("properties").is_some());
    assert_eq!(p["map"].get("properties"), None, "a map stays a map");
}

#[test]
fn a_bare_object_stays_free_form_unless_strict() {
    let bare = json!({"type": "object", "properties": {"meta": {"type": "object"}, "any": {}}});
    let got = listed(bare.clone());
    assert_eq!(got["properties"]["meta"], json!({"type": "object"}));
    assert_eq!(got["properties"]["any"], json!({}));
    let got = strict(bare);
    assert_eq!(got["properties"]["meta"], json!({"type": "object", "additionalProperties": false}));
    assert_eq!(got["properties"]["any"], json!({}), "a schema that is not an object is left alone");
    assert_eq!(listed(json!({"type": ["object", "null"]})), json!({"type": ["object", "null"]}));
    assert_eq!(strict(json!({"type": ["object", "null"]}))["additionalProperties"], json!(false));
}

#[test]
fn required_names_without_a_schema_stay_admitted() {
    let got = listed(json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}));
    assert_eq!(got["additionalProperties"], json!(false));
    assert_eq!(got["properties"], json!({"a": {"type": "integer"}, "b": true}));
    let got = listed(json!({"required": ["x"]}));
    assert_eq!(got, json!({"required": ["x"], "properties": {"x": true}, "additionalProperties": false}));
}

#[test]
fn strict_refuses_additional_properties_other_than_false_naming_the_path() {
    let error = strict_error(json!({"type": "object", "properties": {"meta": {"type": "object", "additionalProperties": true}}}));
    assert!(error.contains("#/properties/meta/additionalProperties"), "{error}");
    assert!(error.contains("strict"), "{error}");
    let error = strict_error(json!({"type": "object", "$defs": {"a/b": {"type": "object", "additionalProperties": {"type": "string"}}}}));
    assert!(error.contains("#/$defs/a~1b/additionalProperties"), "{error}");
    let error = strict_error(json!({"type": "array", "items": {"type": "object", "properties": {}, "additionalProperties": true}}));
    assert!(error.contains("#/items/additionalProperties"), "{error}");
    let ok = strict(json!({"type": "object", "properties": {"a": {}}, "additionalProperties": false}));
    assert_eq!(ok["additionalProperties"], json!(false));
}

#[test]
fn open_leaves_the_schema_as_sent_and_strict_wins_over_open() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}, "$defs": {"D": {"properties": {"c": {}}}}});
    assert_eq!(closed(schema.clone(), ObjectKeys::Open), schema);
    assert_eq!(ObjectKeys::for_request(false, true), ObjectKeys::Open);
    assert_eq!(ObjectKeys::for_request(false, false), ObjectKeys::Listed);
    assert_eq!(ObjectKeys::for_request(true, true), ObjectKeys::Strict);
    assert_eq!(ObjectKeys::for_request(true, false), ObjectKeys::Strict);
}

#[test]
fn all_of_branches_stay_open_and_their_parent_admits_their_names() {
    let schema = json!({
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"$ref": "#/$defs/B"},
            {"allOf": [{"properties": {"c": {"type": "object", "properties": {"d": {}}}}}]}
        ],
        "$defs": {"B": {"type": "object", "properties": {"b": {"type": "string"}}}}
    });
    let got = listed(schema);
    assert_eq!(got["additionalProperties"], json!(false));
    assert_eq!(got["properties"], json!({"a": true, "b": true, "c": true}));
    assert_eq!(got["allOf"][0].get("additionalProperties"), None, "a branch stays open");
    assert_eq!(got["allOf"][2]["allOf"][0].get("additionalProperties"), None);
    assert_eq!(got["allOf"][2]["allOf"][0]["properties"]["c"]["additionalProperties"], json!(false), "objects inside a branch are closed");
}

#[test]
fn any_of_alternatives_are_closed_alone_and_combined_next_to_properties() {
    let union = listed(json!({"anyOf": [{"type": "object", "properties": {"cat": {}}}, {"type": "object", "properties": {"dog": {}}}]}));
    assert_eq!(union["anyOf"][0]["additionalProperties"], json!(false));
    assert_eq!(union["anyOf"][1]["additionalProperties"], json!(false));
    assert_eq!(union.get("additionalProperties"), None);

    let combined = listed(json!({"type": "object", "properties": {"id": {}}, "oneOf": [{"properties": {"x": {}}, "required": ["x"]}, {"required": ["y"]}]}));
    assert_eq!(combined["additionalProperties"], json!(false));
    assert_eq!(combined["properties"], json!({"id": {}, "x": true, "y": true}));
    assert_eq!(combined["oneOf"][0].get("additionalProperties"), None);
}

#[test]
fn boolean_and_non_object_schemas_pass_through() {
    for schema in [json!(true), json!(false), json!({"type": "string"}), json!({"type": "array", "items": {"type": "integer"}})] {
        assert_eq!(strict(schema.clone()), schema);
        assert_eq!(listed(schema.clone()), schema);
    }
}
