"""Bad input through the CLI: one line on stderr naming the problem and its fix, a distinct exit code, no
traceback, and nothing a user made changed (every file under the watched paths hashed before and after).

Runs the CLI in-process on the shipped embedded model (2M parameters) with a few new tokens, or on tiny
models built here, so the whole suite takes seconds per case.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import socket
from pathlib import Path

import pytest

from amphista_jax.assets import default_model_dir, draft_model_dir, shipped_heads_dir
from amphista_jax.cli import main
from amphista_jax.infra.errors import BAD_INPUT_EXIT, ENVIRONMENT_EXIT
from tests.helpers import ROOT

MODEL = str(default_model_dir())
HEADS = str(shipped_heads_dir("medusa"))


@dataclasses.dataclass
class Outcome:
    code: int
    out: str
    err: str


def _hashes(paths: list[Path]) -> dict[str, str]:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else [])]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def run_cli(capsys, argv: list[str], watch: list[Path] = ()) -> Outcome:
    """Run `amphista-jax argv` in-process; assert every file under `watch` is unchanged (none added, none
    removed, none rewritten)."""
    watch = [Path(p) for p in watch]
    before = _hashes(watch)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    assert _hashes(watch) == before, f"{argv} changed files under {watch}"
    return Outcome(code, out, err)


def assert_bad_input(outcome: Outcome, *needles: str, code: int = BAD_INPUT_EXIT) -> None:
    """Exit `code`, no traceback, and one stderr line (progress bars aside) that contains every needle."""
    assert outcome.code == code, (outcome.code, outcome.err[-2000:])
    assert "Traceback" not in outcome.err + outcome.out, outcome.err[-2000:]
    errors = [line for line in outcome.err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, outcome.err[-2000:]
    for needle in needles:
        assert needle.lower() in errors[0].lower(), (needle, errors[0])


@pytest.fixture
def user_files(tmp_path):
    """A directory of things a user made: a file and a folder that must never change."""
    root = tmp_path / "mine"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "a.txt").write_text("keep me\n")
    (root / "report.json").write_text(json.dumps({"mine": True}) + "\n")
    return root


# --- generate -------------------------------------------------------------------------------------------------
GEN = ["generate", "--model", MODEL, "--prompt", "def add(a, b):", "--max-new-tokens", "2"]


@pytest.mark.parametrize("extra, needles", [
    (["--temperature", "-1"], ["--temperature", ">= 0"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-p", "1.5"], ["--top-p"]),
    (["--top-k", "-3"], ["--top-k", ">= 0"]),
    (["--top-k", "100000"], ["--top-k", "vocabulary"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--max-len", "4"], ["cache", "--max-len"]),
    (["--acceptance", "greedy", "--temperature", "0.7", "--draft", "medusa"], ["greedy acceptance", "rejection"]),
    (["--tree", "no-such-tree", "--draft", "medusa"], ["unknown tree", "preset"]),
    (["--heads", "/nonexistent/heads"], ["--heads", "not a draft-head checkpoint"]),
    (["--draft", "amphista", "--heads", HEADS, "--tree", "chain-1"], ["medusa heads"]),
    (["--heads", str(shipped_heads_dir("bita")), "--tree", "chain-4"], ["depth 4", "3 tokens deep"]),  # 3 masks
    (["--tree", "efficient-3x²", "--draft", "bita"], ["efficient-DxK"]),
    (["--tree", "fan-2x", "--draft", "prompt_lookup"], ["fan-KxD", "fan-2x4"]),
    (["--tree", "fan-5x2", "--draft", "prompt_lookup"], ["ranks 5 siblings", "fewer children"]),
    (["--mesh", "3,1,1"], ["--mesh 3,1,1", "3 devices", "device count", "drop --mesh"]),
    (["--mesh", "1,2"], ["--mesh", "DATA,FSDP,TENSOR"]),
    (["--mesh", "0,1,1"], ["--mesh", ">= 1"]),
    (["--p-min", "0.3"], ["--p-min", "--draft-model"]),
    (["--p-min", "1.5", "--draft-model", str(draft_model_dir()), "--tree", "chain-2"], ["p_min", "[0, 1)"]),
])
def test_generate_bad_arguments(capsys, extra, needles):
    assert_bad_input(run_cli(capsys, GEN + extra), *needles)


def test_generate_model_that_is_not_a_checkpoint(capsys, user_files):
    outcome = run_cli(capsys, ["generate", "--model", str(user_files), "--prompt", "x"], watch=[user_files])
    assert_bad_input(outcome, str(user_files), "config.json")
    assert_bad_input(run_cli(capsys, ["generate", "--model", "/no/such/model", "--prompt", "x"]), "/no/such/model")


def test_prompt_beyond_the_models_positions_is_refused(capsys):
    # the embedded model was trained for 2048 positions; ~2700 tokens with a cache large enough for them
    outcome = run_cli(capsys, GEN[:4] + ["x = [1, 2, 3]\n" * 500, "--max-len", "8192"])
    assert_bad_input(outcome, "2048 positions", "shorten the prompt")


def test_distill_beyond_the_models_positions_is_refused(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt": "def f():"}\n')
    outcome = run_cli(capsys, ["distill", "--prompts", str(prompts), "--out", str(tmp_path / "out.jsonl"),
                               "--prompt-len", "2000", "--max-new-tokens", "100"], watch=[tmp_path])
    assert_bad_input(outcome, "2048 positions")


def test_prompt_within_positions_but_beyond_the_cache_names_max_len(capsys):
    assert_bad_input(run_cli(capsys, GEN[:4] + ["x = 1\n" * 40, "--max-len", "32"]), "raise --max-len")


@pytest.mark.parametrize("content, needles", [
    ("[]", ["no draft nodes"]),
    ("[[0], [0, 0", ["not JSON", "line 1"]),
    ('{"paths": [[0]]}', ["list of paths"]),
    ("[[0, 1]]", ["no parent"]),
    ("[[0], [-1]]", ["ranks >= 0"]),
    ("[[0], [0.5]]", ["integer ranks"]),
    ("[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]", ["depth 5", "4 tokens deep"]),
])
def test_bad_tree_files(capsys, tmp_path, content, needles):
    tree = tmp_path / "tree.json"
    tree.write_text(content)
    outcome = run_cli(capsys, GEN + ["--heads", HEADS, "--tree", str(tree)], watch=[tree, Path(HEADS)])
    assert_bad_input(outcome, *needles)


def test_heads_of_another_target_of_the_same_shape_are_refused(capsys, tmp_path):
    import jax

    from amphista_jax.drafters.io import load_draft, save_draft
    from amphista_jax.models.hf import load_params

    params, config = load_params(MODEL, dtype="float32")
    method, drafter, draft_params = load_draft(HEADS, config, params)
    other = jax.tree.map(lambda x: x * 1.5 + 0.01, params)  # same shapes, other weights
    save_draft(tmp_path / "heads", method, drafter, draft_params, config, target_params=other)
    outcome = run_cli(capsys, GEN + ["--heads", str(tmp_path / "heads")], watch=[tmp_path / "heads"])
    assert_bad_input(outcome, "another target of the same shape")
    # the same heads saved against this target (in bf16: a dtype conversion is the same target) load fine
    save_draft(tmp_path / "ok", method, drafter, draft_params, config, dtype="bfloat16",
               target_params=jax.tree.map(lambda x: x.astype("bfloat16"), params))
    assert run_cli(capsys, GEN + ["--heads", str(tmp_path / "ok"), "--tree", "chain-2"]).code == 0


def test_heads_of_another_target_shape_are_refused(capsys, tmp_path):
    import dataclasses

    from amphista_jax.drafters.io import load_draft, save_draft
    from amphista_jax.models.hf import load_params

    params, config = load_params(MODEL, dtype="float32")
    method, drafter, draft_params = load_draft(HEADS, config, params)
    other = dataclasses.replace(config, hidden_size=config.hidden_size * 2)
    save_draft(tmp_path / "heads", method, drafter, draft_params, other)
    assert_bad_input(run_cli(capsys, GEN + ["--heads", str(tmp_path / "heads")]), "trained for another target")


def test_debug_shows_the_traceback(capsys, monkeypatch):
    from amphista_jax.infra.errors import UserError

    with pytest.raises(UserError, match="--top-p"):
        main(["--debug"] + GEN + ["--top-p", "0"])
    monkeypatch.setenv("AMPHISTA_DEBUG", "1")
    with pytest.raises(UserError, match="--top-p"):
        main(GEN + ["--top-p", "0"])


# --- demo and tree-search -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needles", [
    (["demo", "--runs", "0"], ["--runs"]),
    (["demo", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["demo", "--task", "HumanEval/999"], ["HumanEval/999", "HumanEval/163"]),
    (["demo", "--tree", "no-such-tree"], ["unknown tree"]),
    (["demo", "--heads", "/nonexistent"], ["not a draft-head checkpoint"]),
    (["demo", "--method", "no-such-method"], ["--method", "invalid choice"]),
    (["demo", "--task", "HumanEval/1", "--prompt", "x"], ["not allowed with"]),
    (["tree-search", "--heads", "/nonexistent"], ["not a draft-head checkpoint"]),
    (["tree-search", "--heads", HEADS, "--tasks", "9:3"], ["--tasks", "START < STOP"]),
    (["tree-search", "--heads", HEADS, "--tasks", "100:999", "--out", "/tmp/unused-tree.json"], ["100:999"]),
    (["tree-search", "--heads", HEADS, "--max-nodes", "0"], ["--max-nodes", ">= 1"]),
    (["tree-search", "--heads", HEADS, "--out", str(ROOT / "configs"), "--replace"], ["is a directory", "tree.json"]),
    (["tree-search"], ["--heads DIR", "--method NAME"]),
    (["tree-search", "--heads", HEADS, "--method", "prompt_lookup"], ["not both"]),
    (["tree-search", "--method", "prompt_lookup"], ["--out", ".batch.json"]),
    (["tree-search", "--method", "medusa", "--out", "/tmp/unused-tree.json"], ["nothing to train", "--heads"]),
    (["no-such-command"], ["invalid choice"]),
])
def test_demo_and_tree_search_bad_arguments(capsys, argv, needles):
    assert_bad_input(run_cli(capsys, argv, watch=[Path(HEADS)]), *needles)


def test_tree_search_output_under_a_file_is_refused_before_any_work(capsys, user_files):
    outcome = run_cli(capsys, ["tree-search", "--heads", HEADS, "--out", str(user_files / "report.json" / "t.json")],
                      watch=[user_files])
    assert_bad_input(outcome, "is a file, not a directory")


def test_tree_search_never_replaces_a_searched_tree_without_replace(capsys, tmp_path):
    out = tmp_path / "cpu.json"
    out.write_text("[[0]]\n")
    outcome = run_cli(capsys, ["tree-search", "--heads", HEADS, "--out", str(out)], watch=[tmp_path])
    assert_bad_input(outcome, "--replace")


# --- distill, eval, convert -----------------------------------------------------------------------------------
EVAL = ["eval", "--config", "configs/eval/humaneval-code.yaml", "--set", "max_new_tokens=2", "--set",
        "dataset.limit=1", "--set", "heldout_batches=0"]


def _checkpoint(tmp_path, name: str = "ckpt", dtype: str = "float32") -> Path:
    out = tmp_path / name
    assert main(["convert", "--model", MODEL, "--out", str(out), "--dtype", dtype]) == 0
    return out


def test_convert_never_overwrites_an_existing_checkpoint(capsys, tmp_path):
    out = _checkpoint(tmp_path)
    capsys.readouterr()
    outcome = run_cli(capsys, ["convert", "--model", MODEL, "--out", str(out)], watch=[out])
    assert_bad_input(outcome, str(out), "already exists", "pick a new --out")
    assert "saved" not in outcome.out


@pytest.mark.parametrize("extra", [["--heads", HEADS], []])
def test_convert_never_writes_into_a_users_directory(capsys, user_files, extra):
    outcome = run_cli(capsys, ["convert", "--model", MODEL, *extra, "--out", str(user_files)], watch=[user_files])
    assert_bad_input(outcome, "already exists", "pick a new --out")


def test_convert_writes_its_output_whole_or_not_at_all(capsys, tmp_path):
    """A convert the machine stops half-way (a real write failure: a 1 MiB file-size limit, met by safetensors
    inside its own Rust writer) exits 3 in one line and leaves neither --out nor its staging directory; a killed
    run's staging directory is named and removed by the next run, which then writes --out whole; a staging
    directory whose writer still runs is refused in one line."""
    import shlex
    import subprocess
    import sys

    out = tmp_path / "new"
    # `ulimit -f 1024`: writing past 1 MiB fails with EFBIG (SIGXFSZ ignored, else the kernel kills the writer)
    limited = f"trap '' XFSZ; ulimit -f 1024; exec {shlex.quote(sys.executable)} -m amphista_jax.cli convert " \
              f"--model {shlex.quote(MODEL)} --out {shlex.quote(str(out))}"
    proc = subprocess.run(["bash", "-c", limited], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert_bad_input(Outcome(proc.returncode, proc.stdout, proc.stderr), "File too large", "model.safetensors",
                     code=ENVIRONMENT_EXIT)
    assert sorted(tmp_path.iterdir()) == []  # no half-written --out, no staging left
    killed = tmp_path / f".{out.name}.partial-999999999"
    (killed / "model.safetensors").parent.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"torn")
    (killed / ".amphista-lock").write_text(json.dumps({"pid": 999999999, "host": socket.gethostname()}))
    outcome = run_cli(capsys, ["convert", "--model", MODEL, "--out", str(out), "--dtype", "float32"])
    assert outcome.code == 0 and "a partial output of a killed run; removing it" in outcome.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"] and (out / "config.json").is_file()
    live = tmp_path / ".other.partial-1"
    live.mkdir()
    (live / ".amphista-lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                     "command": "convert"}))
    outcome = run_cli(capsys, ["convert", "--model", MODEL, "--out", str(tmp_path / "other")], watch=[live])
    assert_bad_input(outcome, "is being written by convert", "pick another output")


def test_convert_negative_shard_size(capsys, tmp_path):
    outcome = run_cli(capsys, ["convert", "--model", MODEL, "--out", str(tmp_path / "new"), "--max-shard-mb", "-1"])
    assert_bad_input(outcome, "--max-shard-mb -1", ">= 0")
    assert not (tmp_path / "new").exists()


def test_convert_dtype_checkpoint_keeps_the_stored_dtypes(tmp_path):
    import jax

    from amphista_jax.models.hf import load_params

    f32 = _checkpoint(tmp_path, "f32")
    kept = _checkpoint(tmp_path, "kept", dtype="checkpoint")  # from the shipped bf16 model
    again = tmp_path / "again"
    assert main(["convert", "--model", str(f32), "--out", str(again), "--dtype", "checkpoint"]) == 0
    for path, dtype in ((kept, "bfloat16"), (again, "float32")):
        assert json.loads((path / "config.json").read_text())["torch_dtype"] == dtype
        assert {str(x.dtype) for x in jax.tree.leaves(load_params(path)[0])} == {dtype}


def _distill(prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["distill", "--model", MODEL, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2",
            "--prompt-len", "16", "--batch-size", "2", *extra]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"id": "b", "prompt": "import os"}) + "\n")
    return path


@pytest.mark.parametrize("content, line", [
    (json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n", 1),
    (json.dumps({"id": "a", "conversations": []}) + "\n" + json.dumps({"conversations": []}), 2),
    ("my notes, no newline", 1),
])
def test_distill_never_rewrites_an_out_file_it_did_not_write(capsys, tmp_path, prompts, content, line):
    out = tmp_path / "mine.jsonl"
    out.write_text(content)
    outcome = run_cli(capsys, _distill(prompts, out), watch=[out])
    assert_bad_input(outcome, f"{out}:{line}", "not a distill output", "pick a new --out")


def test_distill_cuts_only_its_own_torn_last_line(capsys, tmp_path, prompts):
    out = tmp_path / "distilled.jsonl"
    out.write_text(json.dumps({"id": "a", "conversations": []}) + "\n" + '{"id": "b", "conversa')
    assert main(_distill(prompts, out)) == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b"]


@pytest.mark.parametrize("extra, needles", [
    (["--batch-size", "0"], ["--batch-size 0", ">= 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0", ">= 1"]),
    (["--prompt-len", "0"], ["--prompt-len 0", ">= 1"]),
    (["--temperature", "-1"], ["--temperature -1", ">= 0"]),
    (["--model", "/no/such/model"], ["/no/such/model", "does not exist"]),
])
def test_distill_bad_arguments(capsys, tmp_path, prompts, extra, needles):
    out = tmp_path / "out.jsonl"
    outcome = run_cli(capsys, _distill(prompts, out, *extra), watch=[prompts])
    assert_bad_input(outcome, *needles)
    assert not out.exists()


def test_distill_prompts_file_as_out(capsys, prompts):
    same = prompts.parent / ".." / prompts.parent.name / prompts.name
    outcome = run_cli(capsys, _distill(prompts, same), watch=[prompts])
    assert_bad_input(outcome, "is the --prompts file", "pick another --out")


def test_distill_out_under_a_file(capsys, prompts, user_files):
    outcome = run_cli(capsys, _distill(prompts, user_files / "report.json" / "out.jsonl"), watch=[user_files])
    assert_bad_input(outcome, "is a file, not a directory")


def test_distill_skips_empty_prompts_and_refuses_a_file_of_only_empty_ones(capsys, tmp_path):
    """Empty prompts would become records the evaluation refuses: they are skipped and counted, and a file with
    nothing else is one line before the model loads."""
    from amphista_jax.train.distill import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in enumerate(["", "  ", "def f():"])) + "\n")
    prompts, report = read_prompts(path)
    assert prompts == [("2", "def f():")] and sum(report.skipped.values()) == 2
    path.write_text(json.dumps({"id": 0, "prompt": " \n"}) + "\n")
    outcome = run_cli(capsys, _distill(path, tmp_path / "out.jsonl"), watch=[path])
    assert_bad_input(outcome, "yields no prompt", "an empty prompt")
    assert not (tmp_path / "out.jsonl").exists()


def test_distill_prompts_that_are_not_json(capsys, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "x"\n')
    outcome = run_cli(capsys, _distill(bad, tmp_path / "out.jsonl"), watch=[bad])
    assert_bad_input(outcome, f"{bad}:1", "invalid JSON")


@pytest.mark.parametrize("extra, needles", [
    (["--set", "temperature=-1"], ["temperature=-1.0", ">= 0"]),
    (["--set", "dataset.limit=-1"], ["dataset.limit=-1", ">= 0"]),
    (["--set", "dataset.turns=-1"], ["dataset.turns=-1", ">= 0"]),
    (["--set", "num_prompts=1"], ["unknown key", "num_prompts"]),
    (["--set", "attention=flash"], ["attention 'flash'", "xla"]),
    (["--set", "order=random"], ["order 'random'", "method, prompt"]),
    (["--set", "dataset.kind=jsonl", "--set", "dataset.path=/no/such.jsonl"], ["/no/such.jsonl", "does not exist"]),
    (["--methods", "ar", "foo"], ["method spec 'foo'", "neither"]),
    (["--methods", "ar", "medusa:untrained@nosuch"], ["'medusa:untrained@nosuch'", "unknown tree"]),
    (["--methods", "ar", "x="], ["method spec 'x='", "names no source"]),
    (["--set", "mesh.data=3"], ["3 devices", "device count", "mesh=null"]),
    (["--set", "mesh.tensor=0"], ["tensor=0", ">= 1"]),
    (["--set", "top_k=100000"], ["top_k=100000", "larger than the vocabulary"]),
    (["--methods", "ar", "medusa:untrained@"], ["empty tree after `@`"]),
    (["--methods", "ar", "prompt_lookup#max_ngram=three"], ["max_ngram='three' must be an integer"]),
    (["--methods", "ar", "gumiho:untrained#full_tree_attention=1"], ["full_tree_attention=1", "true or false"]),
    (["--methods", "ar", "medusa:untrained#heads=2"], ["['heads'] are not medusa settings", "num_heads"]),
])
def test_eval_bad_arguments(capsys, tmp_path, extra, needles):
    out = tmp_path / "eval"
    outcome = run_cli(capsys, EVAL + ["--set", f"out_dir={out}", *extra])
    assert_bad_input(outcome, *needles)
    assert not out.exists()


@pytest.mark.parametrize("name, content, needles", [
    ("data.jsonl", '{"prompt": "x"\n', ["data.jsonl:1", "invalid JSON"]),
    ("tree.json", "[[0], [0, 0]", ["tree.json", "line 1"]),
    ("heads/draft.json", '{"method": "medusa",\n', ["draft.json", "line 2"]),
])
def test_eval_json_inputs_that_are_not_json(capsys, tmp_path, name, content, needles):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    extra = {"data.jsonl": ["--set", "dataset.kind=jsonl", "--set", f"dataset.path={path}"],
             "tree.json": ["--methods", "ar", f"medusa:untrained@{path}"],
             "heads/draft.json": ["--methods", "ar", str(path.parent)]}[name]
    outcome = run_cli(capsys, EVAL + ["--set", f"out_dir={tmp_path / 'eval'}", *extra], watch=[path])
    assert_bad_input(outcome, *needles)


@pytest.mark.parametrize("setting, needles", [
    ({"num_heads": "4"}, ["num_heads='4' must be an integer", "re-save the heads"]),
    ({"shared_lm_head": "no"}, ["shared_lm_head='no' must be true or false"]),
    ({"draft_vocab": [1, "x"]}, ["draft_vocab=[1, 'x'] must be a list of integers"]),
    ({"heads": 4}, ["['heads'] are not medusa settings"]),
])
def test_eval_heads_whose_draft_json_has_wrong_types(capsys, tmp_path, setting, needles):
    heads = tmp_path / "heads"
    heads.mkdir()
    meta = json.loads((Path(HEADS) / "draft.json").read_text())
    (heads / "draft.json").write_text(json.dumps(meta | {"settings": meta["settings"] | setting}))
    outcome = run_cli(capsys, EVAL + ["--set", f"out_dir={tmp_path / 'eval'}", "--methods", "ar", str(heads)],
                      watch=[heads])
    assert_bad_input(outcome, "draft.json", *needles)


def test_eval_never_writes_into_a_users_directory(capsys, user_files, tmp_path):
    outcome = run_cli(capsys, EVAL + ["--methods", "ar", "--set", f"out_dir={user_files}"], watch=[user_files])
    assert_bad_input(outcome, "no run.json", "pick a new out_dir")
    outcome = run_cli(capsys, EVAL + ["--methods", "ar", "--set", f"out_dir={user_files}", "--replace"],
                      watch=[user_files])
    assert_bad_input(outcome, "no run.json", "pick a new out_dir")  # --replace replaces eval runs only
    train_run = tmp_path / "train-run"  # a train out_dir has a run.json too, of another kind
    (train_run / "checkpoints").mkdir(parents=True)
    (train_run / "run.json").write_text(json.dumps({"config": {}, "target": {}, "data": {}}))
    (train_run / "summary.json").write_text("{}")
    outcome = run_cli(capsys, EVAL + ["--methods", "ar", "--set", f"out_dir={train_run}", "--replace"],
                      watch=[train_run])
    assert_bad_input(outcome, "not an eval run record", "new out_dir")
    outcome = run_cli(capsys, EVAL + ["--methods", "ar", "--set", f"out_dir={user_files / 'report.json' / 'x'}"],
                      watch=[user_files])
    assert_bad_input(outcome, "is a file, not a directory")


def test_eval_resume_refuses_heads_or_data_changed_under_the_same_path(capsys, tmp_path):
    import shutil

    heads, out, data = tmp_path / "heads", tmp_path / "eval", tmp_path / "data.jsonl"
    assert main(["convert", "--heads", HEADS, "--out", str(heads), "--dtype", "float32"]) == 0
    data.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):\n"}) + "\n")
    argv = EVAL + ["--set", f"out_dir={out}", "--set", "dataset.kind=jsonl", "--set", f"dataset.path={data}",
                   "--methods", "ar", f"m={heads}@chain-1"]
    assert main(argv) == 0
    assert main(argv) == 0  # the same inputs resume (nothing left to run)
    assert "resuming it (2 prompt result(s) kept" in capsys.readouterr().err
    first_turns = [*argv[:-3], "--set", "dataset.turns=1", *argv[-3:]]  # a record would hold other turns
    assert_bad_input(run_cli(capsys, first_turns, watch=[out]), "dataset.turns", "use a new out_dir")
    shutil.rmtree(heads)  # retrained under the same path
    assert main(["convert", "--heads", HEADS, "--out", str(heads), "--dtype", "bfloat16"]) == 0
    assert_bad_input(run_cli(capsys, argv, watch=[out]), "method m heads_files", "use a new out_dir", "--replace")
    data.write_text(json.dumps({"id": "a", "prompt": "import os\n"}) + "\n")
    assert_bad_input(run_cli(capsys, argv[:-1], watch=[out]), "dataset.sha256", "use a new out_dir")
    (out / "notes.md").write_text("mine")
    assert main(argv[:-1] + ["--replace"]) == 0  # starts over: only AR, on the new data
    assert "resuming" not in capsys.readouterr().err and (out / "notes.md").read_text() == "mine"
    assert json.loads((out / "summary.json").read_text())["methods"][0]["label"] == "ar"
    assert [p.name for p in (out / "results").iterdir()] == ["ar.process0.jsonl"]
    sha256 = hashlib.sha256(data.read_bytes()).hexdigest()
    assert json.loads((out / "run.json").read_text())["settings"]["dataset"]["sha256"] == sha256


# --- train and pretrain-target --------------------------------------------------------------------------------
TRAIN = ["train", "--config", "configs/medusa/code.yaml", "--set", "data.kind=text", "--set", "data.max_len=32",
         "--set", "data.batch_size=2", "--set", "loop.steps=2", "--set", "drafter.num_heads=2"]
PRETRAIN = ["pretrain-target", "--config", "configs/target/tiny-code.yaml", "max_files=30", "heldout_fraction=0.2",
            "vocab_size=300", "seq_len=32", "batch_size=4", "arch.hidden_size=32", "arch.intermediate_size=64",
            "arch.num_layers=2", "arch.num_heads=2", "arch.num_kv_heads=1", "eval_windows=4", "sample_tokens=8",
            "checkpoint_every=2", "optim.warmup_steps=1", "steps=2"]


def _code(root: Path) -> Path:
    """30 small Python files: a text-kind training set."""
    root.mkdir(parents=True)
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n\n" * 6)
    return root


def _train(out: Path, data: Path, *extra: str) -> list[str]:
    return TRAIN + ["--set", f"out_dir={out}", "--set", f"data.train={data}", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[str], Path, Path]:
    """(argv, out_dir, data dir) of a finished 2-step train run."""
    root = tmp_path_factory.mktemp("train")
    argv = _train(root / "run", _code(root / "code"))
    assert main(argv) == 0
    return argv, root / "run", root / "code"


def _copy_run(trained, tmp_path: Path) -> tuple[list[str], Path]:
    import shutil

    argv, out, _ = trained
    shutil.copytree(out, tmp_path / "run")
    return argv + ["--set", f"out_dir={tmp_path / 'run'}"], tmp_path / "run"


@pytest.mark.parametrize("extra, needles", [
    (["--set", "loop.keep_checkpoints=0"], ["keep_checkpoints=0", "at least its latest checkpoint"]),
    (["--set", "loop.steps=true"], ["loop.steps", "expected int, got True"]),
    (["--set", "loop.steps=1.5"], ["loop.steps", "expected int, got 1.5"]),
    (["--set", "loop.log_every=0"], ["log_every=0", ">= 1"]),
    (["--set", "optim.lr=0"], ["lr=0.0", "> 0"]),
    (["--set", "optim.b2=1"], ["b2=1.0", "[0, 1)"]),
    (["--set", "data.batch_size=0"], ["batch_size=0", ">= 1"]),
    (["--set", "data.heldout_fraction=2"], ["heldout_fraction=2.0", "(0, 1)"]),
    (["--set", "drafter.type=speculator"], ["drafter.type 'speculator' is not one of", "medusa"]),
    (["--set", "drafter=3"], ["drafter", "expected a mapping of a type"]),
    (["--set", "drafter={num_heads: 2}"], ["drafter: no type", "add drafter.type"]),
    (["--set", "drafter.num_headz=2"], ["drafter: unknown key(s) ['num_headz']", "num_heads"]),
    (["--set", "loop.steps.x=1"], ["loop.steps is a value"]),
    (["--set", "model=/no/such/model"], ["/no/such/model", "does not exist"]),
    (["--set", "data.train=/no/such/data"], ["data.train /no/such/data", "matches no file"]),
    (["--set", "data.kind=sharegpt"], ["is not a file", "conversations"]),
    (["--set", "data.kind=stdlib", "--set", "data.corpus=/no/such.yaml"], ["data.corpus /no/such.yaml"]),
    (["--set", "data.max_len=100000"], ["data.max_len=100000", "2048 positions"]),
    (["--set", "mesh.data=3"], ["3 devices", "device count"]),
    (["--set", "part_lrs.nothere=0.1"], ["part_lrs ['nothere']", "parameter groups"]),
    (["--set", "drafter.num_heads=-3"], ["num_heads=-3 must be an integer >= 1"]),
    (["--set", "drafter.num_heads=0"], ["num_heads=0 must be an integer >= 1"]),
    (["--set", "drafter.num_layers=-1"], ["num_layers=-1 must be an integer >= 0 (ResBlocks per head)"]),
    (["--set", "drafter.loss_decay=0"], ["loss_decay=0.0 must be in (0, 1]"]),
    (["--set", "drafter.num_heads='4'"], ["drafter.num_heads", "expected int, got '4'"]),
    (["--set", "drafter.num_heads=2.5"], ["drafter.num_heads", "expected int, got 2.5"]),
    (["--set", "draft_vocab_size=-1"], ["draft_vocab_size=-1 must be an integer >= 0"]),
    (["--set", "draft_vocab_size=100000"], ["draft_vocab_size=100000 exceeds the target's"]),
    (["--set", "drafter={type: bita}", "--set", "data.cache_target_hidden=true"],
     ["bita runs the target inside its own loss", "data.cache_target_hidden=false"]),
    (["--set", "loss.labels=model"], ["loss.labels 'model'", "data, target"]),
    (["--set", "loss.kind=kl"], ["loss.kind kl", "set loss.labels to target"]),
    (["--set", "loss.kind=mse", "--set", "loss.labels=target"], ["loss.kind 'mse'", "ce, kl"]),
    (["--set", "loss.top_k=0", "--set", "loss.labels=target"], ["loss.top_k=0", "integer >= 1"]),
    (["--set", "drafter={type: bita}", "--set", "loss.labels=target"],
     ["bita runs the target inside its loss", "loss.labels data"]),
    (["--set", "drafter={type: eagle3}", "--set", "loss.labels=target"],
     ["eagle3 has no LM term here", "drafter.lm_weight > 0"]),
])
def test_train_bad_settings_fail_before_any_work(capsys, tmp_path, extra, needles):
    data, out = _code(tmp_path / "code"), tmp_path / "run"
    assert_bad_input(run_cli(capsys, _train(out, data, *extra), watch=[data]), *needles)
    assert not out.exists()


OLD_FORM = "data: {kind: text, train: x}\nmethod: eagle3\nmethod_settings: {ttt_steps: 2, draft_vocab_size: 64}\n"
OVER_OLD_BASE = "base: old.yaml\nout_dir: runs/x\n"  # a config of today's form over a base of the old one
OLD_RECIPE = "model: tiny\nmethods:\n  medusa: {config: %s, tokens: 64, set: [method_settings.num_heads=2]}\n"


@pytest.mark.parametrize("argv, needles", [
    (["train", "--config", "{dir}/old.yaml"],
     ["old.yaml: method/method_settings are gone", "write drafter: {type: eagle3, <settings>}",
      "draft_vocab_size: 64 at the top level", "(see configs/medusa/code.yaml)"]),
    (["plan", "--config", "{dir}/old.yaml"], ["method/method_settings are gone", "drafter: {type: eagle3"]),
    (["train", "--config", "{dir}/job.yaml"], ["job.yaml: method/method_settings are gone", "drafter: {type: eagle3"]),
    (["train", "--config", "configs/medusa/code.yaml", "--set", "method_settings.num_heads=2"],
     ["--set method_settings.num_heads=2: method_settings is gone", "write --set drafter.num_heads=2"]),
    (["train", "--config", "configs/medusa/code.yaml", "--set", "method_settings.draft_vocab_size=64"],
     ["method_settings is gone", "write --set draft_vocab_size=64"]),
    (["train", "--config", "configs/medusa/code.yaml", "--set", "method=hydra"],
     ["--set method=hydra: method is gone", "write --set drafter.type=hydra", "--set 'drafter={type: hydra}'"]),
    (["plan", "--config", "configs/medusa/vicuna-7b.yaml", "--set", "method=eagle"],
     ["method is gone", "--set drafter.type=eagle"]),
    (["recipe", "--config", "{dir}/recipe.yaml"], ["method_settings is gone", "drafter.num_heads=2"]),
])
def test_the_config_form_before_registered_drafters_is_refused_in_one_line(capsys, tmp_path, argv, needles):
    """`method` + `method_settings` (a file, a base of it, or `--set`) stop before any work in one line that names
    what replaced them: `drafter: {type: <name>, <settings>}` and `--set drafter.<setting>=v`."""
    (tmp_path / "old.yaml").write_text(OLD_FORM)
    (tmp_path / "job.yaml").write_text(OVER_OLD_BASE)
    (tmp_path / "recipe.yaml").write_text(OLD_RECIPE % (ROOT / "configs/medusa/code.yaml"))
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert_bad_input(run_cli(capsys, argv, watch=[tmp_path]), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "old.yaml", "recipe.yaml"]


def test_train_out_dir_under_a_file(capsys, tmp_path, user_files):
    outcome = run_cli(capsys, _train(user_files / "report.json" / "run", _code(tmp_path / "code")), watch=[user_files])
    assert_bad_input(outcome, "is a file, not a directory")


def test_train_rerun_of_a_finished_run_changes_nothing(capsys, trained):
    argv, out, data = trained
    outcome = run_cli(capsys, argv + ["--set", "loop.keep_checkpoints=5"], watch=[out, data])  # bookkeeping only
    assert outcome.code == 0 and "already trained" in outcome.out, outcome.err[-2000:]


@pytest.mark.parametrize("extra, needles", [
    (["--set", "optim.lr=0.002"], ["optim.lr 0.001 -> 0.002"]),
    (["--set", "loop.steps=3"], ["loop.steps 2 -> 3"]),  # the LR schedule spans `steps`: no silent extension
    (["--set", "drafter.num_heads=3"], ["drafter.num_heads 2 -> 3"]),
    (["--set", "data.max_len=48", "--set", "data.seed=1"], ["data.max_len 32 -> 48", "data.seed 0 -> 1"]),
])
def test_train_into_a_run_with_other_settings_is_refused(capsys, trained, extra, needles):
    argv, out, data = trained
    assert_bad_input(run_cli(capsys, argv + extra, watch=[out, data]), *needles, "use a new out_dir")


def test_train_refuses_data_changed_under_the_same_path(capsys, trained):
    argv, out, data = trained
    original = (data / "m0.py").read_text()
    (data / "m0.py").write_text(original + "# edited\n")
    try:
        outcome = run_cli(capsys, argv, watch=[out])
    finally:
        (data / "m0.py").write_text(original)
    assert_bad_input(outcome, "data.train changed", "use a new out_dir")


def test_train_refuses_a_target_changed_under_the_same_path(capsys, trained, tmp_path):
    argv, out = _copy_run(trained, tmp_path)
    run = json.loads((out / "run.json").read_text())
    run["target"]["model.safetensors"] = "0" * 64  # the run was started on other weights under this path
    (out / "run.json").write_text(json.dumps(run))
    assert_bad_input(run_cli(capsys, argv, watch=[out]), "target model.safetensors changed", "use a new out_dir")


def test_train_never_adopts_a_run_without_run_json(capsys, trained, tmp_path):
    argv, out = _copy_run(trained, tmp_path)
    (out / "run.json").unlink()  # e.g. a run of an older amphista-jax: its settings are unknown
    assert_bad_input(run_cli(capsys, argv, watch=[out]), "no run.json", "use a new out_dir")


def test_train_stops_at_once_when_a_checkpoint_cannot_be_written(capsys, tmp_path, monkeypatch):

    from orbax.checkpoint._src.serialization import serialization

    async def disk_full(*args, **kwargs):  # what tensorstore meets on a full disk, in orbax's background thread
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
    data, out = _code(tmp_path / "code"), tmp_path / "run"
    outcome = run_cli(capsys, _train(out, data, "--set", "loop.steps=50", "--set", "loop.checkpoint_every=1"),
                      watch=[data])
    assert_bad_input(outcome, "saving a checkpoint", "No space left on device", "rerun the same command",
                     code=ENVIRONMENT_EXIT)
    assert not (out / "heads").exists() and not (out / "metrics.jsonl").exists()


def test_pretrain_bad_overrides_fail_before_any_work(capsys, tmp_path):
    run_dir = tmp_path / "target"
    base = PRETRAIN + [f"run_dir={run_dir}", f"export_dir={run_dir / 'export'}"]
    for extra, needles in [
        (["stepz=3"], ["unknown key", "stepz"]),
        (["steps=-3"], ["steps=-3", ">= 1"]),
        (["steps=true"], ["steps", "expected int, got True"]),
        (["keep_checkpoints=0"], ["keep_checkpoints=0"]),
        (["batch_size=0"], ["batch_size=0"]),
        (["arch.num_heads=3"], ["hidden_size=32", "multiple of num_heads=3"]),
        (["seq_len=4000"], ["seq_len=4000", "max_position_embeddings"]),
        (["sample_tokens=0"], ["sample_tokens=0"]),
        (["stdlib=false"], ["corpus would be empty"]),
        (["bpb_package=no-such-package-xyz"], ["no-such-package-xyz", "not installed"]),
        (["init_from=/no/such/export"], ["init_from /no/such/export", "export_dir"]),
        ([f"export_dir={run_dir}"], ["holds run_dir", "run_dir/export"]),
        (["run_dir=/dev/null/target"], ["run_dir", "not a directory"]),
    ]:
        assert_bad_input(run_cli(capsys, base + extra), *needles)
        assert not run_dir.exists(), extra


def test_pretrain_never_writes_into_a_users_export_dir(capsys, tmp_path, user_files):
    outcome = run_cli(capsys, PRETRAIN + [f"run_dir={tmp_path / 'target'}", f"export_dir={user_files}"],
                      watch=[user_files])
    assert_bad_input(outcome, f"export_dir {user_files}", "did not make")


def test_pretrain_fresh_start_never_appends_to_another_runs_metrics(capsys, tmp_path):
    run_dir = tmp_path / "target"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    outcome = run_cli(capsys, PRETRAIN + [f"run_dir={run_dir}", f"export_dir={run_dir / 'export'}"],
                      watch=[run_dir])
    assert_bad_input(outcome, "metrics.jsonl holds 1 metric rows", "another run's log")


@pytest.mark.slow
def test_plan_never_overwrites_earlier_plans_and_checks_out_before_compiling(capsys, tmp_path, user_files):
    """Under -m slow (its `--replace` run compiles a 7B plan): test_an_unwritable_output_exits_3_before_any_work[plan]
    runs plan's `--out` check before any compile, and test_output_lock.py's
    test_every_command_refuses_an_output_another_run_is_writing[plan] its refusal to write into a taken `--out`."""
    out = tmp_path / "plans"
    out.mkdir()
    (out / "plan.md").write_text("my notes\n")
    plan = ["plan", "--config", "configs/medusa/vicuna-7b.yaml"]
    assert_bad_input(run_cli(capsys, plan + ["--out", str(out)], watch=[out]), "plan.md", "--replace")
    assert_bad_input(run_cli(capsys, plan + ["--out", str(user_files / "report.json")], watch=[user_files]),
                     "is a file")
    (out / "mine.txt").write_text("kept\n")
    assert main(plan + ["--out", str(out), "--replace"]) == 0  # replaces the plans, and only them
    assert (out / "plan.md").read_text() != "my notes\n" and json.loads((out / "plan.json").read_text())
    assert (out / "mine.txt").read_text() == "kept\n" and sorted(p.name for p in out.iterdir()) == [
        "mine.txt", "plan.json", "plan.md"]


@pytest.mark.parametrize("damage, needles", [
    (lambda text, cfg: text[:40], ["config.json is not valid JSON", "damaged"]),
    (lambda text, cfg: json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}), ["no 'hidden_size'"]),
    (lambda text, cfg: json.dumps(cfg | {"hidden_size": "big"}), ["wrong kind", "'big'"]),
    (lambda text, cfg: "[1, 2]", ["holds a JSON list"]),
])
def test_a_damaged_config_json_is_one_line(capsys, tmp_path, damage, needles):
    import shutil

    from amphista_jax.assets import default_model_dir

    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model)
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(damage(text, json.loads(text)))
    assert_bad_input(run_cli(capsys, ["generate", "--model", str(model), "--prompt", "hi"], watch=[model]), *needles)


# --- a machine that refuses: exit 3 at every door that writes ----------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["convert", "--model", MODEL, "--out", "{tmp}/out"],
    TRAIN + ["--set", "out_dir={tmp}/out", "--set", f"data.train={ROOT / 'pallas_kernels'}"],
    PRETRAIN + ["run_dir={tmp}/out", "export_dir={tmp}/export"],
    ["fetch", "mt-bench"],  # into AMPHISTA_HOME
], ids=["convert", "train", "pretrain-target", "fetch"])
def test_too_little_free_space_is_refused_before_any_work(capsys, tmp_path, argv, monkeypatch):
    import shutil

    import amphista_jax.infra.errors as errors

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 4096))
    outcome = run_cli(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert_bad_input(outcome, "0 MiB free but about", "free space", code=ENVIRONMENT_EXIT)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


UNWRITABLE = Path("/sys/amphista-jax-out")  # /sys refuses new files, root included


@pytest.mark.parametrize("argv", [
    ["train", "--config", "configs/medusa/code.yaml", "--set", f"out_dir={UNWRITABLE}"],
    ["eval", "--config", "configs/eval/humaneval-code.yaml", "--set", f"out_dir={UNWRITABLE}"],
    ["convert", "--model", MODEL, "--out", str(UNWRITABLE)],
    ["plan", "--config", "configs/medusa/vicuna-7b.yaml", "--out", str(UNWRITABLE)],
    ["tree-search", "--heads", HEADS, "--out", str(UNWRITABLE / "tree.json")],
    PRETRAIN + [f"run_dir={UNWRITABLE}"],
    ["fetch", "mt-bench"],  # into AMPHISTA_HOME
], ids=["train", "eval", "convert", "plan", "tree-search", "pretrain-target", "fetch"])
def test_an_unwritable_output_exits_3_before_any_work(capsys, argv, monkeypatch):
    try:
        (UNWRITABLE.parent / f".probe-{os.getpid()}").touch()
        pytest.skip("/sys is writable on this machine: no unwritable directory to point at")
    except OSError:
        pass
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("AMPHISTA_HOME", str(UNWRITABLE))
    assert_bad_input(run_cli(capsys, argv), "cannot be written", "writable", code=ENVIRONMENT_EXIT)
