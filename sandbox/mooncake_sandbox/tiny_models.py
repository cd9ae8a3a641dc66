"""Generate the sandbox's tiny target model and tiny Eagle-3 draft, deterministically.

Standalone script: it runs with the ENGINE venv's python (it needs torch, tokenizers and
safetensors, which the operator's own venv does not carry) and imports nothing from this
package. The output directory's name is derived from this file's hash by the caller, so any
change here produces a fresh model set.

    python tiny_models.py OUTPUT_DIR

writes OUTPUT_DIR/target (random LlamaForCausalLM: hidden 128, 4 layers, vocab 2048, a
byte-level BPE tokenizer trained here on deterministic text, a chat template),
OUTPUT_DIR/revision-2/target (the same model and tokenizer with other random weights: a second
"revision" in a directory of the same basename, which is all vLLM puts of the model into a store
key) and OUTPUT_DIR/draft (random LlamaForCausalLMEagle3: 1 layer, same vocabulary, so no d2t/t2d
tensors), then prints a JSON manifest of file hashes on stdout.

The weights are random, so answers are gibberish; what matters is that every run of every
replica computes the same greedy tokens from the same prefix, and that a prefix whose KV is
wrong (the Eagle load_mask bug leaves one block uninitialised) changes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

# Single-threaded training keeps merge order independent of the machine's core count.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # type: ignore[import-not-found]  # engine venv only
from safetensors.torch import save_file  # type: ignore[import-not-found]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found]

SEED = 20260526
# Target revisions generated; revision r draws its weights from SEED + REVISION_SEED_STEP * (r - 1).
REVISIONS = (1, 2)
REVISION_SEED_STEP = 1000
VOCAB_SIZE = 2048
HIDDEN = 128
INTERMEDIATE = 256
TARGET_LAYERS = 4
DRAFT_LAYERS = 1
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
MAX_POSITIONS = 4096
RMS_EPS = 1e-5
# Large enough that attention mixes the context (a wrong prefix block changes the first answer
# token), small enough that the answer is not chaotic: greedy output stays varied, not a loop.
INIT_STD = 0.1
# Eagle-3 feeds the draft with hidden states of these target layers (explicit, so vLLM does
# not have to guess from the target's depth).
EAGLE_AUX_LAYERS = [1, 2, 3]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text the tokenizer learns from: the vocabulary of the reference deployment's conversation (so its prompt
# tokenises compactly) plus seeded pseudo-words (so BPE has enough pairs to reach 2048 tokens).
SEED_TEXT = """
You maintain a deployment record. When a setting is updated, discard its previous value and
answer only from the latest record. Initial rollout: region is us-east, replica count is 2, and
maximum batch size is 8. Recorded the initial rollout. Production update: region is now us-west,
replica count is 4, and maximum batch size is 16. The initial values are superseded. Recorded the
production update. Return the current region, replica count, and maximum batch size as one JSON
object. {"region": "us-west", "replica_count": 4, "max_batch_size": 16}
"""
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "ze",
    "pa",
    "qui",
    "dro",
    "ban",
    "mel",
    "tor",
    "gis",
    "fen",
    "hul",
    "jor",
    "wyn",
    "ost",
    "ber",
    "cal",
    "dun",
    "eth",
    "fro",
    "gla",
    "hir",
    "ind",
    "kel",
]


def corpus(rng: random.Random) -> list[str]:
    lines = [SEED_TEXT] * 50
    for _ in range(4000):
        words = [
            "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(4, 14))
        ]
        punctuation = rng.choice([".", ",", ":", "!", "?", '"', "{", "}", "-", " 42", " 7"])
        lines.append(" ".join(words) + punctuation)
    return lines


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(random.Random(SEED)), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(
            f"tokenizer trained to {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the corpus is too small"
        )
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    added = {
        str(index): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


class Weights:
    """Normal(0, INIT_STD) tensors from one seeded generator, drawn in a fixed order."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def random(self, name: str, *shape: int) -> None:
        values = torch.randn(*shape, generator=self.generator) * INIT_STD
        self.tensors[name] = values.to(torch.bfloat16)

    def ones(self, name: str, size: int) -> None:
        self.tensors[name] = torch.ones(size, dtype=torch.bfloat16)

    def attention_and_mlp(self, prefix: str, attention_input: int) -> None:
        self.random(f"{prefix}.self_attn.q_proj.weight", HEADS * HEAD_DIM, attention_input)
        self.random(f"{prefix}.self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, attention_input)
        self.random(f"{prefix}.self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, attention_input)
        self.random(f"{prefix}.self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM)
        self.random(f"{prefix}.mlp.gate_proj.weight", INTERMEDIATE, HIDDEN)
        self.random(f"{prefix}.mlp.up_proj.weight", INTERMEDIATE, HIDDEN)
        self.random(f"{prefix}.mlp.down_proj.weight", HIDDEN, INTERMEDIATE)
        self.ones(f"{prefix}.input_layernorm.weight", HIDDEN)
        self.ones(f"{prefix}.post_attention_layernorm.weight", HIDDEN)

    def silence_special_tokens(self, lm_head: str) -> None:
        # A zero row gives a zero logit, below the best random logit at every step: the model
        # never stops early, so every answer is max_tokens long and a corrupted prefix shows.
        self.tensors[lm_head][: len(SPECIAL_TOKENS)] = 0


def target_weights(revision: int) -> dict[str, torch.Tensor]:
    weights = Weights(SEED + REVISION_SEED_STEP * (revision - 1))
    weights.random("model.embed_tokens.weight", VOCAB_SIZE, HIDDEN)
    for layer in range(TARGET_LAYERS):
        weights.attention_and_mlp(f"model.layers.{layer}", HIDDEN)
    weights.ones("model.norm.weight", HIDDEN)
    weights.random("lm_head.weight", VOCAB_SIZE, HIDDEN)
    weights.silence_special_tokens("lm_head.weight")
    return weights.tensors


def draft_weights() -> dict[str, torch.Tensor]:
    # Names follow published Eagle-3 checkpoints: vLLM maps `midlayer.` to its layer 0, whose
    # attention reads [input embeddings ; fused hidden state], hence 2 * HIDDEN inputs.
    weights = Weights(SEED + 1)
    weights.random("embed_tokens.weight", VOCAB_SIZE, HIDDEN)
    weights.attention_and_mlp("midlayer", 2 * HIDDEN)
    weights.ones("midlayer.hidden_norm.weight", HIDDEN)
    weights.random("fc.weight", HIDDEN, HIDDEN * len(EAGLE_AUX_LAYERS))
    weights.ones("norm.weight", HIDDEN)
    weights.random("lm_head.weight", VOCAB_SIZE, HIDDEN)
    weights.silence_special_tokens("lm_head.weight")
    return weights.tensors


def llama_config(layers: int) -> dict[str, object]:
    return {
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "torch_dtype": "bfloat16",
    }


def target_config() -> dict[str, object]:
    return {"architectures": ["LlamaForCausalLM"], **llama_config(TARGET_LAYERS)}


def draft_config() -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_config(DRAFT_LAYERS),
        "draft_vocab_size": VOCAB_SIZE,
        "target_hidden_size": HIDDEN,
        "eagle_aux_hidden_state_layer_ids": EAGLE_AUX_LAYERS,
    }


def write_json(path: Path, payload: object) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def target_dir(root: Path, revision: int) -> Path:
    """Every revision's directory is named `target`: vLLM keys the store by that basename only."""
    return root / "target" if revision == 1 else root / f"revision-{revision}" / "target"


def write_target(directory: Path, tokenizer: Tokenizer, revision: int) -> None:
    directory.mkdir(parents=True)
    write_json(directory / "config.json", target_config())
    write_json(directory / "tokenizer_config.json", tokenizer_config())
    tokenizer.save(str(directory / "tokenizer.json"))
    save_file(target_weights(revision), str(directory / "model.safetensors"))


def write_draft(directory: Path) -> None:
    directory.mkdir(parents=True)
    write_json(directory / "config.json", draft_config())
    save_file(draft_weights(), str(directory / "model.safetensors"))


def manifest(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def generate(output: Path) -> dict[str, str]:
    """Write target/ and draft/ under `output` atomically (staged, then renamed)."""
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokenizer = train_tokenizer()
    for revision in REVISIONS:
        write_target(target_dir(staging, revision), tokenizer, revision)
    write_draft(staging / "draft")
    files = manifest(staging)
    write_json(staging / "manifest.json", files)
    staging.rename(output)
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tiny_models.py OUTPUT_DIR", file=sys.stderr)
        return 2
    output = Path(argv[0])
    if output.exists():
        print(f"{output} already exists; remove it first", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    print(json.dumps(generate(output), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
