"""The LoRA adapters this scheduler serves, and their loading on every executor.

`--enable-lora` turns adapters on; `--lora-modules NAME=PATH ...` registers some at start and
`LoadLoraAdapter` / `UnloadLoraAdapter` at run time. A PATH is a PEFT folder on the scheduler's
host or a Hugging Face name (`ORG/ADAPTER`, through its cache). The scheduler reads the folder's two
files once (`pagoda.lora_files`: the config checked, a rank above `--max-lora-rank` refused) and
sends them as bytes to each executor (`LoadLora` on the link): an executor on another host needs no
shared volume, and one that joins later, or replaces a dead one, gets every adapter before its
first step. Each executor answers with a `LoraStatus`; a load that fails on any executor is undone
on all of them and the RPC fails with the executor's reason (it names the field): nothing is loaded.
An executor that fails one later (a new executor) fails that adapter's requests, never serves them
from the base weights.

At most `--max-cpu-loras` adapters are loaded: loading one more evicts the least recently used
that no request is using (RESOURCE_EXHAUSTED if every one is in use). An evicted adapter stays
known by its path, as vLLM's: the next request naming it loads it again (from its path, evicting
another) before it is queued. Unloading stops new requests naming it at once (NOT_FOUND). The
executors drop an unloaded or evicted adapter once the requests in flight with it have finished.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from pagoda.lora_files import AdapterFiles, LoraError, read_adapter_files
from scheduler_svc.errors import AlreadyExists, ServiceError

log = logging.getLogger(__name__)

# how long a LoadLoraAdapter waits for every executor's answer
LOAD_TIMEOUT_S = 60.0
DRAIN_POLL_S = 0.1


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidAdapter(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AdapterExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class LoraRegistry:
    """Adapters by name, least recently used first; `send(executor_id, message)` reaches an executor.

    `executors()` lists the live executors' ids; `in_use(name)` says whether a request still holds one.
    """

    def __init__(
        self,
        max_lora_rank: int,
        max_cpu_loras: int,
        base_name: str,
        executors: Callable[[], Iterable[str]],
        send: Callable[[str, object], asyncio.Future],
        in_use: Callable[[str], bool],
    ) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.base_name = base_name
        self._executors, self._send, self._in_use = executors, send, in_use
        self.adapters: OrderedDict[str, AdapterFiles] = OrderedDict()  # loaded, least recently used first
        self.paths: dict[str, str] = {}  # every adapter known (loaded or evicted) -> where it is read from
        self._reloading: dict[str, asyncio.Future] = {}  # an evicted adapter being loaded again
        self.retiring: dict[str, AdapterFiles] = {}  # unloaded, still held by requests in flight
        self._waiting: dict[tuple[str, str], asyncio.Future] = {}  # (executor id, adapter) -> its LoraStatus error

    # ---- requests ---------------------------------------------------------------------------
    async def acquire(self, model: str) -> str:
        """The adapter a request's `model` names ("" for the base model), loaded again if it was evicted;
        NOT_FOUND naming `model`."""
        if not model or model == self.base_name:
            return ""
        if model not in self.paths:
            raise NotFound("model", f"{model!r} is neither the base model ({self.base_name!r}) nor a LoRA adapter")
        if model not in self.adapters:
            reloading = self._reloading.get(model)
            if reloading is None:
                reloading = self._reloading[model] = asyncio.ensure_future(self._load(model, self.paths[model]))
                reloading.add_done_callback(lambda _: self._reloading.pop(model, None))
            await asyncio.shield(reloading)
        self.adapters.move_to_end(model)
        return model

    # ---- loading ------------------------------------------------------------------------------
    def read(self, name: str, path: str, revision: str | None = None) -> AdapterFiles:
        """The adapter's files from a folder or a hub name; errors name the field."""
        from pagoda.hub import HubError, resolve_adapter

        if not name:
            raise InvalidAdapter("lora_name: empty")
        if name == self.base_name:
            raise InvalidAdapter(f"lora_name: {name!r} is the base model's name")
        if not path:
            raise InvalidAdapter("lora_path: empty")
        try:
            folder = resolve_adapter(path, revision, flag="lora_path")
            return read_adapter_files(name, folder, self.max_lora_rank)
        except HubError as exc:
            raise NotFound("lora_path", str(exc).removeprefix("lora_path ")) from None
        except LoraError as exc:
            if exc.field == "lora_path":
                raise NotFound("lora_path", str(exc).removeprefix("lora_path: ")) from None
            raise InvalidAdapter(str(exc)) from None

    async def load(self, name: str, path: str) -> None:
        """Register `name` and load it on every live executor; undone everywhere if any fails."""
        if name in self.paths:
            raise AlreadyExists(f"lora_name: {name!r} is already loaded (unload it first)")
        await self._load(name, path)
        self.paths[name] = path

    async def _load(self, name: str, path: str) -> None:
        files = self.read(name, path)
        if len(self.adapters) >= self.max_cpu_loras:
            self._evict_one()
        executors = list(self._executors())
        errors = await asyncio.gather(*(self._load_on(e, files) for e in executors))
        failed = [(e, error) for e, error in zip(executors, errors, strict=True) if error]
        if failed:
            for executor_id in executors:
                await self._send(executor_id, _unload(name))
            executor_id, error = failed[0]
            raise FailedPrecondition(f"lora_path: executor {executor_id} cannot apply it: {error}")
        self.adapters[name] = files
        log.info("LoRA adapter %r loaded from %s (rank %d, %d bytes) on %d executors", name, files.path, files.rank,
                 len(files.weights), len(executors))

    def register(self, name: str, path: str) -> None:
        """(start-up, before any executor) `--lora-modules`: read and checked now; executors get it as they join."""
        if len(self.adapters) >= self.max_cpu_loras:
            raise ValueError(f"--lora-modules: {len(self.adapters) + 1} adapters, above --max-cpu-loras {self.max_cpu_loras}")
        self.adapters[name] = self.read(name, path)
        self.paths[name] = path

    async def unload(self, name: str) -> None:
        if self.paths.pop(name, None) is None:
            raise NotFound("lora_name", f"{name!r} is not loaded")
        files = self.adapters.pop(name, None)
        if files is not None:
            self._retire(name, files)

    def _evict_one(self) -> None:
        idle = next((n for n in self.adapters if not self._in_use(n)), None)
        if idle is None:
            raise AdapterExhausted(f"lora_name: --max-cpu-loras {self.max_cpu_loras} adapters are loaded and all in use")
        log.info("LoRA adapter %r evicted (least recently used; --max-cpu-loras %d)", idle, self.max_cpu_loras)
        self._retire(idle, self.adapters.pop(idle))

    def _retire(self, name: str, files: AdapterFiles) -> None:
        """New requests no longer find `name`; the executors drop it once no request holds it."""
        self.retiring[name] = files
        asyncio.ensure_future(self._drop_when_idle(name, files))

    async def _drop_when_idle(self, name: str, files: AdapterFiles) -> None:
        while self._in_use(name):
            await asyncio.sleep(DRAIN_POLL_S)
        if self.retiring.get(name) is files:
            del self.retiring[name]
        if name not in self.adapters and name not in self._reloading:  # (not loaded again meanwhile)
            for executor_id in list(self._executors()):
                await self._send(executor_id, _unload(name))
        log.info("LoRA adapter %r unloaded", name)

    # ---- executors ------------------------------------------------------------------------------
    async def send_all(self, executor_id: str) -> None:
        """A joining executor: every adapter, before its first step (errors pin on requests there)."""
        for files in [*self.adapters.values(), *self.retiring.values()]:
            await self._send(executor_id, _load(files))

    async def _load_on(self, executor_id: str, files: AdapterFiles) -> str:
        """Load on one executor; its error ("" if loaded, or gone without an answer: it is dead)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[(executor_id, files.name)] = future
        try:
            if not await self._send(executor_id, _load(files)):
                return ""
            return await asyncio.wait_for(future, LOAD_TIMEOUT_S)
        except TimeoutError:
            return f"no answer in {LOAD_TIMEOUT_S:g} s"
        finally:
            self._waiting.pop((executor_id, files.name), None)

    def on_status(self, executor_id: str, name: str, error: str) -> None:
        future = self._waiting.get((executor_id, name))
        if future is not None and not future.done():
            future.set_result(error)
        elif error:
            log.error("executor %s cannot apply LoRA adapter %r: %s (its requests fail there)", executor_id, name, error)

    def names(self) -> list[str]:
        """Every adapter a request may name (an evicted one is loaded again when asked for)."""
        return sorted(self.paths)


def _load(files: AdapterFiles):
    from pagoda.v1 import executor_pb2 as xpb

    return xpb.SchedulerMessage(load_lora=xpb.LoadLora(name=files.name, config_json=files.config_json, weights=files.weights))


def _unload(name: str):
    from pagoda.v1 import executor_pb2 as xpb

    return xpb.SchedulerMessage(unload_lora=xpb.UnloadLora(name=name))


def parse_lora_modules(specs: Iterable[str]) -> list[tuple[str, str]]:
    """`--lora-modules NAME=PATH ...` (vLLM's form); a bare PATH is named after its last part."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name, spec
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        out.append((name, path))
    return out
