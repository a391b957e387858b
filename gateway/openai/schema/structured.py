"""Structured outputs on the API, declared: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, and the one constraint spec they become.

The spec's shape and the JSON Schema checks are gateway/openai/structured_api.py's; here are
the fields' types and caps (so /openapi.json states them) and the rule that at most one
constraint is sent.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StringConstraints,
    Tag,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from gateway.errors import bad_request
from gateway.openai.schema.base import Body, by_key, refuse
from gateway.openai.structured_api import (
    GUIDED,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_BYTES,
    MAX_REGEX_CHARS,
    STRUCTURED_KINDS,
    STRUCTURED_OPTIONS,
    schema_problem,
)

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's, for schema and function names
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
STRUCTURED_DESCRIPTION = (
    "vLLM's structured outputs: exactly one of json (a schema, or its JSON text), regex, "
    "choice or grammar (EBNF / Lark), or json_object. vLLM's older top-level guided_json, "
    "guided_regex, guided_choice and guided_grammar are read the same way. At most one of "
    "response_format (other than text), structured_outputs and guided_* may be sent; with "
    "tools, only when tool_choice is \"none\".")


def json_value(value: Any) -> Any:
    """A json constraint's schema: an object, or (as vLLM takes it) its JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise refuse("is not valid JSON") from None
    why = schema_problem(value)
    if why is not None:
        raise refuse(why)
    return value


def grammar_value(value: str) -> str:
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise refuse(f"is {size} bytes; at most {MAX_GRAMMAR_BYTES} are allowed")
    return value


SchemaObject = Annotated[Any, Field(json_schema_extra={
    "type": ["object", "null"],
    "description": "A JSON Schema (Draft 2020-12); `$ref`s must resolve inside it."})]
JsonSpec = Annotated[Any, AfterValidator(json_value), Field(json_schema_extra={
    "oneOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}],
    "description": "A JSON Schema, or its JSON text."})]
Regex = Annotated[str, StringConstraints(min_length=1, max_length=MAX_REGEX_CHARS)]
Grammar = Annotated[str, StringConstraints(min_length=1), AfterValidator(grammar_value)]
Choices = Annotated[list[Annotated[str, StringConstraints(min_length=1,
                                                          max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]


def spec(kind: str, value: Any, param: str) -> dict:
    """The engine's spec of one validated constraint."""
    if kind == "json":
        return {"type": "json", "schema": value, "param": param}
    if kind == "choice":
        return {"type": "choice", "choices": list(dict.fromkeys(value)), "param": param}
    return {"type": kind, "pattern" if kind == "regex" else "grammar": value, "param": param}


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaSpec(Body):
    name: Name
    description: str | None = None
    schema_: SchemaObject = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        if value is not None and (why := schema_problem(value)) is not None:
            raise refuse(why)
        return value


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _has_spec(self) -> JsonSchemaFormat:
        if self.json_schema is None:
            where = "response_format.json_schema"
            raise bad_request(f"{where} must be an object with name and schema", where)
        return self


ResponseFormat = Annotated[Annotated[TextFormat, Tag("~text")]
                           | Annotated[JsonObjectFormat, Tag("~json_object")]
                           | Annotated[JsonSchemaFormat, Tag("~json_schema")],
                           by_key("type", {"text": "text", "json_object": "json_object",
                                           "json_schema": "json_schema"})]


class StructuredOutputs(Body):
    """vLLM's structured_outputs: exactly one constraint, and options that change only how,
    never whether, output is valid."""

    model_config = ConfigDict(extra="allow", json_schema_extra={
        "description": STRUCTURED_DESCRIPTION})
    json_: JsonSpec = Field(None, alias="json")
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        for key in self.model_extra or ():
            if key not in STRUCTURED_OPTIONS:
                raise bad_request(f"structured_outputs.{key:.40} is not supported by this "
                                  "server", f"structured_outputs.{key:.40}")
        if len(self.kinds()) != 1:
            raise bad_request("structured_outputs needs exactly one of json, regex, choice, "
                              f"grammar, got {len(self.kinds())}", "structured_outputs")
        return self

    def kinds(self) -> list[str]:
        kinds = [k for k in STRUCTURED_KINDS if getattr(self, _attr(k)) is not None]
        return kinds + ["json_object"] if self.json_object else kinds

    def spec(self) -> dict:
        kind = self.kinds()[0]
        if kind == "json_object":
            return {"type": "json", "param": "structured_outputs.json_object"}
        return spec(kind, getattr(self, _attr(kind)), f"structured_outputs.{kind}")


def _attr(kind: str) -> str:
    return "json_" if kind == "json" else kind


def sent_constraints(data: Any) -> list[str]:
    """The constraint fields a raw body sends, in the order `structured_spec` reads them;
    looked up, not validated: it costs nothing whatever their size."""
    if not isinstance(data, dict):
        return []
    fmt = data.get("response_format")
    sent = ["response_format"] if isinstance(fmt, dict) and fmt.get("type") in (
        "json_object", "json_schema") else []
    if isinstance(data.get("structured_outputs"), dict):
        sent.append("structured_outputs")
    return sent + [name for name in GUIDED if data.get(name) is not None]


def combined(second: str, first: str) -> Exception:
    return bad_request(f"{second} cannot be combined with {first}: send one constraint on the "
                       "output", second)


class StructuredFields(Body):
    """The constraint fields both generation endpoints take."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSpec = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_constraint_first(cls, data: Any) -> Any:
        # before any field: two constraints are refused for being two, not after each of
        # their schemas (up to 64 KiB, about 0.2 s of checking apiece) was checked
        sent = sent_constraints(data)
        if len(sent) > 1:
            raise combined(sent[1], sent[0])
        return data

    def structured_spec(self) -> dict | None:
        """The one output constraint sent, or None (a 400 when more than one is)."""
        if self.response_format is None and self.structured_outputs is None and \
                self.guided_json is None and self.guided_regex is None and \
                self.guided_choice is None and self.guided_grammar is None:
            return None  # the usual case, checked first: no constraint
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            found.append(("response_format", _format_spec(fmt)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.spec()))
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, spec(kind, value, name)))
        if len(found) > 1:
            raise combined(found[1][0], found[0][0])
        return found[0][1] if found else None


def _format_spec(fmt: JsonObjectFormat | JsonSchemaFormat) -> dict:
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json", "param": "response_format"}
    where = "response_format.json_schema"
    schema = fmt.json_schema.schema_
    if schema is None:  # OpenAI's: no schema, any JSON object
        return {"type": "json", "param": where}
    return {"type": "json", "schema": schema, "param": f"{where}.schema"}


# refused fields, declared so that a truthy value is a 400 rather than silently ignored
Refused = SkipJsonSchema[Any]
