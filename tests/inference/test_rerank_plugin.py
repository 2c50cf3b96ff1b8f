"""A task written only as a plugin (examples/plugins/rerank.py), registered only in a models file.

The plugin's folder is put on the import path (here, and on PYTHONPATH of a private live stack: web,
online and offline workers of their own on a Redis database of their own); no platform file names it.
The model is a tiny random cross-encoder built here, as the span QA head is, so its scores mean nothing:
the tests check shapes, order, messages and that every row is answered, not relevance.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import requests
import yaml

from benchmarks.tiny_bert import build_tiny_cross_encoder
from inference.core.registry import RegistryError, parse_registry
from tests.conftest import ROOT, Stack, database_url, make_test_users, running_stack, wait_until

PLUGINS = ROOT / "examples" / "plugins"
# A Redis database no other module's stack or fixture uses: this stack's queues and heartbeats are its own.
REDIS_DB = 2
DEFAULTS = {"device": "cpu", "torch_threads": 1, "max_backlog": 16}
LIMITS = {"max_batch_size": 32, "max_batch_tokens": 4096, "max_seq_length": 64}
QUERY = "how long does delivery take"
DOCUMENTS = ["Refunds go to the original card.", "Delivery takes 5 to 7 working days.", "Parcels are insured."]


@pytest.fixture(scope="module", autouse=True)
def plugin_on_path() -> Iterator[None]:
    sys.path.insert(0, str(PLUGINS))
    yield
    sys.path.remove(str(PLUGINS))


def registry_of(models: dict):
    return parse_registry({"models": models}, **DEFAULTS)


# The models file -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"task": "no_such_plugin:RerankTask"}, "model 'm': task 'no_such_plugin:RerankTask': cannot import module"),
        ({"task": "rerank:NoSuchTask"}, "model 'm': task 'rerank:NoSuchTask': module 'rerank' has no 'NoSuchTask'"),
        ({"task": "rerank:json"}, "model 'm': task 'rerank:json' is not a TaskType subclass"),
        ({"task": "rerank"}, "model 'm': task must be one of"),
        (
            {"task": "rerank:RerankTask", "handler": "no_such_plugin:Handler"},
            "model 'm': handler 'no_such_plugin:Handler': no module 'no_such_plugin'",
        ),
        ({"task": "rerank:RerankTask", "handler": "nocolon"}, "handler 'nocolon' must be a dotted path module:Class"),
        ({"task": "rerank:RerankTask", "options": {"top_k": 3}}, "task rerank takes no options ['top_k']"),
        ({"task": "rerank:RerankTask", "options": {"max_documents": 0}}, "options.max_documents must be"),
        ({"task": "embedding", "options": {"max_documents": 3}}, "task embedding takes no options"),
    ],
)
def test_the_registry_refuses_a_task_or_handler_it_cannot_use_naming_the_model_and_the_path(entry, message):
    with pytest.raises(RegistryError) as refused:
        registry_of({"m": {"path": "x", **entry}})
    assert message in str(refused.value)


def test_a_plugin_task_is_registered_by_its_name_with_its_options():
    spec = registry_of({"r": {"task": "rerank:RerankTask", "path": "x", "options": {"max_documents": 4}}}).get("r")
    assert spec.task == "rerank"
    assert spec.option("max_documents") == 4
    assert spec.handler_path == "rerank:load_handler"
    assert spec.task_type.input_fields == ("query", "documents")
    hash(spec)  # per-spec caches key on it


def test_a_handler_path_overrides_the_tasks_own():
    spec = registry_of({"r": {"task": "rerank:RerankTask", "path": "x", "handler": "rerank:load_handler"}}).get("r")
    assert spec.handler_path == "rerank:load_handler"
    builtin = registry_of({"e": {"task": "embedding", "path": "x"}}).get("e")
    assert builtin.handler_path == "inference.child.handlers.embedding:EmbeddingHandler"


def test_importing_the_plugin_does_not_import_torch():
    import subprocess

    code = "import sys, rerank; print('torch' in sys.modules, 'transformers' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False False", result.stderr


def test_the_api_schema_describes_a_plugin_task_the_models_file_names(settings, tmp_path):
    from inference.core.registry import get_registry
    from inference.web.api.schema import add_predict_endpoint

    models = {"reranker": {"task": "rerank:RerankTask", "path": "x"}, "e": {"task": "embedding", "path": "x"}}
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": models}))
    settings.INFERENCE_MODELS_FILE = str(tmp_path / "models.yaml")
    get_registry.cache_clear()
    try:
        result = add_predict_endpoint({}, None, None, True)
    finally:
        get_registry.cache_clear()
    schemas = result["components"]["schemas"]
    assert schemas["QueryDocuments"]["description"].startswith("An input of a model of task rerank:")
    assert schemas["Rerank"]["description"] == "The output of a model of task rerank."
    post = result["paths"]["/api/v1/models/{name}/predict"]["post"]
    body = post["requestBody"]["content"]["application/json"]
    assert {"$ref": "#/components/schemas/QueryDocuments"} in body["schema"]["properties"]["inputs"]["items"]["oneOf"]
    assert body["examples"]["rerank"]["value"]["inputs"][0]["documents"]
    outputs = post["responses"]["200"]["content"]["application/json"]["schema"]["properties"]["outputs"]
    assert {"$ref": "#/components/schemas/Rerank"} in outputs["items"]["oneOf"]
    assert "| `rerank` | QueryDocuments | Rerank |" in post["description"]


# Job cells ----------------------------------------------------------------------------------------------


def test_a_documents_cell_must_be_a_json_array_of_non_empty_strings():
    from inference.core.task_types import get_task_type

    task = get_task_type("rerank:RerankTask")
    assert task.cells_error({"query": "q", "documents": json.dumps(DOCUMENTS)}, 1000) == ""
    assert task.cells_error({"query": "", "documents": "[]"}, 1000) == "empty query"
    assert "not a JSON array" in task.cells_error({"query": "q", "documents": "a, b"}, 1000)
    assert "non-empty JSON array" in task.cells_error({"query": "q", "documents": "[]"}, 1000)
    assert task.cells_error({"query": "q", "documents": '["a", " "]'}, 1000) == "documents[1] is empty or not a string"
    assert task.input_from_cells({"query": "q", "documents": '["a", "b"]'}) == {"query": "q", "documents": ["a", "b"]}


# A live stack of its own -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rerank_stack(django_db_setup, django_db_blocker, redis_url, tmp_path_factory) -> Iterator[Stack]:
    model = build_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))
    entry = {"task": "rerank:RerankTask", "path": str(model), "options": {"max_documents": 8}, **LIMITS}
    models_file = tmp_path_factory.mktemp("rerank-models") / "models.yaml"
    models_file.write_text(yaml.safe_dump({"default": "reranker", "models": {"reranker": entry}}))
    own_redis = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    redis.Redis.from_url(own_redis).flushdb()
    tokens = make_test_users(django_db_blocker)
    with django_db_blocker.unblock():
        db_url = database_url()
    python_path = os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))
    with running_stack(
        db_url=db_url,
        redis_url=own_redis,
        models_file=models_file,
        log_dir=tmp_path_factory.mktemp("rerank-logs"),
        tokens=tokens,
        offline_models="reranker",
        extra_env={"PYTHONPATH": python_path},
    ) as running:
        yield running
    redis.Redis.from_url(own_redis).flushdb()


@pytest.mark.integration
def test_online_predict_scores_every_document_in_input_order_and_ranks_them(rerank_stack):
    inputs = [{"query": QUERY, "documents": DOCUMENTS}, {"query": "refund", "documents": ["one document"]}]
    answer = rerank_stack.predict("reranker", inputs)
    assert answer.status_code == 200, answer.text
    first, second = answer.json()["outputs"]
    assert len(first["scores"]) == len(DOCUMENTS)
    assert sorted(first["ranking"]) == [0, 1, 2]
    assert [first["scores"][i] for i in first["ranking"]] == sorted(first["scores"], reverse=True)
    assert first["label"] == str(first["ranking"][0]) and first["score"] == max(first["scores"])
    assert second["ranking"] == [0] and second["label"] == "0"
    # The same document scores the same wherever it stands (each pair is its own sequence).
    again = rerank_stack.predict("reranker", [{"query": QUERY, "documents": DOCUMENTS[::-1]}]).json()["outputs"][0]
    assert again["scores"] == pytest.approx(first["scores"][::-1], abs=1e-4)


@pytest.mark.integration
def test_the_models_list_gives_the_plugin_task_and_its_input_fields(rerank_stack):
    models = requests.get(f"{rerank_stack.url}/api/v1/models", headers=rerank_stack.headers(), timeout=10).json()
    listed = models["models"] if isinstance(models, dict) else models
    reranker = next(m for m in listed if m["name"] == "reranker")
    assert reranker["task"] == "rerank" and reranker["input_fields"] == ["query", "documents"]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"query": QUERY, "documents": "one document"}, "inputs[0].documents must be a list of strings, got a string"),
        ({"query": QUERY, "documents": []}, "inputs[0].documents is empty: send 1 to 8 documents"),
        ({"query": QUERY, "documents": ["fine", " "]}, "inputs[0].documents[1] is empty"),
        ({"query": QUERY, "documents": ["fine", 3]}, "inputs[0].documents[1] is a number, not a string"),
        (
            {"query": QUERY, "documents": ["d"] * 9},
            "inputs[0].documents has 9 documents; the limit is 8 for model 'reranker'",
        ),
        ({"query": "", "documents": ["d"]}, "inputs[0].query is empty"),
        ({"documents": ["d"]}, "inputs[0] has no field 'query'; expected query, documents"),
        ("just text", 'inputs[0] must be an object {"query": ..., "documents": ...} for model \'reranker\''),
    ],
)
def test_a_bad_input_is_a_400_naming_the_problem(rerank_stack, item, message):
    answer = rerank_stack.predict("reranker", [item])
    assert answer.status_code == 400, answer.text
    assert answer.json()["code"] == "invalid_input"
    assert message in answer.json()["detail"]


def _csv(rows: list[tuple[str, list[str] | str]]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "query", "documents"])
    for number, (query, documents) in enumerate(rows):
        writer.writerow([f"r{number}", query, documents if isinstance(documents, str) else json.dumps(documents)])
    return out.getvalue().encode()


@pytest.mark.integration
def test_a_csv_job_with_query_and_documents_columns_answers_every_row_and_exports_the_rerank_columns(rerank_stack):
    rows = [(f"{QUERY} {n}", DOCUMENTS[: 1 + n % 3]) for n in range(12)] + [("a query", "not json")]
    created = requests.post(
        f"{rerank_stack.url}/api/v1/jobs",
        headers=rerank_stack.headers(),
        files={"file": ("rerank.csv", _csv(rows), "text/csv")},
        data={"model": "reranker", "id_column": "id"},
        timeout=30,
    )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]

    def ended() -> dict | None:
        job = requests.get(f"{rerank_stack.url}/api/v1/jobs/{job_id}", headers=rerank_stack.headers(), timeout=10)
        body = job.json()
        return body if body["status"] in ("succeeded", "partial", "failed", "cancelled") else None

    job = wait_until(ended, 240, "the rerank job to end", interval_s=0.5)
    assert job["done_rows"] == 12 and job["failed_rows"] == 1, job
    export = requests.get(
        f"{rerank_stack.url}/api/v1/jobs/{job_id}/results.csv", headers=rerank_stack.headers(), timeout=30
    )
    assert export.status_code == 200, export.text
    table = list(csv.DictReader(io.StringIO(export.text)))
    assert list(table[0])[:10] == [
        "job",
        "row",
        "index",
        "id",
        "query",
        "documents",
        "status",
        "label",
        "best_document",
        "score",
    ]
    assert {"ranking", "scores", "output"} <= set(table[0])
    for row, (query, documents) in zip(table[:12], rows[:12], strict=True):
        assert row["status"] == "done" and row["query"] == query
        scores, ranking = json.loads(row["scores"]), json.loads(row["ranking"])
        assert len(scores) == len(documents) and sorted(ranking) == list(range(len(documents)))
        assert row["label"] == str(ranking[0]) and row["best_document"] == documents[ranking[0]]
    assert table[12]["status"] == "failed" and "not a JSON array" in table[12]["error"]
    # The job page heads its table by the task type, and the upload form asks for the plugin's columns.
    session = rerank_stack.browser_login()
    page = session.get(f"{rerank_stack.url}/jobs/{job_id}/", timeout=30).text
    assert "<th>Query</th>" in page and "<th>Best document (its index)</th>" in page and ">Relevance</th>" in page
    upload = session.get(f"{rerank_stack.url}/jobs/", timeout=30).text
    assert 'name="query_column"' in upload and 'name="documents_column"' in upload


def test_a_versions_options_are_checked_and_frozen_like_the_entrys():
    entry = {"task": "rerank:RerankTask", "path": "x", "options": {"max_documents": 4}}
    versions = registry_of({"r": {**entry, "versions": {"2": {"options": {"max_documents": 6}}}}}).versions_of("r")
    assert versions["1"].option("max_documents") == 4 and versions["2"].option("max_documents") == 6
    hash(versions["2"])
    with pytest.raises(RegistryError, match="options.max_documents must be"):
        registry_of({"r": {**entry, "versions": {"2": {"options": {"max_documents": -1}}}}})
    with pytest.raises(RegistryError, match="a router needs a `routes:` file"):
        registry_of({"m": {"task": "router", "path": "x", "routes": "r.yaml", "versions": {"2": {"routes": ""}}}})
