"""The OpenAI-compatible embeddings API (inference/web/api/openai_compat.py), through the official `openai`
client against the live stack: the same vectors as predict, OpenAI's shapes and errors, the same
admission. The plain functions that shape requests, answers and errors are tested directly too.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest
import requests
from openai import OpenAI
from tokenizers import Tokenizer

from benchmarks.tiny_bert import MINILM
from inference.core.keys import backlog_key
from inference.core.registry import resolve_path
from inference.web.api.openai_compat import OpenAIError, embeddings_body, openai_error
from platform_.errors import ApiError
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

TEXTS = ["how do I reset my password", "my parcel never arrived", "I was charged twice for my subscription"]
DIM = 384
SEQ_LENGTH = 128  # the test models file's max_seq_length


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key=stack.token, max_retries=0)


def predicted_vectors(stack, texts: list[str]) -> list[list[float]]:
    response = stack.predict("embedding", texts)
    assert response.status_code == 200, response.text
    return [output["embedding"] for output in response.json()["outputs"]]


def tokenizer_counts(texts: list[str]) -> list[int]:
    """What MiniLM's own tokenizer makes of each text (special tokens included, truncated as served)."""
    tokenizer = Tokenizer.from_file(str(resolve_path(MINILM) / "tokenizer.json"))
    tokenizer.enable_truncation(SEQ_LENGTH)
    tokenizer.no_padding()  # the file pads to a fixed length; the model runs only the real tokens
    return [len(tokenizer.encode(text).ids) for text in texts]


