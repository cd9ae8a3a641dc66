"""Buggy variants of vLLM's MooncakeStore coordinator, built from a fixed upstream file.

The sandbox runs the buggy engine next to the fixed one so the canary can be shown to catch the
Eagle double prune (upstream vLLM PR #43516), and the patcher's tests revert real upstream code to
the shapes it must recognise. Everything here is text and ast: vLLM is never imported, and the
user's vLLM install is never modified (an overlay package shadows it instead).

- `reintroduce_double_prune`: the later-release regression, a fixed file whose `load_mask` lost
  `apply_eagle=False`.
- `revert_to_prefix_shape`: the pre-fix shape (what main looked like before PR #43516): no
  `apply_eagle` anywhere, `_find_hit_blocks` applies the Eagle pop unconditionally.
- `make_buggy_overlay`: a private `vllm` package whose coordinator holds a buggy shape.
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import shutil
import tempfile
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path, PurePosixPath

COORDINATOR_RELPATH = PurePosixPath("distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py")
OVERLAY_STAMP = ".mooncake-operator-overlay"

_CLASS = "MooncakeStoreCoordinator"
_LOOKUP = "find_longest_cache_hit"
_LOAD_MASK = "load_mask"
_HIT_BLOCKS = "_find_hit_blocks"
_FLAG = "apply_eagle"
_INDEX_SET = "self.eagle_attn_group_indices"

Transform = Callable[[str], str]


class BuggyEngineError(ValueError):
    """The source is not a fixed coordinator these transforms understand."""


_Located = ast.expr | ast.stmt | ast.arg | ast.keyword


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: bytes


class _Source:
    """UTF-8 bytes with ast positions mapped to offsets (ast columns count bytes)."""

    def __init__(self, text: str) -> None:
        self.data = text.encode("utf-8")
        self._line_starts = [0] + [m.end() for m in re.finditer(rb"\n", self.data)]
        self.tree = ast.parse(self.data)

    def line_start(self, lineno: int) -> int:
        return self._line_starts[lineno - 1]

    def line_end(self, lineno: int) -> int:
        """Offset just past the newline ending `lineno`."""
        return self._line_starts[lineno] if lineno < len(self._line_starts) else len(self.data)

    def start(self, node: _Located) -> int:
        return self.line_start(node.lineno) + node.col_offset

    def end(self, node: _Located) -> int:
        assert node.end_lineno is not None and node.end_col_offset is not None
        return self.line_start(node.end_lineno) + node.end_col_offset

    def apply(self, edits: Sequence[_Edit]) -> str:
        ordered = sorted(edits, key=lambda edit: (edit.start, edit.end))
        for before, after in itertools.pairwise(ordered):
            if before.end > after.start:
                raise BuggyEngineError("internal error: overlapping edits")
        out = self.data
        for edit in reversed(ordered):
            out = out[: edit.start] + edit.text + out[edit.end :]
        return out.decode("utf-8")


def _is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and _is_name(node.value, "self")


def _methods(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == _CLASS:
            found = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
            missing = [m for m in (_LOOKUP, _LOAD_MASK, _HIT_BLOCKS) if m not in found]
            if missing:
                raise BuggyEngineError(f"{_CLASS} has no {', '.join(missing)}")
            return found
    raise BuggyEngineError(f"no top-level class {_CLASS}: not vLLM's MooncakeStore coordinator")


def _single_call(fn: ast.FunctionDef, method: str) -> ast.Call:
    calls = [node for node in ast.walk(fn) if isinstance(node, ast.Call) and _is_self_attr(node.func, method)]
    if len(calls) != 1:
        raise BuggyEngineError(f"{fn.name}() calls self.{method}() {len(calls)} times, expected once")
    return calls[0]


def _remove_item(src: _Source, items: Sequence[_Located], item: _Located) -> _Edit:
    """Delete one item of a comma-separated list together with one neighbouring comma."""
    ordered = sorted(items, key=src.start)
    position = next(i for i, candidate in enumerate(ordered) if candidate is item)
    if position + 1 < len(ordered):
        return _Edit(src.start(item), src.start(ordered[position + 1]), b"")
    if position == 0:
        raise BuggyEngineError("cannot remove the only item of a list")
    return _Edit(src.end(ordered[position - 1]), src.end(item), b"")


def _remove_call_keyword(src: _Source, call: ast.Call, name: str) -> list[_Edit]:
    keyword = next((kw for kw in call.keywords if kw.arg == name), None)
    if keyword is None:
        return []
    return [_remove_item(src, [*call.args, *call.keywords], keyword)]


def _remove_flag_param(src: _Source, fn: ast.FunctionDef) -> list[_Edit]:
    """Drop `apply_eagle` (and the bare `*` when it was the only keyword-only parameter)."""
    args = fn.args
    names = [arg.arg for arg in args.kwonlyargs]
    if _FLAG not in names:
        return []
    index = names.index(_FLAG)
    param = args.kwonlyargs[index]
    default = args.kw_defaults[index]
    end = src.end(default) if default is not None else src.end(param)
    if index + 1 < len(args.kwonlyargs):
        return [_Edit(src.start(param), src.start(args.kwonlyargs[index + 1]), b"")]
    previous: list[_Located] = [*args.posonlyargs, *args.args, *args.defaults, *args.kwonlyargs[:index]]
    previous += [d for d in args.kw_defaults[:index] if d is not None]
    if args.vararg is not None or not previous:
        raise BuggyEngineError(f"{fn.name}()'s parameters are not the expected plain list")
    return [_Edit(max(src.end(p) for p in previous), end, b"")]


def _ungate_edits(src: _Source, fn: ast.FunctionDef) -> list[_Edit]:
    """Undo the gating of the Eagle picks in _find_hit_blocks (both upstream styles)."""
    edits: list[_Edit] = []
    local_names: set[str] = set()
    for node in ast.walk(fn):
        # 0.22-0.26: `eagle_indices = self.eagle_attn_group_indices if apply_eagle else set()`
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.IfExp)
            and _is_name(node.value.test, _FLAG)
            and _is_self_attr(node.value.body, "eagle_attn_group_indices")
        ):
            local_names.add(node.targets[0].id)
            assert node.end_lineno is not None
            edits.append(_Edit(src.line_start(node.lineno), src.line_end(node.end_lineno), b""))
        # 0.27+: `apply_eagle and group_eagle [and ...]`
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            for position, value in enumerate(node.values):
                if _is_name(value, _FLAG):
                    following = node.values[position + 1] if position + 1 < len(node.values) else None
                    if following is None:
                        previous = node.values[position - 1]
                        edits.append(_Edit(src.end(previous), src.end(value), b""))
                    else:
                        edits.append(_Edit(src.start(value), src.start(following), b""))
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in local_names and isinstance(node.ctx, ast.Load):
            edits.append(_Edit(src.start(node), src.end(node), _INDEX_SET.encode()))
    return edits


def _docstring_edits(src: _Source, fn: ast.FunctionDef) -> list[_Edit]:
    """Drop the docstring paragraphs that explain apply_eagle (the pre-fix code had none)."""
    first = fn.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return []
    raw = src.data[src.start(first.value) : src.end(first.value)]
    quote = re.match(rb'[rRuU]?("""|\'\'\')', raw)
    if quote is None or _FLAG.encode() not in raw:
        return []
    inner = raw[quote.end() : -3]
    body = inner.rstrip()
    paragraphs = re.split(rb"\n[ \t]*\n", body)
    kept = [p for p in paragraphs if _FLAG.encode() not in p]
    if not kept:
        return []
    new_inner = b"\n\n".join(kept) + inner[len(body) :]
    start = src.start(first.value) + quote.end()
    return [_Edit(start, start + len(inner), new_inner)]


