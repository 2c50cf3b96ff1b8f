"""The article's naive design, kept as the baseline: one inference per request, a thread per request, no bound.

    python -m benchmarks.naive_server --port 8100 [--model router]

A plain threaded HTTP server (standard library): every request runs the model itself, in its own
thread, whatever else is running; torch uses its default thread count, as an unconfigured service
would. Same model and handler code as the platform, so the difference is the system around it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(port: int, model: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import django

    django.setup()
    from inference.child.handlers import build_handler
    from inference.core.registry import get_registry

    handler = build_handler(get_registry().get(model))
    handler.warm_up()

    class Predict(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle on, keep-alive clients wait ~40 ms for
        # a delayed ACK on every request. A fair baseline must not pay that.
        disable_nagle_algorithm = True

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            started = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            outputs = handler.predict(body["inputs"])
            payload = json.dumps(
                {"model": model, "outputs": outputs, "ms": (time.perf_counter() - started) * 1000}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:  # logging every request would be its own bottleneck
            pass

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", port), Predict).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="router")
    args = parser.parse_args()
    serve(args.port, args.model)


if __name__ == "__main__":
    main()
