"""The gateway's OpenAPI document, with the real request schemas.

The generation routes read the raw body themselves (its size is capped before it is
parsed, and errors are OpenAI-format), so FastAPI cannot infer their request models.
Each route names its model with `request_body`, and `publish_request_schemas` puts the
models' JSON Schemas under `components.schemas`: client generators and API fuzzers
read the same constraints the gateway enforces.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def publish_request_schemas(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Add `models` (and the models they use) to the app's OpenAPI components."""
    models = tuple(models)
    generate = app.openapi  # FastAPI's: builds the document once, then returns it

    def openapi() -> dict[str, Any]:
        doc = generate()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            if model.__name__ not in schemas:
                schema = model.model_json_schema(ref_template=_REF, mode="validation")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return doc

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
