"""Build a C source of ours once per machine with the system compiler and load it through ctypes.

The CPU kernels (decode attention, GGUF matmul) are plain C, no torch headers: `cc -O3
-march=native` takes well under a second. The shared library goes to
`~/.cache/pagoda/kernels/` (or `$PAGODA_CACHE_DIR/kernels`), keyed by the source (and the
headers beside it that it includes with quotes), the flags, the compiler's version and this
CPU's flags, so a changed source, header, compiler or machine builds anew and nothing stale is
loaded. Where no compiler is found or the build fails, `load()`
returns None and the caller keeps its torch path; `<env_switch>=0` turns a kernel off (for
side-by-side runs).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# -ffast-math's code generation, spelled out: given as -ffast-math (or -Ofast,
# -funsafe-math-optimizations), GCC < 13 links crtfastmath.o into the shared library, which
# turns on flush-to-zero for the whole process when it is loaded (torch's numerics, and
# hypothesis refusing to run in the test process, found in CI).
FAST_MATH = (
    "-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math",
    "-freciprocal-math", "-ffinite-math-only", "-fcx-limited-range",
)
BASE_CFLAGS = ("-O3", "-march=native", *FAST_MATH, "-shared", "-fPIC", "-std=c11")


def cache_dir() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "kernels"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_text(source: Path) -> str:
    """The text the build depends on: `source`, then each local header it includes (recursively, once)."""
    texts: list[str] = []
    seen: set[Path] = set()

    def visit(path: Path) -> None:
        if path in seen or not path.is_file():
            return
        seen.add(path)
        text = path.read_text()
        texts.append(text)
        for name in _LOCAL_INCLUDE.findall(text):
            visit((path.parent / name).resolve())

    visit(source.resolve())
    return "\0".join(texts)


def build(source: Path, cflags: tuple[str, ...], compiler: str, libs: tuple[str, ...] = ("-lm",)) -> Path:
    """The shared library of `source` in the cache (built now unless there already)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source_text(source), " ".join(cflags + libs), version, cpu_flags()]).encode())
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then rename: no half-written .so
        built = Path(tmp) / target.name
        subprocess.run([compiler, *cflags, "-o", str(built), str(source), *libs], capture_output=True, text=True, check=True)
        os.replace(built, target)
    log.info("built %s: %s", source.name, target)
    return target


def load(source: Path, cflags: tuple[str, ...], what: str, libs: tuple[str, ...] = ("-lm",)) -> ctypes.CDLL | None:
    """`source` built and loaded, or None (no compiler, build failed: logged as `what`).

    Whether to use it at all is the caller's choice (`executor_svc.backend.BackendOptions`)."""
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler found: no %s", what)
        return None
    try:
        return ctypes.CDLL(str(build(source, cflags, compiler, libs)))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("could not build the %s (%s)", what, getattr(e, "stderr", "") or e)
        return None


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty where /proc is not)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return set()
    return {os.path.realpath(p) for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))}


def load_openmp(source: Path, cflags: tuple[str, ...], what: str) -> tuple[ctypes.CDLL | None, bool]:
    """`source` built with -fopenmp and loaded, and whether its OpenMP team is torch's; else `load`'s, False.

    torch's CPU wheel brings its OpenMP runtime as libgomp.so.1, loaded with torch: a library of
    ours built with -fopenmp needs libgomp.so.1 and the dynamic loader hands it the one already
    in the process, so an `omp parallel` region of ours runs on the threads torch's GEMMs use.
    Where that does not hold (the runtime bundled under another name, as some torch builds do;
    no OpenMP in the compiler), the library would bring a second runtime whose threads compete
    with torch's: its OpenMP regions are then not to be used (False)."""
    import torch  # noqa: F401  (its runtime loaded first)

    before = _openmp_runtimes()
    flags = tuple(f for f in cflags if f != "-fopenmp-simd") + ("-fopenmp",)
    library = load(source, flags, f"{what} with OpenMP")
    if library is not None:
        after = _openmp_runtimes()
        if len(before) == 1 and after == before:
            return library, True
        log.info("%s: not on torch's OpenMP team (runtimes in this process: %s)", what,
                 ", ".join(sorted(after)) or "none")
        return library, False
    return load(source, cflags, what), False
