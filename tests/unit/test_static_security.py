"""Static checks of issue #13: nothing binds a wildcard address by default; nothing is pickled on a socket.

The source is parsed, not grepped: a wildcard address in a string that is not a docstring
in a service package, or any import of a pickle-like module (also in examples, bench, docker), or pyzmq's pickling `send_pyobj`/`recv_pyobj`, fails the test. The
defaults of each command line are checked by parsing an empty command line.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

from pagoda.link_security import is_loopback_endpoint

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["pagoda", "scheduler_svc", "executor_svc", "gateway_svc"]  # what binds: no wildcard literal at all
PACKAGES = [*SERVICES, "examples", "bench", "docker"]  # what talks: no pickle
WILDCARDS = ("0.0.0.0", "tcp://*", "[::]")
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
PICKLING_CALLS = {"send_pyobj", "recv_pyobj"}


def sources() -> list[Path]:
    files = []
    for package in PACKAGES:
        if (ROOT / package).is_dir():
            files += [p for p in (ROOT / package).rglob("*.py") if "v1" not in p.relative_to(ROOT).parts]
    return files


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_wildcard_bind_and_no_pickle_in_source(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    service = path.relative_to(ROOT).parts[0] in SERVICES
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            wildcard = any(w in node.value for w in WILDCARDS)
            assert not (wildcard and service), f"{path}:{node.lineno}: wildcard address {node.value!r}"
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & PICKLERS, f"{path}:{node.lineno}: imports a pickler"
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] not in PICKLERS, f"{path}:{node.lineno}: imports a pickler"
        if isinstance(node, ast.Attribute):
            assert node.attr not in PICKLING_CALLS, f"{path}:{node.lineno}: {node.attr} pickles"


@pytest.mark.parametrize("module, keys", [
    ("scheduler_svc.__main__", ("host", "executor_bind")),
    ("executor_svc.__main__", ("scheduler",)),
    ("gateway_svc.__main__", ("host", "target")),
])
def test_command_line_defaults_are_loopback(module, keys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)
    try:
        main = importlib.import_module(module)
    except ModuleNotFoundError:
        pytest.skip(f"{module} is not in this tree")
    args = main.parse_args([])
    for key in keys:
        if not hasattr(args, key):
            continue
        value = getattr(args, key)
        endpoint = value if "://" in value else f"tcp://{value.rsplit(':', 1)[0] if value.count(':') == 1 else value}:1"
        assert is_loopback_endpoint(endpoint), f"{module} --{key.replace('_', '-')} defaults to {value}"
