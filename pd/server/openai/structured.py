"""A request's structured-output fields -> one llguidance grammar (``SamplingParams.grammar``),
compiled here, before admission: a grammar llguidance refuses, or one longer than
``MAX_GRAMMAR_CHARS``, is a 400 that says why.

The fields, at most one per request (each names the other it met in its 400):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (what ``client.beta.chat.completions.parse(response_format=Model)`` sends; the schema is
  always enforced, ``strict`` or not);
- vLLM's ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_choice``
  (one of the strings), ``guided_grammar`` (a Lark grammar, llguidance's dialect);
- vLLM's newer ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar": ...}``.

JSON comes out in ``json.dumps``' layout (``{"a": 1, "b": 2}``), with no free whitespace: a
small model cannot pad it with whitespace until max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

from pd.executor.grammar import grammar_error
from pd.server.http.errors import APIError

# json.dumps' layout, fixed (no free whitespace: a small model cannot pad the answer with it
# until max_tokens)
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar")
# The longest schema, regex, grammar or tools a request may bring, in characters of its JSON
# text: OpenAI's own bound on a schema's property names and enums together is 120,000
MAX_GRAMMAR_CHARS = 131_072


def check_grammar_size(value: Any, param: str) -> None:
    """APIError (400) when a schema, regex, grammar or the tools' JSON text is longer than
    ``MAX_GRAMMAR_CHARS``: compiling and checking one takes time in proportion to it, in a parse
    thread and then on every node that samples under it."""
    size = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
    if size > MAX_GRAMMAR_CHARS:
        raise APIError(
            f"{param} is {size} characters of JSON, at most {MAX_GRAMMAR_CHARS}", param=param
        )


def grammar_of(fields: Mapping[str, Any]) -> str:
    """The grammar of a request's structured-output fields (name -> value, None when not
    sent), "" when none asks for one; APIError (400, naming the field) for a malformed field,
    two of them, one past ``MAX_GRAMMAR_CHARS``, or a grammar llguidance cannot compile."""
    asked = {name: value for name, value in fields.items() if value is not None}
    rf = asked.get("response_format")
    if rf is not None and rf.get("type") == "text":
        del asked["response_format"]
    if len(asked) > 1:
        names = " and ".join(sorted(asked))
        raise APIError(
            f"{names} each ask for a structured output: send one", param=sorted(asked)[1]
        )
    if not asked:
        return ""
    ((name, value),) = asked.items()
    check_grammar_size(value, name)
    try:
        if name == "response_format":
            grammar = _response_format(value)
        elif name == "structured_outputs":
            grammar = _structured_outputs(value)
        else:
            grammar = _guided(name.removeprefix("guided_"), value, name)
    except (ValueError, TypeError, RuntimeError) as e:  # llguidance's own refusals
        raise APIError(f"{name}: the grammar does not compile: {e}", param=name) from e
    error = grammar_error(grammar)
    if error:
        raise APIError(f"{name}: the grammar does not compile: {error}", param=name)
    return grammar


def _response_format(rf: Mapping[str, Any]) -> str:
    kind = rf.get("type")
    if kind == "json_object":
        return _json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise APIError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": ...}}',
                param="response_format",
            )
        return _json_grammar(spec.get("schema", {"type": "object"}), "response_format")
    raise APIError(
        f"response_format type {kind!r} is not supported (text, json_object or json_schema)",
        param="response_format",
    )


def _structured_outputs(so: Any) -> str:
    if not isinstance(so, Mapping):
        raise APIError("structured_outputs must be an object", param="structured_outputs")
    asked = {k: v for k, v in so.items() if v is not None}
    unknown = sorted(set(asked) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown or len(asked) != 1:
        raise APIError(
            f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}; "
            f"got {', '.join(sorted(asked)) or 'none'}",
            param="structured_outputs",
        )
    ((kind, value),) = asked.items()
    return _guided(kind, value, "structured_outputs")


def _guided(kind: str, value: Any, param: str) -> str:
    """The grammar of one of vLLM's kinds: json, regex, choice, grammar."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise APIError(f"{param}: the schema is not JSON: {e}", param=param) from e
        return _json_grammar(value, param)
    if kind == "regex":
        _need(
            isinstance(value, str) and value, f"{param}: a regex must be a non-empty string", param
        )
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        ok = isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
        _need(ok, f"{param}: choices must be a non-empty list of non-empty strings", param)
        # JSON's string escapes are Lark's: each choice is one literal
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value)
        )
    assert kind == "grammar", kind
    _need(isinstance(value, str) and value, f"{param}: a grammar must be a non-empty string", param)
    return llguidance.LLMatcher.grammar_from_lark(value)


def _json_grammar(schema: Any, param: str) -> str:
    _need(isinstance(schema, Mapping | bool), f"{param}: a JSON schema must be an object", param)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)


def _need(ok: Any, message: str, param: str) -> None:
    if not ok:
        raise APIError(message, param=param)
