"""The evaluation runner end to end on the embedded model: resume after a kill, two real local processes
(jax.distributed on 127.0.0.1) merge to the one-process result, and the lossless check fails loudly."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from amphista_jax import cli
from amphista_jax.evals.results import read_results
from tests.helpers import ROOT, subprocess_env

PROMPTS = [
    {"id": "add", "category": "code", "prompt": "def add(a, b):\n"},
    {"id": "stack", "category": "code", "prompt": "class Stack:\n    def __init__(self):\n"},
    {"id": "os", "category": "imports", "prompt": "import os\n"},
    {"id": "two-turns", "category": "imports", "turns": ["import sys\n", "\n\ndef main():\n"]},
    {"id": "json", "category": "code", "prompt": "def load(path):\n    with open(path) as f:\n"},
]
LABELS = ("ar", "medusa-untrained@small-8")


def _args(prompts: Path, out: Path) -> list[str]:
    return ["eval", "--config", str(ROOT / "configs/eval/humaneval-code.yaml"), "--methods", "ar",
            "medusa:untrained@small-8", "--set", "dataset.kind=jsonl", "--set", f"dataset.path={prompts}",
            "--set", "dataset.limit=0", "--set", "max_new_tokens=8", "--set", f"out_dir={out}",
            "--set", "heldout_batches=0"]


def _essence(out: Path) -> dict[str, list]:
    """Everything but timings, per method, in prompt order, from the merged results."""
    keep = ("tokens", "text", "steps", "accept_lengths", "new_tokens", "prompt_tokens")
    return {label: [(r["id"], r["category"], [{k: t[k] for k in keep} for t in r["turns"]], r.get("node_hits"))
                    for r in map(json.loads, (out / "merged" / f"{label.replace('@', '_')}.jsonl").read_text()
                                 .splitlines())]
            for label in LABELS}


def _lines(out: Path) -> list[str]:
    return [line for p in sorted((out / "results").glob("*.process*.jsonl")) for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def reference(prompts_file, tmp_path_factory) -> Path:
    """One uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("reference")
    assert cli.main(_args(prompts_file, out)) == 0
    return out


def test_reference_run_is_complete_lossless_and_reported(reference):
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["lossless"] == {"checked": True, "mismatches": []}
    assert [m["label"] for m in summary["methods"]] == list(LABELS)
    ar = summary["metrics"]["ar"]
    assert list(ar) == ["overall", "code", "imports"] and ar["overall"]["tau"] == 1.0
    assert ar["overall"]["prompts"] == 5 and ar["overall"]["turns"] == 6
    essence = _essence(reference)
    two = next(r for r in essence["ar"] if r[0] == "two-turns")
    assert len(two[2]) == 2 and two[2][1]["prompt_tokens"] > two[2][0]["prompt_tokens"]  # answer 1 is in turn 2
    same = lambda rows: [(i, [(t["tokens"], t["text"], t["prompt_tokens"]) for t in turns])  # noqa: E731
                         for i, _, turns, _ in rows]
    assert same(essence["ar"]) == same(essence[LABELS[1]])  # identical tokens and texts in every turn
    assert sum(r[2][0]["steps"] for r in essence[LABELS[1]]) < sum(r[2][0]["steps"] for r in essence["ar"])
    stats = json.loads((reference / "tree_stats.json").read_text())[LABELS[1]]
    assert stats["tree"] == "small-8" and len(stats["depth_rank_tries"]) == 3
    report = (reference / "report.md").read_text()
    assert "| medusa-untrained@small-8 | small-8 | **overall** | 5 |" in report
    assert (reference / "tau_by_category.png").stat().st_size > 1000


