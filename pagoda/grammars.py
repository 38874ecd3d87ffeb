"""Compiling a `Constraint` with xgrammar: the one place both services do it.

The scheduler compiles each new constraint once in a child process, to refuse one that
does not compile before any work (`scheduler_svc.constraint_check`); the executor compiles
it again for its matcher (`executor_svc.structured_output`). Both build the tokenizer's
`xgrammar.TokenizerInfo` the way the transformers reference does
(`TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size)`), so the masks
are the reference's. xgrammar (and with it torch) is imported only when called.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pagoda.constraint import Constraint, ConstraintKind, choice_grammar

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def tokenizer_info(model_dir: str | Path, stop_token_ids: list[int] | None = None):
    """The `xgrammar.TokenizerInfo` of the tokenizer in `model_dir`, padded to the model's vocabulary.

    `stop_token_ids` None: xgrammar's choice from the tokenizer (its EOS), as the reference's.
    """
    import xgrammar as xgr
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config.get("text_config", config)["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def compile_constraint(compiler, constraint: Constraint):
    """`constraint` compiled by `compiler` (an `xgrammar.GrammarCompiler`), with xgrammar's defaults.

    Raises whatever xgrammar raises for a constraint that does not parse or compile
    (`error_message` turns it into the reason a client reads).
    """
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return compiler.compile_json_schema(constraint.value)
    if kind is ConstraintKind.REGEX:
        return compiler.compile_regex(constraint.value)
    if kind is ConstraintKind.GRAMMAR:
        return compiler.compile_grammar(constraint.value)
    if kind is ConstraintKind.JSON_OBJECT:
        return compiler.compile_builtin_json_grammar()
    if kind is ConstraintKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(constraint.choices))
    if kind is ConstraintKind.STRUCTURAL_TAG:
        return compiler.compile_structural_tag(constraint.value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def error_message(exc: BaseException) -> str:
    """A compile error as a client should read it: xgrammar's reason, without its source location."""
    text = str(exc).strip() or type(exc).__name__
    lines = [_CPP_PREFIX.sub("", line) for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:500]
