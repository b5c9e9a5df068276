"""Pydantic errors as people read them: `loras[0].strength: Input should be ...`, with a hint for typos.

Job specs, manifests, Ray Data rows, evaluation and timing specs, the command line and the HTTP API
all validate through pydantic models; this module is the one place that turns a `ValidationError`
into messages that name the field by its path and say what was expected.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from typing import Any, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError


def field_error(field: str, message: str) -> PydanticCustomError:
    """The error a model-level check raises about one of its fields. pydantic gives such an error no location; the
    field travels in its context (`error_field` reads it), so no door has to find it in the message."""
    # pydantic fills `{name}` placeholders of the context's keys only: the message is otherwise kept as it is.
    return PydanticCustomError("value_error", message, {"field": field})


def error_field(error: dict) -> str:
    """Where one pydantic error is: its location, ended by the field a model-level check named (`field_error`)."""
    named = (error.get("ctx") or {}).get("field")
    return field_path((*error["loc"], named) if named else error["loc"])


def field_path(loc: tuple) -> str:
    """pydantic's ('loras', 0, 'strength') as 'loras[0].strength'; '' for a model-level error."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def short(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: error messages repeat inputs, never whole blobs."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_message(error: dict, model: type[BaseModel] | None = None, echo_limit: int = 80) -> str:
    """One pydantic error's message without its 'Value error, ' prefix.

    An unknown field gets a did-you-mean from the fields of its section (found by walking `model`
    along the error's location); a type or range error repeats the input it got, cut to `echo_limit`
    characters (the HTTP API repeats at most 64 characters of what a client sent).
    """
    if error["type"] == "extra_forbidden":
        return "unknown field" + _suggestion(error["loc"], model)
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "assertion_error", "missing") and "input" in error:
        message += f" (got {short(error['input'], echo_limit)})"
    return message


def validation_messages(exc: ValidationError, model: type[BaseModel] | None = None) -> list[tuple[str, str]]:
    """(field path, message) for every error of `exc`; the path is '' for model-level errors."""
    return [(field_path(e["loc"]), error_message(e, model)) for e in exc.errors()]


def format_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """`path: message` lines, '(top level)' for model-level errors."""
    return [f"{path or '(top level)'}: {message}" for path, message in validation_messages(exc, model)]


def _suggestion(loc: tuple, model: type[BaseModel] | None) -> str:
    """' (did you mean 'sampler'?)' for a misspelt field, found among the fields of its section."""
    for part in loc[:-1]:
        if model is None:
            return ""
        if isinstance(part, int):
            continue  # an item of a list: its model is the list's item type, found below
        field = model.model_fields.get(part)
        types = (field.annotation, *_nested_args(field.annotation)) if field else ()
        model = next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _nested_args(annotation: Any) -> tuple:
    """The type arguments of `annotation`, one level of nesting deep (list[LoRASpec] | None -> LoRASpec)."""
    found = []
    for arg in get_args(annotation):
        found.append(arg)
        found.extend(get_args(arg))
    return tuple(found)


# ---------------------------------------------------------------------------------------------
# Usage errors at the command line


def usage_error_lines(error: BaseException) -> list[str] | None:
    """The lines a usage error is told in, or None for a genuine bug (which keeps its traceback).

    Usage errors are bad settings and specs (pydantic, JobSpecError, RenderError and every other
    ValueError) and files that are missing or unreadable (OSError), also when they were raised inside a
    Ray worker and reached the driver wrapped in a RayTaskError or an actor's death.
    """
    cause = getattr(error, "cause", None)  # ray.exceptions.RayTaskError / RayActorError keep the original
    if isinstance(cause, BaseException) and cause is not error:
        return usage_error_lines(cause)
    if isinstance(error, ValidationError):
        return format_validation_error(error)
    if isinstance(error, (ValueError, OSError)):
        return _one_line_per_problem(str(error).strip() or type(error).__name__)
    return None


def _one_line_per_problem(text: str) -> list[str]:
    """`invalid job spec F:` + indented problems as one line per problem, each naming F; else one line."""
    head, *rest = [line.strip() for line in text.splitlines() if line.strip()]
    if rest and head.endswith(":"):
        return [f"{head} {problem}" for problem in rest]
    return ["; ".join([head, *rest])]


def debug_requested(flag: bool = False) -> bool:
    """`--debug`, or SNAPREF_DEBUG=1: show a usage error's traceback too."""
    return flag or os.environ.get("SNAPREF_DEBUG", "").strip().lower() in {"1", "true", "yes"}


def run_reporting_usage_errors(command: Callable[[], int], *, debug: bool = False) -> int:
    """`command()`'s exit status; a usage error is printed as `error: ...` lines on stderr and exits 2."""
    try:
        return command()
    except Exception as e:
        lines = usage_error_lines(e)
        if lines is None or debug_requested(debug):
            raise
        for line in lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
