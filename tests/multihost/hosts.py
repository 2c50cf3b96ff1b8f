"""Hosts on one machine: Linux network namespaces on a private bridge, each with its own address and hostname.

Each host is a network namespace with a veth pair to a bridge in the root namespace, on a private
10.x.y.0/24 derived from the test session's pid (so concurrent sessions never share a name or a
subnet). The bridge has the .1 address, so the test process itself (in the root namespace) reaches
every host as a client on another machine would; the hosts reach each other only through their
addresses. Processes start with `ip netns exec`, in their own UTS namespace named after the host,
so worker ids (`hostname:pid`) and Celery node names say which host answered.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mh"


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can), found by making one."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "util-linux's `unshare` and `setpriv` are not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed (needs root, CAP_SYS_ADMIN): {made.stderr.strip()}"
        inside = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "true"], capture_output=True, text=True, timeout=30
        )
        if inside.returncode != 0:
            return f"cannot run a process in a network and UTS namespace: {inside.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def reap_stale() -> None:
    """Remove what an earlier session killed before its teardown left behind (its pid is gone)."""

    def dead(name: str, pattern: str) -> bool:
        match = re.fullmatch(pattern, name)
        return bool(match) and not Path(f"/proc/{match.group(1)}").exists()

    listed = _ip("netns", "list", check=False).stdout.split()
    for name in [n for n in listed if dead(n, rf"{PREFIX}(\d+)[a-z]")]:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name, check=False)
    links = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    for name in re.findall(rf"^\d+: ({PREFIX}\d+br)[:@]", links, flags=re.MULTILINE):
        if dead(name, rf"{PREFIX}(\d+)br"):
            _ip("link", "del", name, check=False)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-pg-*"):
        if dead(folder.name, rf"{PREFIX}(\d+)-pg-\w+"):
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class Host:
    """A machine: a network namespace, its address on the bridge, and its hostname."""

    letter: str
    netns: str
    address: str

    @property
    def hostname(self) -> str:
        return f"host-{self.letter}"

    def command(self, argv: list[str], *, user: str | None = None) -> list[str]:
        """`argv` run on this host (as `user` when given); the process keeps the pid Popen sees, as each
        of ip, unshare, sh and setpriv execs the next."""
        inside = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *argv] if user else argv
        set_name = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", set_name, self.hostname, *inside]


@dataclass
class Network:
    """A bridge with one host per letter on it; `up()` builds it, `down()` removes every piece, always."""

    letters: str
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pid = os.getpid()  # distinct for every pid below 32,768 (the usual pid_max)
        self.subnet = f"10.{64 + (pid >> 8) % 128}.{pid % 256}"
        self.bridge = f"{self.tag}br"
        self.gateway = f"{self.subnet}.1"
        for i, letter in enumerate(self.letters):
            self.hosts[letter] = Host(letter, f"{self.tag}{letter}", f"{self.subnet}.{i + 2}")

    @property
    def cidr(self) -> str:
        return f"{self.subnet}.0/24"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts.values():
            outside, inside = f"{host.netns}0", f"{host.netns}1"
            _ip("netns", "add", host.netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", host.netns)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", inside, netns=host.netns)
            _ip("link", "set", inside, "up", netns=host.netns)
            _ip("link", "set", "lo", "up", netns=host.netns)

    def down(self) -> None:
        for host in self.hosts.values():
            _ip("link", "del", f"{host.netns}0", check=False)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network still present (empty after `down()`)."""
        names = _ip("netns", "list", check=False).stdout.split() + _ip("-o", "link", check=False).stdout.split()
        return sorted({n.rstrip(":").split("@")[0] for n in names if n.startswith(self.tag)})


@dataclass
class Process:
    """A process started on a host, in its own process group, its output in a log file."""

    name: str
    host: Host
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def send(self, sig: int) -> None:
        """Send `sig` to the process group, resumed first in case a test froze it."""
        if self.popen.poll() is not None:
            return
        for each in (signal.SIGCONT, sig):
            try:
                os.killpg(self.pid, each)
            except ProcessLookupError:
                return

    def wait_or_kill(self, timeout_s: float) -> int:
        """Wait for the process to exit; SIGKILL its group after `timeout_s`."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            return self.popen.wait(timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20) -> int:
        self.send(sig)
        return self.wait_or_kill(timeout_s)


def start(
    host: Host, name: str, argv: list[str], env: dict[str, str], log_dir: Path, *, user: str | None = None
) -> Process:
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            host.command(argv, user=user),
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Process(name, host, popen, log)


def postgres_bin_dir() -> Path:
    """PostgreSQL's server binaries: PG_BIN_DIR, else the newest /usr/lib/postgresql/<n>/bin, else pg_config's."""
    given = os.environ.get("PG_BIN_DIR")
    if given:
        return Path(given)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    if shutil.which("pg_config"):
        return Path(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip())
    raise RuntimeError("PostgreSQL server binaries not found (set PG_BIN_DIR): the multihost tests need a real server")
