"""Stop tokens and chat templates from a checkpoint directory."""

from __future__ import annotations

import json

import pytest

from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.tokenizer import TokenizerError, encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.train.corpus import train_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300).save_pretrained(path)
    return path


def test_eos_ids_from_generation_config_list(tok_dir):
    tok = load_tokenizer(tok_dir)
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    ids = stop_token_ids(tok_dir, tok, tiny_llama_config(eos_token_ids=(9, 11)))
    assert ids == (9, 11, 2, 7)  # config first, then generation_config, then the tokenizer's; no duplicates


def test_chat_template_and_plain_prompts(tok_dir):
    tok = load_tokenizer(tok_dir)
    plain = encode_prompt(tok, "def f")
    assert plain[0] == tok.bos_token_id
    chat = encode_prompt(tok, "def f", chat=True)
    assert tok.decode(chat).endswith("# user:\ndef f\n# assistant:\n")
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat template"):
        encode_prompt(tok, "def f", chat=True)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    """Its ids beyond `vocab_size` would index past the embedding (a garbage completion): refused at load."""
    from amphista_jax.assets import default_model_dir

    for f in default_model_dir().iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((default_model_dir() / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": 1000}))
    with pytest.raises(TokenizerError, match=r"has 4096 tokens but the model's config.json has vocab_size 1000"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert len(load_tokenizer(tmp_path)) == 4096
