"""Container image references, checked as the kubelet and container runtimes parse them (the
distribution project's reference grammar): `[host[:port]/]repository[:tag][@algorithm:hex]`.

A reference the runtime cannot parse would leave pods in InvalidImageName after everything else was
applied; refused at validation instead, it is an Invalid spec (and a `render` error) that names the field.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[_.]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE_RE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@(?P<digest>{_DIGEST}))?")
SHA256_RE = re.compile(r"sha256:[0-9a-f]{64}")
MAX_NAME_LENGTH = 255
SHAPE = (
    "[registry[:port]/]repository[:tag][@sha256:<64 hex digits>], e.g. registry.example.com/team/vllm:0.32"
)


def image_reference_problem(value: str) -> str | None:
    """Why `value` is not an image reference the runtime accepts; None when it is one."""
    if value != value.strip() or any(ch.isspace() for ch in value):
        return f"image {value!r} contains whitespace; expected {SHAPE}"
    found = IMAGE_REFERENCE_RE.fullmatch(value)
    if found is None:
        hint = ""
        if "@" in value and value.rsplit("@", 1)[1].count(":") > 1:
            hint = " (a tag goes before the digest: repository:tag@sha256:...)"
        elif value.lower() != value and IMAGE_REFERENCE_RE.fullmatch(value.lower()):
            hint = " (the repository must be lowercase)"
        return f"image {value!r} is not a valid image reference{hint}; expected {SHAPE}"
    if len(found.group("name")) > MAX_NAME_LENGTH:
        return f"image {value!r}: the repository name is longer than {MAX_NAME_LENGTH} characters"
    digest = found.group("digest")
    if digest is not None and digest.startswith("sha256:") and not SHA256_RE.fullmatch(digest):
        return f"image {value!r}: a sha256 digest is 64 lowercase hex digits"
    return None


def _check(value: str) -> str:
    problem = image_reference_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


ImageReference = Annotated[str, AfterValidator(_check)]
