"""`manage.py worker_probe --live | --ready`: a worker container's health, read from its heartbeats in Redis.

Kubernetes runs it as the exec probe of every worker container (deploy/kubernetes/), docker compose as the
workers' healthcheck (docker-compose.yml). It judges this host only: a pod's hostname is its name, and
heartbeat fields are `<hostname>:<pid>` (inference/core/workers.py).

--live   this host's dispatcher (the worker's main process: it consumes the queue and hands batches to
         children) beat within 3 x DISPATCHER_HEARTBEAT_S. Its beat runs on the main process's own event
         loop, so a stopped or wedged main process stops beating while its children, which beat from
         threads of their own, would still look alive. Failing it restarts the container.
--ready  at least one child of this host beat within 3 x WORKER_HEARTBEAT_S with models loaded (a child
         beats only once its models are loaded, inference/child/worker_process.py). It gates rolling updates:
         an old worker is stopped only once a new one can serve.

Both flags at once (docker compose has one healthcheck) pass when both would. Exit status 0 or 1 with
one line saying why. When Redis does not answer, --live passes and says so:
restarting every worker cannot bring Redis back, only reload every model (Celery reconnects by itself),
while --ready fails. Redis gets 2 s to answer, so the probe ends well inside its timeout.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY
from platform_.redis import new_redis

REDIS_TIMEOUT_S = 2.0
MISSED_BEATS = 3  # as everywhere else: three missed beats and a process counts as gone (inference/core/workers.py)


def _of_host(raw: dict[str, str], hostname: str) -> dict[str, dict[str, Any]]:
    """Entries of `hostname` (field `<hostname>:<pid>`), parsed; an unreadable entry counts as absent."""
    entries: dict[str, dict[str, Any]] = {}
    for field, value in raw.items():
        if field.rpartition(":")[0] != hostname:
            continue
        try:
            entry = json.loads(value)
            float(entry["ts"])
        except (ValueError, TypeError, KeyError):
            continue
        entries[field] = entry
    return entries


def check_live(raw_dispatchers: dict[str, str], hostname: str, interval_s: float, now: float) -> tuple[bool, str]:
    """Live when a dispatcher of `hostname` beat within MISSED_BEATS intervals."""
    limit_s = MISSED_BEATS * interval_s
    mine = _of_host(raw_dispatchers, hostname)
    if not mine:
        return False, f"not live: no dispatcher of host {hostname} in {DISPATCHERS_KEY} (worker not started yet?)"
    field, entry = max(mine.items(), key=lambda item: float(item[1]["ts"]))
    age_s = now - float(entry["ts"])
    if age_s > limit_s:
        return False, f"not live: dispatcher {field} last beat {age_s:.1f} s ago (limit {limit_s:g} s)"
    return True, f"live: dispatcher {field} ({entry.get('queue', '?')}) beat {max(age_s, 0.0):.1f} s ago"


def check_ready(raw_children: dict[str, str], hostname: str, interval_s: float, now: float) -> tuple[bool, str]:
    """Ready when a child of `hostname` beat within MISSED_BEATS intervals with its models loaded."""
    limit_s = MISSED_BEATS * interval_s
    mine = _of_host(raw_children, hostname)
    if not mine:
        return False, f"not ready: no worker child of host {hostname} in {WORKERS_KEY} (models still loading?)"
    serving = [e for e in mine.values() if now - float(e["ts"]) <= limit_s and e.get("models")]
    if not serving:
        newest_s = now - max(float(e["ts"]) for e in mine.values())
        return False, (
            f"not ready: no child of {hostname} alive with models loaded "
            f"(newest beat {newest_s:.1f} s ago, limit {limit_s:g} s)"
        )
    models = sorted({m for e in serving for m in e["models"]})
    return True, f"ready: {len(serving)} child(ren) of {hostname} alive with models {', '.join(models)}"


class Command(BaseCommand):
    help = "Exit 0 when this worker host is live (--live) or ready (--ready), from its heartbeats in Redis; else 1."

    # A probe must not fail on a database or model-file check: it reads Redis only.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--live", action="store_true", help="this host's dispatcher beats")
        parser.add_argument("--ready", action="store_true", help="a child of this host serves its models")
        parser.add_argument(
            "--hostname", default=socket.gethostname(), help="the host to judge (default: this one, the pod name)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not (options["live"] or options["ready"]):
            raise CommandError("say --live, --ready or both")
        hostname: str = options["hostname"]
        client = new_redis(socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(DISPATCHERS_KEY)
            pipe.hgetall(WORKERS_KEY)
            dispatchers, children = pipe.execute()
        except redis.RedisError as exc:
            reason = f"Redis unreachable ({type(exc).__name__}: {exc})"
            if options["ready"]:
                self._finish(False, f"not ready: {reason}")
            self._finish(True, f"live (not judged): {reason}; a broker outage is not this worker's fault")
        finally:
            client.close()
        now = time.time()
        results = []
        if options["live"]:
            results.append(check_live(dispatchers, hostname, settings.DISPATCHER_HEARTBEAT_S, now))
        if options["ready"]:
            results.append(check_ready(children, hostname, settings.WORKER_HEARTBEAT_S, now))
        failed = [line for ok, line in results if not ok]
        self._finish(not failed, "; ".join(failed or [line for _, line in results]))

    def _finish(self, ok: bool, line: str) -> None:
        (self.stdout if ok else self.stderr).write(line)
        sys.exit(0 if ok else 1)
