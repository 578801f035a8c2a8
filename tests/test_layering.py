"""The package's layering: every module imports only from units below it (function-level imports included), so
the subpackages form a one-way order and no two import each other back."""

from __future__ import annotations

import ast
from pathlib import Path

import paradraft

SRC = Path(paradraft.__file__).parent

# units (a subpackage or a top-level module) and their rank: a unit may import only units of a LOWER rank, or itself
RANKS = {
    "errors": 0, "vllm_worker": 0, "utils": 1, "vllm_driver": 2, "outputs": 2, "kernels": 2, "config": 3, "verifier": 4,
    "data": 5, "models": 6,
    "decode": 7, "train": 7, "export": 7,
    "bench": 8, "regenerate": 8,
    "pipeline": 9, "quickstart": 10, "cli": 11, "__main__": 12,
}


def unit_of(module: str) -> str:
    """'paradraft.data.prepare' -> 'data'; the package itself or one of its attributes (__version__) -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else "__init__"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute paradraft module) of every import in a file, wherever it stands."""
    pkg = list(path.relative_to(SRC.parent).with_suffix("").parts[:-1])  # the package the file is in
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
            else:
                names = [node.module or ""]
            out += [(node.lineno, n) for n in names if n.startswith("paradraft")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("paradraft")]
    return out


def test_every_unit_has_a_rank():
    units = {p.stem if p.parent == SRC else p.relative_to(SRC).parts[0] for p in SRC.rglob("*.py")}
    assert units - {"__init__"} <= set(RANKS), f"give these units a rank in RANKS: {units - set(RANKS) - {'__init__'}}"


def test_imports_go_one_way_down():
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        me = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if me == "__init__":
            continue
        for line, mod in imports(path):
            other = unit_of(mod)
            if other in ("__init__", me):
                continue
            if RANKS[other] >= RANKS[me]:
                bad.append(f"{rel}:{line} ({me}, rank {RANKS[me]}) imports {mod} ({other}, rank {RANKS[other]})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_a_relative_import_is_resolved_like_python_does():
    path = SRC / "data" / "prepare.py"
    mods = {m for _, m in imports(path)}
    assert "paradraft.verifier" in mods and "paradraft.data.sources" in mods
