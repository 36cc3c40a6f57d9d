"""The offline code corpus (the interpreter's own standard library) and its byte-level BPE tokenizer."""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# A minimal template so `--chat` works; the embedded model is a code model, not an instruction model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The `.py` files of the standard library, sorted, without installed packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def is_heldout(rel_path: str, fraction: float) -> bool:
    """Stable split: a file is held out when the hash of its relative path falls under `fraction`."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split_corpus(files: Sequence[Path], root: Path, fraction: float) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts) in sorted file order; unreadable (non-UTF-8) files are skipped."""
    train, heldout = [], []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (heldout if is_heldout(f.relative_to(root).as_posix(), fraction) else train).append(text)
    return train, heldout


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `<pad>`=0, `<s>`=1, `</s>`=2; encoding prepends BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=4096, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast
