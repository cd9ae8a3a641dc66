"""The base of every API model (frozen, camelCase on the wire, unknown fields rejected, no
coercion, as the API server) and how a validation error reads.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Frozen, camelCase on the wire, unknown fields rejected, no type coercion (as the API server)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        populate_by_name=True,
        alias_generator=to_camel,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-compatible wire form (camelCase keys, unset optional fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def describe_validation_error(error: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One readable line per problem: the wire path (camelCase) and the message. With the validated
    `model`, an unknown field also names the closest field there ("did you mean ...?")."""
    problems = []
    for item in error.errors():
        path = ".".join(map(str, item["loc"]))
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden" and model is not None and item["loc"]:
            message = "unknown field" + _closest_field(model, item["loc"])
        problems.append(f"{path}: {message}" if path else message)
    return problems


def _closest_field(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """ "; did you mean 'x'?" for the field of the model at loc[:-1] closest to loc[-1], or " (known
    fields: ...)" when none is close; "" where the model cannot be followed."""
    fields = _fields_at(model, loc[:-1])
    if not fields:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), fields, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known fields: {', '.join(sorted(fields))})"


def _fields_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The wire names of the model's fields at `loc` (through nested models, lists and maps)."""
    current: Any = model
    for key in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            found = next(
                (f for name, f in current.model_fields.items() if key in (name, f.alias)),
                None,
            )
            if found is None:
                return []
            current = found.annotation
        elif typing.get_origin(current) in (list, tuple) and isinstance(key, int):
            current = typing.get_args(current)[0]
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or name for name, f in current.model_fields.items()]
    return []


def _unwrap(annotation: Any) -> Any:
    """Annotated[X, ...] -> X; X | None -> X (the one model or container type in a union)."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            structured = [
                arg
                for arg in members
                if typing.get_origin(arg) in (list, tuple, dict)
                or (isinstance(arg, type) and issubclass(arg, BaseModel))
            ]
            if len(structured) != 1:
                return annotation
            annotation = structured[0]
        else:
            return annotation
