"""The building blocks of raysim's validation, below every layer that validates: the strict
pydantic base (``ConfigModel``), the user-mistake error (``ConfigError``, exit 2), pydantic's
errors in raysim's words, and ``module:Name`` imports. The experiment's schema
(``raysim.config``) and the model builders' keys (``raysim.models.spec``) both use them."""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Iterable
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MESSAGE_LIMIT = 2048  # characters of a user-mistake message: one screen, whatever the input

_BRIEF = reprlib.Repr()
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 6
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 2, 60, 60, 40


def brief(value: Any) -> str:
    """``repr(value)`` cut short (reprlib): a value echoed in a message, however large it is (a
    YAML alias bomb is a list of lists nested a dozen deep), costs a few dozen characters."""
    text = _BRIEF.repr(value)
    if isinstance(value, list | tuple | dict) and len(value) > _BRIEF.maxlist:
        text += f" ({len(value)} items)"
    return text


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, the cut said with how much was left out."""
    if len(text) <= limit:
        return text
    keep = limit - len(f"... ({len(text)} more characters)")  # the tail at its longest
    return f"{text[:keep]}... ({len(text) - keep} more characters)"


class ConfigError(ValueError):
    """A user mistake in the experiment config (CLI exit code 2). Its message is cut to
    ``MESSAGE_LIMIT`` characters, so that no input makes it longer than a screen."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(shorten(str(message)), *args)


class ConfigModel(BaseModel):
    """pydantic's BaseModel, except that true/false is not a number: pydantic's lax mode reads
    ``rounds: true`` as 1 and ``lr: false`` as 0.0. The base of every config section and of the
    algorithms' Params. Numbers are finite: ``privacy.epsilon: .inf`` is no budget."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
            if kinds and bool not in kinds:  # a number field (bool is an int to Python)
                numbers = {k for k in kinds if isinstance(k, type)}
                words = ["a whole number" if numbers == {int} else "a number"]
                words += [repr(k) for k in kinds if not isinstance(k, type)]
                raise ValueError(f"must be {' or '.join(words)} (got {str(value).lower()})")
        return value


def _scalar_kinds(annotation: Any) -> set[Any]:
    """int/float/bool and the Literal values an annotation admits; empty where it admits
    anything else (str, lists, sections), which reject or keep a bool on their own terms."""
    args = get_args(annotation)
    origin = get_origin(annotation)
    if annotation in (int, float, bool):
        return {annotation}
    if origin is Literal:
        return set(args)
    if origin in (Union, UnionType):
        kinds = [_scalar_kinds(a) for a in args if a is not type(None)]
        return set().union(*kinds) if all(kinds) else set()
    return set()


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest of ``choices`` (difflib), or "" if none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check_import_path(path: str, field: str) -> None:
    """A ``module:Name`` value must be an absolute module path and a name (a relative import,
    ``..os:system``, has no package to be relative to): ValueError naming ``field``."""
    module, _, attr = path.partition(":")
    if not (_DOTTED.fullmatch(module) and attr.isidentifier()):
        raise ValueError(
            f"{field}: {brief(path)} is not module:Name (an absolute, dotted module path, a "
            "colon, then a name in that module, e.g. mypackage.mymodule:MyClass)"
        )


def import_named(path: str, field: str) -> Any:
    """What a ``module:Name`` value (an algorithm or a model of the user's own) names; a
    ``ConfigError`` naming ``field`` where it cannot be imported."""
    import importlib

    try:
        check_import_path(path, field)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{field}: cannot import {brief(path)}: {shorten(str(exc), 300)}"
        ) from None


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section that ``loc`` (a pydantic error location) points into."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = getattr(field, "annotation", None) if field else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return []
        model = sub
    return list(model.model_fields)


def _description(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The ``description`` of the field ``loc`` points at (why its bounds are what they are)."""
    for i, part in enumerate(loc):
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        if i == len(loc) - 1:
            return field.description
        sub = field.annotation
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return None
        model = sub
    return None


_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_TYPES = {
    "int_type": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "finite_number": "a finite number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "bool_parsing": "true or false",
    "list_type": "a list, e.g. [1, 2]",
    "dict_type": "a section (key: value lines)",
    "model_type": "a section (key: value lines)",
    "string_type": "a string",
}


def error_message(err: dict[str, Any], model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """One pydantic error in the words of the rest of raysim (no pydantic jargon or URLs)."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        fields = _fields_at(model, loc)
        hint = did_you_mean(loc[-1], fields)
        return f"unknown field{hint}" + (f" (allowed: {', '.join(fields)})" if fields else "")
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = did_you_mean(got, allowed) if isinstance(got, str) and len(got) < 100 else ""
        return f"got {brief(got)}; allowed: {', '.join(allowed)}{hint}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), "?")
        why = _description(model, loc)
        return f"must be {_BOUNDS[kind]} {bound} (got {brief(got)})" + (f": {why}" if why else "")
    if kind in _TYPES:
        return f"must be {_TYPES[kind]} (got {brief(got)})"
    if kind == "missing":
        return "is required"
    return err["msg"].removeprefix("Value error, ")
