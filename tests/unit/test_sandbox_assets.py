"""What the sandbox builds with the real engine venv: deterministic tiny models, the engine overlays.

Marker `engine`: these need `$MOONCAKE_OPERATOR_CACHE/engine-venv` (`mooncake-operator sandbox prepare`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from mooncake_sandbox.engine_env import EngineEnv, cache_root, installation_problems
from mooncake_sandbox.engines import EngineMode, patcher_script, patcher_status, prepare_engine
from mooncake_sandbox.models import (
    GENERATOR,
    PERTURBATION_GENERATOR,
    REASONING_GENERATOR,
    TinyModels,
    ensure_reasoning_target,
    ensure_tiny_models,
    generate_models,
    models_dir,
    probe_request_json,
    reasoning_dir,
)

pytestmark = pytest.mark.engine

COORDINATOR = Path("distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py")


@pytest.fixture(scope="module")
def engine() -> EngineEnv:
    env = EngineEnv(cache_root() / "engine-venv")
    if not env.python.exists():
        pytest.fail(f"no engine venv at {env.venv}: run `mooncake-operator sandbox prepare` first")
    return env


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_engine_venv_matches_the_pins(engine: EngineEnv) -> None:
    assert installation_problems(engine) == []


def test_tiny_models_are_byte_identical_across_runs(engine: EngineEnv, tmp_path: Path) -> None:
    generate_models(engine, tmp_path / "first")
    generate_models(engine, tmp_path / "second")

    first = json.loads((tmp_path / "first" / "manifest.json").read_text())
    second = json.loads((tmp_path / "second" / "manifest.json").read_text())
    assert first == second
    assert set(first) == {
        "target/config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "revision-2/target/config.json",
        "revision-2/target/model.safetensors",
        "revision-2/target/tokenizer.json",
        "revision-2/target/tokenizer_config.json",
        "draft/config.json",
        "draft/model.safetensors",
    }
    assert all(_digest(tmp_path / "first" / name) == digest for name, digest in first.items())


def test_tiny_models_have_the_shapes_the_sandbox_relies_on(engine: EngineEnv, tmp_path: Path) -> None:
    generate_models(engine, tmp_path / "models")
    target = json.loads((tmp_path / "models" / "target" / "config.json").read_text())
    draft = json.loads((tmp_path / "models" / "draft" / "config.json").read_text())
    tokenizer = json.loads((tmp_path / "models" / "target" / "tokenizer.json").read_text())
    tokenizer_config = json.loads((tmp_path / "models" / "target" / "tokenizer_config.json").read_text())

    assert target["architectures"] == ["LlamaForCausalLM"]
    assert (target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]) == (128, 4, 2048)
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft["num_hidden_layers"] == 1
    assert draft["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert draft["vocab_size"] == draft["draft_vocab_size"] == target["vocab_size"]  # no d2t/t2d
    assert len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"]) >= 2048
    assert "add_generation_prompt" in tokenizer_config["chat_template"]


def test_revision_2_has_other_weights_under_the_same_basename(engine: EngineEnv, tmp_path: Path) -> None:
    generate_models(engine, tmp_path / "models")
    models = TinyModels(tmp_path / "models")
    first, second = models.target_for(1), models.target_for(2)
    assert first.name == second.name == "target"  # vLLM's store key holds only this basename
    assert _digest(first / "model.safetensors") != _digest(second / "model.safetensors")
    for same in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _digest(first / same) == _digest(second / same)


def test_the_model_cache_is_keyed_by_the_generator(tmp_path: Path) -> None:
    assert models_dir(tmp_path).name == hashlib.sha256(GENERATOR.read_bytes()).hexdigest()[:16]


def test_overlays_are_buggy_and_patched_and_the_install_is_untouched(
    engine: EngineEnv, tmp_path: Path
) -> None:
    installed = engine.vllm_package_dir()
    before = _digest(installed / COORDINATOR)

    buggy = prepare_engine(engine, EngineMode.BUGGY, tmp_path, log=print)
    patched = prepare_engine(engine, EngineMode.PATCHED, tmp_path, log=print)

    assert (buggy.patcher_status, patched.patcher_status) == ("buggy", "patched")
    assert "pre-fix shape" in buggy.patcher_detail
    assert _digest(installed / COORDINATOR) == before
    assert patcher_status(engine, patcher_script(), installed)[0] == "fixed-upstream"
    assert (buggy.vllm_dir / COORDINATOR).read_bytes() != (patched.vllm_dir / COORDINATOR).read_bytes()
    # Everything but the coordinator is the installed package itself.
    assert (buggy.vllm_dir / "__init__.py").resolve() == (installed / "__init__.py").resolve()
    # A second call reuses the cached overlay.
    again = prepare_engine(engine, EngineMode.BUGGY, tmp_path, log=lambda line: pytest.fail(line))
    assert again.pythonpath == buggy.pythonpath


# Runs in the engine venv: what the perturbed copy changed, and how far a logit can move.
PERTURBATION_PROBE = """
import json, sys
import torch
from safetensors.torch import load_file
original, perturbed = load_file(sys.argv[1]), load_file(sys.argv[2])
changed = sorted(name for name in original if not torch.equal(original[name], perturbed[name]))
moved = perturbed["lm_head.weight"].float() - original["lm_head.weight"].float()
hidden = moved.shape[1]
# The worst final hidden state for each row (the RMSNorm output has |h| < sqrt(hidden) with gain 1).
worst = float(moved.norm(dim=1).max()) * hidden ** 0.5
h = torch.nn.functional.normalize(torch.randn(64, hidden, generator=torch.Generator().manual_seed(1)), dim=1)
sampled = float((h * hidden ** 0.5 @ moved.T).abs().max())
zero_rows = [int(i) for i in range(3) if perturbed["lm_head.weight"][i].abs().sum() == 0]
print(json.dumps({"changed": changed, "worst": worst, "sampled": sampled, "zero_rows": zero_rows}))
"""


def test_the_perturbed_target_moves_logits_by_at_most_its_bound(engine: EngineEnv, tmp_path: Path) -> None:
    models = ensure_tiny_models(engine, cache_root(), log=print)
    # Generated from the cached tiny models, twice, into directories of this test's own.
    result = subprocess.run(
        [
            str(engine.python),
            str(PERTURBATION_GENERATOR),
            str(models.target),
            str(tmp_path / "a" / "target"),
            "0.1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(result.stdout)
    again = subprocess.run(
        [
            str(engine.python),
            str(PERTURBATION_GENERATOR),
            str(models.target),
            str(tmp_path / "b" / "target"),
            "0.1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(again.stdout) == report
    a, b = tmp_path / "a" / "target", tmp_path / "b" / "target"
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors"), "deterministic"
    for same in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _digest(a / same) == _digest(models.target / same)
    probe = subprocess.run(
        [
            str(engine.python),
            "-c",
            PERTURBATION_PROBE,
            str(models.target / "model.safetensors"),
            str(a / "model.safetensors"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    facts = json.loads(probe.stdout)
    assert facts["changed"] == ["lm_head.weight"], (
        "every layer before lm_head, so every KV block, is unchanged"
    )
    assert facts["zero_rows"] == [0, 1, 2], "special tokens stay silent"
    assert facts["sampled"] <= facts["worst"] <= report["effective_bound_nats"] < 0.1 * 1.5
    assert report["bound_nats"] == 0.1 and 0 < report["typical_move_nats"] < 0.1


def test_the_perturbation_generator_refuses_bad_bounds(engine: EngineEnv, tmp_path: Path) -> None:
    for bound in ("0", "-0.1", "nan", "x"):
        result = subprocess.run(
            [str(engine.python), str(PERTURBATION_GENERATOR), "src", str(tmp_path / "target"), bound],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 2 and "BOUND_NATS" in result.stderr


def _generate_reasoning(engine: EngineEnv, output: Path) -> dict[str, object]:
    result = subprocess.run(
        [str(engine.python), str(REASONING_GENERATOR), str(output), probe_request_json()],
        capture_output=True,
        text=True,
        check=True,
    )
    report: dict[str, object] = json.loads(result.stdout)
    return report


def test_the_reasoning_target_is_byte_identical_across_runs(engine: EngineEnv, tmp_path: Path) -> None:
    first = _generate_reasoning(engine, tmp_path / "a" / "reasoning-target")
    second = _generate_reasoning(engine, tmp_path / "b" / "reasoning-target")

    assert first == second
    names = ["config.json", "model.safetensors", "reasoning.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(path.name for path in (tmp_path / "a" / "reasoning-target").iterdir()) == names
    for name in names:
        assert _digest(tmp_path / "a" / "reasoning-target" / name) == _digest(
            tmp_path / "b" / "reasoning-target" / name
        ), name


def test_the_reasoning_generator_refuses_bad_input(engine: EngineEnv, tmp_path: Path) -> None:
    for probe in ("not json", "{}", json.dumps({"messages": [], "max_tokens": 10})):
        result = subprocess.run(
            [str(engine.python), str(REASONING_GENERATOR), str(tmp_path / "out"), probe],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 2 and "PROBE_REQUEST_JSON" in result.stderr, probe
        assert not (tmp_path / "out").exists()


# Runs in the engine venv: the reasoning target's tokens and template as vLLM's tokenizer loads them, its
# weights against the plain target's, and vLLM's own minimax_m2 parser on the probe's greedy answer.
REASONING_PROBE = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
sys.path.insert(0, sys.argv[3])
import reasoning_model
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager
from vllm.tokenizers import get_tokenizer

plain, target, request = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[4])
facts = json.loads((target / "reasoning.json").read_text())
tokenizer = get_tokenizer(str(target))
rendered = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=False)
ids = tokenizer.encode("x</think>y<think>z", add_special_tokens=False)
weights, base = load_file(str(target / "model.safetensors")), load_file(str(plain / "model.safetensors"))
head, base_head = weights["lm_head.weight"], base["lm_head.weight"]
answer = reasoning_model.Probe(target, request).run(weights).answer
parser = ReasoningParserManager.get_reasoning_parser("minimax_m2")(tokenizer)
reasoning, content = parser.extract_reasoning(
    tokenizer.decode(answer, skip_special_tokens=True), ChatCompletionRequest(**request)
)
print(json.dumps({
    "facts": facts,
    "template_tail": rendered[-30:],
    "ids": ids,
    "text": tokenizer.decode(ids, skip_special_tokens=True),
    "same_but_lm_head": sorted(n for n in base if n != "lm_head.weight" and torch.equal(base[n], weights[n])),
    "names": sorted(weights),
    "zero_rows": [i for i in range(head.shape[0]) if head[i].abs().sum() == 0],
    "other_rows_unchanged": bool(torch.equal(head[5:], base_head[5:])),
    "answer": answer,
    "reasoning": reasoning,
    "content": content,
}))
"""


