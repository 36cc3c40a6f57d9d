"""The scale curve reads evals over trained head sets: each point's tokens from its run, tau and agreement from
the eval; later evals add to the curve's points, never measured otherwise than they; a bad eval directory is one
line."""

from __future__ import annotations

import json

from amphista_jax.evals.run_record import RESULT_SETTINGS
from amphista_jax.evals.scale_curve import agreement_curves, main


def _eval(tmp_path, runs: dict[str, int], eval_name: str = "eval", new_tokens: int = 64) -> str:
    methods = [{"label": "ar", "spec": "ar", "method": "ar", "tree": "-"}]
    metrics = {"ar": {"overall": {"tau": 1.0}}}
    accuracy = {}
    for i, (name, tokens) in enumerate(runs.items()):
        run = tmp_path / name
        (run / "heads").mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"tokens_seen": tokens, "method": "eagle3"}))
        methods.append({"label": name, "spec": f"{name}={run / 'heads'}@dynamic", "method": "eagle3",
                        "tree": "dynamic"})
        metrics[name] = {"overall": {"tau": 1.5 + i}}
        accuracy[name] = {"0": {"top1": 0.4, "agree": 0.3 + i / 10}, "1": {"top1": 0.2, "agree": 0.1 + i / 10}}
    out = tmp_path / eval_name
    out.mkdir()
    config = dict.fromkeys(RESULT_SETTINGS) | {"methods": [m["spec"] for m in methods], "out_dir": str(out),
                                               "max_new_tokens": new_tokens, "dataset": {"kind": "mt_bench"}}
    (out / "summary.json").write_text(json.dumps({"methods": methods, "metrics": metrics, "head_accuracy": accuracy,
                                                  "machine": f"cpu: {eval_name}", "config": config}))
    return str(out)


def test_points_in_token_order_with_tau_and_agreement(tmp_path, capsys):
    eval_dir = _eval(tmp_path, {"big": 4_000_000, "small": 1_000_000})
    assert main([eval_dir, "--out", str(tmp_path / "curve")]) == 0
    data = json.loads((tmp_path / "curve" / "scale_curve.json").read_text())
    assert [(p["label"], p["tokens_seen"], p["tau"], p["agreement"]) for p in data["points"]] == [
        ("small", 1_000_000, 2.5, [0.4, 0.2]), ("big", 4_000_000, 1.5, [0.3, 0.1])]
    assert (tmp_path / "curve" / "scale_curve.png").stat().st_size > 1000
    assert "| eagle3 | dynamic |" in capsys.readouterr().out
    assert {p["machine"] for p in data["points"]} == {"cpu: eval"}


def test_a_later_eval_adds_its_points_and_replaces_the_same_run_and_tree(tmp_path, capsys):
    curve = tmp_path / "curve"
    assert main([_eval(tmp_path, {"small": 1_000_000, "mid": 2_000_000}), "--out", str(curve)]) == 0
    # another machine, another day: "mid" re-measured and "big" new, on the same settings
    (tmp_path / "mid" / "heads").rmdir()
    (tmp_path / "mid" / "summary.json").unlink()
    assert main([_eval(tmp_path, {"mid": 2_000_000, "big": 4_000_000}, eval_name="later"), "--out", str(curve)]) == 0
    points = json.loads((curve / "scale_curve.json").read_text())["points"]
    assert [(p["label"], p["machine"]) for p in points] == [
        ("small", "cpu: eval"), ("mid", "cpu: later"), ("big", "cpu: later")]
    table = (curve / "scale_curve.md").read_text()
    assert "Machine 1: cpu: eval" in table and "Machine 2: cpu: later" in table and "| 4.00M |" in table


def test_points_measured_otherwise_are_one_line(tmp_path, capsys):
    curve = tmp_path / "curve"
    assert main([_eval(tmp_path, {"small": 1_000_000}), "--out", str(curve)]) == 0
    before = (curve / "scale_curve.json").read_text()
    assert main([_eval(tmp_path, {"big": 4_000_000}, eval_name="longer", new_tokens=128), "--out", str(curve)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_new_tokens differ" in err
    assert (curve / "scale_curve.json").read_text() == before
    (curve / "scale_curve.json").write_text(json.dumps({"points": [{"label": "old"}]}))
    assert main([_eval(tmp_path, {"new": 1}, eval_name="third"), "--out", str(curve)]) == 2
    assert "without the eval settings" in capsys.readouterr().err


def test_a_bad_eval_directory_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run `amphista-jax eval`" in err
    eval_dir = _eval(tmp_path, {"one": 10})
    (tmp_path / "one" / "summary.json").unlink()
    assert main([eval_dir]) == 2
    assert "must be a training run's" in capsys.readouterr().err


def test_a_run_decoded_on_two_trees_is_one_agreement_point():
    def point(label, run, tree, tokens):
        return {"label": label, "method": "hydra", "tree": tree, "run": run, "tokens_seen": tokens, "tau": 2.0,
                "agreement": [0.5]}

    rows = [point("4x", "r4", "mc_sim_7b_63", 4), point("4x-auto", "r4", "grown-4", 4),
            point("1x", "r1", "mc_sim_7b_63", 1)]
    assert [p["label"] for p in agreement_curves(rows)["hydra"]] == ["1x", "4x"]
