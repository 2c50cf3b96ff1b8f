"""The online path end to end: HTTP -> uvicorn -> admission (Redis) -> Celery worker -> reply.

Every test here talks to the live stack the session starts: a real web process and a real prefork
Celery worker serving the online queue with MiniLM and a tiny random BERT.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from inference.core.keys import backlog_key
from tests.conftest import TIGHT_BACKLOG, wait_until

pytestmark = pytest.mark.integration

STAGES = ["admission", "queue_wait", "batch_wait", "pass_wait", "inference", "postprocess", "total"]


def post(stack, model, body, content_type="application/json", **headers):
    return requests.post(
        f"{stack.url}/api/v1/models/{model}/predict",
        data=body,
        headers={**stack.headers(**headers), "Content-Type": content_type},
        timeout=30,
    )


# --- round trips, one per task handler --------------------------------------------------------


def test_router_routes_a_billing_question_and_reports_its_timing(stack):
    response = stack.predict(
        "router", ["My invoice shows a double charge, please refund me"], **{"X-Request-ID": "abc-123"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "router"
    (output,) = body["outputs"]
    assert output["label"] == "billing"
    assert set(output["scores"]) == {"billing", "technical", "account", "sales", "shipping"}
    assert response.headers["X-Request-ID"] == "abc-123"
    server_timing = response.headers["Server-Timing"]
    for stage in STAGES:
        assert f"{stage};dur=" in server_timing
        assert body["timing"][f"{stage}_ms"] >= 0
    assert body["timing"]["batch_size"] >= 1
    assert body["timing"]["total_ms"] >= body["timing"]["inference_ms"]


def test_router_keeps_input_order(stack):
    texts = ["The app crashes when I open settings", "What does the enterprise plan cost?", "I forgot my password"]
    response = stack.predict("router", texts)
    assert [o["label"] for o in response.json()["outputs"]] == ["technical", "sales", "account"]


def test_embedding_vectors_are_unit_length_and_meaningful(stack):
    texts = ["How do I reset my password?", "I can't remember my login password", "The weather is sunny today"]
    response = stack.predict("embedding", texts)
    assert response.status_code == 200, response.text
    vectors = [o["embedding"] for o in response.json()["outputs"]]
    assert all(len(v) == 384 for v in vectors)
    assert all(math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, abs_tol=1e-3) for v in vectors)

    def cosine(a, b):
        return sum(x * y for x, y in zip(a, b, strict=False))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2


def test_classification_labels_come_from_id2label_with_softmax_scores(stack):
    response = stack.predict("sentiment", ["great product", "terrible support, never again"])
    assert response.status_code == 200, response.text
    for output in response.json()["outputs"]:
        assert set(output["scores"]) == {"negative", "neutral", "positive"}
        assert math.isclose(sum(output["scores"].values()), 1.0, abs_tol=1e-4)
        assert output["label"] == max(output["scores"], key=output["scores"].get)


def test_a_request_id_is_made_when_the_client_sends_none(stack):
    response = stack.predict("router", ["hello"])
    assert len(response.headers["X-Request-ID"]) >= 16


# --- batching ---------------------------------------------------------------------------------


def test_sixteen_concurrent_requests_share_batches(stack):
    texts = [f"My order number {i} has not arrived yet" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda t: stack.predict("router", [t]), texts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    sizes = [r.json()["timing"]["batch_size"] for r in responses]
    assert max(sizes) > 1, sizes
    assert all(r.json()["outputs"][0]["label"] == "shipping" for r in responses)


# --- admission, deadlines ---------------------------------------------------------------------


def test_backlog_full_answers_503_with_retry_after_and_the_limit(stack):
    # Two clients fill it (one client alone may hold half of it: its own excess would be a 429).
    tokens = [stack.token, stack.other_token] * (TIGHT_BACKLOG // 2)
    stack.pause_worker()
    try:
        with ThreadPoolExecutor(TIGHT_BACKLOG) as pool:
            waiting = [pool.submit(stack.predict, "router-tight", [f"text {i}"], token=t) for i, t in enumerate(tokens)]
            wait_until(lambda: stack.redis.zcard(backlog_key("router-tight")) == TIGHT_BACKLOG, 10, "a full backlog")
            refused = stack.predict("router-tight", ["one too many"], token=stack.third_token)
            stack.resume_worker()
            accepted = [f.result() for f in waiting]
    finally:
        stack.resume_worker()
    assert refused.status_code == 503
    body = refused.json()
    assert body["code"] == "backlog_full"
    assert f"its limit is {TIGHT_BACKLOG}" in body["detail"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert all(r.status_code == 200 for r in accepted), "requests admitted before the refusal are not lost"


def test_deadline_that_cannot_be_met_answers_503_before_queueing(stack):
    for _ in range(3):  # give admission a measured drain rate
        assert stack.predict("router", ["warm the rate estimate"]).status_code == 200
    skipped_before = stack.stats("router").get("expired_skipped", 0)
    admitted_in_a_hurry: list[int] = []
    stack.pause_worker()
    try:
        with ThreadPoolExecutor(8) as pool:
            waiting = [pool.submit(stack.predict, "router", [f"queued {i}"]) for i in range(8)]
            wait_until(lambda: stack.redis.zcard(backlog_key("router")) >= 8, 10, "8 requests in the backlog")

            def refused_in_a_hurry() -> tuple[requests.Response, int] | None:
                queued_before = stack.redis.llen("online.router")
                response = stack.predict("router", ["in a hurry"], **{"X-Deadline-Ms": "20"})
                queued = stack.redis.llen("online.router") - queued_before
                if response.status_code == 503:
                    return response, queued
                admitted_in_a_hurry.append(response.status_code)
                return None

            # The web process caches the children and drain rate for 0.5 s: a hurried request may be admitted
            # (and time out) until the figures it decides on include this backlog; then it is refused.
            refused, queued_by_refusal = wait_until(refused_in_a_hurry, 10, "a refusal on this backlog's figures")
            stack.resume_worker()
            accepted = [f.result() for f in waiting]
        # Hurried requests admitted before the refusal are skipped by the worker, now: not in a later test.
        wait_until(
            lambda: stack.stats("router").get("expired_skipped", 0) - skipped_before >= len(admitted_in_a_hurry),
            30,
            "the worker to skip the hurried requests it was given",
        )
    finally:
        stack.resume_worker()
    assert refused.status_code == 503, refused.text
    assert refused.json()["code"] == "deadline"
    assert "cannot meet this request's deadline" in refused.json()["detail"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert queued_by_refusal == 0, "the refused request was not queued"
    assert all(r.status_code == 200 for r in accepted)


def test_deadline_passes_gives_504_and_the_worker_skips_the_request(stack):
    before = stack.stats("router")
    stack.pause_worker()
    try:
        started = time.monotonic()
        response = stack.predict("router", ["nobody will wait for this"], **{"X-Deadline-Ms": "400"})
        elapsed = time.monotonic() - started
    finally:
        stack.resume_worker()
    assert response.status_code == 504
    assert response.json()["code"] == "deadline_exceeded"
    assert "400 ms" in response.json()["detail"]
    assert elapsed < 3
    after = wait_until(
        lambda: (s := stack.stats("router")).get("expired_skipped", 0) > before.get("expired_skipped", 0) and s,
        15,
        "the worker to skip the expired request",
    )
    assert after["expired_skipped"] - before.get("expired_skipped", 0) == 1
    assert after.get("texts_done", 0) == before.get("texts_done", 0), "the expired request was never computed"


def test_sixty_four_slow_requests_wait_in_parallel_not_in_turn(stack):
    """With the worker paused, 64 requests with a 3 s deadline must all time out together in about 3 s.

    Through the identity model, whose drain rate this test measures itself: admission, which refuses
    when the requests ahead cannot drain in time, then admits all 64 whatever the machine's load and
    whatever ran before (with the router, a rate measured on a loaded machine refused some with 503)."""
    for _ in range(3):
        assert stack.predict("identity", ["measure the drain rate"]).status_code == 200
    before = stack.stats("identity").get("expired_skipped", 0)
    stack.pause_worker()
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            responses = list(
                pool.map(lambda i: stack.predict("identity", [f"slow {i}"], **{"X-Deadline-Ms": "3000"}), range(64))
            )
        elapsed = time.monotonic() - started
    finally:
        stack.resume_worker()
    assert [r.status_code for r in responses] == [504] * 64, [r.text for r in responses if r.status_code != 504][:3]
    assert elapsed < 10, f"64 waits of 3 s took {elapsed:.1f} s: they were serialized"
    wait_until(lambda: stack.stats("identity").get("expired_skipped", 0) - before >= 64, 30, "64 skipped requests")


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "status", "message"),
    [
        ('{"inputs": [', "application/json", 400, "invalid JSON"),
        ('{"inputs": ["x"]}', "text/plain", 415, "Content-Type must be application/json"),
        ("{}", "application/json", 400, "`inputs` is required"),
        ('{"inputs": []}', "application/json", 400, "`inputs` is empty"),
        ('{"inputs": ["ok", 42]}', "application/json", 400, "inputs[1] is a number"),
        ('{"inputs": "just a string"}', "application/json", 400, "must be a list of strings"),
        ('{"inputs": [' + ",".join(['"t"'] * 65) + "]}", "application/json", 400, "has 65 texts; the limit is 64"),
        ('{"inputs": ["ok", "' + "x" * 10_001 + '"]}', "application/json", 400, "inputs[1] is 10001 characters"),
    ],
)
def test_bad_input_is_a_clear_4xx(stack, body, content_type, status, message):
    response = post(stack, "router", body, content_type)
    assert response.status_code == status
    assert message in response.json()["detail"]
    assert response.headers["X-Request-ID"]


def test_bad_deadline_header_is_400(stack):
    response = stack.predict("router", ["x"], **{"X-Deadline-Ms": "soon"})
    assert response.status_code == 400 and "X-Deadline-Ms" in response.json()["detail"]


def test_unknown_model_is_404_and_lists_the_served_ones(stack):
    response = stack.predict("gpt-17", ["x"])
    assert response.status_code == 404
    assert "unknown model 'gpt-17'" in response.json()["detail"] and "router" in response.json()["detail"]


def test_wrong_method_is_405(stack):
    response = requests.get(f"{stack.url}/api/v1/models/router/predict", headers=stack.headers(), timeout=10)
    assert response.status_code == 405


# --- authentication ---------------------------------------------------------------------------


def test_anonymous_calls_get_401(stack):
    predict = requests.post(f"{stack.url}/api/v1/models/router/predict", json={"inputs": ["x"]}, timeout=10)
    assert predict.status_code == 401
    assert predict.headers["WWW-Authenticate"] == "Token"
    assert requests.get(f"{stack.url}/api/v1/models", timeout=10).status_code == 401


def test_a_wrong_token_gets_401(stack):
    response = requests.post(
        f"{stack.url}/api/v1/models/router/predict",
        json={"inputs": ["x"]},
        headers={"Authorization": "Token not-a-real-token"},
        timeout=10,
    )
    assert response.status_code == 401 and response.json()["detail"] == "invalid token"


# --- discovery and probes ---------------------------------------------------------------------


def test_models_lists_what_a_worker_serves(stack):
    response = requests.get(f"{stack.url}/api/v1/models", headers=stack.headers(), timeout=10)
    models = {m["name"]: m for m in response.json()["models"]}
    assert response.json()["default"] == "router"
    assert models["router"]["served"] and models["router"]["task"] == "router"
    assert models["sentiment"]["task"] == "text-classification"
    assert models["router-tight"]["max_backlog"] == TIGHT_BACKLOG


def test_health_and_ready(stack):
    assert requests.get(f"{stack.url}/api/v1/health", timeout=10).json() == {"status": "ok"}
    ready = requests.get(f"{stack.url}/api/v1/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["checks"]["online_workers"] >= 1


def test_schema_documents_predict_and_docs_need_no_cdn(stack):
    schema = requests.get(f"{stack.url}/api/schema/?format=json", timeout=10).json()
    assert "/api/v1/models/{name}/predict" in schema["paths"]
    docs = requests.get(f"{stack.url}/api/docs/", timeout=10)
    assert docs.status_code == 200
    assert "cdn" not in docs.text.lower() and "/static/drf_spectacular_sidecar/" in docs.text
    asset = docs.text.split("/static/drf_spectacular_sidecar/")[1].split('"')[0]
    assert requests.get(f"{stack.url}/static/drf_spectacular_sidecar/{asset}", timeout=10).status_code == 200


def test_a_caller_that_hangs_up_stays_counted_until_its_deadline(stack):
    """Its request is still queued and will take the model's time, so admission keeps counting it
    (a send-and-hang-up loop must not bypass admission), but only until its deadline."""
    live = lambda: stack.redis.zcount(backlog_key("router"), time.time(), "+inf")  # noqa: E731
    stack.pause_worker()
    try:
        stack.hang_up("router", "nobody will wait for this", deadline_ms=2500, after_s=1.0)
        assert live() == 1, "hung up, but its work is still queued: still counted"
        wait_until(lambda: live() == 0, 5, "its deadline to pass")
    finally:
        stack.resume_worker()