def test_the_reasoning_target_thinks_then_answers_for_vllms_minimax_m2_parser(engine: EngineEnv) -> None:
    models = ensure_tiny_models(engine, cache_root(), log=print)
    target = ensure_reasoning_target(engine, models, log=print)
    assert target.path == reasoning_dir(models) and target.path.name != models.target.name
    probe = subprocess.run(
        [
            str(engine.python),
            "-c",
            REASONING_PROBE,
            str(models.target),
            str(target.path),
            str(REASONING_GENERATOR.parent),
            probe_request_json(),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    facts = json.loads(probe.stdout.splitlines()[-1])
    report = facts["facts"]
    # The template opens the think block; the markers are single, non-special tokens (kept in the text).
    assert facts["template_tail"].endswith("<|im_start|>assistant\n<think>\n")
    assert facts["ids"][1] == 4 and facts["ids"][3] == 3 and len(facts["ids"]) == 5
    assert facts["text"] == "x</think>y<think>z"
    # Every tensor but lm_head is the plain target's (revision 1's seeded draws).
    assert facts["same_but_lm_head"] == [name for name in facts["names"] if name != "lm_head.weight"]
    # `<think>` is silent like the special tokens; `</think>` has a row of its own, every other row is
    # the plain target's.
    assert facts["zero_rows"] == [0, 1, 2, 3] and facts["other_rows_unchanged"]
    assert report["margin"] >= 1.15
    # On the reference request: reasoning of the reported length, then `</think>` and an answer, which
    # vLLM's parser splits at that first `</think>`.
    steps = report["probe_reasoning_tokens"]
    assert steps == target.probe_reasoning_tokens and 8 <= steps <= 16
    answer = facts["answer"]
    assert answer.index(4) == steps and answer.count(4) == report["probe_think_ends"]
    assert facts["reasoning"] and facts["content"]
    assert "</think>" not in facts["reasoning"]
