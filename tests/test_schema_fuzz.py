"""A bounded property-based run of the API against its own OpenAPI schema, on the live stack.

Schemathesis generates requests from /api/schema/ (valid and invalid ones), sends them with the
test user's token and checks each answer: never a 5xx, a status code the schema documents, and a
body that matches the documented shape. Bounded so it takes about a minute on 2 cores: a few
examples per operation, a fixed seed (derandomize) so a failure comes back the same way, and no
shrinking. A failure prints the request as a curl command.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = 10
# Operations that would end the session's own credential: every later test uses that token.
# tests/platform/test_credentials.py covers them.
DESTRUCTIVE = {"/api/v1/token/rotate"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_api_answers_generated_requests_as_documented(stack):
    """Every operation, valid and invalid inputs: no 5xx, only documented status codes and shapes.

    Operations are walked here rather than through schemathesis' pytest plugin, whose lazy
    (fixture-based) loader does not run on pytest 9; all failures are collected into one report.
    """
    # One job of the caller's, so generated ids (small integers) also reach the detail, results,
    # cancel and retry of a job that exists.
    upload = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.csv", b"key,text\nk1,where is my parcel\nk2,refund please\n", "text/csv")},
        data={"text_column": "text", "id_column": "key", "model": "router"},
        headers=stack.headers(),
        timeout=30,
    )
    assert upload.status_code in (201, 202), upload.text
    document = requests.get(f"{stack.url}/api/schema/?format=json", timeout=30)
    assert document.status_code == 200, document.text
    api = schemathesis.openapi.from_dict(document.json())
    failures: list[str] = []
    operations = 0
    statuses: dict[int, int] = {}
    for result in api.get_all_operations():
        operation = result.ok()
        operations += 1
        if operation.path in DESTRUCTIVE:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                derandomize=True,  # a fixed seed: the same requests every run
                deadline=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: it could take minutes
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def run(case) -> None:
                response = case.call_and_validate(
                    base_url=stack.url, headers=stack.headers(), timeout=30, checks=CHECKS
                )
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

            try:
                run()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE, f"no valid request for {operation.path} could be made"
                # Nothing in this operation can be invalid (no parameters, or free-form strings only).
            except (
                Exception,
                BaseExceptionGroup,
            ) as error:  # each operation's failures are reported, not the first only
                failures.append(f"{operation.method.upper()} {operation.path} ({mode}):\n{error}")
    print(f"{operations} operations, answers by status: {dict(sorted(statuses.items()))}")
    assert operations >= 10, "the schema lost operations"
    assert sum(n for status, n in statuses.items() if status < 300) >= operations, "few requests got through"
    assert not failures, "\n\n".join(failures)
