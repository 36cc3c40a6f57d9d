"""The `amphista-jax` command line."""

from __future__ import annotations

from amphista_jax.cli import main


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


def test_speculative_generate_equals_ar_and_reports_tau(smoke_model, capsys, tmp_path):
    import jax

    from amphista_jax.drafters import Medusa
    from amphista_jax.drafters.io import save_draft
    from amphista_jax.models.hf import load_params
    from amphista_jax.models.target import Target

    run_dir, _ = smoke_model
    model = str(run_dir / "export")
    args = ["generate", "--model", model, "--prompt", "def f(x):", "--max-new-tokens", "12"]
    main(args)
    ar_text = capsys.readouterr().out
    params, config = load_params(model, dtype="float32")
    medusa = Medusa(num_heads=3)
    save_draft(tmp_path / "heads", "medusa", medusa, medusa.init(jax.random.key(0), Target(config, params)), config)
    main(args + ["--heads", str(tmp_path / "heads"), "--tree", "small-8"])
    out, err = capsys.readouterr()
    assert out == ar_text and "tau = " in err
    main(args + ["--draft", "medusa", "--tree", "chain-4", "--show-drafts"])
    assert "untrained medusa heads" in capsys.readouterr().err


def test_generate_on_a_mesh_prints_the_one_device_text(smoke_model, capsys):
    """--mesh 2,2,2 shards the target (AR) and the target and heads (speculative): the one-device text."""
    import jax
    import pytest

    if jax.device_count() != 8:
        pytest.skip("needs 8 devices (XLA_FLAGS host device count)")
    run_dir, _ = smoke_model
    args = ["generate", "--model", str(run_dir / "export"), "--prompt", "def f(x):", "--max-new-tokens", "8"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main(args + ["--mesh", "2,2,2"]) == 0
    assert capsys.readouterr().out == one
    assert main(args + ["--mesh", "2,2,2", "--draft", "medusa", "--tree", "small-8"]) == 0
    assert capsys.readouterr().out == one


def test_convert_reshards_and_keeps_the_tokenizer(smoke_model, tmp_path):
    import json

    import jax
    import numpy as np

    from amphista_jax.models.hf import load_params

    run_dir, _ = smoke_model
    out = tmp_path / "f32"
    assert main(["convert", "--model", str(run_dir / "export"), "--out", str(out), "--dtype", "float32",
                 "--max-shard-mb", "0"]) == 0
    assert (out / "tokenizer.json").is_file()
    a, _ = load_params(run_dir / "export", dtype="float32")
    b, _ = load_params(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