def test_resume_after_kill_matches_an_uninterrupted_run(prompts_file, reference, tmp_path):
    out = tmp_path / "resumed"
    proc = subprocess.Popen([sys.executable, "-m", "amphista_jax.cli", *_args(prompts_file, out)], cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(_lines(out) if (out / "results").is_dir() else []) < 2:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _lines(out)
    assert 2 <= len(before) < 2 * len(PROMPTS), "the run was not killed part-way"
    ar_file = out / "results" / "ar.process0.jsonl"
    with ar_file.open("a") as f:
        f.write('{"id": "torn-write", "turns": [')  # a crash in the middle of a line
    assert cli.main(_args(prompts_file, out)) == 0
    after = _lines(out)
    assert after[: len(before)] == before  # finished prompts were kept, not rerun
    ids = [(p.name.split(".process")[0], json.loads(line)["id"]) for p in sorted((out / "results").glob("*.jsonl"))
           for line in p.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 2 * len(PROMPTS)  # no prompt ran twice; the torn line is gone
    assert _essence(out) == _essence(reference)


def test_prompt_order_interleaves_the_methods_and_writes_the_same_results(prompts_file, reference, tmp_path,
                                                                          monkeypatch):
    """`order: prompt` runs every method on a batch before the next batch (so a machine whose speed drifts during
    the run shifts every method alike); each result is what the method-by-method reference wrote."""
    from amphista_jax.evals import runner

    ran, run_batch = [], runner._MethodRun.run_batch
    monkeypatch.setattr(runner._MethodRun, "run_batch", lambda self, s, k, bar: (
        ran.append((self.method.label, [p.id for _, p in self.batches[k]])), run_batch(self, s, k, bar)))
    out = tmp_path / "interleaved"
    assert cli.main(_args(prompts_file, out) + ["--set", "order=prompt"]) == 0
    assert ran == [(label, [p["id"]]) for p in PROMPTS for label in LABELS]
    assert _essence(out) == _essence(reference)


def test_two_local_processes_merge_to_the_one_process_result(prompts_file, reference, tmp_path):
    """Also at batch size 2 (a padded last batch, rows of different lengths and turn counts): per-row results
    equal the batch-1 run's."""
    out = tmp_path / "two"
    args = _args(prompts_file, out) + ["--set", "batch_size=2"]
    launch = [sys.executable, "-m", "amphista_jax.evals.launch_local", "-n", "2", "--"]
    result = subprocess.run([*launch, sys.executable, "-m", "amphista_jax.cli", *args], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 process(es)" in (out / "report.md").read_text()
    for label in LABELS:
        per_process = [len(p.read_text().splitlines()) for p in sorted((out / "results").glob(
            f"{label.replace('@', '_')}.process*.jsonl"))]
        assert per_process == [3, 2]  # prompts were split between the two processes
    assert _essence(out) == _essence(reference)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
@pytest.mark.slow
def test_a_mesh_gives_the_one_device_tokens(reference, tmp_path, monkeypatch):
    """The target and the heads sharded over (data=2, fsdp=2, tensor=2): the tokens of the one-device run (two of
    its prompts, one with two turns). Under -m slow: test_sharding.py's
    test_sharded_speculative_generate_equals_one_device[medusa] and test_cli.py's
    test_generate_on_a_mesh_prints_the_one_device_text decode with the target and the heads sharded over the same
    mesh and get one device's tokens."""
    from amphista_jax.engine import sharding
    placed = []
    place = sharding.place_for_decoding  # the generator's placement of the target and the heads
    monkeypatch.setattr(sharding, "place_for_decoding", lambda *a, **k: placed.append(place(*a, **k)) or placed[-1])
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "mesh"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS if p["id"] in ("add", "two-turns")))
    mesh = ["--set", "mesh.data=2", "--set", "mesh.fsdp=2", "--set", "mesh.tensor=2"]
    assert cli.main(_args(prompts, out) + mesh) == 0
    sharded = lambda tree: not max(jax.tree.leaves(tree), key=lambda x: x.size).sharding.is_fully_replicated  # noqa: E731
    assert sharded(placed[0][0]) and sharded(placed[-1][1])  # the target; the Medusa heads
    assert json.loads((out / "summary.json").read_text())["config"]["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    one = {label: [r for r in rows if r[0] in ("add", "two-turns")] for label, rows in _essence(reference).items()}
    assert _essence(out) == one


def test_lossless_check_fails_loudly_on_a_wrong_drafter_output(reference, prompts_file, tmp_path, capsys):
    out = tmp_path / "corrupted"
    shutil.copytree(reference, out)
    path = out / "results" / "medusa-untrained_small-8.process0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[2]["turns"][0]["tokens"][3] += 1  # a drafter that emitted a token the target would not have
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(_args(prompts_file, out)) == 1
    assert "LOSSLESS CHECK FAILED: 1 prompt(s)" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    bad = records[2]["turns"][0]["tokens"][3]
    assert summary["lossless"]["mismatches"] == [{"id": records[2]["id"], "method": LABELS[1], "turn": 0, "index": 3,
                                                  "ar_token": bad - 1, "method_token": bad}]
    assert "**1 MISMATCH(ES)**" in (out / "report.md").read_text()
    assert cli.main(_args(prompts_file, out) + ["--set", "allow_mismatch=true"]) == 0
    assert len(read_results(out / "results", LABELS[1])) == len(PROMPTS)  # nothing was regenerated


def test_rerun_with_other_settings_is_refused(reference, prompts_file, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(reference, out)
    from amphista_jax.infra.identity import RunMismatchError

    with pytest.raises(RunMismatchError, match=r"max_new_tokens.*\(8, 9\).*use a new out_dir"):
        cli.main(["--debug", *_args(prompts_file, out), "--set", "max_new_tokens=9"])  # --debug: raise
    with pytest.raises(RunMismatchError, match="method medusa-untrained@small-8"):
        args = _args(prompts_file, out)
        args[args.index("medusa:untrained@small-8")] = "medusa-untrained@small-8=medusa:untrained@chain-4"
        cli.main(["--debug", *args])


def test_method_specs_resolve_any_registered_drafter_and_reject_bad_ones(tmp_path):
    import jax

    from amphista_jax.drafters import DRAFTERS
    from amphista_jax.evals.methods import MethodSpecError, resolve_methods, split_label
    from amphista_jax.models.config import tiny_llama_config
    from amphista_jax.models.llama import init_params
    from amphista_jax.models.target import Target
    from amphista_jax.trees.tree import TreeSpec

    config = tiny_llama_config()
    target = Target(config, jax.jit(init_params, static_argnums=0)(config, jax.random.key(0)))
    # every drafter on the default tree, or on its paper's where it drafts dynamic budgets only (Gumiho)
    trees = {n: "" if TreeSpec in d.tree_kinds else d().paper_tree for n, d in DRAFTERS.items()}
    specs = tuple(f"{n}:untrained" + (f"@{t}" if t else "") for n, t in trees.items()) + (
        "base=ar", "x=medusa:untrained@chain-4")
    methods = resolve_methods(specs, "small-8", target.config)
    assert [m.label for m in methods] == ["base", *(f"{n}-untrained" + (f"@{t}" if t else "") for n, t in
                                                    trees.items()), "x"]  # AR first
    assert [m.tree_name for m in methods] == ["-", *(t or "small-8" for t in trees.values()), "chain-4"]
    assert resolve_methods(("medusa:untrained",), "small-8", target.config)[0].label == "ar"  # AR is always run
    # the first `ar` spec runs first; a later one stays in place: AR timed again there (the run's timing noise)
    again = resolve_methods(("medusa:untrained", "ar", "ar-end=ar"), "small-8", target.config)
    assert [(m.label, m.method) for m in again] == [("ar", "ar"), ("medusa-untrained", "medusa"), ("ar-end", "ar")]
    with pytest.raises(MethodSpecError, match=r"\['ar'\] are used twice"):
        resolve_methods(("ar", "ar"), "small-8", target.config)
    with pytest.raises(MethodSpecError, match="unknown method 'medusae'"):
        resolve_methods(("medusae:untrained",), "small-8", target.config)
    with pytest.raises(MethodSpecError, match="neither a draft-head directory nor a method"):
        resolve_methods((str(tmp_path / "no-heads"),), "small-8", target.config)
    with pytest.raises(MethodSpecError, match="used twice"):
        resolve_methods(("medusa:untrained", "medusa:untrained"), "small-8", target.config)
    with pytest.raises(MethodSpecError, match="AR baseline has no tree"):
        resolve_methods(("ar@chain-4",), "small-8", target.config)
    heads = tmp_path / "lr=1e-3" / "heads"  # a heads path with `=` in it is a source, not `label=source`
    heads.mkdir(parents=True)
    assert split_label(f"{heads}@chain-4") == ("", f"{heads}@chain-4")
    assert split_label(f"mine={heads}") == ("mine", str(heads))
    spec = "gumiho:untrained@dynamic-63x7x35#full_tree_attention=false"  # the `=` of a setting is not a label's
    assert split_label(spec) == ("", spec) and split_label(f"g={spec}") == ("g", spec)
    assert resolve_methods((spec,), "small-8")[1].drafter.full_tree_attention is False
    with pytest.raises(MethodSpecError, match="empty tree after `@`"):
        resolve_methods(("medusa:untrained@",), "small-8")
    # a run records a draft vocabulary by its size and digest, not its ids (32,768 of them, per method)
    from amphista_jax.infra.identity import json_digest

    (cut,) = resolve_methods(("medusa:untrained@chain-4#draft_vocab=[7]",), "small-8", target.config)[1:]
    assert cut.drafter.draft_vocab == (7,)
    assert cut.describe()["settings"]["draft_vocab"] == {"ids": 1, "sha256": json_digest([7])}
    (whole,) = resolve_methods(("medusa:untrained@chain-4",), "small-8", target.config)[1:]
    assert whole.describe()["settings"]["draft_vocab"] == ()

