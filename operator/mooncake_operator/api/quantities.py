"""Sizes: Mooncake store sizes ("80GB", binary units as Mooncake reads them), Kubernetes resource
quantities ("64Gi", "500m"), and byte counts written back as quantities.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Annotated

from pydantic import AfterValidator, Field

# Largest byte count a size or quantity may state: 2**63 - 1 (Kubernetes quantities are int64 too), so
# arithmetic on it stays exact and every digit string stays far below Python's int/str conversion limit.
MAX_BYTES = 2**63 - 1


# Mooncake store sizes use the grammar vLLM's MooncakeStoreConfig parses: a number and an optional unit
# GB/MB/KB/B, case-insensitive, binary multiples (1GB = 1024**3 bytes). We accept exactly that grammar, so
# every value we write into mooncake_store.json is one the engine reads the same way.
_STORE_SIZE_UNITS = {"gb": 1024**3, "mb": 1024**2, "kb": 1024, "b": 1, "": 1}
_STORE_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|mb|kb|b)?\s*$", re.IGNORECASE)


def parse_store_size(value: str) -> int:
    """Bytes of a Mooncake store size ("80GB", "4GB", "512MB"; binary units, as Mooncake reads them)."""
    match = _STORE_SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse size {value!r}: write a number and one of the units GB, MB, KB or B "
            '(binary, as Mooncake reads them: "80GB" is 80 * 1024**3 bytes), e.g. "80GB" or "512MB"'
        )
    number, unit = match.group(1), (match.group(2) or "").lower()
    if len(number) > 40:  # 40 digits already exceed MAX_BYTES; longer ones are refused unparsed
        raise ValueError(f"size {value[:40]!r}... is too large (at most {MAX_BYTES} bytes)")
    size = Decimal(number) * _STORE_SIZE_UNITS[unit]
    if size > MAX_BYTES:
        raise ValueError(f"size {value!r} is too large (at most {MAX_BYTES} bytes)")
    return int(size)


def _check_store_size(value: str) -> str:
    parse_store_size(value)
    return value


# The pattern goes into the CRD only, so pydantic reports the friendlier message of `parse_store_size`.
STORE_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([gGmMkK]?[bB])?\s*$"
StoreSize = Annotated[
    str,
    AfterValidator(_check_store_size),
    Field(json_schema_extra={"pattern": STORE_SIZE_PATTERN}),
]

# Kubernetes resource quantities ("64Gi", "500m", "4"): resource.Quantity's grammar.
_QUANTITY_RE = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: str | int) -> Decimal:
    """The numeric value of a Kubernetes quantity ("64Gi" -> 68719476736, "500m" -> 0.5)."""
    text = str(value).strip()
    shown = text if len(text) <= 40 else text[:40] + "..."
    if len(text) > 60:  # no quantity up to MAX_BYTES needs more characters
        raise ValueError(f"quantity {shown!r} is too large (at most {MAX_BYTES})")
    match = _QUANTITY_RE.match(text)
    if match is None:
        raise ValueError(
            f"cannot parse quantity {value!r}: use a Kubernetes quantity such as '64Gi', '4' or '500m'"
        )
    number = Decimal(match.group("number"))
    suffix = match.group("suffix") or ""
    try:
        if suffix in _BINARY_SUFFIXES:
            amount = number * _BINARY_SUFFIXES[suffix]
        elif suffix in _DECIMAL_SUFFIXES:
            amount = number * _DECIMAL_SUFFIXES[suffix]
        else:
            amount = number * Decimal(10) ** int(suffix[1:])
    except ArithmeticError as error:  # decimal.Overflow: an exponent like 1e999999999
        raise ValueError(f"quantity {shown!r} is too large (at most {MAX_BYTES})") from error
    if abs(amount) > MAX_BYTES:
        raise ValueError(f"quantity {shown!r} is too large (at most {MAX_BYTES})")
    return amount


def _check_quantity(value: str | int) -> str | int:
    if parse_quantity(value) < 0:
        raise ValueError(f"quantity {value!r} must not be negative")
    return value


Quantity = Annotated[str | int, AfterValidator(_check_quantity)]


def format_bytes(value: Decimal | int) -> str:
    """A byte count as the largest exact binary quantity ("344Gi", "1536Mi", "100")."""
    whole = math.ceil(value)
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if whole and whole % size == 0:
            return f"{whole // size}{suffix}"
    return str(whole)
