"""The package's structure, checked: dependencies point one way, components refuse themselves through
protocols, no module over 400 lines, private names of Lightning, torch and DeepSpeed only in compat modules,
and docs/architecture.md lists exactly the modules on disk.

Run it alone with ``python -m pytest tests/test_architecture.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightning_hybrid"
DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
COMPAT = {"_lightning_compat.py", "_torch_compat.py", "strategies/deepspeed/compat.py"}
LIBRARIES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "deepspeed")
MAX_LINES = 400

pytestmark = pytest.mark.unit


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import, also those inside functions."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
    return found


def test_dependencies_point_one_way():
    """strategies/ never imports callbacks/ (and plugins/ only to wrap the precision plugin it owns, as
    Lightning's strategies do); checkpoint/ and the pipeline contract import no strategy, callback or
    user-facing utility."""
    wrong = []
    for name, tree in _modules().items():
        for line, module, _ in _imports(tree):
            if name.startswith("strategies/") and module.startswith("lightning_hybrid.callbacks"):
                wrong.append(f"{name}:{line} imports {module}")
            plugin = module.startswith("lightning_hybrid.plugins") and module != "lightning_hybrid.plugins._clipping"
            if name.startswith("strategies/") and plugin:
                wrong.append(f"{name}:{line} imports {module}")
            if name.startswith("checkpoint/") or name == "contract.py":
                if module.startswith(("lightning_hybrid.strategies", "lightning_hybrid.callbacks")):
                    wrong.append(f"{name}:{line} imports {module}")
                if module.startswith(("lightning_hybrid.utilities", "lightning_hybrid.plugins")):
                    wrong.append(f"{name}:{line} imports {module}")
    assert not wrong, wrong


def test_strategies_detect_no_concrete_callback_or_plugin():
    """A component that cannot work under a strategy refuses itself (``StepsInsideTrainingStep``,
    ``ChecksItsStrategy``); a strategy never tests for a concrete class of callbacks/, plugins/ or optim/."""
    modules = _modules()
    concrete = {
        node.name
        for name, tree in modules.items()
        if name.startswith(("callbacks/", "plugins/", "optim/"))
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    wrong = []
    for name, tree in modules.items():
        if not name.startswith("strategies/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                for cls in classes:
                    label = cls.id if isinstance(cls, ast.Name) else getattr(cls, "attr", "")
                    if label in concrete:
                        wrong.append(f"{name}:{node.lineno} isinstance(..., {label})")
    assert concrete and not wrong, wrong


def test_no_module_over_400_lines_and_each_opens_with_what_it_owns():
    long = {n: len((PACKAGE / n).read_text().splitlines()) for n in _modules()}
    assert not {n: k for n, k in long.items() if k > MAX_LINES}
    undocumented = [n for n, tree in _modules().items() if not ast.get_docstring(tree)]
    assert not undocumented, undocumented


def _own_names(modules: dict[str, ast.Module]) -> set[str]:
    """Every name the pack itself defines (functions, classes, attributes it sets on its own objects, variables,
    arguments, and keys of an instance's ``__dict__`` set by hand)."""
    own: set[str] = set()
    for tree in modules.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                # set on the pack's own objects; a private attribute set on another library's object is still
                # that library's name (``pipe._layer_specs = ...``)
                if getattr(node.value, "id", None) in ("self", "cls") or not _private(node.attr):
                    own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "__dict__"
                and isinstance(node.slice, ast.Constant)
            ):
                own.add(str(node.slice.value))
    return own


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign(value: object, own: set[str]) -> bool:
    """A string that names someone else's private attribute (an identifier with one leading underscore)."""
    return isinstance(value, str) and value.isidentifier() and _private(value) and value not in own


def test_private_names_of_lightning_torch_and_deepspeed_only_in_compat_modules():
    """An underscored name the pack does not define, reached by import, attribute or string, is another
    library's private name: it belongs in ``_lightning_compat``, ``_torch_compat`` or
    ``strategies/deepspeed/compat`` (the standard library's ``os._exit`` is public API)."""
    modules = _modules()
    own = _own_names(modules)
    wrong = []
    for name, tree in modules.items():
        if name in COMPAT:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                parts = node.module.split(".") + [a.name for a in node.names]
                wrong += [f"{name}:{node.lineno} from {node.module} import {p}" for p in parts if _private(p)]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in LIBRARIES and any(map(_private, alias.name.split("."))):
                        wrong.append(f"{name}:{node.lineno} import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                if not (node.attr == "_exit" and getattr(node.value, "id", None) == "os"):
                    wrong.append(f"{name}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
                wrong += (
                    [f"{name}:{node.lineno} {node.value!r}"] if node.value.isidentifier() - (node.value in own) else []
                )
    assert not wrong, wrong


def test_the_architecture_doc_lists_exactly_the_modules_on_disk():
    text = DOC.read_text()
    block = re.search(r"```\nsrc/lightning_hybrid/\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no package map"
    listed, folder = set(), ""
    for line in block.group(1).splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match:
            continue
        indent, entry = len(match.group(1)), match.group(2)
        if entry.endswith("/"):
            folder = entry if indent == 2 else folder.split("/")[0] + "/" + entry
            continue
        if entry.endswith(".py"):
            listed.add(entry if indent == 2 else folder + entry)
    on_disk = {n for n in _modules() if not n.endswith("__init__.py")}
    assert listed == on_disk, {"not on disk": sorted(listed - on_disk), "not listed": sorted(on_disk - listed)}
