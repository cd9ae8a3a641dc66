#!/usr/bin/env python3
"""Checks, fixes and proves vLLM's MooncakeStore Eagle load mask (upstream vLLM PR #43516).

With Eagle speculative decoding, ``client.lookup`` already drops the last hit block, and the
pre-fix ``MooncakeStoreCoordinator.load_mask`` dropped it a second time: the receiving replica
skipped one block that its scheduler had counted as cached and answered from uninitialised KV.

    patch_connector.py status [--vllm-dir DIR]   one word: fixed-upstream | patched | buggy | unknown
    patch_connector.py apply  [--vllm-dir DIR]   make a buggy coordinator fixed (idempotent, atomic)
    patch_connector.py verify [--vllm-dir DIR]   run the real coordinator and check its masks

DIR is the ``vllm`` package directory; without it the package is located without importing it.
``status`` and ``apply`` read and write nothing but
``<DIR>/distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py`` (and its bytecode);
``verify`` imports vLLM and changes no source (Python may cache bytecode, as for any import).
Exit codes: 0 fixed-upstream/patched/verified, 1 buggy or verification failed, 2 unknown shape
(apply refuses, the file stays byte-identical), 3 environment error (no vLLM, unwritable file,
vLLM not importable).

Standard library only: this runs inside the engine image before anything else is installed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import itertools
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

COORDINATOR_RELPATH = Path("distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py")
COORDINATOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator"
# A comment line: it leaves the module's AST, and so the fixed code, untouched.
MARKER = (
    "# mooncake-operator: load_mask Eagle double-prune fix (vLLM PR #43516) applied by patch_connector.py"
)

FIXED_UPSTREAM = "fixed-upstream"
PATCHED = "patched"
BUGGY = "buggy"
UNKNOWN = "unknown"
STATUS_EXIT = {FIXED_UPSTREAM: 0, PATCHED: 0, BUGGY: 1, UNKNOWN: 2}
EXIT_FAILED = 1
EXIT_UNKNOWN = 2
EXIT_ENVIRONMENT = 3

CLASS_NAME = "MooncakeStoreCoordinator"
LOOKUP = "find_longest_cache_hit"
LOAD_MASK = "load_mask"
HIT_BLOCKS = "_find_hit_blocks"
FLAG = "apply_eagle"
INDEX_SET_ATTR = "eagle_attn_group_indices"  # vLLM 0.22-0.26: a set of attention-group indices
GATED_INDICES = "eagle_indices"  # the local the fix reads instead of that set

EXPECTED = (
    f"a class {CLASS_NAME} with {LOOKUP}(), {LOAD_MASK}() calling self.{LOOKUP}() once, and "
    f"{HIT_BLOCKS}() that picks the Eagle groups from self.{INDEX_SET_ATTR} (vLLM 0.22-0.26) or from "
    "an eagle flag unpacked from self.attention_groups (vLLM 0.27+); either no apply_eagle at all "
    "(pre-fix) or apply_eagle gating every Eagle pick (fixed)"
)


class ShapeError(Exception):
    """The coordinator is not a shape this patcher knows how to judge or fix (exit 2)."""


class EnvironmentProblem(Exception):
    """vLLM is missing, not importable, or a file cannot be written (exit 3)."""


@dataclass(frozen=True)
class Shape:
    state: str
    detail: str


# ---------------------------------------------------------------------------------------------
# Structural analysis (ast). Recognises by structure, not by hash, so unrelated upstream drift
# still classifies; strict about the three methods the fix touches.


@dataclass(frozen=True)
class _EagleUse:
    """One place where _find_hit_blocks reads which groups get the Eagle pop."""

    node: ast.expr
    parent: ast.AST
    gated: bool  # only effective when apply_eagle is true


@dataclass(frozen=True)
class _Analysis:
    tree: ast.Module
    cls: ast.ClassDef
    lookup: ast.FunctionDef
    load_mask: ast.FunctionDef
    hit_blocks: ast.FunctionDef
    inner_call: ast.Call  # lookup -> self._find_hit_blocks(...)
    mask_call: ast.Call  # load_mask -> self.find_longest_cache_hit(...)
    eagle_uses: tuple[_EagleUse, ...]
    mentions_flag: bool


def _is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and _is_name(node.value, "self")


def _is_const(node: ast.AST | None, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _parents(root: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def _self_calls(fn: ast.FunctionDef, method: str) -> list[ast.Call]:
    return [node for node in ast.walk(fn) if isinstance(node, ast.Call) and _is_self_attr(node.func, method)]


def _keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((kw for kw in call.keywords if kw.arg == name), None)


def _flag_param(fn: ast.FunctionDef) -> tuple[ast.arg, ast.expr | None] | None:
    args = fn.args
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if arg.arg == FLAG:
            return arg, default
    return None


def _mentions_flag(root: ast.AST) -> bool:
    for node in ast.walk(root):
        if isinstance(node, ast.arg) and node.arg == FLAG:
            return True
        if isinstance(node, ast.Name) and node.id == FLAG:
            return True
        if isinstance(node, ast.keyword) and node.arg == FLAG:
            return True
    return False


def _tuple_names(target: ast.AST) -> Iterator[ast.Name]:
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            if isinstance(element, ast.Name):
                yield element
            else:
                yield from _tuple_names(element)


def _eagle_flag_names(fn: ast.FunctionDef) -> set[str]:
    """Names unpacked from ``self.attention_groups`` that carry a group's Eagle flag (0.27+)."""

    def from_groups(expr: ast.AST) -> bool:
        return any(_is_self_attr(node, "attention_groups") for node in ast.walk(expr))

    names: set[str] = set()
    for node in ast.walk(fn):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Assign):
            pairs = [(target, node.value) for target in node.targets]
        elif isinstance(node, ast.For):
            pairs = [(node.target, node.iter)]
        for target, value in pairs:
            if from_groups(value):
                names.update(n.id for n in _tuple_names(target) if "eagle" in n.id)
    return names


