"""The code blocks of README.md and docs/: found, run, or validated against the code they name.

A block runs as it is unless an HTML comment on the line above it says what it needs:
``<!-- snippet: needs several processes; given: model, data -->``. Such a Python block is validated instead:
it compiles, its imports run, every name it reads is bound in the block, imported, a builtin or ``given``,
and every keyword argument it passes to a callable it imported (a class of the pack, ``L.Trainer``,
``torch.optim.AdamW``) is a parameter of that callable. A YAML block is a LightningCLI configuration, parsed
by LightningCLI's own parser against the classes it names (``model:`` against the example GPT); a YAML
block that is not one says so (``<!-- snippet: not a LightningCLI config -->``) and is only loaded.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\s*$")
MARKER = re.compile(r"^<!-- snippet: (.*) -->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # the comment's text, or None: run it

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def given(self) -> set[str]:
        match = re.search(r"given: ([\w, ]+)", self.marker or "")
        return {name.strip() for name in match.group(1).split(",")} if match else set()


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match and match.group(1) in ("python", "yaml"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = MARKER.match(lines[i - 1]) if i else None
            found.append(Block(path, i + 1, match.group(1), "\n".join(lines[i + 1 : end]) + "\n",
                               above.group(1) if above else None))  # fmt: skip
            i = end
        elif lines[i].startswith("```"):  # another language's block: skip to its end
            i = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks(path)]


# ------------------------------------------------------------------------------------------------ python


def run_python(block: Block, cwd: Path, timeout: float = 240) -> None:
    """Run the block in a fresh interpreter in ``cwd``; raise with its output when it fails."""
    proc = subprocess.run(
        [sys.executable, "-c", block.code], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT / "examples")},
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"{block.where}: the block failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _bound_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _imported(tree: ast.AST) -> dict[str, Any]:
    """The objects the block's imports bind, by name (the imports run)."""
    objects: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                objects[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module(alias.name.split(".")[0])
                )
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
                objects[alias.asname or alias.name] = getattr(module, alias.name)
    return objects


def _resolve(node: ast.expr, objects: dict[str, Any]) -> Any:
    """The object an expression like ``L.Trainer`` or ``HybridParallelStrategy`` names, or None."""
    if isinstance(node, ast.Name):
        return objects.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, objects)
        if owner is None:
            return None
        if not hasattr(owner, node.attr):
            raise AssertionError(f"{ast.unparse(node.value)} has no attribute {node.attr!r}")
        return getattr(owner, node.attr)
    return None


def validate_python(block: Block) -> None:
    """Compile, import, resolve names and check keyword arguments (see the module); raise what is wrong."""
    try:
        tree = ast.parse(block.code)
        compile(tree, block.where, "exec")
    except SyntaxError as error:
        raise AssertionError(f"{block.where}: does not compile: {error}") from None
    objects = _imported(tree)
    known = _bound_names(tree) | set(dir(builtins)) | block.given
    unknown = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in known})
    if unknown:
        raise AssertionError(f"{block.where}: names neither bound, imported nor given: {unknown}")
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        try:
            target = _resolve(node.func, objects)
        except AssertionError as error:
            problems.append(str(error))
            continue
        if target is None or not callable(target):
            continue
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        params = signature.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        for keyword in node.keywords:
            if keyword.arg is not None and keyword.arg not in params:
                problems.append(f"{ast.unparse(node.func)}() takes no argument {keyword.arg!r}")
    if problems:
        raise AssertionError(f"{block.where}: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------------ yaml

CLI_KEYS = {"trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path", "seed_everything"}


def validate_yaml(block: Block) -> None:
    """Parse a LightningCLI configuration with LightningCLI's parser (nothing is instantiated)."""
    import yaml

    config = yaml.safe_load(block.code)
    if block.marker and "not a LightningCLI config" in block.marker:
        return
    if not isinstance(config, dict) or not set(config) <= CLI_KEYS:
        raise AssertionError(f"{block.where}: not a LightningCLI configuration (top-level keys {sorted(config)})")
    ckpt_path = config.pop("ckpt_path", None)  # the fit subcommand's argument: a path or "last"
    if ckpt_path is not None and not isinstance(ckpt_path, str):
        raise AssertionError(f"{block.where}: ckpt_path must be a string, got {ckpt_path!r}")
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT

    class ParseOnly(LightningCLI):
        def instantiate_classes(self) -> None:  # the parser has checked every class_path and init_args
            pass

    report = io.StringIO()
    try:
        with contextlib.redirect_stderr(report):
            ParseOnly(GPT, run=False, args=config, save_config_callback=None)
    except SystemExit:  # the parser reports on stderr and exits
        error = report.getvalue()
        error = error[error.find("error:") :]
        raise AssertionError(f"{block.where}: LightningCLI's parser refused it: {error}") from None
