"""The accelerator facts script (`evals/benchmarks/accelerator_facts.py`) on CPU at its small shapes: every stage
recorded with a status and its measured numbers, the compiled kernel tests "skipped" (never "passed") where they
skip, a stage that fails recorded with its error while the later ones run, a stage past its limit killed, a budget
too small for a stage recorded as "not run: budget", and the weight-traffic stage's programs (the stage the whole
run replaces by a failing one) read in-process."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from amphista_jax.evals.benchmarks import accelerator_facts as facts_script
from amphista_jax.evals.benchmarks.accelerator_facts import NOT_RUN, STAGES, Sizes, Stage

STATUSES = {"bandwidth": "done", "ar_step": "done", "weight_traffic": "failed", "spec_step": "done",
            "train_step": "done", "kernel_tests": "skipped"}


def python(code: str) -> list[list[str]]:
    return [[sys.executable, "-c", code]]


def replaced(name: str, code: str) -> tuple[Stage, ...]:
    """`STAGES` with stage `name`'s child replaced by `python -c code`."""
    return tuple(dataclasses.replace(s, commands=lambda *_: python(code)) if s.name == name else s for s in STAGES)


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    """facts.json of the small run on this machine, its weight-traffic stage's child one that raises."""
    out = tmp_path_factory.mktemp("facts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(facts_script, "STAGES", replaced("weight_traffic", "raise RuntimeError('forced failure')"))
        # a budget whose shares leave every small stage minutes: the suite runs beside other work on 2 cores
        facts_script.main(["--out", str(out), "--small", "--budget-s", "1800"])
    return json.loads((out / "facts.json").read_text()) | {"md": (out / "facts.md").read_text()}


def test_every_stage_has_a_status_and_the_run_is_named(facts):
    assert {name: stage["status"] for name, stage in facts["stages"].items()} == STATUSES
    # a stage's children run inside its limit; reading their reports afterwards takes a moment more (a child that
    # fails at once rounds to 0.0 s)
    late = {name: (stage["wall_s"], stage["limit_s"]) for name, stage in facts["stages"].items()
            if not 0 <= stage["wall_s"] <= stage["limit_s"] + 5}
    assert not late, f"stages past their limit (wall s, limit s): {late}"
    assert facts["device"] == "cpu" and facts["machine"]["backend"] == "cpu" and facts["jax"]
    assert facts["command"].endswith("--small --budget-s 1800")
    assert all(f"{name}: {status}" in facts["md"] for name, status in STATUSES.items())


def test_measured_numbers_are_positive_and_handed_on(facts):
    stages = {name: stage["result"] for name, stage in facts["stages"].items() if "result" in stage}
    bandwidth = stages["bandwidth"]["bandwidth_bytes_per_s"]
    assert bandwidth > 0 and stages["bandwidth"]["data_sheet"] is None  # a CPU has none
    ar = stages["ar_step"]
    assert ar["bandwidth_bytes_per_s"] == bandwidth  # the roofline of stage 1's bandwidth, not one of its own
    assert [(r["layout"], r["batch"]) for r in ar["rows"]] == [("split", 1), ("stacked", 1)]
    assert all(r["step_ms"] > 0 and 0 < r["roofline_share"] and r["bytes_per_step"] > r["weight_bytes"] > 0
               for r in ar["rows"])
    spec = stages["spec_step"]["rows"]
    assert [f"{r['method']}@{r['tree']}" for r in spec] == list(facts_script.SPEC_PAIRS)
    assert all(r["step_ms"] > 0 and r["ar_step_ms"] > 0 for r in spec)
    train = stages["train_step"]
    assert sorted(r["method"] for r in train["rows"]) == sorted(facts_script.TRAIN_METHODS)
    assert all(r["stored_step_tokens_per_s"] > 0 and r["stored_step_flops"] > 0 for r in train["rows"])
    assert train["peak_flops"] is None and all(r["stored_step_mfu"] is None for r in train["rows"])  # no data sheet


def test_kernel_tests_that_skip_are_skipped_not_passed(facts):
    kernel = facts["stages"]["kernel_tests"]["result"]
    assert kernel["passed"] == 0 and kernel["skipped"] == kernel["tests"] > 0 and kernel["failed_tests"] == []


def test_a_failing_stage_is_recorded_and_the_next_ones_run(facts):
    failed = facts["stages"]["weight_traffic"]
    assert failed["error"] == "RuntimeError: forced failure" and failed["result"] == {}
    assert all(facts["stages"][name]["result"] for name in ("spec_step", "train_step", "kernel_tests"))


def test_a_stage_past_its_limit_is_killed_and_no_stage_starts_without_budget(monkeypatch, tmp_path):
    monkeypatch.setattr(facts_script, "MIN_STAGE_S", 1.0)
    monkeypatch.setattr(facts_script, "STAGES", replaced("bandwidth", "import time; time.sleep(60)")[:2])
    facts_script.main(["--out", str(tmp_path), "--small", "--budget-s", "1.5"])
    stages = json.loads((tmp_path / "facts.json").read_text())["stages"]
    assert stages["bandwidth"]["status"] == "timed out" and stages["bandwidth"]["wall_s"] < 10
    assert stages["ar_step"] == {"status": NOT_RUN} and not (tmp_path / "ar_step").exists()


def test_a_budget_too_small_for_any_stage_runs_none(tmp_path):
    facts_script.main(["--out", str(tmp_path), "--small", "--budget-s", "5"])
    stages = json.loads((tmp_path / "facts.json").read_text())["stages"]
    assert stages == {s.name: {"status": NOT_RUN} for s in STAGES}
    assert f"kernel_tests: {NOT_RUN}" in (tmp_path / "facts.md").read_text()


def test_weight_traffic_stage_sees_the_stacked_copies_and_none_split(tmp_path):
    facts_script.weight_traffic_stage(Sizes.of("tiny", small=True), tmp_path)
    rows = {(r["program"], r["layout"]): r for r in json.loads((tmp_path / "weight_traffic.json").read_text())["rows"]}
    assert rows["AR", "stacked"]["weight_moves"] > 0 and rows["AR", "stacked"]["weight_move_bytes_per_step"] > 0
    assert rows["AR", "split"]["weight_moves"] == 0 == rows["eagle3@dynamic", "split"]["weight_moves"]


@pytest.mark.parametrize(("kind", "name"), [("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H200", "H200"),
                                            ("TPU v5 lite", "TPU-v5e"), ("TPU v5", "TPU-v5p"), ("cpu", None),
                                            ("NVIDIA H100 PCIe", None)])
def test_device_kinds_name_their_data_sheets(kind: str, name: str | None):
    sheet = facts_script.accelerator(kind)
    assert (sheet and sheet.name) == name
