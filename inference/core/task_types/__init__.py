"""A task is one descriptor: a `TaskType` says everything the platform needs to know about a task.

Before, a task was spread over a dozen tables and if-chains (the registry's task list, task_io's input
fields and schemas, the handler if-chain, token pricing, labels, the jobs export layouts, the job page's
headings, the upload form's column fields). Now each of those places asks the model's task type:

  input            `input_fields`, `check_input` (a predict input, 400 messages), `cells_error` and
                   `input_from_cells` (one CSV or JSON-lines row's cells), `cells_from_input` (batch lines)
  OpenAPI          `input_schema` / `output_schema` (component names) and `schemas()` (the components)
  handler          `handler`, a "module:attr" path imported only in a worker child (torch lives there)
  cost             `input_tokens` (structured inputs; text tasks are priced by the shared text counter),
                   `input_problem` (the offline runner's per-row check before a batch runs)
  jobs             `export_columns`, `score_heading` / `score_help`, `input_heading` / `answer_heading`
  review           `labels(spec)`
  models file      `check_entry` (task-specific keys such as a router's `routes`), `check_options`
                   (the entry's free `options:` mapping, for plugins)

A task type is a class, not a table entry, so a plugin can override any step (a rerank task parses a JSON
array of documents from one CSV cell) while the built-ins only set attributes. Instances are stateless
singletons; per-model settings come in through the `ModelSpec` each method is given.

The models file names a task by a built-in name or by a dotted path `module:Class` (a plugin outside the
platform). `get_task_type` imports it once per process and remembers it under its path and its `name`,
so `ModelSpec.task` (the registry stores the type's `name`) finds it again.

Importing this package never imports torch, and neither may a task type module: the web tier reads them.
Nothing here imports the registry (the registry imports this package), so built-in task modules are
named by string in BUILTIN and imported on first use.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from platform_.errors import ApiError

if TYPE_CHECKING:
    from inference.core.registry import ModelSpec

# Built-in task name -> its descriptor, in the order the API's description lists them.
BUILTIN: dict[str, str] = {
    "router": "inference.core.task_types.router:RouterTask",
    "text-classification": "inference.core.task_types.text_classification:TextClassificationTask",
    "embedding": "inference.core.task_types.embedding:EmbeddingTask",
    "identity": "inference.core.task_types.identity:IdentityTask",
    "token-classification": "inference.core.task_types.token_classification:TokenClassificationTask",
    "question-answering": "inference.core.task_types.question_answering:QuestionAnsweringTask",
}
TEXT_SCHEMA = "Text"

_TYPE_NAMES = {
    dict: "an object",
    list: "a list",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


class TaskTypeError(ValueError):
    """A task or handler path names nothing importable, or a models-file entry does not suit its task.

    The registry turns it into a RegistryError naming the model."""


def type_name(value: object, default: str = "a string") -> str:
    """How a JSON value's type is written in messages: "an object", "a list", "null", ..."""
    return _TYPE_NAMES.get(type(value), default)


def invalid(detail: str) -> ApiError:
    return ApiError(400, "invalid_input", detail)


def object_shape(fields: tuple[str, ...]) -> str:
    """How an object input is written in messages: {"question": ..., "context": ...}."""
    return "{" + ", ".join(f'"{name}": ...' for name in fields) + "}"


