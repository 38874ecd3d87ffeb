"""Command-line flags that also read `PAGODA_*` environment variables.

`--max-num-seqs` reads `PAGODA_MAX_NUM_SEQS`; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os


def env_name(flag: str) -> str:
    return "PAGODA_" + flag.lstrip("-").replace("-", "_").upper()


def _env_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_flag(parser: argparse.ArgumentParser, flag: str, *, type=str, default=None, help="", **kw) -> None:
    """Add `flag` whose default comes from its PAGODA_* variable when that is set."""
    env = env_name(flag)
    if env in os.environ:
        default = type(os.environ[env])
    parser.add_argument(flag, type=type, default=default, help=f"{help} [env {env}]", **kw)


def add_bool_flag(parser: argparse.ArgumentParser, flag: str, *, default: bool, help="") -> None:
    env = env_name(flag)
    if env in os.environ:
        default = _env_bool(os.environ[env])
    parser.add_argument(
        flag, action=argparse.BooleanOptionalAction, default=default, help=f"{help} [env {env}]"
    )
