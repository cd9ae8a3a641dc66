"""The customer's request and what its answer must hold: the canary's defaults.

The body is the one the customer sent in every trial of their report, byte for byte in content;
the expectations are theirs: one JSON object with the production update's values (us-west, 4, 16),
none of the superseded initial values (us-east, 2, 8), and nothing before the object (one of the
corrupted answers put a paraphrase of the system instruction there).
"""

from __future__ import annotations

import copy
from typing import Any

from mooncake_operator.canary.expectations import (
    Expectation,
    JsonObjectOnly,
    JsonValuesExclude,
    JsonValuesInclude,
)

_CUSTOMER_REQUEST: dict[str, Any] = {
    "model": "MiniMaxAI/MiniMax-M2.5",
    "messages": [
        {
            "role": "system",
            "content": (
                "You maintain a deployment record. When a setting is updated, discard its previous "
                "value and answer only from the latest record."
            ),
        },
        {
            "role": "user",
            "content": "Initial rollout: region is us-east, replica count is 2, and maximum batch size is 8.",
        },
        {"role": "assistant", "content": "Recorded the initial rollout."},
        {
            "role": "user",
            "content": (
                "Production update: region is now us-west, replica count is 4, and maximum batch size "
                "is 16. The initial values are superseded."
            ),
        },
        {"role": "assistant", "content": "Recorded the production update."},
        {
            "role": "user",
            "content": "Return the current region, replica count, and maximum batch size as one JSON object.",
        },
    ],
    "temperature": 0,
    "seed": 0,
    "max_tokens": 80,
    "stream": False,
}


def customer_request() -> dict[str, Any]:
    """The customer's chat request body (a fresh deep copy: callers may edit it)."""
    return copy.deepcopy(_CUSTOMER_REQUEST)


def customer_expectations() -> list[Expectation]:
    """One JSON object holding us-west, 4 and 16, none of us-east, 2 and 8, nothing before it."""
    return [
        JsonObjectOnly(),
        JsonValuesInclude(values=["us-west", 4, 16]),
        JsonValuesExclude(values=["us-east", 2, 8]),
    ]