def _index_set_gated(node: ast.expr, parent: ast.AST) -> bool:
    # self.eagle_attn_group_indices if apply_eagle else set()
    return (
        isinstance(parent, ast.IfExp)
        and parent.body is node
        and _is_name(parent.test, FLAG)
        and isinstance(parent.orelse, ast.Call)
        and _is_name(parent.orelse.func, "set")
        and not parent.orelse.args
        and not parent.orelse.keywords
    )


def _flag_gated(node: ast.expr, parent: ast.AST) -> bool:
    # apply_eagle and <flag> [and ...]
    if not (isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.And)):
        return False
    position = next(i for i, value in enumerate(parent.values) if value is node)
    return any(_is_name(value, FLAG) for value in parent.values[:position])


def _eagle_uses(fn: ast.FunctionDef) -> tuple[_EagleUse, ...]:
    parents = _parents(fn)
    flags = _eagle_flag_names(fn)
    uses: list[_EagleUse] = []
    for node in ast.walk(fn):
        if (
            _is_self_attr(node, INDEX_SET_ATTR)
            and isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
        ):
            parent = parents[id(node)]
            uses.append(_EagleUse(node, parent, _index_set_gated(node, parent)))
        elif isinstance(node, ast.Name) and node.id in flags and isinstance(node.ctx, ast.Load):
            parent = parents[id(node)]
            uses.append(_EagleUse(node, parent, _flag_gated(node, parent)))
    return tuple(sorted(uses, key=lambda use: (use.node.lineno, use.node.col_offset)))


def _single_call(fn: ast.FunctionDef, method: str) -> ast.Call:
    calls = _self_calls(fn, method)
    if len(calls) != 1:
        raise ShapeError(f"{fn.name}() calls self.{method}() {len(calls)} times (expected once)")
    return calls[0]