def _comment_block_edits(src: _Source, first_line: int, last_line: int) -> list[_Edit]:
    """Delete runs of whole-line comments that mention apply_eagle, within the given lines."""
    comment_lines = []
    for token in tokenize.tokenize(BytesIO(src.data).readline):
        if token.type != tokenize.COMMENT or not first_line <= token.start[0] <= last_line:
            continue
        line = src.data[src.line_start(token.start[0]) : src.line_end(token.start[0])]
        if line.lstrip().startswith(b"#"):
            comment_lines.append((token.start[0], _FLAG in token.string))
    blocks: list[list[tuple[int, bool]]] = []
    for lineno, mentions in comment_lines:
        if blocks and blocks[-1][-1][0] == lineno - 1:
            blocks[-1].append((lineno, mentions))
        else:
            blocks.append([(lineno, mentions)])
    return [
        _Edit(src.line_start(block[0][0]), src.line_end(block[-1][0]), b"")
        for block in blocks
        if any(mentions for _, mentions in block)
    ]


def _flag_identifiers(tree: ast.AST) -> Iterator[int]:
    for node in ast.walk(tree):
        if (
            (isinstance(node, ast.arg) and node.arg == _FLAG)
            or (isinstance(node, ast.Name) and node.id == _FLAG)
            or (isinstance(node, ast.keyword) and node.arg == _FLAG)
        ):
            yield getattr(node, "lineno", 0)


