"""Tokenizers, chat templates and stop tokens of a local Hugging Face checkpoint directory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from amphista_jax.infra.errors import UserError
from amphista_jax.models.config import ModelConfig


class TokenizerError(UserError, ValueError):
    """A checkpoint directory whose tokenizer cannot be used as asked."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint directory `path`, refused when it has more tokens than the model's
    `config.json` `vocab_size` (its higher ids would index past the embedding: garbage, not an error)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot load a tokenizer from {path} ({e}); the directory needs tokenizer.json "
                             "or the tokenizer files its tokenizer_config.json names") from e
    config = Path(path) / "config.json"
    try:
        vocab = int(json.loads(config.read_text()).get("vocab_size", 0)) if config.is_file() else 0
    except (ValueError, TypeError, AttributeError):
        vocab = 0  # a damaged config.json is the model loader's to report
    if vocab and len(tokenizer) > vocab:
        raise TokenizerError(f"the tokenizer in {path} has {len(tokenizer)} tokens but the model's config.json has "
                             f"vocab_size {vocab}: put the tokenizer that belongs to this model beside it")
    return tokenizer


def stop_token_ids(path: str | Path, tokenizer: PreTrainedTokenizerBase, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), config.json and the tokenizer, deduplicated."""
    ids: list[int] = list(config.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool = False) -> list[int]:
    """Token ids of `text`; with `chat`, as one user turn through the tokenizer's chat template."""
    if not chat:
        return list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
    return encode_conversation(tokenizer, [{"role": "user", "content": text}])


def encode_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` (`[{"role", "content"}]`) through the chat template, ending with the header of
    the assistant's next turn (`add_generation_prompt`)."""
    if not tokenizer.chat_template:
        raise TokenizerError("this tokenizer has no chat template: drop --chat, or add a chat_template to its "
                             "tokenizer_config.json")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def colour_drafts(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int], drafted: Sequence[bool]) -> str:
    """Decoded text with the tokens that came from the draft heads in green (ANSI)."""
    out, previous = [], ""
    for i in range(len(tokens)):
        text = tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
        piece, previous = text[len(previous):], text
        out.append(f"\033[32m{piece}\033[0m" if drafted[i] else piece)
    return "".join(out)
