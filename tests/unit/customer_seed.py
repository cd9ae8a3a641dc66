"""The customer's report (shared/seeds/000), verbatim: what the rendered replicas must reproduce."""

from __future__ import annotations

# `vllm serve` and its arguments (apart from listen ports) ...
CUSTOMER_ARGV = (
    "vllm",
    "serve",
    "MiniMaxAI/MiniMax-M2.5",
    "--revision",
    "f710177d938eff80b684d42c5aa84b382612f21f",
    "--tokenizer-revision",
    "f710177d938eff80b684d42c5aa84b382612f21f",
    "--trust-remote-code",
    "--tensor-parallel-size",
    "4",
    "--max-model-len",
    "4096",
    "--block-size",
    "16",
    "--kv-transfer-config",
    '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both","kv_connector_extra_config":{"load_async":true}}',
    "--speculative-config",
    '{"method":"eagle3","model":"thoughtworks/MiniMax-M2.5-Eagle3",'
    '"revision":"fb4699b3d33913e6b5e2462dd7962775e44e5fea","num_speculative_tokens":3,'
    '"draft_tensor_parallel_size":1}',
)
# ... its environment ...
CUSTOMER_ENV = {"PYTHONHASHSEED": "0", "MOONCAKE_CONFIG_PATH": "/etc/vllm/mooncake_store.json"}
# ... and /etc/vllm/mooncake_store.json, as text so key order is checked too.
CUSTOMER_STORE_JSON = """{
  "mode": "embedded",
  "metadata_server": "P2PHANDSHAKE",
  "master_server_address": "10.0.0.10:50051",
  "global_segment_size": "80GB",
  "local_buffer_size": "4GB",
  "protocol": "tcp",
  "device_name": "",
  "enable_offload": false
}"""
