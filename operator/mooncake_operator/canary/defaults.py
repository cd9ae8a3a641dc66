"""The canary's default limits and thresholds (imports nothing: `canary --help` shows them and starts fast).

The `canary` package module imports nothing either, so reading these loads neither pydantic nor httpx.
`canary.models` re-exports these names; this module is their one source of truth.
"""

from __future__ import annotations

from typing import Final

# Caps on one response body, decoded size (documented in docs/canary.md). A chat answer of the default
# 80 tokens is ~1 KiB; 4 MiB leaves room for long answers with reasoning. A vLLM metrics page is
# ~100-500 KiB (histograms per engine); 16 MiB leaves room for many engines and LoRA adapters.
DEFAULT_MAX_CHAT_BODY_BYTES: Final = 4 * 1024 * 1024
DEFAULT_MAX_METRICS_BODY_BYTES: Final = 16 * 1024 * 1024
MAX_BODY_BYTES_LIMIT: Final = 1024 * 1024 * 1024  # what a cap may be raised to
# A TCP connect on a LAN takes milliseconds; 5 s rides out a busy node without hiding a blackhole long.
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0

# The logprob rule's defaults; docs/canary.md gives their sources. vLLM serves at most 20 top logprobs
# by default (--max-logprobs); 5 is what vLLM's own check_logprobs_close tests compare.
DEFAULT_TOP_K: Final = 5
MAX_TOP_K: Final = 20
# The largest tie shift measured upstream between a warm and a cold computation (0.06-0.125 nat,
# vllm #5543; LMCache's rule uses 0.1): a flip needs a gap no larger than the shift that tipped it.
DEFAULT_MAX_TIE_GAP_NATS: Final = 0.125
# ~4x the largest warm-versus-cold drift measured upstream (2.6e-2 on H100, vllm #52701), for FP8 MoE
# at TP 4, which nobody measured; a wrong trailing block moves a distribution by whole nats.
DEFAULT_MAX_DRIFT_NATS: Final = 0.1

# How long the canary waits, after the cold answer, for the writer's store puts to cover the prompt's
# full blocks before it sends the warm request. vLLM's connector stores blocks from a sending thread that
# no request waits for; on GPUs a put of a few blocks takes milliseconds, on CPU engines longer
# (bench/RESULTS.md). The wait ends as soon as the puts are reported, so a healthy writer costs less.
DEFAULT_PUT_WAIT_S: Final = 10.0
MAX_PUT_WAIT_S: Final = 300.0
