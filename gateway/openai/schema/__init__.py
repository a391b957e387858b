"""The OpenAI-compatible API declared once: request bodies as pydantic v2 models, answers as
TypedDicts, and the OpenAPI components derived from both.

Why one declaration: the readers, the OpenAPI document and the answer builders used to be
written by hand three times and kept in step by shared constants. Now a cap is a field
constraint here, the validator and /openapi.json both read it, and the answer builders return
dicts typed by `gateway.openai.schema.answers`, which mypy checks and the document describes.

`read(Model, body)` validates a decoded JSON body into a model, or raises the 400 `APIError`
OpenAI clients expect (`param` the dotted, indexed name, e.g. `messages[0].content`).
"""
from __future__ import annotations

from gateway.openai.schema.base import Body, read

__all__ = ["Body", "read"]
