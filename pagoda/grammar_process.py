"""A child process that compiles constraints, bounded in time and memory: both services use it.

`CompileProcess.compile(constraint, timeout_s)` sends one constraint to the child and waits at
most `timeout_s`; a compile that overruns is killed with its child (the next call starts a fresh
one), and one that needs more than `memory_bytes` above the child's start-up footprint fails
there (its address space is capped), never in the caller's process. With `serialize=True` the
child also sends the compiled grammar back (`xgrammar.CompiledGrammar.serialize_json`, at most
`max_reply_bytes`), for the caller to deserialize off its hot path: the executor's matchers then
never compile in its own process (executor_svc/structured_output.py). The scheduler's check
keeps it too, and sends it with the request (scheduler_svc/constraint_check.py): an executor
then deserializes it instead of compiling the constraint again.

Serializing is not always cheaper than compiling again: a union of many small grammars (128
tools' calls, a structural tag) compiles in 0.35 s but serializes in 8.5 s to 40 MB, which
takes 4 s to deserialize (measured with the default model's tokenizer; 2.1 MB in memory). So
the child sends a grammar back only when it is small (`SMALL_GRAMMAR_BYTES` in memory) or
took `RECOMPILE_BELOW_S` or more to compile; otherwise it answers that the constraint
compiles, with nothing to carry, and the caller compiles it again where it needs it, in about
the time the child took (the executor does, off the step's path). A serialization that
overruns its bound is not a refusal either: the constraint compiled, the child is replaced.

Nothing is pickled: the child and its parent exchange JSON and raw bytes over a pipe. The child
is started with "spawn" (a fork would copy gRPC's, ZeroMQ's and torch's threads mid-flight).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import resource
import signal
import threading
import time

from pagoda.constraint import Constraint

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
CHILD_CACHE_BYTES = 64 << 20  # xgrammar's own cache in the child, within its memory cap
MAX_REPLY_BYTES = 512 << 20  # a serialized compiled grammar sent back (a hostile 8-string schema: ~16 MB)
# Sent back serialized only when small in memory (a schema of a few fields: ~10-200 KB, serialized
# and deserialized in well under 0.3 s), or slow to compile again (a hostile 8-string schema of
# maxLength 1000: 2.9 s, serialized in 0.9 s, deserialized in 0.5 s). Measured, default model.
SMALL_GRAMMAR_BYTES = 256 << 10
RECOMPILE_BELOW_S = 1.0


class CompileUnavailable(RuntimeError):
    """The compile process could not start (the caller retries later or refuses the constraint)."""


class CompileProcess:
    """One child that compiles constraints one at a time; killed and replaced when it overruns."""

    def __init__(self, model_dir: str, memory_bytes: int, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self.model_dir = model_dir
        self.memory_bytes = memory_bytes
        self.max_reply_bytes = max_reply_bytes
        self._proc: multiprocessing.Process | None = None
        self._conn = None
        self._ready = False  # the child said it is ready (else it is starting, when _proc is set)
        self._lock = threading.RLock()  # compile, warm and stop may come from different threads

    def compile(self, constraint: Constraint, timeout_s: float, serialize: bool = False) -> tuple[str | None, bytes | None]:
        """(None, the serialized grammar or None) when `constraint` compiles, else (why not, None).
        With `serialize` the grammar is None when it is cheaper to compile again than to carry
        (see the module's docstring) or its serialization overran `timeout_s`.

        Raises CompileUnavailable if no child can start.
        """
        with self._lock:
            return self._compile(constraint, timeout_s, serialize)

    def warm(self) -> None:
        """Start the child now, without waiting for it (its start-up, seconds, overlaps other work)."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self.stop()
                self._spawn()

    def _compile(self, constraint: Constraint, timeout_s: float, serialize: bool) -> tuple[str | None, bytes | None]:
        self._ensure_started()
        request = {"kind": constraint.kind.value, "value": constraint.value, "choices": list(constraint.choices), "serialize": serialize}
        started = time.monotonic()
        try:
            self._conn.send_bytes(json.dumps(request).encode())
            if not self._conn.poll(timeout_s):
                return self._overran(constraint, timeout_s)
            reply = json.loads(self._conn.recv_bytes())
            grammar = None
            if reply.get("serialized"):  # it compiled: serializing it has a bound of its own
                if not self._conn.poll(timeout_s):
                    log.warning("serializing %s took over %.1f s: killing the compile process",
                                constraint.field, timeout_s)
                    self.stop()
                    self.warm()
                    return None, None  # it compiles: the caller compiles it again
                grammar = self._conn.recv_bytes(self.max_reply_bytes) or None
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self.stop()
            log.warning("the compile process died on %s (exit code %s)", constraint.field, code)
            self.warm()  # the next compile finds a fresh child started
            return f"compiling it ended the compiler (over its {self.memory_bytes >> 20} MiB memory limit?)", None
        log.debug("compiled %s in %.1f ms", constraint.field, (time.monotonic() - started) * 1e3)
        return reply.get("error"), grammar

    def _overran(self, constraint: Constraint, timeout_s: float) -> tuple[str, None]:
        log.warning("compiling %s took over %.1f s: killing the compile process", constraint.field, timeout_s)
        self.stop()
        self.warm()  # the next compile finds a fresh child started
        return f"does not compile within {timeout_s:g} s (the limit)", None

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        proc = context.Process(
            target=_child_main, args=(child, self.model_dir, self.memory_bytes), name="constraint-compile", daemon=True
        )
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def _ensure_started(self) -> None:
        if self._proc is None or not self._proc.is_alive():
            self.stop()
            self._spawn()
        if self._ready:
            return
        proc, parent = self._proc, self._conn
        if not parent.poll(START_TIMEOUT_S):
            self.stop()
            raise CompileUnavailable("the constraint compiler did not start; retry")
        try:
            ready = json.loads(parent.recv_bytes())
        except (EOFError, OSError):
            proc.join(1)
            self.stop()
            raise CompileUnavailable("the constraint compiler failed to start; retry") from None
        if "error" in ready:
            self.stop()
            raise CompileUnavailable(f"the constraint compiler failed to start: {ready['error']}")
        self._ready = True

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def stop(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join(5)
            if self._conn is not None:
                self._conn.close()
            self._proc = self._conn = None
            self._ready = False


def _child_main(conn, model_dir: str, memory_bytes: int) -> None:
    """The child: build the compiler, cap the address space, then compile each request it gets.

    A terminal's Ctrl-C reaches the whole process group, this child too: it ignores SIGINT, and
    ends when its parent stops it or goes away (its pipe closes), so no KeyboardInterrupt
    traceback is printed while the services shut down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import xgrammar as xgr

        from pagoda.constraint import ConstraintKind
        from pagoda.grammars import compile_constraint, error_message, tokenizer_info

        # One thread: a compile is bounded by one core. The cache stays on, bounded: xgrammar
        # also caches sub-grammars with it, which makes first compiles faster too (measured:
        # a 30-field schema with patterns 0.3 s with it, 5.3 s without).
        compiler = xgr.GrammarCompiler(tokenizer_info(model_dir), max_threads=1, cache_limit_bytes=CHILD_CACHE_BYTES)
        _cap_address_space(memory_bytes)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which refuses to serve constraints
        conn.send_bytes(json.dumps({"error": repr(exc)}).encode())
        return
    conn.send_bytes(b"{}")
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        compiled = None
        try:
            kind = ConstraintKind(request["kind"])
            constraint = Constraint(kind, request["value"], tuple(request["choices"]))
            started = time.monotonic()
            compiled = compile_constraint(compiler, constraint)
            compile_s = time.monotonic() - started
            serialize = bool(request.get("serialize")) and (
                compiled.memory_size_bytes <= SMALL_GRAMMAR_BYTES or compile_s >= RECOMPILE_BELOW_S)
            reply = {"serialized": serialize, "compile_s": round(compile_s, 4),
                     "memory_bytes": compiled.memory_size_bytes}
        except MemoryError:
            reply = {"error": f"compiling it needs more than {memory_bytes >> 20} MiB (the limit)"}
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors are the client's answer
            message = error_message(exc)
            if "bad_alloc" in message:
                message = f"compiling it needs more than {memory_bytes >> 20} MiB (the limit)"
            reply = {"error": f"does not compile: {message}"}
        conn.send_bytes(json.dumps(reply).encode())  # the compile's answer, before any serializing
        if reply.get("serialized"):
            try:
                grammar = compiled.serialize_json().encode()
            except Exception:  # noqa: BLE001 - out of memory: it compiled, nothing is carried (b"")
                grammar = b""
            del compiled
            conn.send_bytes(grammar)


def _cap_address_space(memory_bytes: int) -> None:
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_bytes + memory_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
