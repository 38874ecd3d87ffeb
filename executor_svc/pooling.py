"""The pooling runner (`--runner pooling`): whole inputs in, one vector or one row of scores out each.

A step's `pool_requests` run as one flat batch of tokens with no padding and no KV cache (nothing
is kept after the step): encoders (BERT, XLM-RoBERTa: `executor_svc.models.bert`) attend
bidirectionally; decoder embedding models (Qwen3-Embedding, a `Qwen3Model` folder: any family of
`executor_svc.models`) run through the one `DecoderModel`, causally, their final norm applied
and no LM head. Attention is `attention.varlen`'s (length buckets, one SDPA call each). A GGUF
file (`pagoda.gguf_pooling`: its metadata folder stands for it) is read by
`models.bert.load_encoder_gguf` or `models.gguf.load_gguf`, its weights dequantized.

Then, as sentence-transformers computes them (`pagoda.pooling_files.PoolingSpec` says how):

- embed: the pooled vector (the first token, the mean of the tokens or the last token), cut to
  the request's `dimensions` (Matryoshka), L2-normalized if the request asks (after the cut);
- classify: the head's logits through the activation `CrossEncoder.predict` applies (a sigmoid
  for one label by default).

A request the model cannot take (no tokens, a token outside the vocabulary, longer than the
model, the other task, dimensions the model does not declare) fails alone, before any work.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from executor_svc.attention.varlen import VarlenPlan, varlen_attention
from executor_svc.loader import UnsupportedModelError, load_weights, weight_bytes
from executor_svc.model_runner import resolve_device, resolve_dtype
from pagoda.model_files import fingerprint, gguf_source
from pagoda.pooling_files import PoolingError, PoolingSpec, read_pooling_spec

log = logging.getLogger(__name__)

TASKS = {1: "embed", 2: "classify", "embed": "embed", "classify": "classify"}  # PoolTask values


class _NoCacheCausalAttention:
    """The `AttentionBackend` the decoder calls for pooling: whole sequences, no KV cache written."""

    name = "varlen"

    def __init__(self, plan: VarlenPlan) -> None:
        self.plan = plan

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, logits_soft_cap=None):
        return varlen_attention(q, k, v, self.plan, scale, causal=True, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap)


def _load_decoder(model_dir: Path, device: torch.device, dtype: torch.dtype, gguf_file: Path | None = None):
    """The folder's decoder (a *ForCausalLM or a bare *Model of a supported family), no LM head;
    from `gguf_file` (the folder standing for it) dequantized into `dtype`, as `--quantization none`."""
    from transformers import AutoConfig

    from executor_svc.model import DecoderModel
    from executor_svc.models import BY_MODEL_TYPE, SUPPORTED_ARCHITECTURES, family

    hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    arch = (getattr(hf, "architectures", None) or [""])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        arch = BY_MODEL_TYPE.get(hf.model_type, arch)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {hf.model_type!r}: no decoder family to pool its hidden states")
    # the LM head is never used: tied, so that no lm_head parameter waits for a tensor
    config = dataclasses.replace(family(arch).read_config(hf, arch), tie_word_embeddings=True)
    if gguf_file is not None:
        from executor_svc.models.gguf import load_gguf

        # (an LM head the file may hold is never used: not read)
        return load_gguf(gguf_file, config, device, dtype, skip=frozenset({"output.weight"})).eval()
    with torch.device("meta"):
        model = family(arch).build(config, dtype=dtype, tp=None)
    model = model.to_empty(device=device)
    model.init_buffers()
    load_weights(model, model_dir)
    return model.eval()


class PoolingRunner:
    """A pooling model replica. What the worker registers: `runner`, `block_size`, `num_kv_blocks`
    (2: the least the scheduler takes; a pooling executor holds no KV cache), `device`,
    `vocab_size`, `weight_bytes`, `kv_cache_groups` (none), `fingerprint`."""

    runner = "pooling"
    num_kv_blocks = 2
    # a step's inputs run in batches of about this many tokens (a longer input alone), which bounds
    # the activations' memory; on the shared 2-core AVX2 EPYC, BGE-small's shape, 1,024-8,192 took
    # the same CPU time within its noise (bench/README.md). A GPU takes larger batches.
    max_batch_tokens = 2048
    kv_cache_groups = ()
    loras = None

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto",
                 block_size: int = 16, num_threads: int | None = None) -> None:
        self._device = resolve_device(device)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_dir = Path(model_dir)
        self.dtype = resolve_dtype(dtype, self._device)
        self.block_size = block_size
        if self._device.type != "cpu":
            self.max_batch_tokens = 16384
        spec = read_pooling_spec(self.model_dir)
        if spec is None:
            raise UnsupportedModelError(f"{self.model_dir} is a generation model: nothing says how to pool it "
                                        "(no modules.json, a language-model head)")
        self.spec: PoolingSpec = spec
        gguf_file = gguf_source(self.model_dir)
        if spec.is_encoder:
            from executor_svc.models.bert import load_encoder, load_encoder_gguf

            if gguf_file is not None:
                self.model = load_encoder_gguf(gguf_file, self.model_dir, self._device, self.dtype)
            else:
                self.model = load_encoder(self.model_dir, self._device, self.dtype)
            self.encoder = True
            self.vocab_size = self.model.config.vocab_size
            self.type_vocab_size = self.model.config.type_vocab_size
            self.max_model_len = min(spec.max_model_len, self.model.config.max_model_len)
        else:
            if spec.task != "embed":
                raise UnsupportedModelError(f"{spec.architecture}: decoder classifiers are not served")
            self.model = _load_decoder(self.model_dir, self._device, self.dtype, gguf_file)
            self.encoder = False
            self.vocab_size = self.model.config.vocab_size
            self.type_vocab_size = 1
            self.max_model_len = min(spec.max_model_len, self.model.config.max_position_embeddings)
        self.weight_bytes = weight_bytes(self.model)
        self._fingerprint = fingerprint(self.model_dir)
        log.info("pooling model %s on %s (%s, %s %s, %.1f MiB)", self.model_dir, self._device, self.dtype,
                 spec.task, spec.pooling_mode, self.weight_bytes / 2**20)

    # -- what the worker registers ------------------------------------------------------------
    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def reset(self) -> None:
        """Nothing to drop: a pooling runner keeps no request after its step."""

    def enable_lora(self, max_lora_rank: int, kernels=None) -> None:
        raise ValueError("LoRA adapters are not applied by the pooling runner")

    def add_lora_files(self, name: str, config_json: bytes, weights: bytes) -> int:
        from pagoda.lora_files import LoraError

        raise LoraError("lora_name", f"{name!r}: the pooling runner applies no LoRA adapters")

    def remove_lora(self, name: str) -> None:
        from pagoda.lora_files import LoraError

        raise LoraError("lora_name", f"{name!r}: the pooling runner applies no LoRA adapters")

    # -- a step ---------------------------------------------------------------------------------
    def check(self, request) -> str | None:
        """Why `request` cannot run (a message naming the field), or None."""
        ids = request.token_ids
        if not ids:
            return "token_ids: empty input"
        if len(ids) > self.max_model_len:
            return f"token_ids: {len(ids)} tokens, more than the model's {self.max_model_len}"
        if max(ids) >= self.vocab_size or min(ids) < 0:
            return f"token_ids: a token id outside the vocabulary of {self.vocab_size}"
        types = request.token_type_ids
        if len(types) and len(types) != len(ids):
            return f"token_type_ids: {len(types)} ids for {len(ids)} tokens"
        if len(types) and (max(types) >= self.type_vocab_size or min(types) < 0):
            return f"token_type_ids: outside the model's {self.type_vocab_size} token types"
        task = TASKS.get(request.task)
        if task is None:
            return f"task: {request.task!r} is not embed or classify"
        if task != self.spec.task:
            return f"task: the model {'embeds' if self.spec.task == 'embed' else 'classifies'}, it cannot {task}"
        if task == "embed":
            try:
                self.spec.check_dimensions(int(request.dimensions))
            except PoolingError as exc:
                return str(exc)
        return None

    @torch.inference_mode()
    def run(self, requests) -> list[list[float] | str]:
        """One output per request: its values (a vector, or one score a label), or why it failed.

        `requests`: `executor_pb2.PoolRequest`s or objects with the same fields (`task` "embed" /
        "classify" or the PoolTask value)."""
        results: list[list[float] | str] = [""] * len(requests)
        valid = []
        for i, request in enumerate(requests):
            error = self.check(request)
            if error is None:
                valid.append(i)
            else:
                results[i] = error
        if not valid:
            return results
        # by length, in batches of about max_batch_tokens: similar lengths share an attention bucket,
        # and the activations of a batch stay in the CPU's caches
        valid.sort(key=lambda i: len(requests[i].token_ids))
        batch: list[int] = []
        tokens = 0
        for i in valid:
            n = len(requests[i].token_ids)
            if batch and tokens + n > self.max_batch_tokens:
                self._run_batch(requests, batch, results)
                batch, tokens = [], 0
            batch.append(i)
            tokens += n
        self._run_batch(requests, batch, results)
        return results

    def _run_batch(self, requests, valid: list[int], results: list) -> None:
        lengths = [len(requests[i].token_ids) for i in valid]
        flat = [t for i in valid for t in requests[i].token_ids]
        input_ids = torch.tensor(flat, dtype=torch.int64, device=self._device)
        hidden = self._hidden(input_ids, lengths, [requests[i] for i in valid])
        starts = torch.tensor([0, *lengths[:-1]], device=self._device).cumsum(0)
        if self.spec.task == "classify":
            scores = self._activation(self.model.classify(hidden[starts]).float())
            for row, i in enumerate(valid):
                results[i] = scores[row].tolist()
            return
        vectors = self._pool(hidden, starts, lengths)
        for row, i in enumerate(valid):
            vector = vectors[row]
            dims = int(requests[i].dimensions)
            if dims:
                vector = vector[:dims]
            if requests[i].normalize:
                vector = F.normalize(vector, p=2, dim=0)
            results[i] = vector.tolist()

    def _hidden(self, input_ids: torch.Tensor, lengths: list[int], requests) -> torch.Tensor:
        """The last hidden states [T, hidden] (a decoder's after its final norm)."""
        if self.encoder:
            types = [t for r, n in zip(requests, lengths) for t in (r.token_type_ids if len(r.token_type_ids) else [0] * n)]
            token_types = torch.tensor(types, dtype=torch.int64, device=self._device)
            return self.model(input_ids, token_types, lengths)
        model = self.model
        plan = VarlenPlan(lengths, self._device)
        starts = torch.tensor([0, *lengths[:-1]], device=self._device).cumsum(0)
        positions = torch.arange(input_ids.shape[0], device=self._device) - torch.repeat_interleave(
            starts, torch.tensor(lengths, device=self._device))
        empty = torch.empty(0, device=self._device)
        caches = [(empty, empty)] * len(model.layers)
        hidden, residual = model(input_ids, positions, caches, None, _NoCacheCausalAttention(plan))
        return model.norm.add_norm(hidden, residual, model.ops)[0]

    def _pool(self, hidden: torch.Tensor, starts: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[n, hidden] float32: each input's first, mean or last token state."""
        mode = self.spec.pooling_mode
        if mode == "cls":
            return hidden[starts].float()
        lens = torch.tensor(lengths, device=hidden.device)
        if mode == "lasttoken":
            return hidden[starts + lens - 1].float()
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lens)
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq, hidden.float())
        return sums / lens[:, None].float()

    def _activation(self, logits: torch.Tensor) -> torch.Tensor:
        act = self.spec.activation
        if act == "sigmoid":
            return torch.sigmoid(logits)
        if act == "tanh":
            return torch.tanh(logits)
        if act == "softmax":
            return torch.softmax(logits, dim=-1)
        return logits

    def execute_proto(self, plan) -> "object":
        """A StepPlan's `pool_requests` -> its StepResult: `pooled` for the requests that ran,
        `errors` for each that failed alone."""
        from pagoda.v1 import executor_pb2 as pb

        requests = list(plan.pool_requests)
        outputs = self.run(requests)
        result = pb.StepResult(step_id=plan.step_id)
        for request, output in zip(requests, outputs):
            if isinstance(output, str):
                result.errors.add(req_id=request.req_id, message=output)
            else:
                result.pooled.add(req_id=request.req_id, values=output)
        return result
