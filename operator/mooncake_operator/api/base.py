"""The base of every API model (frozen, camelCase on the wire, unknown fields rejected, no
coercion, as the API server) and how a validation error reads.
"""

from __future__ import annotations

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


def describe_validation_error(error: ValidationError) -> list[str]:
    """One readable line per problem: the wire path (camelCase) and the message."""
    problems = []
    for item in error.errors():
        path = ".".join(map(str, item["loc"]))
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{path}: {message}" if path else message)
    return problems
