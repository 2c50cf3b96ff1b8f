"""`manage.py models`: model versions from the command line (issue 21).

    manage.py models status [router]
    manage.py models checksum router@2          # what to write as the version's `sha256:`
    manage.py models promote router 2 [--wait [--timeout 300]]
    manage.py models rollback router [--wait]    # promote the previous version
    manage.py models canary router 2 --percent 10
    manage.py models canary router --clear

The same plain functions as the admin actions and the staff API (inference/deployments.py).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference import deployments
from inference.core.registry import get_registry
from inference.core.versions import split_pin, version_checksum


class Command(BaseCommand):
    help = "Model versions: checksum, promote (with --wait), rollback, canary, status."

    def add_arguments(self, parser: CommandParser) -> None:
        commands = parser.add_subparsers(dest="command", required=True)
        status = commands.add_parser("status", help="each model's deployment")
        status.add_argument("model", nargs="?")
        checksum = commands.add_parser("checksum", help="the sha256 of a version's files (model@version)")
        checksum.add_argument("pinned")
        for name in ("promote", "rollback"):
            sub = commands.add_parser(name, help=f"{name} a model's version (load, then switch)")
            sub.add_argument("model")
            if name == "promote":
                sub.add_argument("version")
            sub.add_argument("--wait", action="store_true", help="wait for the switch (or the failure)")
            sub.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits at most")
        canary = commands.add_parser("canary", help="give a version a sticky share of callers, or --clear it")
        canary.add_argument("model")
        canary.add_argument("version", nargs="?")
        canary.add_argument("--percent", type=float, default=10.0)
        canary.add_argument("--clear", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            getattr(self, f"_{options['command']}")(options)
        except deployments.DeploymentError as error:
            raise CommandError(str(error)) from None

    def _show(self, state: Any) -> None:
        self.stdout.write(json.dumps(deployments.state_body(state), indent=2))

    def _status(self, options: dict) -> None:
        names = [options["model"]] if options["model"] else get_registry().names()
        for name in names:
            self._show(deployments.current(name))

    def _checksum(self, options: dict) -> None:
        model, version = split_pin(options["pinned"])
        spec = get_registry().version_spec(model, version)
        if spec is None:
            raise CommandError(f"no such model version {options['pinned']!r}")
        self.stdout.write(version_checksum(spec))

    def _promote(self, options: dict, version: str | None = None) -> None:
        version = version or options["version"]
        state = deployments.promote(options["model"], version, by="manage.py")
        if options["wait"]:
            state = deployments.wait_for(options["model"], version, options["timeout"])
            if state.active != version:
                self._show(state)
                raise CommandError(f"{options['model']}@{version} is not active (failed or timed out): see its status")
        self._show(state)

    def _rollback(self, options: dict) -> None:
        previous = deployments.current(options["model"]).previous
        if not previous:
            raise CommandError(f"{options['model']} has no previous version to roll back to")
        self._promote(options, previous)

    def _canary(self, options: dict) -> None:
        if options["clear"]:
            self._show(deployments.clear_canary(options["model"], by="manage.py"))
            return
        if not options["version"]:
            raise CommandError("name the canary's version, or --clear")
        self._show(deployments.set_canary(options["model"], options["version"], options["percent"], by="manage.py"))
