"""A LoRA adapter's files, read and checked without torch: what the scheduler sends its executors.

A PEFT folder is `adapter_config.json` + `adapter_model.safetensors`. The scheduler reads both
(`read_adapter_files`), refuses by its config what no executor could apply (another PEFT type,
DoRA, replaced modules, biases, Conv1D bases, the embedding or the LM head, a rank above
`--max-lora-rank`), and sends the two files as bytes over the executor link: an executor on
another host never reads a path. Each executor then checks the matrices against its model
(`executor_svc.lora`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# An adapter's weights this large or larger are refused (a rank-64 adapter of every projection of
# an 8B model is ~0.7 GB in float32; the executor link carries it whole)
MAX_WEIGHT_BYTES = 2 << 30


class LoraError(ValueError):
    """An adapter that cannot be applied; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class AdapterFiles:
    name: str
    path: Path
    config_json: bytes
    weights: bytes
    rank: int  # the largest rank its config names


def check_adapter_config(config: object, max_rank: int) -> dict:
    """`config` (adapter_config.json's object) checked for what the decoder can apply; returned as is."""
    if not isinstance(config, dict):
        raise LoraError(CONFIG_FILE, "expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError("peft_type", f"{config.get('peft_type')!r}: only LORA adapters are served")
    if config.get("use_dora"):
        raise LoraError("use_dora", "DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise LoraError("modules_to_save", f"{config['modules_to_save']}: only LoRA matrices are applied, no module is replaced")
    if config.get("bias", "none") != "none":
        raise LoraError("bias", f"{config['bias']!r}: adapters with biases are not supported")
    if config.get("fan_in_fan_out"):
        raise LoraError("fan_in_fan_out", "not supported (Conv1D bases)")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]  # a regular expression: the weights say which modules it matched
    for target in targets:
        if target.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head", "wte", "output"):
            raise LoraError("target_modules", f"{target!r}: adapters on the embedding or the LM head are not supported")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in ranks):
        raise LoraError("r", f"{ranks}: ranks must be positive integers")
    if max(ranks) > max_rank:
        raise LoraError("r", f"rank {max(ranks)} is above --max-lora-rank {max_rank}")
    return config


def parse_adapter_config(config_json: bytes, max_rank: int) -> dict:
    try:
        config = json.loads(config_json)
    except ValueError as exc:
        raise LoraError(CONFIG_FILE, f"not JSON: {exc}") from None
    return check_adapter_config(config, max_rank)


def read_adapter_files(name: str, path: str | Path, max_rank: int) -> AdapterFiles:
    """The folder's two files, its config checked; LoraError naming the field (`lora_path` for the folder)."""
    path = Path(path)
    if not path.is_dir():
        raise LoraError("lora_path", f"{path} is not a folder")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / file).is_file():
            raise LoraError("lora_path", f"{path} has no {file}")
    config_json = (path / CONFIG_FILE).read_bytes()
    config = parse_adapter_config(config_json, max_rank)
    size = (path / WEIGHTS_FILE).stat().st_size
    if size >= MAX_WEIGHT_BYTES:
        raise LoraError("lora_path", f"{path / WEIGHTS_FILE}: {size} bytes, at most {MAX_WEIGHT_BYTES - 1}")
    rank = max([config.get("r", 8), *(config.get("rank_pattern") or {}).values()])
    return AdapterFiles(name, path, config_json, (path / WEIGHTS_FILE).read_bytes(), rank)
