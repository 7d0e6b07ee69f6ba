"""The documentation: every Python and YAML block of README.md and docs/ runs or is validated against the code
it names (``tests/_snippets.py``), a renamed argument fails these tests, the README is a landing page whose old
sections all live on in the site, and ``mkdocs build --strict`` builds every page of the navigation."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from _snippets import ROOT, Block, all_blocks, blocks, run_python, validate_python, validate_yaml

BLOCKS = all_blocks()

# the headings of the README before the documentation site: each is now a heading of a page of the site
MOVED = [
    "Set-up: two commands", "Quick start", "The pipeline model contract", "Hugging Face models",
    "Checkpoints in any layout", "What each ZeRO stage keeps per rank", "Optimizers under ZeRO",
    "Tied weights across stages", "What works with what", "Gradients seen and changed by your code",
    "Choosing an engine", "Fitting a big model", "Failure-aware checkpoints", "Losing a node",
    "Checkpoints: what we promise, what we do not", "fp16 loss scaling agreed across ranks",
    "Exact accumulation schedules", "Large-batch recipe", "Benchmarks", "Launching", "Layout",
]  # fmt: skip


def _id(block: Block) -> str:
    return f"{block.where}:{block.lang}"


def test_the_documents_have_blocks_of_both_kinds_and_some_run():
    kinds = {(b.lang, b.marker is None) for b in BLOCKS}
    assert {("python", True), ("python", False), ("yaml", True)} <= kinds, kinds
    assert len(BLOCKS) >= 20


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python" and b.marker], ids=_id)
def test_python_block_that_needs_more_than_this_machine_is_validated(block):
    validate_python(block)


@pytest.mark.trainer
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python" and not b.marker], ids=_id)
def test_python_block_runs(block, tmp_path):
    run_python(block, tmp_path)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=_id)
def test_yaml_block_is_a_configuration_lightningcli_accepts(block):
    validate_yaml(block)


def _copy(block: Block, old: str, new: str) -> Block:
    assert old in block.code, (block.where, old)
    return Block(block.path, block.line, block.lang, block.code.replace(old, new), block.marker)


@pytest.mark.trainer
def test_a_renamed_argument_fails_the_snippet_tests(tmp_path):
    """Planted breaks, each in a copy of a block: an argument renamed in a validated Python block, in a YAML
    block (a strategy's and a callback's), and in a block that runs; a name the block never defines."""
    readme = blocks(ROOT / "README.md")
    quick = next(b for b in readme if b.lang == "python" and "HybridParallelStrategy(" in b.code)
    with pytest.raises(AssertionError, match="HybridParallelStrategy\\(\\) takes no argument 'pipeline_size'"):
        validate_python(_copy(quick, "pipeline_parallel_size=2", "pipeline_size=2"))
    with pytest.raises(AssertionError, match="takes no argument 'num_node'"):
        validate_python(_copy(quick, "num_nodes=2", "num_node=2"))
    with pytest.raises(AssertionError, match="names neither bound, imported nor given: \\['datamodule'\\]"):
        validate_python(_copy(quick, "datamodule=data", "datamodule=datamodule"))
    strategy_yaml = next(b for b in readme if b.lang == "yaml" and "HybridParallelStrategy" in b.code)
    with pytest.raises(AssertionError, match=r"zero_stages.*not accepted|not accepted.*zero_stages"):
        validate_yaml(_copy(strategy_yaml, "zero_stage:", "zero_stages:"))
    callbacks_yaml = next(b for b in readme if b.lang == "yaml" and "FaultTolerantCheckpoint" in b.code)
    with pytest.raises(AssertionError, match="every_n_steps"):
        validate_yaml(_copy(callbacks_yaml, "every_n_train_steps:", "every_n_steps:"))
    runs = next(b for b in BLOCKS if b.lang == "python" and not b.marker and "FaultTolerantCheckpoint(" in b.code)
    with pytest.raises(AssertionError, match="every_n_steps"):
        run_python(_copy(runs, "every_n_train_steps=10", "every_n_steps=10"), tmp_path)


def _headings(text: str) -> list[str]:
    found, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !ENV and other tags: kept as plain values
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def test_readme_is_a_landing_page_and_its_old_sections_are_in_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for heading in ("Set-up: two commands", "Quick start", "What it guarantees", "Documentation", "Contributing"):
        assert heading in _headings(readme)
    assert "bash scripts/main.sh" in readme and "bash scripts/test.sh" in readme and "mkdocs serve" in readme
    pages = _nav_pages(_mkdocs_config()["nav"])
    assert all((ROOT / "docs" / page).is_file() for page in pages), pages
    on_site = {heading: page for page in pages for heading in _headings((ROOT / "docs" / page).read_text())}
    missing = [heading for heading in MOVED if heading not in on_site]
    assert not missing, f"sections of the old README not in any page of the navigation: {missing}"
    # every page on disk is in the navigation
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages), on_disk ^ set(pages)


@pytest.mark.trainer
def test_the_site_builds_strict_with_every_page_and_its_navigation(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
        capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    pages = _nav_pages(_mkdocs_config()["nav"])
    index = (site / "index.html").read_text()
    for page in pages:
        html = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert html.is_file(), page
        if page != "index.md":  # the navigation of the home page links every page
            assert f'href="{page.removesuffix(".md")}/"' in index, page
    reference = (site / "reference" / "strategies" / "index.html").read_text()
    for argument in ("pipeline_parallel_size", "zero_stage", "schedule", "init_from", "reduce_gradients"):
        assert argument in reference, argument
    troubleshooting = (site / "guides" / "troubleshooting" / "index.html").read_text()
    assert troubleshooting.count("<li><strong>") >= 150  # the refusals, read from the code
    assert "cannot be pipelined" in troubleshooting
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    for result in (ROOT / "benchmarks" / "results").glob("*.txt"):  # the results files, included as they are
        first = result.read_text().splitlines()[0].strip()
        assert result.name in benchmarks and first[:40].replace("&", "&amp;").replace("<", "&lt;") in benchmarks
    assert "Every rank, the same message" in troubleshooting and (site / "conformance" / "index.html").is_file()


def test_every_public_constructor_argument_is_documented():
    """The reference pages come from the docstrings: every argument of every public class's constructor is
    named in its docstring's Args."""
    import inspect

    import lightning_hybrid.callbacks as callbacks
    import lightning_hybrid.models as models
    import lightning_hybrid.optim as optim
    import lightning_hybrid.plugins as plugins
    import lightning_hybrid.strategies as strategies

    missing = []
    for module in (strategies, callbacks, plugins, optim, models):
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.isclass(obj) or not obj.__init__.__module__.startswith("lightning_hybrid"):
                continue  # a constructor of torch's (LayerwiseOptimizer's): documented there
            doc = inspect.getdoc(obj) or ""
            for param in list(inspect.signature(obj).parameters.values()):
                if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name == "self":
                    continue
                if not re.search(rf"^\s*{param.name}( \(.*\))?:", doc, re.M):
                    missing.append(f"{name}({param.name})")
    assert not missing, missing


def test_the_docs_dir_holds_no_stray_snippet_markers():
    # a marker must sit right above a block: one that does not would silently fail to mark anything
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- snippet:"):
                assert i + 1 < len(lines) and lines[i + 1].startswith("```"), f"{path}:{i + 1}"


def test_the_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local and all((ROOT / t).exists() for t in local), [t for t in local if not (ROOT / t).exists()]
