"""JSON schemas as users write them: closed objects by default, and OpenAI's `strict` rules.

* `close_objects(schema)`: a copy of `schema` in which every object schema that lists
  `properties` (or `patternProperties`) and says nothing about `additionalProperties` is closed
  (`additionalProperties: false`), at every level — nested objects, `$defs`, array items, `anyOf`
  branches — as xgrammar and vLLM do. pydantic's `model_json_schema()` never writes
  `additionalProperties`; left open, a grammar lets the model start an extra key it never
  finishes. An object that sets `additionalProperties` (true or a schema) keeps it; one without
  `properties` (`{"type": "object"}`, a free-form dict) stays open; the members of an `allOf` are
  not closed one by one (each would forbid the others' keys).
* `check_strict(schema, param)`: `strict: true` follows OpenAI's structured-output rules; a schema
  OpenAI would refuse is a `BadRequest` naming the rule and, in `param`, where it is broken:
  the root is an object (not `anyOf`); every object sets `additionalProperties: false` and lists
  every property in `required`; only the supported keywords; at most 5000 properties, 10 levels
  of nested objects and 1000 enum values.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterator

from mmserve.errors import BadRequest, clip

# where subschemas live: a map of them, one of them, or a list of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _children(schema: dict) -> Iterator[tuple[tuple, Any]]:
    """(path below `schema`, subschema) of every direct subschema of `schema`."""
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield (key, name), sub
    for key in _SCHEMA_ONE:
        value = schema.get(key)
        if isinstance(value, dict):
            yield (key,), value
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield (key, i), sub


def close_objects(schema: Any) -> Any:
    """A copy of `schema` whose object schemas with properties are closed unless they say otherwise."""
    if not isinstance(schema, dict):
        return schema
    out = copy.deepcopy(schema)
    stack: list[tuple[dict, bool]] = [(out, True)]  # (schema, may close it)
    while stack:  # iterative: a deep schema must not overflow the interpreter's stack
        node, closable = stack.pop()
        if (closable and ("properties" in node or "patternProperties" in node)
                and "additionalProperties" not in node and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
        for path, sub in _children(node):
            if isinstance(sub, dict):
                stack.append((sub, path[0] != "allOf"))
    return out


_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                "readOnly", "writeOnly"}
_STRICT_KEYWORDS = _ANNOTATIONS | {
    "type", "properties", "required", "additionalProperties", "items", "anyOf", "enum", "const", "$ref",
    "$defs", "definitions",
    "pattern", "format",  # strings
    "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",  # numbers
    "minItems", "maxItems",  # arrays
}
_STRICT_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
MAX_STRICT_PROPERTIES = 5000
MAX_STRICT_DEPTH = 10
MAX_STRICT_ENUM_VALUES = 1000
_PLAIN = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]{0,63}\Z")


def _param(base: str, path: tuple) -> str:
    out = base
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        elif _PLAIN.match(key):
            out += f".{key}"
        else:
            out += f"[{clip(key, 64)}]"
    return out


def _refuse(base: str, path: tuple, rule: str) -> BadRequest:
    keys = [clip(k, 64) if isinstance(k, str) else str(k) for k in path[-8:]]
    context = "(" + ("..., " if len(path) > 8 else "") + ", ".join(keys) + ("," if len(path) == 1 else "") + ")"
    return BadRequest(f"invalid schema for strict: true (OpenAI's structured-output rules): in context={context}, "
                      f"{rule}", param=_param(base, path))


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def check_strict(schema: Any, param: str) -> None:
    """Raises BadRequest when OpenAI would refuse `schema` under `strict: true` (see the module doc)."""
    if not isinstance(schema, dict) or schema.get("type") != "object" or "anyOf" in schema:
        got = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
        raise BadRequest("invalid schema for strict: true (OpenAI's structured-output rules): the schema must be "
                         f"a JSON Schema of 'type: \"object\"' (not anyOf), got 'type: {clip(got, 64)}'",
                         param=param)
    properties = enums = 0
    stack: list[tuple[dict, tuple, int]] = [(schema, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        for key in node:
            if key not in _STRICT_KEYWORDS:
                raise _refuse(param, path, f"{clip(key, 64)!s} is not permitted (supported: type, properties, "
                              "required, additionalProperties, items, anyOf, enum, const, $ref, $defs, pattern, "
                              "format, minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf, minItems, "
                              "maxItems and annotations)")
        kinds = node.get("type")
        for kind in (kinds if isinstance(kinds, list) else [] if kinds is None else [kinds]):
            if kind not in _STRICT_TYPES:
                raise _refuse(param, path + ("type",), f"type {clip(kind, 64)} is not supported")
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            raise _refuse(param, path + ("$ref",), "'$ref' must point inside the schema ('#/...')")
        if isinstance(node.get("enum"), list):
            enums += len(node["enum"])
        if _is_object(node):
            if depth > MAX_STRICT_DEPTH:
                raise _refuse(param, path, f"objects nest deeper than {MAX_STRICT_DEPTH} levels")
            if node.get("additionalProperties") is not False:
                raise _refuse(param, path, "'additionalProperties' is required to be supplied and to be false")
            props = node.get("properties") or {}
            properties += len(props) if isinstance(props, dict) else 0
            required = node.get("required")
            missing = [p for p in props if not isinstance(required, list) or p not in required]
            if missing:
                raise _refuse(param, path, "'required' is required to be supplied and to be an array including "
                              f"every key in properties; missing {clip(missing[0], 64)}")
        for sub_path, sub in _children(node):
            if isinstance(sub, dict):
                stack.append((sub, path + sub_path, depth + (1 if _is_object(node) and sub_path[0] == "properties"
                                                             else 0)))
    if properties > MAX_STRICT_PROPERTIES:
        raise BadRequest(f"invalid schema for strict: true: {properties} object properties in all; OpenAI allows at "
                         f"most {MAX_STRICT_PROPERTIES}", param=param)
    if enums > MAX_STRICT_ENUM_VALUES:
        raise BadRequest(f"invalid schema for strict: true: {enums} enum values in all; OpenAI allows at most "
                         f"{MAX_STRICT_ENUM_VALUES}", param=param)
