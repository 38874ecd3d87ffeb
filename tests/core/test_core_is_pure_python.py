"""The scheduler core imports only the standard library and `pagoda.step`."""

import ast
import subprocess
import sys
from pathlib import Path

import scheduler_svc.core

CORE_DIR = Path(scheduler_svc.core.__file__).parent


def test_core_imports_only_stdlib_and_the_step_contract():
    allowed = {"pagoda.step", "scheduler_svc.core"}
    for path in CORE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or any(name == a or name.startswith(a + ".") for a in allowed)
                assert ok, f"{path.name} imports {name}"


def test_importing_the_core_loads_no_torch_grpc_or_zmq():
    code = "import sys, scheduler_svc.core; print(sorted({'torch', 'grpc', 'zmq'} & set(sys.modules)))"
    repo_root = CORE_DIR.parent.parent
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root)
    assert result.stdout.strip() == "[]"