def check_text(text: str, where: str, max_chars: int) -> None:
    """A 400 unless `text` is a non-blank string of at most max_chars characters of valid Unicode."""
    if not text.strip():
        raise invalid(f"{where} is empty")
    if len(text) > max_chars:
        raise invalid(f"{where} is {len(text)} characters; the limit is {max_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): valid JSON, but not text
        raise invalid(f"{where} is not valid Unicode text: {exc.reason} at character {exc.start}") from None


def check_string(value: Any, where: str, max_chars: int) -> None:
    if not isinstance(value, str):
        raise invalid(f"{where} is {type_name(value, 'not a string')}, not a string")
    check_text(value, where, max_chars)


def cell_error(field: str, value: object, max_chars: int) -> str:
    """Why one cell of a job row cannot run ("" when it can); the message names the field."""
    if not isinstance(value, str) or not value.strip():
        return f"empty {field}"
    if len(value) > max_chars:
        return f"{field} too long: {len(value)} characters, the limit is {max_chars}"
    return ""


@dataclass(frozen=True)
class ExportColumn:
    """A task's own column in a jobs CSV export: its header and its value from a row's stored input
    cells and the model's output (None for a row that has no answer yet).

    `text` values (from the client's file or the model's answer) are neutralised against spreadsheet
    formulas; other values are numbers, written with 6 decimals (integers as they are)."""

    header: str
    value: Callable[[Mapping[str, Any], Mapping[str, Any] | None], object]
    text: bool = True


# The job-wide columns an export layout may name by string (jobs/export.py fills them from the row).
TEXT_EXPORT: tuple[str | ExportColumn, ...] = ("text", "status", "label", "score", "corrected_label", "low_confidence")


class TaskType:
    """One task: what its inputs and outputs are, which handler runs it, what it costs and how jobs show it.

    Subclass it, set the attributes, and override the methods the task's inputs need. A text task (one
    input field "text") needs only `name`, `handler`, `output_schema` and `schemas`.
    """

    name: str = ""
    # The fields of one input; ("text",) means an input is a plain string, else an object of these fields
    # (and a job reads one CSV column per field, `<field>_column`).
    input_fields: tuple[str, ...] = ("text",)
    # "module:attr" of the handler: a class with `load(spec)` or a function of the spec returning a handler.
    handler: str = ""
    input_schema: str = TEXT_SCHEMA
    output_schema: str = ""
    # Keys of a models-file entry only this task reads (a router's `routes`): documented and checked here.
    model_keys: tuple[str, ...] = ()
    # `options:` a models-file entry may give, with their defaults (a plugin's own settings).
    option_defaults: Mapping[str, Any] = {}
    # Structured inputs in messages: what one input's tokens are, and how a too-large one is made smaller.
    sequences_note: str = "every sequence its fields make"
    input_noun: str = "the input's fields"
    split_hint: str = "send a smaller input"
    # Jobs: the export's task columns, the review's score column and the job page's headings.
    export_columns: tuple[str | ExportColumn, ...] = TEXT_EXPORT
    score_heading: str = "Score"
    score_help: str = "the model's score for the row"
    input_heading: str = "Text"
    answer_heading: str = "Label"
    answer_label: str = ""  # the answer's short name where a narrow table stacks ("": answer_heading)

    @property
    def takes_text(self) -> bool:
        return self.input_fields == ("text",)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # OpenAPI ---------------------------------------------------------------------------------------------

    def schemas(self, max_chars: int) -> dict[str, dict[str, Any]]:
        """The OpenAPI components this task defines (its input and output, and parts of them). The shared
        Text input is the platform's; a component of the same name defined by two tasks must be equal."""
        return {}

    def input_example(self) -> Any:
        return None

    # The models file -------------------------------------------------------------------------------------

    def check_entry(self, entry: Mapping[str, Any]) -> None:
        """TaskTypeError when a models-file entry lacks or misuses a key this task reads."""

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The entry's `options:` with defaults filled in; TaskTypeError for an unknown or invalid one."""
        if not isinstance(options, Mapping):
            raise TaskTypeError(f"`options` must be a mapping, got {type_name(options)}")
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            takes = ", ".join(sorted(self.option_defaults)) or "none"
            raise TaskTypeError(f"task {self.name} takes no options {unknown} (it takes: {takes})")
        return {**self.option_defaults, **options}

    # Online inputs ---------------------------------------------------------------------------------------

    def check_input(self, item: Any, index: int, max_chars: int, model: str = "", options: Mapping = {}) -> None:
        """A 400 naming the problem unless `item` is one valid input (inputs[index]) of a model of this task."""
        where = f"inputs[{index}]"
        if self.takes_text:
            if not isinstance(item, str):
                raise invalid(f"{where} is {type_name(item, 'not a string')}, not a string")
            check_text(item, where, max_chars)
            return
        self.check_fields(item, where, model)
        for name in self.input_fields:
            check_string(item[name], f"{where}.{name}", max_chars)

    def check_fields(self, item: Any, where: str, model: str) -> None:
        """A 400 unless `item` is an object with exactly this task's fields (their values are not checked)."""
        fields = self.input_fields
        if not isinstance(item, dict):
            raise invalid(
                f"{where} must be an object {object_shape(fields)} for model {model!r} (task {self.name}), "
                f"got {type_name(item)}"
            )
        expected = ", ".join(fields)
        for name in item:
            if name not in fields:
                shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}... ({len(name)} characters)"
                raise invalid(f"{where} has unknown field {shown}; expected {expected}")
        for name in fields:
            if name not in item:
                raise invalid(f"{where} has no field {name!r}; expected {expected}")

    def input_tokens(self, spec: ModelSpec, index: int, item: Any) -> int:
        """Tokens the model runs for one structured input (inputs[index]): what admission prices it by.

        Text tasks are counted by inference/core/tokens.py's shared text counter and never call this."""
        raise NotImplementedError(f"task {self.name} does not say what a structured input costs")

    # Job rows --------------------------------------------------------------------------------------------

    def cells_error(self, cells: Mapping[str, Any], max_chars: int) -> str:
        """Why a job row's cells (field -> the CSV or JSON-lines value) cannot run ("" when they can)."""
        for field in self.input_fields:
            error = cell_error(field, cells.get(field), max_chars)
            if error:
                return error
        return ""

    def input_from_cells(self, cells: Mapping[str, str]) -> Any:
        """One model input from a job row's cells: the text, or an object of the fields."""
        if self.takes_text:
            return cells["text"]
        return {field: cells[field] for field in self.input_fields}

    def cells_from_input(self, item: Any) -> dict[str, str]:
        """A job row's cells (strings, as a CSV gives them) from one valid predict input: batch lines."""
        if self.takes_text:
            return {"text": item}
        return {field: _as_cell(item[field]) for field in self.input_fields}

    def input_problem(self, spec: ModelSpec, item: Any) -> str:
        """Why `spec`'s model cannot take this job input ("" when it can), checked before a batch runs:
        a handler raising on one row would fail every row of the batch, other users' jobs included."""
        if self.takes_text:
            return ""
        try:
            tokens = self.input_tokens(spec, 0, item)
        except ApiError as error:
            return error.detail.removeprefix("inputs[0].")[:500]
        if tokens > spec.max_batch_tokens:  # as online: one row runs whole, without yielding to online calls
            return (
                f"{self.input_noun} are {tokens} tokens for model {spec.name!r}; one row may be at most "
                f"{spec.max_batch_tokens} (the model's max_batch_tokens, one forward pass): {self.split_hint}"
            )
        return ""

    # Review ----------------------------------------------------------------------------------------------

    def labels(self, spec: ModelSpec) -> list[str]:
        """The labels the model answers, in its order, read without loading it; [] when it has none."""
        return []


