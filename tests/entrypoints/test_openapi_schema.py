"""The OpenAPI schema against a real `vllm serve` (tiny model, CPU): it documents what the server does (400 with the
OpenAI error body, never FastAPI's 422; the required and non-empty fields; the enforced bounds), and a bounded,
seeded property-based run of schemathesis over the three generation endpoints (schema-valid and schema-violating
bodies) finds no 5xx and no response that breaks the schema (status codes, content types, bodies).

The server is kept small so that any schema-valid request is cheap: --max-model-len 64 bounds max_tokens and
VLLM_MAX_N_SEQUENCES=4 bounds n.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer, start_server, stop_server

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
positive_data_acceptance = schemathesis.checks.positive_data_acceptance

OPERATIONS = [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
              ("/inference/v1/generate", "GenerateRequest")]
MAX_EXAMPLES = 40  # per operation and generation mode
# NOTE: schemathesis's positive_data_acceptance (every schema-valid body is served) is left out: some bounds
# depend on the model and on other fields (vocabulary size, the context left for max_tokens, the mask rules), which a
# JSON schema cannot say; those bodies get a 400. Every other check runs (5xx, status codes, content types, response
# bodies against the schema, schema-violating bodies refused).


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--max-model-len", "64", "--max-num-seqs", "4", "--api-key", API_KEY, "--seed", "0"],
                       {"VLLM_MAX_N_SEQUENCES": "4"})
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def openapi(server: RemoteServer) -> dict[str, Any]:
    resp = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert resp.status_code == 200
    return resp.json()


def _resolve(schema: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    return schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]


def test_schema_documents_400_and_required_fields(openapi: dict[str, Any]) -> None:
    assert "422" not in str(openapi) and "HTTPValidationError" not in str(openapi)
    for path, model in OPERATIONS:
        responses = openapi["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "500", "503"} <= set(responses)
        error = _resolve(openapi, responses["400"]["content"]["application/json"]["schema"])
        assert error["required"] == ["error"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        body = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(model)
    completion = openapi["components"]["schemas"]["CompletionRequest"]
    assert "prompt" in completion["required"]
    assert {"type": "string", "minLength": 1} in completion["properties"]["prompt"]["anyOf"]
    assert all(v.get("minItems") == 1 for v in completion["properties"]["prompt"]["anyOf"] if v["type"] == "array")
    assert completion["properties"]["temperature"]["minimum"] == 0
    assert completion["properties"]["temperature"]["maximum"] == 2
    assert completion["properties"]["n"]["minimum"] == 1
    chat = openapi["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["messages"]["minItems"] == 1
    assert chat["properties"]["messages"]["items"]["required"] == ["role"]
    generate = openapi["components"]["schemas"]["GenerateRequest"]
    assert generate["required"] == ["token_ids"] and generate["properties"]["token_ids"]["minItems"] == 1
    assert generate["properties"]["request_id"]["minLength"] == 1


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", [path for path, _ in OPERATIONS])
def test_schemathesis_finds_no_5xx_and_no_schema_violation(server: RemoteServer, openapi: dict[str, Any],
                                                           path: str, mode: str) -> None:
    schema = schemathesis.openapi.from_dict(openapi)
    operation = schema[path]["POST"]
    generation_mode = schemathesis.GenerationMode.POSITIVE if mode == "positive" \
        else schemathesis.GenerationMode.NEGATIVE
    statuses: dict[int, int] = {}

    @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(case=operation.as_strategy(generation_mode=generation_mode))
    def run(case: Any) -> None:
        response = case.call_and_validate(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                          timeout=60, excluded_checks=[positive_data_acceptance])
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, response.text

    run()
    assert sum(statuses.values()) >= 10, statuses
    if mode == "negative":
        assert all(400 <= s < 500 for s in statuses), statuses
    else:  # schema-valid bodies are served, and their 200 bodies were checked against the response schema
        assert statuses.get(200, 0) >= 3, statuses
