"""The KV connector is a seam: the scheduler and the engine core use it only through its two halves'
protocol (:mod:`goodserve.kv_transfer.base`), no module outside ``kv_transfer/`` names a transport, and the
scheduler keeps no P/D bookkeeping of its own. Read statically with ``ast``, like ``test_layering.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from goodserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from test_layering import SRC, imported_modules

TORCH_FREE = ("__init__", "base", "config", "factory", "lease", "messages", "params", "pull_scheduler",
              "side_channel")


def _sources(*parts: str) -> list[Path]:
    out = []
    for part in parts:
        path = SRC / part
        out.extend([path] if path.suffix == ".py" else sorted(path.rglob("*.py")))
    return out


def _identifiers(path: Path) -> set[str]:
    """Every name a file binds or reads: names, attributes, imported modules and aliases, defs and classes."""
    names: set[str] = set(imported_modules(path))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.update(filter(None, (node.name, node.asname)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _connector_calls(path: Path, owner: str) -> set[str]:
    """Attributes used on ``self.<owner>`` in one file (e.g. ``self.kv_connector.poll`` -> ``poll``)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == owner and isinstance(node.value.value, ast.Name) and node.value.value.id == "self":
            used.add(node.attr)
    return used


def test_no_module_outside_kv_transfer_imports_a_transport():
    offenders = [f"{f.relative_to(SRC)}: {m}" for f in _sources(".") if "kv_transfer" not in f.parts
                 for m in sorted(imported_modules(f)) if m.startswith("goodserve.kv_transfer.nixl_connector")]
    assert not offenders


@pytest.mark.parametrize("package", ["engine", "scheduler", "runner", "server", "router", "sim", "cluster"])
def test_no_transport_is_named_outside_kv_transfer(package):
    offenders = [f"{f.relative_to(SRC)}: {n}" for f in _sources(package) for n in sorted(_identifiers(f))
                 if "nixl" in n.lower()]
    assert not offenders


@pytest.mark.parametrize("path", ["scheduler/scheduler.py", "scheduler/remote_kv.py", "engine/core.py"])
def test_the_scheduler_and_the_core_import_only_the_protocol(path):
    allowed = {f"goodserve.kv_transfer.{m}" for m in ("base", "config", "factory", "messages", "params")}
    used = {m.rsplit(".", 1)[0] if m.count(".") > 2 else m for m in imported_modules(SRC / path)
            if m.startswith("goodserve.kv_transfer")}
    assert used <= allowed, used - allowed


def test_the_scheduler_calls_only_the_scheduler_half_protocol():
    protocol = set(KVConnectorScheduler.__abstractmethods__)
    used = set().union(*(_connector_calls(SRC / "scheduler" / f, "kv_connector")
                         for f in ("scheduler.py", "remote_kv.py")))
    assert used and used <= protocol, used - protocol


def test_the_engine_core_calls_only_the_worker_half_protocol():
    protocol = set(KVConnectorWorker.__abstractmethods__)
    used = _connector_calls(SRC / "engine/core.py", "kv_connector")
    assert used and used <= protocol, used - protocol


@pytest.mark.parametrize("path", ["scheduler/scheduler.py", "scheduler/remote_kv.py"])
def test_the_scheduler_keeps_no_pd_bookkeeping(path):
    tree = ast.parse((SRC / path).read_text())
    own = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    pd = {a for a in own if any(w in a for w in ("held", "recv", "hold", "lease", "pull"))}
    assert not pd


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_scheduler_half_is_torch_free(module):
    names = imported_modules(SRC / "kv_transfer" / f"{module}.py")
    assert not {n for n in names if n == "torch" or n.startswith("torch.")}


def test_every_registered_transport_implements_the_worker_protocol():
    pytest.importorskip("zmq")
    from goodserve.kv_transfer.factory import TRANSPORTS, worker_class

    for name in TRANSPORTS:
        try:
            cls = worker_class(name)
        except ImportError as e:
            pytest.skip(f"{name}: {e}")
        assert issubclass(cls, KVConnectorWorker) and not cls.__abstractmethods__
    with pytest.raises(ValueError, match="unknown kv connector 'carrier-pigeon'"):
        worker_class("carrier-pigeon")
    with pytest.raises(ValueError, match="is not a KVConnectorWorker subclass"):
        worker_class("goodserve.kv_transfer.lease:LeaseTable")