def assert_close(got: list[list[float]], expected: list[list[float]]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert len(a) == len(b) == DIM
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


# --- the official client, round trips -------------------------------------------------------------


def test_float_vectors_equal_predicts_with_openais_shape_and_usage(stack, client):
    result = client.embeddings.create(model="embedding", input=TEXTS, encoding_format="float")
    assert result.object == "list" and result.model == "embedding"
    assert [item.index for item in result.data] == [0, 1, 2]
    assert all(item.object == "embedding" for item in result.data)
    assert_close([item.embedding for item in result.data], predicted_vectors(stack, TEXTS))
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(tokenizer_counts(TEXTS))


def test_the_clients_default_is_base64_and_it_decodes_to_the_same_vectors(stack, client):
    raw = client.embeddings.with_raw_response.create(model="embedding", input=TEXTS)
    assert json.loads(raw.http_request.content)["encoding_format"] == "base64"
    # On the wire: little-endian float32 bytes, base64 encoded.
    wire = json.loads(raw.http_response.content)["data"][0]["embedding"]
    assert isinstance(wire, str)
    decoded = list(struct.unpack(f"<{DIM}f", base64.b64decode(wire)))
    result = raw.parse()
    expected = predicted_vectors(stack, TEXTS)
    assert_close([decoded], expected[:1])
    assert_close([list(item.embedding) for item in result.data], expected)


def test_a_single_string_is_one_embedding(stack, client):
    result = client.embeddings.create(model="embedding", input="where is my order", dimensions=DIM)
    assert len(result.data) == 1 and result.data[0].index == 0
    assert_close([result.data[0].embedding], predicted_vectors(stack, ["where is my order"]))
    assert result.usage.prompt_tokens == tokenizer_counts(["where is my order"])[0]
    assert math.isclose(sum(v * v for v in result.data[0].embedding), 1.0, abs_tol=1e-4)


def test_a_long_text_is_counted_as_the_model_sees_it_truncated(client):
    text = "refund " * 400
    result = client.embeddings.create(model="embedding", input=[text], encoding_format="float")
    assert result.usage.prompt_tokens == tokenizer_counts([text])[0] == SEQ_LENGTH


def test_models_list_and_retrieve_show_the_embedding_models(client):
    assert [m.id for m in client.models.list()] == ["embedding"]
    model = client.models.retrieve("embedding")
    assert model.object == "model" and model.owned_by and model.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("router")


def test_headers_are_predicts_request_id_server_timing_and_deadline(stack):
    response = requests.post(
        f"{stack.url}/v1/embeddings",
        json={"model": "embedding", "input": ["hello"]},
        headers={"Authorization": f"Bearer {stack.token}", "X-Request-ID": "oai-123", "X-Deadline-Ms": "5000"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.headers["X-Request-ID"] == "oai-123"
    assert {part.split(";")[0] for part in response.headers["Server-Timing"].split(", ")} >= {
        "admission",
        "inference",
        "total",
    }
    bad = requests.post(
        f"{stack.url}/v1/embeddings",
        json={"model": "embedding", "input": ["hello"]},
        headers={"Authorization": f"Bearer {stack.token}", "X-Deadline-Ms": "soon"},
        timeout=30,
    )
    assert bad.status_code == 400 and "X-Deadline-Ms" in bad.json()["error"]["message"]
    assert bad.headers["X-Request-ID"]


def test_predict_takes_a_bearer_token_too(stack):
    response = requests.post(
        f"{stack.url}/api/v1/models/embedding/predict",
        json={"inputs": ["hello"]},
        headers={"Authorization": f"Bearer {stack.token}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text


# --- errors through the client --------------------------------------------------------------------


def test_a_bad_key_is_an_authentication_error(stack):
    bad = OpenAI(base_url=stack.url + "/v1", api_key="not-a-real-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.embeddings.create(model="embedding", input=["x"])
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_an_unknown_model_is_not_found_and_the_message_names_the_embedding_models(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="text-embedding-3-small", input=["x"])
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    assert "embedding models served here: embedding" in caught.value.body["message"]


def test_a_model_of_another_task_is_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="router", input=["x"])
    assert caught.value.body["param"] == "model"
    assert "not an embedding model" in caught.value.body["message"]


def test_token_ids_are_refused_by_name(client):
    for token_ids in ([101, 7592, 102], [[101, 7592, 102]]):
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model="embedding", input=token_ids)
        assert caught.value.body["param"] == "input"
        assert "token-id arrays are not supported" in caught.value.body["message"]


def test_an_unsupported_parameter_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="embedding", input=["x"], extra_body={"truncate": "END"})
    assert caught.value.body["param"] == "truncate" and caught.value.body["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="embedding", input=["x"], dimensions=256)
    assert caught.value.body["param"] == "dimensions" and "384" in caught.value.body["message"]


def test_predicts_input_limits_hold(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="embedding", input=[f"text {i}" for i in range(65)])
    assert caught.value.body["param"] == "input"
    assert caught.value.body["message"] == "`input` has 65 texts; the limit is 64 per request"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="embedding", input=["fine", "  "])
    assert caught.value.body["message"] == "input[1] is empty"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="embedding", input=["x" * 10_001])
    assert "10001 characters; the limit is 10000" in caught.value.body["message"]


def test_bad_bodies_get_openais_error_shape(stack):
    def post(body: bytes, content_type: str = "application/json") -> requests.Response:
        return requests.post(
            f"{stack.url}/v1/embeddings",
            data=body,
            headers={"Authorization": f"Bearer {stack.token}", "Content-Type": content_type},
            timeout=30,
        )

    for body, content_type, status in [
        (b'{"model": "embedding", "input": ', "application/json", 400),
        (b"[" * 40 + b"]" * 40, "application/json", 400),
        (b"input=x", "application/x-www-form-urlencoded", 415),
        (b'{"model": "embedding"}', "application/json", 400),
    ]:
        response = post(body, content_type)
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    other = requests.post(f"{stack.url}/v1/chat/completions", json={}, timeout=10)
    assert other.status_code == 404 and "POST /v1/embeddings" in other.json()["error"]["message"]
    assert requests.get(f"{stack.url}/v1/embeddings", headers=stack.headers(), timeout=10).status_code == 405


def test_a_huge_body_is_refused_before_it_is_read(stack):
    """413 from the declared Content-Length alone: no byte of the body is sent."""
    address = urlsplit(stack.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    try:
        connection.putrequest("POST", "/v1/embeddings")
        connection.putheader("Authorization", f"Bearer {stack.token}")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(10**9))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413
    finally:
        connection.close()


def test_a_chunked_body_is_refused_once_it_passes_the_limit(stack):
    """No Content-Length to refuse it by: counted as it arrives (platform_/bodies.py), 413 past 4 MiB."""
    piece = b" " * 65536

    def body():
        yield b'{"model": "embedding", "input": ["'
        for _ in range(200):  # 13 MB, never sent whole
            yield piece

    try:
        response = requests.post(
            f"{stack.url}/v1/embeddings",
            data=body(),
            headers={"Authorization": f"Bearer {stack.token}", "Content-Type": "application/json"},
            timeout=30,
        )
    except requests.ConnectionError:
        return  # the server closed the connection after its 413, while the client was still sending
    assert response.status_code == 413


# --- the same admission as predict ----------------------------------------------------------------


def test_a_flood_through_v1_leaves_another_client_served(stack):
    """One user floods the model through /v1/embeddings and predict at once (one client for admission:
    its excess gets 429 on either path); another user's calls, through both paths, are all answered."""
    long_text = " ".join(["my parcel never arrived and the tracking page shows nothing"] * 8)
    assert stack.predict("embedding", ["give admission a drain rate"]).status_code == 200
    heavy_client = OpenAI(base_url=stack.url + "/v1", api_key=stack.token, max_retries=0)
    light_client = OpenAI(base_url=stack.url + "/v1", api_key=stack.other_token, max_retries=0)
    heavy: list[int] = []
    refusals: list[openai.APIStatusError] = []
    light: list[int] = []
    stop = threading.Event()

    def flood_v1() -> None:
        while not stop.is_set():
            try:
                heavy_client.embeddings.create(model="embedding", input=[long_text] * 16)
                heavy.append(200)
            except openai.APIStatusError as error:
                heavy.append(error.status_code)
                refusals.append(error)

    def flood_predict() -> None:
        while not stop.is_set():
            heavy.append(stack.predict("embedding", [long_text] * 16).status_code)

    def light_calls() -> None:
        while not stop.is_set():
            try:
                result = light_client.embeddings.create(model="embedding", input=["I was charged twice"])
                light.append(200 if len(result.data) == 1 else 0)
            except openai.APIStatusError as error:  # recorded, so the assertion shows it
                light.append(error.status_code)
            light.append(stack.predict("embedding", ["I was charged twice"], token=stack.other_token).status_code)

    threads = [threading.Thread(target=flood_v1) for _ in range(3)]
    threads += [threading.Thread(target=flood_predict), threading.Thread(target=light_calls)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(light) >= 10 and len(heavy) >= 8, 90, "both clients to be answered a few times")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert set(light) == {200}, "the light client's calls are all answered, through /v1 and predict"
    assert set(heavy) <= {200, 429, 503} and 200 in heavy
    for refused in refusals:
        assert refused.body["code"] in ("client_backlog_full", "backlog_full", "deadline")
        assert int(refused.response.headers["Retry-After"]) >= 1
        if refused.status_code == 429:
            assert isinstance(refused, openai.RateLimitError) and refused.body["type"] == "rate_limit_error"


def test_an_admission_refusal_is_a_503_with_retry_after(stack, client):
    """A request whose deadline the embedding model's backlog cannot meet: refused at once, as
    predict's are (test_online_api.py), answered in OpenAI's shape with Retry-After kept."""
    for _ in range(3):  # give admission a measured drain rate
        assert stack.predict("embedding", ["warm the rate estimate"]).status_code == 200
    skipped_before = stack.stats("embedding").get("expired_skipped", 0)
    admitted_in_a_hurry: list[int] = []
    stack.pause_worker()
    try:
        with ThreadPoolExecutor(8) as pool:
            waiting = [pool.submit(stack.predict, "embedding", [f"queued {i}"]) for i in range(8)]
            wait_until(lambda: stack.redis.zcard(backlog_key("embedding")) >= 8, 10, "8 requests in the backlog")

            def refused_in_a_hurry() -> openai.APIStatusError | None:
                try:
                    client.embeddings.create(
                        model="embedding", input=["in a hurry"], extra_headers={"X-Deadline-Ms": "20"}
                    )
                except openai.APIStatusError as error:
                    if error.status_code == 503:
                        return error
                    admitted_in_a_hurry.append(error.status_code)
                return None

            # The web process caches the drain rate for 0.5 s: a hurried request may be admitted (and
            # time out, 504) until the figures it decides on include this backlog.
            refused = wait_until(refused_in_a_hurry, 10, "a refusal on this backlog's figures")
            stack.resume_worker()
            accepted = [f.result() for f in waiting]
        wait_until(
            lambda: stack.stats("embedding").get("expired_skipped", 0) - skipped_before >= len(admitted_in_a_hurry),
            30,
            "the worker to skip the hurried requests it was given",
        )
    finally:
        stack.resume_worker()
    assert isinstance(refused, openai.InternalServerError)
    assert refused.body["type"] == "server_error" and refused.body["code"] == "deadline"
    assert "cannot meet this request's deadline" in refused.body["message"]
    assert int(refused.response.headers["Retry-After"]) >= 1
    assert refused.response.headers["X-Request-ID"]
    assert all(status == 504 for status in admitted_in_a_hurry)
    assert all(r.status_code == 200 for r in accepted)


@pytest.mark.parametrize(
    ("error", "status", "type_", "code", "retry_after"),
    [
        (
            ApiError(503, "backlog_full", "full", headers={"Retry-After": "2"}, limit=4),
            503,
            "server_error",
            "backlog_full",
            "2",
        ),
        (
            ApiError(429, "client_backlog_full", "share", headers={"Retry-After": "1"}),
            429,
            "rate_limit_error",
            "client_backlog_full",
            "1",
        ),
        (ApiError(413, "request_too_large", "too big"), 413, "invalid_request_error", "request_too_large", None),
        (ApiError(504, "deadline_exceeded", "late"), 504, "server_error", "deadline_exceeded", None),
        (ApiError(401, "not_authenticated", "invalid token"), 401, "invalid_request_error", "invalid_api_key", None),
    ],
)
def test_refusals_map_to_openais_shape_with_the_same_status_and_headers(error, status, type_, code, retry_after):
    response = openai_error(error).response()
    assert response.status_code == status
    assert json.loads(response.content) == {
        "error": {"message": error.detail, "type": type_, "param": None, "code": code}
    }
    assert response.get("Retry-After") == retry_after


def test_input_errors_name_the_openai_field():
    error = openai_error(
        ApiError(400, "invalid_input", "inputs[2] cannot be tokenized by model 'embedding'"), param="input"
    )
    assert isinstance(error, OpenAIError)
    assert (
        json.loads(error.response().content)["error"]["message"] == "input[2] cannot be tokenized by model 'embedding'"
    )


def test_base64_is_little_endian_float32():
    body = embeddings_body("embedding", [{"embedding": [1.0, -0.5]}], [3, 4], "base64")
    assert base64.b64decode(body["data"][0]["embedding"]) == struct.pack("<2f", 1.0, -0.5)
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_embeddings_take_predicts_lean_path_not_the_middleware_stack(stack):
    """Served by platform_/asgi.py's LeanView, as predict is (Django's handler and middleware cost a web
    process about a third of its CPU under overload): no header of the middleware stack, but the ones
    the view sets itself."""
    headers = {"Authorization": f"Bearer {stack.token}", "X-Request-ID": "lean-1"}
    lean = requests.post(
        f"{stack.url}/v1/embeddings", json={"model": "embedding", "input": "hi"}, headers=headers, timeout=10
    )
    assert lean.status_code == 200, lean.text
    assert "X-Frame-Options" not in lean.headers  # XFrameOptionsMiddleware did not run
    assert lean.headers["X-Content-Type-Options"] == "nosniff" and lean.headers["X-Request-ID"] == "lean-1"
    assert "total;dur=" in lean.headers["Server-Timing"]
    full = requests.get(f"{stack.url}/v1/models", headers=headers, timeout=10)
    assert full.status_code == 200 and full.headers["X-Frame-Options"] == "DENY"  # the full stack, for contrast
