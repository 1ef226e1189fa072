"""Prompts in the model's chat format, as text both sides of the swarm encode alike.

    question ─► [system?, user] messages ─► tokenizer.apply_chat_template(add_generation_prompt=True)
             ─► text (a leading BOS dropped when the tokenizer adds its own) ─► Prompt.text

A rollout peer's engine and the learner (`GRPOTrainer.encode_prompt`) both encode a prompt's text
with the tokenizer's default special-token handling, ``tokenizer(text)``; so the template is
applied here, as text, and the formatter checks at construction that encoding that text gives
the very ids ``apply_chat_template(..., tokenize=True)`` gives. A template that writes the BOS
token as text would get a second BOS from a tokenizer that adds one itself; that BOS is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from echo2swarm.runtime.logging import get_logger

__all__ = ["ChatFormatter", "load_tokenizer"]

logger = get_logger(__name__)


def load_tokenizer(source: str | Path | Any, option: str = "tokenizer") -> Any:
    """A tokenizer object as is, or the one in a local model/tokenizer directory (never the hub)."""
    if not isinstance(source, (str, Path)):
        if not callable(getattr(source, "apply_chat_template", None)):
            raise ValueError(f"{option} must be a local model directory or a transformers tokenizer, got {type(source).__name__}")
        return source
    path = Path(source)
    if not path.is_dir():
        raise ValueError(f"{option} = {str(source)!r} is not a directory; give the local model (or tokenizer) directory")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{option} = {str(source)!r}: no tokenizer could be loaded from it ({exc})") from None


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


class ChatFormatter:
    """Turns a user message into the chat-formatted prompt text of ``tokenizer``.

    Example::

        chat = ChatFormatter(AutoTokenizer.from_pretrained("Qwen/Qwen3-0.6B"), system_prompt="Be brief.")
        chat("What is 6*7?")   # '<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\n...assistant\\n'
    """

    def __init__(self, tokenizer: Any, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (tokenizer.chat_template is empty)")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        bos = getattr(tokenizer, "bos_token", None)
        bos_id = getattr(tokenizer, "bos_token_id", None)
        # Does plain encoding add a BOS by itself (Llama-style)? Then a templated BOS is one too many.
        adds_bos = bos_id is not None and tokenizer("a")["input_ids"][:1] == [bos_id]
        self._strip = bos if (adds_bos and bos) else None
        probe = self._messages("What is 6*7?")
        text = self(probe[-1]["content"])
        expected = _ids(tokenizer.apply_chat_template(probe, tokenize=True, add_generation_prompt=True))
        if list(tokenizer(text)["input_ids"]) != expected:
            # E.g. a template without BOS and a tokenizer that adds one: the model sees one token more
            # than apply_chat_template would give it. Worth knowing, rarely worth refusing.
            logger.warning("chat template: tokenizer(text) encodes a prompt to %s..., apply_chat_template to %s...; "
                           "rollout engines and the learner use the first", list(tokenizer(text)["input_ids"])[:8],
                           expected[:8])

    def _messages(self, text: str) -> list[dict[str, str]]:
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return [*system, {"role": "user", "content": text}]

    def __call__(self, text: str) -> str:
        out = self.tokenizer.apply_chat_template(self._messages(text), tokenize=False, add_generation_prompt=True)
        if not isinstance(out, str):
            raise ValueError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, not text")
        if self._strip and out.startswith(self._strip):
            out = out[len(self._strip):]
        return out
