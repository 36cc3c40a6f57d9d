"""The `amphista-jax` command line."""

from __future__ import annotations

import pytest

from amphista_jax.cli import main
from amphista_jax.decode import PromptTooLongError


def test_generate_prints_completion_and_speed(smoke_model, capsys):
    run_dir, _ = smoke_model
    assert main(["generate", "--model", str(run_dir / "export"), "--prompt", "def f(x):", "--max-new-tokens",
                 "8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):")
    assert "tokens/s" in err


def test_generate_chat_and_sampling(smoke_model, capsys):
    run_dir, _ = smoke_model
    assert main(["generate", "--model", str(run_dir / "export"), "--prompt", "hello", "--chat",
                 "--temperature", "0.7", "--top-k", "5", "--max-new-tokens", "4"]) == 0
    assert "tokens/s" in capsys.readouterr().err


def test_prompt_longer_than_max_len_is_a_clear_error(smoke_model):
    run_dir, _ = smoke_model
    with pytest.raises(PromptTooLongError, match="raise --max-len"):
        main(["generate", "--model", str(run_dir / "export"), "--prompt", "x = 1\n" * 40, "--max-len", "32"])
