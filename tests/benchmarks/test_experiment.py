"""`specserve experiment`: the policy grid, custom policies, workloads, and a small live run replayed from its trace."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from specserve.benchmarks import experiment
from specserve.cli import main
from specserve.core.draft.schedule import Budget, FixedSchedule
from specserve.core.errors import UserError
from specserve.policies.simulator import WorkloadModel, simulate
from specserve.policies.traces import read_trace

CUSTOM_POLICY = """
from specserve.core.draft.schedule import Budget
from specserve.policies.base import PolicyState


class FirstDepth:
    name = "first-depth"

    def decide(self, state: PolicyState) -> Budget:
        alpha = state.alpha[0] if state.alpha else 0.5
        return Budget(gamma=0 if alpha < 0.3 else 3 if alpha < 0.7 else 6)


class NotAPolicy:
    pass
"""


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_policy.py"
    path.write_text(CUSTOM_POLICY)
    return path


def test_parse_policies(policy_file: Path) -> None:
    specs = experiment.parse_policies(f"fixed:1, fixed:8,heuristic,adaptive,none,{policy_file}:FirstDepth")
    assert [s.label for s in specs][:5] == ["fixed:1", "fixed:8", "heuristic", "adaptive", "none"]
    assert [(s.kind, s.gamma) for s in specs[:2]] == [("fixed", 1), ("fixed", 8)]
    assert specs[4].generation_options() == {"policy": "fixed", "gamma": 0, "drafter": "none"}
    assert specs[1].generation_options() == {"policy": "fixed", "gamma": 8}
    assert specs[3].generation_options() == {"policy": "adaptive"}
    custom = specs[5]
    assert custom.kind == "custom" and custom.custom is not None and custom.custom.name == "first-depth"
    assert custom.decision(16) is custom.custom
    for bad, message in (
        ("fixed:0", "between 1 and 64"),
        ("fixed:x", "integer"),
        ("greedy", "unknown policy"),
        ("none,none", "each once"),
        ("", "at least one"),
        (f"{policy_file}:NotAPolicy", "is not a Policy"),
        (f"{policy_file}:Missing", "has no class"),
        ("no_such_module_here:Policy", "cannot import"),
        (f"{policy_file.parent / 'nope.py'}:X", "does not exist"),
    ):
        with pytest.raises(UserError, match=message):
            experiment.parse_policies(bad)


def test_shuffled_workload_permutes_each_prompt_reproducibly() -> None:
    prompts = [list(range(10, 40)), list(range(50, 70))]
    shuffled = experiment.workload_prompts(experiment.WORKLOADS["shuffled"], prompts, seed=3)
    assert [sorted(s) for s in shuffled] == prompts and shuffled != prompts
    assert shuffled == experiment.workload_prompts(experiment.WORKLOADS["shuffled"], prompts, seed=3)
    assert experiment.workload_prompts(experiment.WORKLOADS["code-t1"], prompts, seed=3) == prompts
    assert experiment.WORKLOADS["shuffled"].temperature == 1.0 and experiment.WORKLOADS["code-t1.5"].temperature == 1.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "fixed:0"], "between 1 and 64"),
        (["--workloads", "code-t9"], "unknown workload"),
        (["--rounds", "0"], "must be >= 1"),
        (["--replay", "x.msgpack", "--trace-out", "y.msgpack"], "cannot be combined"),
        (["--replay", "missing.msgpack"], "does not exist"),
    ],
)
def test_bad_arguments(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_small_live_run_then_replay(
    tmp_path: Path, saved_pairs: dict[str, Path], policy_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = saved_pairs["llama"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x): return x + 1", "for i in range(10): print(i)", "import os"]))
    policies = f"fixed:1,fixed:2,heuristic,adaptive,none,{policy_file}:FirstDepth"
    labels = policies.split(",")
    out, trace = tmp_path / "live", tmp_path / "trace.msgpack"
    argv = ["experiment", "--target", str(models / "target"), "--draft", str(models / "draft"), "--dtype", "float64",
            "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--rounds", "2",
            "--workloads", "code-t0,shuffled", "--policies", policies,
            "--out", str(out), "--trace-out", str(trace)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == f"results: {out / 'experiment.json'}, experiment.md, experiment.csv, throughput.png, " + (
        "gamma_over_time.png, alpha_by_depth.png, predicted_vs_measured.png"
    )
    assert any(line.startswith("| code-t0 | fixed:1 |") for line in printed)
    assert "\n".join(printed[:-1]) + "\n" == (out / "experiment.md").read_text()

    rows = _rows(out / "experiment.csv")
    assert [(r["workload"], r["policy"]) for r in rows] == [(w, p) for w in ("code-t0", "shuffled") for p in labels]
    for name in ("throughput.png", "gamma_over_time.png", "alpha_by_depth.png", "predicted_vs_measured.png"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "experiment.json").read_text())
    assert report["mode"] == "live" and set(report["workloads"]) == {"code-t0", "shuffled"}
    greedy = [r for r in report["rows"] if r["workload"] == "code-t0"]
    assert len({r["new_tokens"] for r in greedy}) == 1  # exact: every policy emits the same greedy tokens
    assert report["workloads"]["code-t0"]["greedy_outputs_identical"] is True
    assert all(r["requests"] == 4 and r["cycles"] >= 1 and r["mean_accepted"] >= 1.0 for r in report["rows"])
    none = [r for r in report["rows"] if r["policy"] == "none"]
    assert all(r["speedup_vs_none"] == 1.0 and r["mean_gamma"] == 0.0 for r in none)
    assert all(r["predicted_speedup"] == pytest.approx(1.0) for r in none)
    code = report["workloads"]["code-t0"]
    assert code["best_fixed"]["policy"] in ("fixed:1", "fixed:2")
    assert {"adaptive_over_best_fixed", "adaptive_over_none", "adaptive_over_heuristic", "alpha_by_depth"} <= set(code)
    assert report["overall"]["adaptive_over_heuristic"] > 0
    assert set(report["targets_met"]) == set(experiment.TARGETS)

    records = read_trace(trace)
    assert {(r.workload, r.policy) for r in records} == {(w, p) for w in ("code-t0", "shuffled") for p in labels}
    assert all(r.gamma == 0 for r in records if r.policy == "none")
    for record in (r for r in records if r.policy == "fixed:2"):
        assert record.remaining is not None and record.nodes == min(2, record.remaining - 1)
    # the key property on real cycles: replaying fixed:2 over its own recording reproduces every cycle
    fixed2 = [r for r in records if r.workload == "code-t0" and r.policy == "fixed:2"]
    model = WorkloadModel.from_records(records, "code-t0", source_policy="fixed:2")
    result = simulate(model, lambda: FixedSchedule(Budget(2)))
    replayed_cycles = [(c.gamma, c.accepted, c.seconds) for c in result.cycles]
    assert replayed_cycles == [(r.nodes, r.accepted, r.seconds) for r in fixed2]

    replayed = tmp_path / "replay"
    assert main(["experiment", "--replay", str(trace), "--policies", policies, "--out", str(replayed), "--json"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and json.loads(printed) == json.loads((replayed / "experiment.json").read_text())
    assert json.loads(printed)["mode"] == "replay"
    rows = _rows(replayed / "experiment.csv")
    assert {(r["workload"], r["policy"]) for r in rows} == {(w, p) for w in ("code-t0", "shuffled") for p in labels}
    assert all(float(r["tokens_per_second"]) > 0 for r in rows)
    assert (replayed / "predicted_vs_measured.png").stat().st_size > 0
