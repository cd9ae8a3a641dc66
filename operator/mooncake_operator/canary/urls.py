"""How a replica URL is shown: never with its credentials (no imports: every canary module may use it)."""

from __future__ import annotations


def redact_url(url: str, *, mask: str = "***@") -> str:
    """`url` with any user:password@ replaced by `***@`: how a URL is shown (tables, JSON, logs, errors)."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    authority_end = min(
        (i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i != -1), default=len(rest)
    )
    authority = rest[:authority_end]
    if "@" not in authority:
        return url
    return f"{scheme}://{mask}{authority.rpartition('@')[2]}{rest[authority_end:]}"