def _analyse(source: bytes) -> _Analysis:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as error:
        raise ShapeError(f"not valid Python ({error})") from None
    cls = next(
        (node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == CLASS_NAME),
        None,
    )
    if cls is None:
        raise ShapeError(f"no top-level class {CLASS_NAME}")
    methods = {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
    missing = [name for name in (LOOKUP, LOAD_MASK, HIT_BLOCKS) if name not in methods]
    if missing:
        raise ShapeError(f"{CLASS_NAME} has no {', '.join(m + '()' for m in missing)}")
    lookup, load_mask, hit_blocks = methods[LOOKUP], methods[LOAD_MASK], methods[HIT_BLOCKS]
    eagle_uses = _eagle_uses(hit_blocks)
    if not eagle_uses:
        raise ShapeError(
            f"{HIT_BLOCKS}() reads neither self.{INDEX_SET_ATTR} nor an eagle flag unpacked from "
            "self.attention_groups: cannot see where it applies the Eagle pop"
        )
    return _Analysis(
        tree=tree,
        cls=cls,
        lookup=lookup,
        load_mask=load_mask,
        hit_blocks=hit_blocks,
        inner_call=_single_call(lookup, HIT_BLOCKS),
        mask_call=_single_call(load_mask, LOOKUP),
        eagle_uses=eagle_uses,
        mentions_flag=_mentions_flag(cls),
    )


def _fix_gaps(analysis: _Analysis) -> list[str]:
    """What is missing from the lookup half of the fix (empty: the lookup half is complete)."""
    gaps = []
    for fn in (analysis.lookup, analysis.hit_blocks):
        param = _flag_param(fn)
        if param is None:
            gaps.append(f"{fn.name}() has no keyword-only parameter {FLAG}")
        elif not _is_const(param[1], True):
            gaps.append(f"{fn.name}()'s {FLAG} does not default to True")
    passed = _keyword(analysis.inner_call, FLAG)
    if passed is None or not _is_name(passed.value, FLAG):
        gaps.append(f"{LOOKUP}() does not pass {FLAG}={FLAG} to {HIT_BLOCKS}()")
    for use in analysis.eagle_uses:
        if not use.gated:
            gaps.append(f"{HIT_BLOCKS}() line {use.node.lineno} reads {ast.unparse(use.node)} ungated")
    return gaps


def _has_marker(source: bytes) -> bool:
    return any(line.strip() == MARKER.encode() for line in source.splitlines())


def _shape_of(analysis: _Analysis, source: bytes) -> Shape:
    if not analysis.mentions_flag:
        if any(use.gated for use in analysis.eagle_uses):  # gated without the flag: impossible
            raise ShapeError("Eagle picks are gated although apply_eagle is never defined")
        return Shape(
            BUGGY,
            "pre-fix shape: no apply_eagle anywhere, so load_mask re-applies the Eagle pop "
            "that the lookup already applied",
        )
    gaps = _fix_gaps(analysis)
    if gaps:
        raise ShapeError("partly fixed: " + "; ".join(gaps))
    passed = _keyword(analysis.mask_call, FLAG)
    if passed is None or _is_const(passed.value, True):
        return Shape(
            BUGGY,
            f"{LOAD_MASK}() calls {LOOKUP}() without {FLAG}=False, so the Eagle pop is applied twice",
        )
    if not _is_const(passed.value, False):
        raise ShapeError(f"{LOAD_MASK}() passes {FLAG}={ast.unparse(passed.value)} (expected False)")
    if _has_marker(source):
        return Shape(PATCHED, "the fix of vLLM PR #43516, applied by this patcher")
    return Shape(FIXED_UPSTREAM, "this vLLM release already carries the fix of vLLM PR #43516")


def classify(source: bytes) -> Shape:
    """The state of one coordinator.py's bytes."""
    try:
        return _shape_of(_analyse(source), source)
    except ShapeError as error:
        return Shape(UNKNOWN, str(error))


# ---------------------------------------------------------------------------------------------
# The fix, as byte-range edits located by the AST (col_offset counts UTF-8 bytes).


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: bytes


_Located = ast.expr | ast.stmt | ast.arg | ast.keyword


class _Source:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.newline = b"\r\n" if b"\r\n" in data else b"\n"
        self._line_starts = [0] + [match.end() for match in re.finditer(rb"\n", data)]

    def line_start(self, lineno: int) -> int:
        return self._line_starts[lineno - 1]

    def start(self, node: _Located) -> int:
        return self.line_start(node.lineno) + node.col_offset

    def end(self, node: _Located) -> int:
        assert node.end_lineno is not None and node.end_col_offset is not None
        return self.line_start(node.end_lineno) + node.end_col_offset

    def line_indent(self, lineno: int) -> bytes:
        match = re.compile(rb"[ \t]*").match(self.data, self.line_start(lineno))
        assert match is not None
        return match.group()

    def text(self, node: _Located) -> bytes:
        return self.data[self.start(node) : self.end(node)]


def _apply_edits(data: bytes, edits: Sequence[_Edit]) -> bytes:
    ordered = sorted(edits, key=lambda edit: (edit.start, edit.end))
    for before, after in itertools.pairwise(ordered):
        if before.end > after.start:
            raise ShapeError("internal error: overlapping edits")
    out = data
    for edit in reversed(ordered):
        out = out[: edit.start] + edit.text + out[edit.end :]
    return out


_CLOSING = re.compile(rb"(\s*,)?(?:\s|#[^\n]*)*\)")


def _append_items(src: _Source, nodes: Sequence[_Located], items: Sequence[bytes], what: str) -> _Edit:
    """Append items after the last of ``nodes`` in a parenthesised list, in the list's own
    layout: one per line when it ends with a trailing comma, inline otherwise."""
    if not nodes:
        raise ShapeError(f"{what} is empty; expected at least one item before the new one")
    last = max(nodes, key=src.end)
    closing = _CLOSING.match(src.data, src.end(last))
    if closing is None:
        raise ShapeError(f"cannot find the closing parenthesis of {what}")
    if closing.group(1):
        indent = src.line_indent(last.lineno)
        at = closing.end(1)
        return _Edit(at, at, b"".join(src.newline + indent + item + b"," for item in items))
    at = src.end(last)
    return _Edit(at, at, b"".join(b", " + item for item in items))


def _signature_edit(src: _Source, fn: ast.FunctionDef) -> _Edit:
    args = fn.args
    if args.vararg is not None or args.kwarg is not None:
        raise ShapeError(f"{fn.name}() takes *args/**kwargs; expected plain parameters")
    nodes: list[_Located] = [*args.posonlyargs, *args.args, *args.defaults, *args.kwonlyargs]
    nodes += [default for default in args.kw_defaults if default is not None]
    items = [f"{FLAG}: bool = True".encode()]
    if not args.kwonlyargs:
        items.insert(0, b"*")
    return _append_items(src, nodes, items, f"{fn.name}()'s parameter list")


def _call_keyword_edits(src: _Source, call: ast.Call, value: bytes, what: str) -> list[_Edit]:
    if any(kw.arg is None for kw in call.keywords) or any(isinstance(arg, ast.Starred) for arg in call.args):
        raise ShapeError(f"{what} passes *args/**kwargs; expected plain arguments")
    present = _keyword(call, FLAG)
    if present is not None:  # apply_eagle=True -> apply_eagle=False
        return [_Edit(src.start(present.value), src.end(present.value), value)]
    item = FLAG.encode() + b"=" + value
    return [_append_items(src, [*call.args, *call.keywords], [item], what)]


def _body_start(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    has_docstring = (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    if has_docstring and len(body) > 1:
        return body[1]
    return body[0]


def _gate_edits(src: _Source, analysis: _Analysis) -> list[_Edit]:
    fn = analysis.hit_blocks
    ungated = [use for use in analysis.eagle_uses if not use.gated]
    edits: list[_Edit] = []
    index_set = [use for use in ungated if isinstance(use.node, ast.Attribute)]
    if index_set:
        if any(isinstance(n, ast.Name) and n.id == GATED_INDICES for n in ast.walk(fn)):
            raise ShapeError(f"{HIT_BLOCKS}() already uses a name {GATED_INDICES}")
        first = _body_start(fn)
        indent = src.line_indent(first.lineno)
        if src.start(first) != src.line_start(first.lineno) + len(indent):
            raise ShapeError(f"{HIT_BLOCKS}()'s body does not start on its own line")
        line = f"{GATED_INDICES} = self.{INDEX_SET_ATTR} if {FLAG} else set()".encode()
        at = src.line_start(first.lineno)
        edits.append(_Edit(at, at, indent + line + src.newline))
        edits += [_Edit(src.start(u.node), src.end(u.node), GATED_INDICES.encode()) for u in index_set]
    for use in ungated:
        if isinstance(use.node, ast.Attribute):
            continue
        gated = FLAG.encode() + b" and " + src.text(use.node)
        bare = isinstance(use.parent, ast.keyword | ast.Assign) or (
            isinstance(use.parent, ast.BoolOp) and isinstance(use.parent.op, ast.And)
        )
        edits.append(_Edit(src.start(use.node), src.end(use.node), gated if bare else b"(" + gated + b")"))
    return edits


def _marker_edit(src: _Source, cls: ast.ClassDef) -> _Edit:
    first_line = min([cls.lineno, *(decorator.lineno for decorator in cls.decorator_list)])
    at = src.line_start(first_line)
    return _Edit(at, at, MARKER.encode() + src.newline)


def _outside_fix(analysis: _Analysis) -> list[str]:
    """Everything the fix must not change, as AST dumps."""
    touched = {id(analysis.lookup), id(analysis.load_mask), id(analysis.hit_blocks)}
    module = [ast.dump(node) for node in analysis.tree.body if node is not analysis.cls]
    cls = [ast.dump(node) for node in analysis.cls.body if id(node) not in touched]
    return module + cls + [ast.dump(d) for d in analysis.cls.decorator_list]


def patch_source(source: bytes) -> bytes:
    """The fixed bytes for a buggy coordinator; the same bytes for a fixed one.

    Raises ShapeError for a shape it does not know (nothing is written by the caller then)."""
    analysis = _analyse(source)
    shape = _shape_of(analysis, source)
    if shape.state != BUGGY:
        return source
    src = _Source(source)
    edits: list[_Edit] = []
    if not analysis.mentions_flag:  # pre-fix: the lookup half of the fix is missing too
        edits.append(_signature_edit(src, analysis.lookup))
        edits.append(_signature_edit(src, analysis.hit_blocks))
        edits += _call_keyword_edits(src, analysis.inner_call, FLAG.encode(), f"{LOOKUP}()'s call")
        edits += _gate_edits(src, analysis)
    edits += _call_keyword_edits(src, analysis.mask_call, b"False", f"{LOAD_MASK}()'s call")
    if not _has_marker(source):
        edits.append(_marker_edit(src, analysis.cls))
    patched = _apply_edits(source, edits)
    result = classify(patched)
    if result.state != PATCHED:
        raise ShapeError(f"internal error: the patched text classifies as {result.state} ({result.detail})")
    if _outside_fix(_analyse(patched)) != _outside_fix(analysis):
        raise ShapeError("internal error: the patch changed code outside the three fixed methods")
    return patched


# ---------------------------------------------------------------------------------------------
# Files.


def locate_vllm_dir(explicit: Path | None) -> Path:
    """The vllm package directory, found without importing vllm (its import is heavy)."""
    if explicit is not None:
        if not explicit.is_dir():
            raise EnvironmentProblem(f"--vllm-dir {explicit}: not a directory")
        if not (explicit / "__init__.py").is_file():
            raise EnvironmentProblem(
                f"--vllm-dir {explicit}: no __init__.py; pass the vllm package directory "
                "(for example .../site-packages/vllm)"
            )
        return explicit
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem(
            f"vLLM is not installed for {sys.executable}; install it, or pass --vllm-dir DIR "
            "(the vllm package directory)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def read_coordinator(vllm_dir: Path) -> tuple[Path, bytes | None]:
    path = vllm_dir / COORDINATOR_RELPATH
    if not path.exists():
        return path, None
    try:
        return path, path.read_bytes()
    except OSError as error:
        raise EnvironmentProblem(f"cannot read {path}: {error.strerror}") from None


def missing_coordinator_detail(path: Path) -> str:
    if path.parent.is_dir():
        return (
            f"no {path.name} in {path.parent}: this vLLM predates {CLASS_NAME} (vLLM 0.21 ships the "
            "store connector without it), so there is no coordinator whose load_mask can be "
            "checked or fixed"
        )
    return f"no MooncakeStore connector in this vLLM ({path.parent} does not exist)"


def classify_file(vllm_dir: Path) -> tuple[Path, Shape]:
    path, data = read_coordinator(vllm_dir)
    if data is None:
        return path, Shape(UNKNOWN, missing_coordinator_detail(path))
    return path, classify(data)


def _remove_bytecode(path: Path) -> None:
    cache = path.parent / "__pycache__"
    for compiled in sorted(cache.glob(f"{path.stem}.*.pyc")):
        try:
            compiled.unlink()
        except OSError as error:
            raise EnvironmentProblem(
                f"cannot remove stale bytecode {compiled}: {error.strerror}; nothing was changed"
            ) from None


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: readers see the old or the new file, never
    half of one. Refuses a read-only file: someone made it so on purpose."""
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if not mode & 0o222:
        raise EnvironmentProblem(
            f"{path} is read-only (mode {mode:o}); make it writable (chmod u+w) and rerun. "
            "Nothing was changed"
        )
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise EnvironmentProblem(
            f"cannot write next to {path}: {error.strerror}. Nothing was changed"
        ) from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        if os.geteuid() == 0:
            os.chown(tmp, info.st_uid, info.st_gid)
        # Bytecode goes first: if the rename then fails, only a cache was lost.
        _remove_bytecode(path)
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise EnvironmentProblem(f"cannot write {path}: {error.strerror}. Nothing was changed") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# The behavioural check: the real coordinator, real KV cache specs, the connector's contract
# "load_mask(lookup's hit) loads every block the lookup counted".

BLOCK = 16  # tokens per block; scheduler, hash and group block sizes are all this
STORED_BLOCKS = 4
WINDOW = 2 * BLOCK  # sliding window of the hybrid layout


@dataclass(frozen=True)
class Scenario:
    name: str
    kinds: tuple[str, ...]  # "full-eagle" | "full" | "swa", one per KV cache group
    use_eagle: bool
    expected_hit_blocks: int


SCENARIOS = (
    Scenario("eagle, full attention", ("full-eagle",), True, STORED_BLOCKS - 1),
    Scenario("eagle, full attention + sliding window", ("full-eagle", "swa"), True, STORED_BLOCKS - 1),
    Scenario("no eagle, full attention", ("full",), False, STORED_BLOCKS),
)


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    hit_tokens: int
    lookup_masks: list[list[bool]]
    load_masks: list[list[bool]]
    problems: tuple[str, ...]


def _check_masks(scenario: Scenario, hit: int, lookup: list[list[bool]], load: list[list[bool]]) -> list[str]:
    problems = []
    expected_hit = scenario.expected_hit_blocks * BLOCK
    if hit != expected_hit:
        problems.append(f"lookup hit {hit} tokens, expected {expected_hit}")
    if len(load) != len(scenario.kinds):
        return [*problems, f"load_mask returned {len(load)} groups, expected {len(scenario.kinds)}"]
    blocks = hit // BLOCK
    for group, (kind, mask) in enumerate(zip(scenario.kinds, load, strict=True)):
        if kind.startswith("full") and mask != [True] * blocks:
            problems.append(f"group {group} ({kind}): load_mask {mask}, expected {[True] * blocks}")
        elif kind == "swa" and (len(mask) != blocks or not mask or not mask[-1]):
            problems.append(f"group {group} ({kind}): load_mask {mask} misses the trailing block")
    if load != lookup:
        problems.append(f"load_mask {load} differs from the lookup's own masks {lookup}")
    return problems


def _build_spec(cls: type, **fields: Any) -> Any:
    import torch  # type: ignore[import-not-found,unused-ignore]  # vLLM's own dependency

    return cls(num_kv_heads=1, head_size=8, dtype=torch.float16, **fields)


def run_scenario(coordinator: ModuleType, scenario: Scenario) -> Outcome:
    import inspect

    from vllm.v1.core.kv_cache_utils import BlockHash  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    specs = {
        "full": lambda: _build_spec(FullAttentionSpec, block_size=BLOCK),
        "full-eagle": lambda: _build_spec(FullAttentionSpec, block_size=BLOCK),
        "swa": lambda: _build_spec(SlidingWindowSpec, block_size=BLOCK, sliding_window=WINDOW),
    }
    groups = [
        KVCacheGroupSpec(
            layer_names=[f"layer{i}"], kv_cache_spec=specs[kind](), is_eagle_group=kind == "full-eagle"
        )
        for i, kind in enumerate(scenario.kinds)
    ]
    hashes = [BlockHash(bytes([n]) * 32) for n in range(1, STORED_BLOCKS + 1)]
    stored = {(group, bytes(h)) for group in range(len(groups)) for h in hashes}
    pool_cls: Callable[..., Any] = coordinator.ExternalCachedBlockPool
    # vLLM 0.23+ takes the hash block size first; 0.22 takes only the exists set.
    pool_args = [BLOCK] if "hash_block_size" in inspect.signature(pool_cls).parameters else []
    coord = coordinator.MooncakeStoreCoordinator(groups, BLOCK, BLOCK, use_eagle=scenario.use_eagle)
    lookup_masks, hit = coord.find_longest_cache_hit(
        hashes, STORED_BLOCKS * BLOCK, pool_cls(*pool_args, stored)
    )
    load_masks = coord.load_mask(hashes, hit)
    lookup = [list(mask) for mask in lookup_masks]
    load = [list(mask) for mask in load_masks]
    return Outcome(scenario, hit, lookup, load, tuple(_check_masks(scenario, hit, lookup, load)))


def import_coordinator(vllm_dir: Path, explicit: bool) -> ModuleType:
    if explicit:  # make this vllm the one `import vllm` finds
        sys.path.insert(0, os.path.abspath(vllm_dir.parent))
    try:
        module = importlib.import_module(COORDINATOR_MODULE)
    except Exception as error:  # any import failure means: cannot verify
        raise EnvironmentProblem(
            f"cannot import {COORDINATOR_MODULE}: {type(error).__name__}: {error}"
        ) from None
    imported = os.path.realpath(str(module.__file__))
    expected = os.path.realpath(vllm_dir / COORDINATOR_RELPATH)
    if imported != expected:
        raise EnvironmentProblem(
            f"imported {module.__file__}, not {vllm_dir / COORDINATOR_RELPATH}: another vLLM comes "
            "first on sys.path, so checking it would prove nothing about this one"
        )
    return module


def verify(vllm_dir: Path, explicit: bool) -> int:
    coordinator = import_coordinator(vllm_dir, explicit)
    version = getattr(sys.modules.get("vllm"), "__version__", "unknown version")
    print(f"verify: vLLM {version}, {coordinator.__file__}")
    failed = False
    for scenario in SCENARIOS:
        try:
            outcome = run_scenario(coordinator, scenario)
        except Exception as error:  # a coordinator that cannot even run the scenario proves nothing
            failed = True
            print(f"  FAIL  {scenario.name}: raised {type(error).__name__}: {error}")
            continue
        observed = f"lookup hit {outcome.hit_tokens} tokens, load_mask {outcome.load_masks}"
        if outcome.problems:
            failed = True
            print(f"  FAIL  {scenario.name}: {observed}")
            for problem in outcome.problems:
                print(f"          {problem}")
        else:
            print(f"  ok    {scenario.name}: {observed}")
    if failed:
        print("verify: FAILED - load_mask does not load every block that the lookup counted as cached")
        return EXIT_FAILED
    print("verify: passed - load_mask loads every block the lookup counted")
    return 0


# ---------------------------------------------------------------------------------------------
# Command line.


def cmd_status(args: argparse.Namespace) -> int:
    path, shape = classify_file(locate_vllm_dir(args.vllm_dir))
    print(shape.state)
    print(f"{path}: {shape.detail}", file=sys.stderr)
    return STATUS_EXIT[shape.state]


def cmd_apply(args: argparse.Namespace) -> int:
    path, data = read_coordinator(locate_vllm_dir(args.vllm_dir))
    if data is None:
        raise ShapeError(f"refusing to patch: {missing_coordinator_detail(path)}")
    shape = classify(data)
    if shape.state == UNKNOWN:
        raise ShapeError(
            f"refusing to patch {path}: unknown shape. Expected {EXPECTED}. Found: {shape.detail}. "
            "The file is unchanged"
        )
    if shape.state != BUGGY:
        print(shape.state)
        print(f"{path}: {shape.detail}; nothing to do", file=sys.stderr)
        return 0
    write_atomically(path, patch_source(data))
    print(PATCHED)
    print(f"{path}: was {shape.detail}; now load_mask passes apply_eagle=False", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    explicit = args.vllm_dir is not None
    return verify(locate_vllm_dir(args.vllm_dir), explicit)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patch_connector.py",
        description="Check, fix and prove vLLM's MooncakeStore Eagle load_mask (vLLM PR #43516).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, func, help_text in (
        ("status", cmd_status, "print fixed-upstream | patched | buggy | unknown (exit 0, 0, 1, 2)"),
        ("apply", cmd_apply, "fix a buggy coordinator in place (atomic, idempotent)"),
        ("verify", cmd_verify, "import the real coordinator and check its load masks"),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--vllm-dir", type=Path, help="the vllm package directory")
        command.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ShapeError as error:
        print(f"patch_connector: {error}", file=sys.stderr)
        return EXIT_UNKNOWN
    except EnvironmentProblem as error:
        print(f"patch_connector: error: {error}", file=sys.stderr)
        return EXIT_ENVIRONMENT


if __name__ == "__main__":
    sys.exit(main())
