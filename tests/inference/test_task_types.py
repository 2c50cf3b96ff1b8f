"""The task descriptors (inference/core/task_types/): each built-in is whole, and lookups refuse clearly."""

from __future__ import annotations

import sys
import types

import pytest

from inference.core import task_io
from inference.core.task_types import BUILTIN, TaskType, TaskTypeError, builtin_task_types, get_task_type, import_path


@pytest.mark.parametrize("name", list(BUILTIN))
def test_each_builtin_names_itself_and_a_handler_that_imports(name):
    task_type = get_task_type(name)
    assert task_type.name == name
    handler = import_path(task_type.handler, "handler")
    assert callable(getattr(handler, "load", handler))
    components = task_type.schemas(100)
    assert task_type.output_schema in components
    assert task_type.takes_text or task_type.input_schema in components


def test_each_output_requires_a_field_no_other_output_has_so_one_of_matches_once():
    outputs = task_io.output_schemas(100, builtin_task_types())
    required = {name: set(outputs[name]["required"]) for name in task_io.output_components(builtin_task_types())}
    for name, fields in required.items():
        others = set().union(*(f for other, f in required.items() if other != name))
        assert fields - others, f"{name} requires nothing the others do not"


def test_a_lookup_of_a_name_that_is_neither_builtin_nor_a_path_says_what_is_allowed():
    with pytest.raises(TaskTypeError, match="task must be one of router, .* or a dotted path module:Class"):
        get_task_type("translate")


def test_a_plugin_may_not_take_a_builtin_tasks_name(monkeypatch):
    module = types.ModuleType("impostor_tasks")

    class Impostor(TaskType):
        name = "embedding"

    module.Impostor = Impostor
    monkeypatch.setitem(sys.modules, "impostor_tasks", module)
    with pytest.raises(TaskTypeError, match="is named 'embedding', the name of"):
        get_task_type("impostor_tasks:Impostor")
