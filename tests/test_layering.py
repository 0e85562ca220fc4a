"""The package layout is the pipeline (egraph -> rules -> extract -> runtime): nothing imports
upward, and runtime/ reads extract's records only, never its search or its models (issue 15: a
Plan holds a costed assignment and lowers it; it does no pipeline work). And the search policy
decides in one place what the search does by size."""

from __future__ import annotations

import ast
from pathlib import Path

from shardsat.extract.policy import (
    EXACT_AUTO_NODES,
    EXACT_MAX_NODES,
    FAMILY_ALL_NODES,
    SEED_CHAIN_NODES,
    SearchPolicy,
    exact_method,
)

PACKAGE = Path(__file__).resolve().parents[1] / "shardsat"
ORDER = ["egraph", "rules", "extract", "runtime"]
# what runtime/ may import from extract/: the records a plan holds, and the device profile
RUNTIME_MAY_READ = {"result", "assignment", "plancost", "profile"}


def _imports(path: Path) -> list[tuple[str, ...]]:
    """Each `from ..x.y import` of a module, as the package-relative path it names."""
    pkg = path.relative_to(PACKAGE).parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = pkg[: len(pkg) - (node.level - 1)]
            out.append(tuple(base) + tuple((node.module or "").split(".")))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardsat."):
            out.append(tuple(node.module.split(".")[1:]))
    return out


def test_nothing_imports_upward():
    bad = []
    for stage in ORDER:
        for path in (PACKAGE / stage).rglob("*.py"):
            for target in _imports(path):
                if target and target[0] in ORDER and ORDER.index(target[0]) > ORDER.index(stage):
                    bad.append(f"{path.relative_to(PACKAGE)} imports {'.'.join(target)}")
    # one deliberate exception, documented in docs/ARCHITECTURE.md: calibrate runs on devices
    bad = [b for b in bad if not b.startswith("extract/profile.py imports runtime.calibrate")]
    assert not bad, bad


def test_runtime_reads_only_extract_records():
    bad = [f"{path.relative_to(PACKAGE)} imports {'.'.join(target)}"
           for path in (PACKAGE / "runtime").rglob("*.py") for target in _imports(path)
           if target[:1] == ("extract",) and len(target) > 1 and target[1] not in RUNTIME_MAY_READ]
    assert not bad, bad


def test_policy_thresholds():
    """Sizes just at and just past each threshold, and what the greedy variant turns off."""
    small = SearchPolicy.derive("auto", EXACT_AUTO_NODES, 2)
    assert small.exact and small.family_share is None and small.chain_every_start and small.split_bound
    assert not SearchPolicy.derive("auto", EXACT_AUTO_NODES + 1, 2).exact
    assert SearchPolicy.derive("exact", EXACT_MAX_NODES, 2).exact
    mid = SearchPolicy.derive("auto", FAMILY_ALL_NODES + 1, 2)
    assert mid.family_share is not None and mid.family_released >= 1
    big = SearchPolicy.derive("greedy", SEED_CHAIN_NODES + 1, 2)
    assert not big.chain_every_start and not big.polish_restarts and not big.seed_hybrids
    assert SearchPolicy.derive("greedy", SEED_CHAIN_NODES + 1, 3).polish_restarts
    g = small.greedy(restarts=False, bound=False)
    assert (g.method, g.exact, g.families, g.restarts, g.bound) == ("greedy", False, False, False, False)
    assert exact_method("exact", EXACT_MAX_NODES + 1)[0] == "greedy"
    assert "not run" in exact_method("exact", EXACT_MAX_NODES + 1)[1]
    assert exact_method("exact", EXACT_MAX_NODES) == ("exact", None)


def test_functions_and_classes_stay_readable():
    """Issue 15's bar: no function over 80 lines and no class over 400 in shardsat/, so the middle
    of the pipeline can be changed by someone who reads one piece at a time."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if not isinstance(node, ast.ClassDef) and size > 80:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({size} lines)")
            if isinstance(node, ast.ClassDef) and size > 400:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} class {node.name} ({size} lines)")
    assert not long, long