def _as_cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


_loaded: dict[str, TaskType] = {}
_lock = threading.Lock()


def get_task_type(name_or_path: str) -> TaskType:
    """The task type a models file names: a built-in name, a `module:Class` path, or the `name` of a
    plugin loaded before in this process. Imported once and cached; TaskTypeError when it cannot be."""
    found = _loaded.get(name_or_path)
    if found is not None:
        return found
    path = BUILTIN.get(name_or_path, name_or_path)
    if not isinstance(name_or_path, str) or ":" not in path:
        raise TaskTypeError(
            f"task must be one of {', '.join(BUILTIN)}, or a dotted path module:Class to a TaskType; "
            f"{name_or_path!r} is neither"
        )
    cls = import_path(path, "task")
    if not (isinstance(cls, type) and issubclass(cls, TaskType)):
        raise TaskTypeError(f"task {path!r} is not a TaskType subclass (inference.core.task_types.TaskType)")
    task_type = cls()
    if not task_type.name:
        raise TaskTypeError(f"task {path!r} has no `name`")
    with _lock:
        known = _loaded.get(task_type.name)
        if known is not None and type(known) is not cls:
            raise TaskTypeError(f"task {path!r} is named {task_type.name!r}, the name of {known!r}")
        if name_or_path in BUILTIN and task_type.name != name_or_path:
            raise TaskTypeError(f"built-in task {name_or_path!r} is named {task_type.name!r}")
        _loaded.setdefault(task_type.name, task_type)
        _loaded[path] = _loaded[task_type.name]
    return _loaded[task_type.name]


def builtin_task_types() -> list[TaskType]:
    return [get_task_type(name) for name in BUILTIN]


def import_path(path: str, what: str) -> Any:
    """The attribute a "module:attr" path names (attr may be dotted); TaskTypeError naming the path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise TaskTypeError(f"{what} {path!r} must be a dotted path module:Class")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or the module failing as it runs
        raise TaskTypeError(
            f"{what} {path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise TaskTypeError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    return target


def check_path(path: Any, what: str) -> None:
    """TaskTypeError unless `path` is "module:attr" and its module can be found, without importing it
    (a handler's module imports torch: only a worker child may run it)."""
    import importlib.util

    if not isinstance(path, str) or ":" not in path or not all(path.partition(":")[::2]):
        raise TaskTypeError(f"{what} {path!r} must be a dotted path module:Class")
    module_name = path.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise TaskTypeError(f"{what} {path!r}: cannot find module {module_name!r} ({exc})") from None
    if found is None:
        raise TaskTypeError(f"{what} {path!r}: no module {module_name!r} on the import path")