def reintroduce_double_prune(source: str) -> str:
    """The regression: a fixed coordinator whose load_mask no longer passes apply_eagle=False,
    so the Eagle pop the lookup already applied is applied a second time."""
    src = _Source(source)
    load_mask = _methods(src.tree)[_LOAD_MASK]
    call = _single_call(load_mask, _LOOKUP)
    keyword = next((kw for kw in call.keywords if kw.arg == _FLAG), None)
    if keyword is None or not (isinstance(keyword.value, ast.Constant) and keyword.value.value is False):
        raise BuggyEngineError(f"{_LOAD_MASK}() does not pass {_FLAG}=False: not a fixed coordinator")
    assert load_mask.end_lineno is not None
    edits = _remove_call_keyword(src, call, _FLAG)
    edits += _comment_block_edits(src, load_mask.lineno, load_mask.end_lineno)
    return src.apply(edits)


def revert_to_prefix_shape(source: str) -> str:
    """The pre-fix shape: no apply_eagle anywhere; _find_hit_blocks always applies the Eagle
    pop, so load_mask (which reuses it) drops the lookup's last hit block a second time."""
    src = _Source(source)
    methods = _methods(src.tree)
    lookup, load_mask, hit_blocks = methods[_LOOKUP], methods[_LOAD_MASK], methods[_HIT_BLOCKS]
    if not any(True for _ in _flag_identifiers(hit_blocks)):
        raise BuggyEngineError(f"{_HIT_BLOCKS}() has no {_FLAG}: not a fixed coordinator")
    edits = _remove_call_keyword(src, _single_call(load_mask, _LOOKUP), _FLAG)
    edits += _remove_call_keyword(src, _single_call(lookup, _HIT_BLOCKS), _FLAG)
    for fn in (lookup, hit_blocks):
        edits += _remove_flag_param(src, fn)
    edits += _ungate_edits(src, hit_blocks)
    for fn in (lookup, load_mask, hit_blocks):
        assert fn.end_lineno is not None
        edits += _docstring_edits(src, fn)
        edits += _comment_block_edits(src, fn.lineno, fn.end_lineno)
    reverted = src.apply(edits)
    left = sorted(set(_flag_identifiers(ast.parse(reverted))))
    if left:
        raise BuggyEngineError(f"{_FLAG} is still used on lines {left}: unexpected coordinator shape")
    return reverted


# ---------------------------------------------------------------------------------------------
# The overlay: a `vllm` package that shadows the installed one on PYTHONPATH.


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _mirror(original: Path, out: Path, remaining: Sequence[str], coordinator_text: str) -> None:
    """Real directories along the path to coordinator.py, symlinks for everything else.

    `__pycache__` is never linked: Python writes fresh bytecode into the overlay's own real
    directories, and the patcher's bytecode removal can never reach the original's."""
    out.mkdir()
    head = remaining[0]
    for entry in sorted(os.scandir(original), key=lambda e: e.name):
        if entry.name not in (head, "__pycache__"):
            os.symlink(entry.path, out / entry.name)
    if len(remaining) == 1:
        (out / head).write_text(coordinator_text, encoding="utf-8")
    else:
        _mirror(original / head, out / head, remaining[1:], coordinator_text)


def make_buggy_overlay(
    vllm_dir: Path, dest: Path, *, transform: Transform = reintroduce_double_prune
) -> Path:
    """Build `dest/vllm`, a copy of the `vllm` package at `vllm_dir` (symlinks, cheap) whose
    coordinator.py is a real file holding `transform(original)`. Returns `dest`: put it first on
    PYTHONPATH and `import vllm` loads the buggy coordinator. Rebuilding replaces a previous
    overlay atomically; the original package is only read."""
    original = vllm_dir.resolve(strict=True)
    coordinator = original / COORDINATOR_RELPATH
    if not (original / "__init__.py").is_file() or not coordinator.is_file():
        raise BuggyEngineError(f"{vllm_dir} is not a vllm package with {COORDINATOR_RELPATH}")
    root = dest.resolve()
    target = root / "vllm"
    if _is_within(root, original) or _is_within(original, target):
        raise BuggyEngineError(f"overlay {dest} would overlap the real vLLM package {original}")
    root.mkdir(parents=True, exist_ok=True)
    if (target.exists() or target.is_symlink()) and not (target / OVERLAY_STAMP).is_file():
        raise BuggyEngineError(f"{target} exists and is not an overlay made here; refusing to replace it")
    text = transform(coordinator.read_text(encoding="utf-8"))
    staging = Path(tempfile.mkdtemp(prefix=".vllm-overlay.", dir=root))
    try:
        built = staging / "vllm"
        _mirror(original, built, COORDINATOR_RELPATH.parts, text)
        (built / OVERLAY_STAMP).write_text(f"overlay of {original}\n", encoding="utf-8")
        if target.exists():
            target.rename(staging / "previous")
        built.rename(target)
    finally:
        # rmtree unlinks symlinks without following them: the original stays untouched.
        shutil.rmtree(staging)
    return root
