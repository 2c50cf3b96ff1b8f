"""Many clients, one platform: does a heavy or misbehaving client fail, starve or jam the others?

    python -m benchmarks.fairness [--url http://127.0.0.1:8000] [--seconds 15] [--steps 1,8,32]

Needs a running stack (`make run`) and its database (for two extra API users: `bench-heavy` and
`bench-light`, created here). In one run, on the same machine:
1. steps: closed-loop clients (well behaved: they honour Retry-After) at each of --steps; the best
   answered req/s is the peak the other scenarios are compared with.
2. heavy flood beside a light client: 4 concurrent requests of 64 texts x ~2,000 characters from one
   token, back to back, while another token sends one short text every 100 ms. Twice: at the default
   deadline (the heavy requests cannot fit it and must be told 413 at once) and with
   `X-Deadline-Ms: 10000` (they fit and compete for the children).
3. recovery: right after the flood, a steady 8-client load; refusals per 5 s window.
4. retry storm: 150 closed-loop clients that resend at once on 503/429 (ignoring Retry-After).
Prints a markdown report (and writes benchmarks/out/fairness.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

from benchmarks.loadgen import CORPUS, HERE, Result, Run, _Http, _measured, closed_loop

OUT = HERE / "out"
LONG_TEXT = " ".join(CORPUS)[:2000]


def bench_tokens() -> tuple[str, str]:
    """API tokens of two bench users, created in the stack's database if missing."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    keys = []
    for name in ("bench-heavy", "bench-light"):
        user, _ = get_user_model().objects.get_or_create(username=name)
        keys.append(Token.objects.get_or_create(user=user)[0].key)
    return keys[0], keys[1]


def pct_ms(latencies: list[float], pct: float) -> float | None:
    ok = sorted(latencies)
    return ok[min(len(ok) - 1, int(round(pct / 100 * (len(ok) - 1))))] * 1000 if ok else None


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def flood(url: str, heavy: str, light: str, seconds: float, heavy_deadline_ms: int | None) -> tuple[Run, Run]:
    """4 heavy requests in flight from one token; one light request every 100 ms from another."""
    heavy_run, light_run = Run(), Run()

    async def body(_: Run) -> None:
        heavy_http = _Http(url, {"Authorization": f"Token {heavy}"})
        light_http = _Http(url, {"Authorization": f"Token {light}"})
        extra = f"X-Deadline-Ms: {heavy_deadline_ms}\r\n" if heavy_deadline_ms else ""
        stop_at = time.monotonic() + seconds

        async def heavy_client() -> None:
            while time.monotonic() < stop_at:
                heavy_run.results.append(await heavy_http.post([LONG_TEXT] * 64, 30, extra))

        async def light_client() -> None:
            rng = random.Random(7)
            pending = set()
            while time.monotonic() < stop_at:
                task = asyncio.create_task(light_http.post(rng.choice(CORPUS), 30))
                task.add_done_callback(lambda t: light_run.results.append(t.result()))
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(0.1)
            await asyncio.gather(*pending)

        await asyncio.gather(*(heavy_client() for _ in range(4)), light_client())
        heavy_http.close()
        light_http.close()

    started = time.monotonic()
    _measured(body)
    heavy_run.wall_s = light_run.wall_s = time.monotonic() - started
    return heavy_run, light_run


def windows(results: list[Result], started: float, width_s: float = 5.0) -> list[tuple[int, int, int]]:
    """(window start s, answered, refused) per window of `width_s`."""
    counts: dict[int, Counter] = {}
    for r in results:
        window = int((r.done_at - started) // width_s)
        counts.setdefault(window, Counter())[r.status] += 1
    return [(int(w * width_s), c[200], c[503] + c[429]) for w, c in sorted(counts.items()) if w >= 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--steps", default="1,8,32")
    parser.add_argument("--storm-clients", type=int, default=150)
    parser.add_argument("--skip", default="", help="comma list of scenarios to skip: steps,flood,storm")
    parser.add_argument("--out", default=str(OUT / "fairness.md"))
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    url = f"{args.url}/api/v1/models/{args.model}/predict"
    heavy, light = bench_tokens()
    lines = [f"# Fairness and hostile load, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    peak = 0.0
    if "steps" not in skip:
        lines += [
            "## Closed loop, well-behaved clients",
            "",
            "| clients | answered req/s | P50 ms | P99 ms | 503 | 429 |",
        ]
        lines += ["|---|---|---|---|---|---|"]
        for clients in [int(c) for c in args.steps.split(",")]:
            run = closed_loop(url, {"Authorization": f"Token {light}"}, clients, args.seconds, seed=clients)
            peak = max(peak, run.qps())
            lines.append(
                f"| {clients} | {run.qps():.1f} | {fmt(run.percentile_ms(50))} | {fmt(run.percentile_ms(99))} "
                f"| {run.count(503)} | {run.count(429)} |"
            )
            print(lines[-1], flush=True)
        lines.append("")
    if "flood" not in skip:
        for deadline in (None, 10_000):
            heavy_run, light_run = flood(url, heavy, light, args.seconds, deadline)
            answered = light_run.count(200) / max(1, len(light_run.results))
            lines += [
                f"## Heavy flood beside a light client (heavy X-Deadline-Ms: {deadline or 'default'})",
                "",
                f"- light client: {len(light_run.results)} requests, {answered:.1%} answered 200, "
                f"P50 {fmt(pct_ms(light_run.ok(), 50))} ms, P99 {fmt(pct_ms(light_run.ok(), 99))} ms, "
                f"statuses {dict(Counter(r.status for r in light_run.results))}",
                f"- heavy client: {len(heavy_run.results)} requests, statuses "
                f"{dict(Counter(r.status for r in heavy_run.results))}, P50 of 200s {fmt(pct_ms(heavy_run.ok(), 50))} ms",
            ]
            print("\n".join(lines[-3:]), flush=True)
            started = time.monotonic()
            after = closed_loop(url, {"Authorization": f"Token {light}"}, 8, args.seconds, seed=99)
            lines.append(
                "- right after it, 8 well-behaved clients: answered/refused per 5 s window "
                + ", ".join(f"{w}s: {ok}/{refused}" for w, ok, refused in windows(after.results, started))
            )
            lines.append("")
            print(lines[-2], flush=True)
    if "storm" not in skip:
        started = time.monotonic()
        storm = closed_loop(
            url, {"Authorization": f"Token {light}"}, args.storm_clients, args.seconds * 2, honour_retry_after=False
        )
        refused = storm.count(503) + storm.count(429)
        ratio = storm.qps() / peak if peak else None
        lines += [
            f"## Retry storm: {args.storm_clients} clients resending at once on 503/429",
            "",
            f"- answered {storm.qps():.1f} req/s ({fmt(ratio, 2)} of the peak {peak:.1f} above), "
            f"refused {refused / storm.wall_s:.0f}/s, P99 of answered {fmt(storm.percentile_ms(99))} ms, "
            f"no answer {storm.count(0)}, generator CPU {storm.client_cpu_pct:.0f}%",
            "- per 5 s window (answered/refused): "
            + ", ".join(f"{w}s: {ok}/{r}" for w, ok, r in windows(storm.results, started)),
            "",
        ]
        print("\n".join(lines[-4:]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
