"""The layers of docs/architecture.md, checked on the source: each package imports only
the layers it stands on (function-level imports included), and no library file grows
past the size the style guide allows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"

#: the layer of each module (by dotted prefix, longest match wins) and what it may import
LAYERS = {
    "kvtier.quant": 0,
    "kvtier.kernels": 1,
    "kvtier.caches": 2,
    "kvtier.config": 3,
    "kvtier.model": 4,
    "kvtier.integrations": 4,
    "kvtier.sampling": 5,
    "kvtier.generate": 5,
    "kvtier.prefill": 5,
    "kvtier.speculative": 5,
    "kvtier.drafters": 5,
    "kvtier.cuda_graph": 5,
    "kvtier.prompt_cache": 5,
    "kvtier.limits": 5,
    "kvtier.devices": 5,
    "kvtier.evaluate": 5,
    "kvtier.serve": 6,
    "kvtier.parallel": 7,
    "kvtier.serve.api": 8,
    "kvtier.serve.tokens_api": 8,
    "kvtier.serve.middleware": 8,
    "kvtier.serve.views": 8,
    "kvtier.serve.responses": 8,
    "kvtier.serve.cli": 8,
    "kvtier.cli": 9,
    "kvtier.cli_run": 9,
    "kvtier.cli_text": 9,
    "kvtier": 9,  # the package's __init__ re-exports the public names
}


def layer_of(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kvtier_imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every import of a kvtier module in ``path``, at any depth;
    ``module`` names the file's module (default: from its place under src/)."""
    here = (module or module_name(path)).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvtier"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] == "kvtier":
                out.append((node.lineno, name))
    return out


FILES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_only_lower_layers(path: Path):
    me = module_name(path)
    mine = layer_of(me)
    bad = []
    for line, name in kvtier_imports(path):
        if name == me or name.startswith(me + "."):
            continue
        theirs = layer_of(name)
        if theirs > mine:
            bad.append(f"line {line}: {name} (layer {theirs})")
    assert not bad, f"{me} (layer {mine}) imports from a layer above it: {bad}"


def test_layer_table_covers_every_module():
    # a new top-level module or package must be placed in the table on purpose
    tops = {module_name(p).split(".")[1] for p in FILES if module_name(p) != "kvtier"}
    named = {p.split(".")[1] for p in LAYERS if p.count(".") >= 1}
    assert tops <= named, f"modules without a layer in LAYERS: {sorted(tops - named)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_file_over_600_lines(path: Path):
    n = len(path.read_text().splitlines())
    assert n <= 600, f"{path.relative_to(SRC)} has {n} lines; split it by concept (STYLE.md 2)"


def test_the_checker_sees_a_violation(tmp_path):
    # the checker itself: an upward import inside a function is found
    pkg = SRC / "quant"
    fake = pkg / "codec.py"
    found = [n for _, n in kvtier_imports(fake)]
    assert all(layer_of(n) == 0 for n in found)
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kvtier.generate import generate\n")
    assert kvtier_imports(probe, "kvtier.quant.probe") == [(2, "kvtier.generate")]
    probe.write_text("from ..generate import generate\n")
    assert kvtier_imports(probe, "kvtier.quant.probe") == [(1, "kvtier.generate")]
    assert layer_of("kvtier.generate") > layer_of("kvtier.quant.codec")
