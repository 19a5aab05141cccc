"""Validate grammar-constrained outputs against their JSON schema in tests.

The `jsonschema` package is the oracle when installed. Without it, a small validator covers
exactly the keywords the grammar tests use (type, properties, required, additionalProperties,
enum, pattern, minLength/maxLength, minimum/maximum, items, maxItems) and fails loudly on any
other keyword, so a test never passes by ignoring a rule.
"""

from __future__ import annotations

import re

try:
    import jsonschema
except ImportError:
    jsonschema = None

_KNOWN = {"type", "properties", "required", "additionalProperties", "enum", "pattern", "minLength", "maxLength",
          "minimum", "maximum", "items", "maxItems"}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(instance, schema: dict) -> None:
    """Raise AssertionError (or jsonschema's ValidationError) unless `instance` fits `schema`."""
    if jsonschema is not None:
        jsonschema.validate(instance, schema)
        return
    _check(instance, schema, "$")


def _check(value, schema: dict, where: str) -> None:
    unknown = set(schema) - _KNOWN
    assert not unknown, f"json_schema_check does not implement {sorted(unknown)}; install jsonschema"
    if "type" in schema:
        assert _TYPES[schema["type"]](value), f"{where}: {value!r} is not {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, str):
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), f"{where}: {value!r} does not match {schema['pattern']}"
        assert len(value) >= schema.get("minLength", 0), f"{where}: {value!r} too short"
        assert len(value) <= schema.get("maxLength", len(value)), f"{where}: {value!r} too long"
    if _TYPES["number"](value):
        assert value >= schema.get("minimum", value), f"{where}: {value} below the minimum"
        assert value <= schema.get("maximum", value), f"{where}: {value} above the maximum"
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), f"{where}: too many items"
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing required {key!r}"
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{where}.{key}")
            else:
                assert schema.get("additionalProperties", True) is not False, f"{where}: unexpected key {key!r}"
