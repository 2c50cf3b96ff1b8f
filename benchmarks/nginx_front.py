"""Debian's nginx in front of a local web server, with the shipped configuration (deploy/nginx/).

    python -m benchmarks.nginx_front --upstream 127.0.0.1:8000 --port 8080 [--set NGINX_REQUESTS_PER_S=200]

Renders deploy/nginx/nginx.conf and templates/platform.conf.template as the nginx image would (each
${NGINX_*} from the defaults below, the environment, then --set), into a folder of its own, and runs
/usr/sbin/nginx in the foreground until Ctrl-C. tests/proxy starts nginx through `start` too, so the
tests and the benchmarks run the configuration that ships, with only the paths and addresses of one host
changed (listed in `render`).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NGINX_DIR = ROOT / "deploy" / "nginx"
NGINX_BINARY = Path("/usr/sbin/nginx")
# The values docker-compose.yml gives the proxy when the environment sets none (keep the two the same:
# tests/deploy/test_proxy_config.py checks it).
DEFAULTS = {
    "NGINX_PORT": "8080",
    "NGINX_UPSTREAM": "web:8000",
    "NGINX_HEADER_TIMEOUT": "10s",
    "NGINX_BODY_TIMEOUT": "30s",
    "NGINX_SEND_TIMEOUT": "30s",
    "NGINX_KEEPALIVE_TIMEOUT": "15s",
    "NGINX_CONNECTIONS_PER_ADDRESS": "64",
    "NGINX_REQUESTS_PER_S": "50",
    "NGINX_REQUEST_BURST": "100",
    "NGINX_UPLOADS_PER_MIN": "30",
    "NGINX_UPLOAD_BURST": "10",
    "NGINX_MAX_BODY": "4m",
    "NGINX_PREDICT_MAX_BODY": "1m",
    "NGINX_UPLOAD_MAX_BODY": "257m",
}
_VARIABLE = re.compile(r"\$\{(NGINX_[A-Z_]+)\}")


def substitute(text: str, values: dict[str, str]) -> str:
    """envsubst as the nginx image runs it: ${NAME} of the given names only; nginx's $variables stay."""
    missing = sorted(set(_VARIABLE.findall(text)) - set(values))
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    return _VARIABLE.sub(lambda m: values[m.group(1)], text)


def _replace_once(text: str, pattern: str, replacement: str) -> str:
    result, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    if count != 1:
        raise ValueError(f"deploy/nginx/nginx.conf: expected one line matching {pattern!r}, found {count}")
    return result


def render(folder: Path, values: dict[str, str], *, proxy_bind: str | None = None) -> Path:
    """The shipped configuration for one host, in `folder`: its main file's path.

    Changed from what ships, and only this: the pid, log and temporary paths go under `folder`; the
    `user` line is dropped (nginx started by a user runs as that user; as root, workers stay root so they
    can use `folder`); and with `proxy_bind` nginx connects to the web from that address, so a web on
    the same host can tell the proxy (FORWARDED_ALLOW_IPS) from clients on 127.0.0.1.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "conf.d").mkdir(exist_ok=True)
    (folder / "temp").mkdir(exist_ok=True)
    main = (NGINX_DIR / "nginx.conf").read_text()
    main = _replace_once(main, r"^user .*;$", "user root;" if os.geteuid() == 0 else "")
    main = _replace_once(main, r"^pid .*;$", f"pid {folder / 'nginx.pid'};")
    main = _replace_once(main, r"^error_log .*;$", f"error_log {folder / 'error.log'} notice;")
    main = _replace_once(main, r"^    access_log .*;$", f"    access_log {folder / 'access.log'};")
    site = substitute((NGINX_DIR / "templates" / "platform.conf.template").read_text(), values)
    here = [
        f"{kind}_temp_path {folder / 'temp' / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    ]
    if proxy_bind:
        here.append(f"proxy_bind {proxy_bind};")
    (folder / "conf.d" / "platform.conf").write_text(
        site + "\n# This host only (benchmarks/nginx_front.py)\n" + "\n".join(here) + "\n"
    )
    (folder / "nginx.conf").write_text(main)
    return folder / "nginx.conf"


@dataclass
class RunningNginx:
    process: subprocess.Popen
    folder: Path
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: workers finish what they serve
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def error_log(self) -> str:
        path = self.folder / "error.log"
        return path.read_text() if path.exists() else ""


def start(
    folder: Path, values: dict[str, str], *, proxy_bind: str | None = None, timeout_s: float = 10
) -> RunningNginx:
    """nginx in the foreground (`daemon off`) with the rendered configuration; returns once it listens."""
    conf = render(folder, values, proxy_bind=proxy_bind)
    check = subprocess.run(
        [str(NGINX_BINARY), "-t", "-q", "-p", str(folder), "-c", str(conf)], capture_output=True, text=True
    )
    if check.returncode != 0:
        raise RuntimeError(f"nginx -t refused the configuration:\n{check.stderr}")
    process = subprocess.Popen(
        [str(NGINX_BINARY), "-p", str(folder), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=(folder / "stderr.log").open("w"),
    )
    port = int(values["NGINX_PORT"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"nginx exited: {(folder / 'stderr.log').read_text()}{(folder / 'error.log').read_text()}"
            )
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return RunningNginx(process, folder, f"http://127.0.0.1:{port}")
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise TimeoutError(f"nginx did not listen on {port} within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", default="127.0.0.1:8000", help="the web server, host:port")
    parser.add_argument("--port", default="8080")
    parser.add_argument("--folder", default=str(ROOT / "var" / "nginx"))
    parser.add_argument("--proxy-bind", default=None, help="the address nginx connects to the web from")
    parser.add_argument("--set", action="append", default=[], metavar="NGINX_NAME=VALUE")
    args = parser.parse_args()
    values = {**DEFAULTS, **{k: v for k, v in os.environ.items() if k in DEFAULTS}}
    values.update(NGINX_PORT=args.port, NGINX_UPSTREAM=args.upstream)
    values.update(dict(item.split("=", 1) for item in args.set))
    running = start(Path(args.folder), values, proxy_bind=args.proxy_bind)
    print(f"nginx on {running.url} in front of {args.upstream} (configuration in {args.folder}); Ctrl-C stops it")
    try:
        running.process.wait()
    except KeyboardInterrupt:
        running.stop()


if __name__ == "__main__":
    main()
