"""Which package may import which, checked on the sources.

Read statically (every ``import`` statement, inside functions too) because the package root still imports
``LLM`` and with it torch, so a runtime check would see torch whatever these packages do.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "goodserve"

# (package or module under src/goodserve, module it must not import, why)
RULES = [
    ("sim", "goodserve.bench", "the simulator shares workload/, not the benchmark's CLI modules"),
    ("workload", "goodserve.bench", "workload/ is what bench and sim share"),
    ("models", "goodserve.runner", "the runner imports models, never the reverse"),
    ("sim", "torch", "the simulator runs without torch"),
    ("workload", "torch", "workload/ runs without torch"),
    ("scheduler", "torch", "the scheduler runs in the simulator"),
    ("kv_cache", "torch", "the KV cache manager runs in the simulator"),
    ("router", "torch", "the router's policies run in the simulator, and the router process needs no model"),
    ("kv_events", "torch", "the KV cache records events, and the router and the simulator read them"),
    ("kv_events", "goodserve.router", "the router follows KV events, never the reverse"),
    ("spec", "torch", "the speculation length and the n-gram proposer run in the scheduler (and the simulator)"),
    *((f"kv_transfer/{m}.py", "torch", "the scheduler (and so the simulator) reads the hand-off's plain data")
      for m in ("__init__", "params", "config", "messages")),
]


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in one source file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package, forbidden, why", RULES)
def test_package_does_not_import(package, forbidden, why):
    path = SRC / package
    files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    assert files, f"no sources under {package}/"
    offenders = [f"{f.relative_to(SRC)}: {name}" for f in files for name in sorted(imported_modules(f))
                 if name == forbidden or name.startswith(forbidden + ".")]
    assert not offenders, f"{package}/ imports {forbidden} ({why}): {offenders}"
