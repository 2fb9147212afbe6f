"""The gateway's OpenAPI document publishes the request schemas it enforces: every
reference resolves, and what the schema allows or refuses agrees with the request
models on a few bodies (the fuzz test in integration/ drives it much harder)."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import ValidationError

from routing.openai.gateway import app
from routing.openai.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.unit


def _validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    # The document is the root, so "#/components/schemas/..." resolves inside it.
    return jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"})


@pytest.mark.parametrize("path, model", [("/v1/chat/completions", ChatCompletionRequest),
                                         ("/v1/completions", CompletionRequest)])
def test_generation_routes_name_their_request_schema(path, model):
    doc = app.openapi()
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
    assert "$defs" not in doc["components"]["schemas"][model.__name__]


@pytest.mark.parametrize("name, model, body, valid", [
    ("ChatCompletionRequest", ChatCompletionRequest,
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, True),
    ("ChatCompletionRequest", ChatCompletionRequest,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "top_k": 5}, True),
    ("ChatCompletionRequest", ChatCompletionRequest, {"messages": []}, False),
    ("ChatCompletionRequest", ChatCompletionRequest,
     {"messages": [{"role": "user", "content": "hi"}], "top_k": 9223372036854775808}, False),
    ("CompletionRequest", CompletionRequest, {"prompt": "hi", "temperature": 0.5}, True),
    ("CompletionRequest", CompletionRequest, {"prompt": [1, 2, 3]}, True),
    ("CompletionRequest", CompletionRequest, {"prompt": "hi", "max_tokens": 0}, False),
    ("CompletionRequest", CompletionRequest, {"prompt": "hi", "top_p": 1.5}, False),
])
def test_the_published_schema_agrees_with_the_model(name, model, body, valid):
    errors = list(_validator(app.openapi(), name).iter_errors(body))
    assert (not errors) == valid, errors
    try:
        model.model_validate(body)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == valid
