"""MkDocs hooks: pages generated from the code when the site is built."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lightning_hybrid"
MARKER = "<!-- refusals: generated from the code when the site is built -->"
RESULTS = "<!-- results: every benchmarks/results/*.txt, included when the site is built -->"


def _text(node: ast.expr) -> str | None:
    """A message as written: string parts verbatim, interpolated values as ``{expression}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None or right is not None:
            return (left or "{...}") + (right or "{...}")
    return None


def refusals(package: Path = PACKAGE) -> dict[str, list[tuple[str, str]]]:
    """Per module: (exception type, message) of every ``raise`` whose message is written out in the code."""
    found: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            kind = ast.unparse(node.exc.func)
            message = _text(node.exc.args[0])
            if message and len(message) > 30 and kind.endswith(("Error", "Exception", "Interrupt")):
                found.setdefault(module, []).append((kind, " ".join(message.split())))
    return found


def _render(found: dict[str, list[tuple[str, str]]]) -> str:
    count = sum(len(v) for v in found.values())
    lines = [f"{count} messages in {len(found)} modules; `{{...}}` stands for a value filled in at run time.", ""]
    for module, messages in found.items():
        lines += [f"### `{module}`", ""]
        for kind, message in messages:
            text = message.replace("<", "&lt;").replace("[", "\\[").replace("]", "\\]")
            lines.append(f"- **{kind}**: {text}")
        lines.append("")
    return "\n".join(lines)


def _results(folder: Path = ROOT / "benchmarks" / "results") -> str:
    parts = []
    for path in sorted(folder.glob("*.txt")):
        parts += [f"### `{path.name}`", "", "```text", path.read_text().rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, _render(refusals()))
    if RESULTS in markdown:
        markdown = markdown.replace(RESULTS, _results())
    return markdown
