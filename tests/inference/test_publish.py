"""The online request message built by hand (inference/web/publish.py) is the one Celery would build."""

from __future__ import annotations

import base64
import json

from inference.web.publish import task_message


def test_the_message_matches_celerys_own_for_the_same_call():
    from platform_.celery import app

    kwargs = {"model": "router", "inputs": ["hi", "there"], "tokens": [3, 3], "client": "7", "deadline": 1.0}
    ours = json.loads(task_message("abc", "online", kwargs))
    theirs = app.amqp.as_task_v2("abc", "inference.predict_online", args=(), kwargs=kwargs, ignore_result=True)
    headers = {k: v for k, v in theirs.headers.items() if k not in ("kwargsrepr", "origin")}
    assert {k: ours["headers"][k] for k in headers} == headers
    args, body_kwargs, embed = json.loads(base64.b64decode(ours["body"]))
    assert (tuple(args), body_kwargs, embed) == theirs.body
    assert ours["properties"]["delivery_info"] == {"exchange": "", "routing_key": "online"}
    assert ours["properties"]["body_encoding"] == "base64" and ours["content-type"] == "application/json"


def test_the_message_does_not_repeat_the_clients_texts_in_its_headers():
    message = task_message("abc", "online", {"model": "router", "inputs": ["a secret text"]})
    headers = json.loads(message)["headers"]
    assert "secret" not in json.dumps(headers) and headers["kwargsrepr"] == "{'model': 'router', 'texts': 1}"
