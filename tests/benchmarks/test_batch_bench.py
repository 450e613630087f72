"""bench-batch: a tiny end-to-end run through the command line (every mode, exact greedy outputs, the report files),
the closed loop's bookkeeping, the exactness check catching a difference, and clear errors for bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve import cli
from specserve.benchmarks import batch


@pytest.mark.timeout(120)
def test_tiny_run_reports_every_mode_and_exact_greedy_outputs(
    tmp_path: Path, saved_pairs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    models = saved_pairs["llama"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n    return", "for i in range(10):", "import os\nimport sys\n"]))
    out = tmp_path / "out" / "batch.json"
    argv = [
        "bench-batch",
        *("--target", str(models / "target"), "--draft", str(models / "draft"), "--dtype", "float64"),
        *("--prompts", str(prompts), "--num-prompts", "3", "--max-new-tokens", "8"),
        *("--concurrency", "1,2", "--requests", "3", "--gammas", "1", "--adaptive-gamma", "2"),
        *("--out", str(out), "--plot", str(tmp_path / "out" / "batch.png")),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["exact"] is True and report["greedy_mismatches"] == []
    assert report["environment"]["threads"] == 1
    names = ["sequential", "batched-plain", "batched-gamma-1", "batched-adaptive", "hf-generate-batch"]
    rows = report["rows"]
    assert [(r["concurrency"], r["temperature"], r["mode"]) for r in rows] == [
        (c, t, m) for c in (1, 2) for t in (0.0, 1.0) for m in names
    ]
    for row in rows:
        assert row["requests"] == 3 and row["tokens"] == 3 * 8  # EOS ignored: every request runs to the length
        assert row["throughput_tok_s"] > 0 and row["ttft_p50_s"] is not None and row["itl_p99_s"] is not None
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["itl_p50_s"] <= row["itl_p99_s"]
        if row["mode"] == "hf-generate-batch":
            assert row["mean_batch_size"] is None and row["cycles"] == 0
        else:
            assert 1 <= row["mean_batch_size"] <= row["concurrency"] and row["cycles"] > 0
        drafts = row["mode"] in ("batched-gamma-1", "batched-adaptive")
        assert (row["mean_gamma"] is not None) == drafts
        if row["mode"] == "batched-gamma-1":
            assert row["mean_gamma"] == 1.0 and row["gamma_histogram"] == {"1": row["cycles"]}
        if row["mode"] == "sequential":
            assert row["same_as_sequential"] is None and row["mean_batch_size"] == 1.0
        else:
            assert row["same_as_sequential"]["compared"] == 3
        if row["temperature"] == 0.0 and row["mode"] != "sequential":
            assert row["same_as_sequential"]["equal"] == 3  # greedy: every batched mode is exact
    table = capsys.readouterr().out
    assert "| T | c | mode | tok/s |" in table and "| 0 | 2 | batched-adaptive |" in table
    assert "1 torch thread(s)" in table
    assert table == out.with_suffix(".md").read_text() + f"results: {out}, batch.md, batch.png\n"
    assert (tmp_path / "out" / "batch.png").stat().st_size > 1000


@pytest.mark.timeout(120)
def test_rounds_pool_into_one_row_per_level(tmp_path: Path, saved_pairs: dict[str, Path]) -> None:
    """``--rounds 2``: every level's modes run twice (the order alternating); a row pools both rounds' requests and
    wall time, and the exactness check compares the first round's outputs."""
    models = saved_pairs["llama"]
    out = tmp_path / "batch.json"
    argv = [
        "bench-batch",
        *("--target", str(models / "target"), "--draft", str(models / "draft"), "--dtype", "float64"),
        *("--num-prompts", "2", "--max-new-tokens", "6", "--temperatures", "0", "--plot", ""),
        *("--concurrency", "2", "--requests", "2", "--modes", "sequential,plain,adaptive", "--rounds", "2"),
        *("--out", str(out)),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["exact"] is True and report["config"]["rounds"] == 2
    assert [r["mode"] for r in report["rows"]] == ["sequential", "batched-plain", "batched-adaptive"]
    for row in report["rows"]:
        assert row["requests"] == 4 and row["tokens"] == 4 * 6
        assert row["throughput_tok_s"] == pytest.approx(row["tokens"] / row["wall_s"])
        if row["mode"] != "sequential":
            assert row["same_as_sequential"] == {"equal": 2, "compared": 2}


def test_closed_loop_keeps_concurrency_in_flight_and_records_chunks() -> None:
    from specserve.core.request import GenerationConfig, GenerationResult, StreamChunk

    class Fake:
        """Three tokens per request, one per step; up to ``slots`` at once."""

        def __init__(self) -> None:
            self.running: dict[int, int] = {}
            self.next_id = 0
            self.max_running = 0

        def submit(self, prompt: object, params: object = None, config: object = None) -> int:
            self.running[self.next_id] = 0
            self.next_id += 1
            self.max_running = max(self.max_running, len(self.running))
            return self.next_id - 1

        def step(self) -> list[tuple[int, StreamChunk]]:
            chunks = []
            for request_id in list(self.running):
                self.running[request_id] += 1
                done = self.running[request_id] == 3
                result = GenerationResult([1], [7, 7, 7], "", "length") if done else None
                chunks.append((request_id, StreamChunk("", [7], result)))
                if done:
                    del self.running[request_id]
            return chunks

        @property
        def has_work(self) -> bool:
            return bool(self.running)

    fake = Fake()
    requests = batch.level_requests([[1], [2]], 5, seed=0)
    assert [(r.prompt_index, r.seed) for r in requests] == [(0, 0), (1, 1), (0, 2), (1, 3), (0, 4)]
    records, wall = batch.closed_loop(fake, requests, 2, GenerationConfig(), 0.0)
    assert fake.max_running == 2 and fake.next_id == 5 and wall >= 0
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    for record in records:
        assert record.output_ids == [7, 7, 7] and [n for _, n in record.chunks] == [1, 1, 1]
        assert len(list(record.itl_samples())) == 2 and record.tpot is not None and record.ttft is not None


def test_itl_spreads_a_burst_over_its_tokens() -> None:
    record = batch.RequestRecord(0, submitted=0.0, chunks=[(1.0, 2), (1.6, 3), (1.8, 1)])
    assert record.ttft == 1.0
    assert list(record.itl_samples()) == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert record.tpot == pytest.approx(0.8 / 5)


def test_exactness_check_reports_a_greedy_difference() -> None:
    rows = [
        {"mode": m, "temperature": t, "concurrency": 2}
        for t in (0.0, 1.0)
        for m in ("sequential", "batched-plain", "hf-generate-batch")
    ]
    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    outputs = {
        ("sequential", 0.0, 2): same,
        ("batched-plain", 0.0, 2): other,  # a greedy batched difference: an error
        ("hf-generate-batch", 0.0, 2): other,  # transformers: informational
        ("sequential", 1.0, 2): same,
        ("batched-plain", 1.0, 2): other,  # sampled: informational
        ("hf-generate-batch", 1.0, 2): same,
    }
    mismatches = batch.compare_outputs(rows, outputs)
    assert mismatches == [{"mode": "batched-plain", "concurrency": 2, "request": 1}]
    assert rows[1]["same_as_sequential"] == {"equal": 1, "compared": 2}
    assert rows[0]["same_as_sequential"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0,2"], "--concurrency must be positive"),
        (["--concurrency", "a"], "--concurrency must be comma-separated numbers"),
        (["--gammas", "0"], "--gammas and --adaptive-gamma must be between"),
        (["--modes", "sequential,turbo"], "--modes must name families"),
        (["--modes", "plain"], "must include 'sequential'"),
        (["--requests", "0"], "--requests must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_flags_are_clear_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-batch", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
