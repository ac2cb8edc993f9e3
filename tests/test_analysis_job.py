"""analysis.job: one report for a multi-worker job (pure Python, no TensorFlow)."""

import re

import pytest

from keras_gpufix.analysis import THRESHOLDS, judge_job, worker_summary


def _summary(task, steps=100, step_ms=10.0, wait_ms=0.0, between_ms=0.5, batch=8, chief=None):
    """A worker_summary from per-step figures, as StepLog.summary() gives them."""
    cycle = (step_ms + wait_ms + between_ms) / 1e3
    total = steps * cycle
    return worker_summary(task, {
        "count": steps, "total_s": total, "samples_per_s": batch / cycle,
        "phases": {"input_wait": wait_ms / 1e3 / cycle, "step": step_ms / 1e3 / cycle,
                   "between": between_ms / 1e3 / cycle},
    }, chief=task == 0 if chief is None else chief, end_time=1.0)


def test_a_worker_slow_to_get_its_input_is_named_with_its_phase():
    # Worker 1 waits 30 ms for input; worker 0 waits for it in the all-reduce.
    report = judge_job([_summary(1, step_ms=12.0, wait_ms=30.0),
                        _summary(0, step_ms=42.0)])
    assert report["straggler"]["task"] == 1
    assert report["straggler"]["phase"] == "input_wait"
    assert report["straggler"]["excess_ms"] == pytest.approx(30.0)
    by_task = {w["task"]: w for w in report["per_worker"]}
    assert by_task[0]["collective_wait_ms"] == pytest.approx(30.0)
    assert by_task[1]["collective_wait_ms"] == 0.0
    assert "straggler: worker 1 (input_wait: 30.0 ms" in report["message"]


def test_samples_are_counted_once_not_summed_over_workers():
    report = judge_job([_summary(0), _summary(1)])
    # 8 samples per 10.5 ms cycle on each worker: the job's figure, not twice it.
    assert report["samples_per_s"] == pytest.approx(8 / 0.0105)
    assert report["straggler"] is None and report["message"].endswith("no straggler")


def test_time_between_steps_is_a_phase_too_and_small_spreads_are_not_stragglers():
    slow = judge_job([_summary(0, step_ms=30.0), _summary(1, step_ms=10.0, between_ms=20.5)])
    assert slow["straggler"]["task"] == 1 and slow["straggler"]["phase"] == "between"
    share = THRESHOLDS["straggler_share"]
    small = (share / 2) * 10.5  # half the threshold's share of the cycle
    fair = judge_job([_summary(0), _summary(1, wait_ms=small, step_ms=10.0 - small)])
    assert fair["straggler"] is None


def test_a_missing_worker_is_named_and_bad_input_is_refused():
    report = judge_job([_summary(0)], expected=3)
    assert report["missing"] == [1, 2] and report["straggler"] is None
    assert "no summary from task(s) [1, 2]" in report["message"]
    with pytest.raises(ValueError, match=re.escape("names a task twice")):
        judge_job([_summary(0), _summary(0)])
    with pytest.raises(ValueError, match="at least one worker"):
        judge_job([_summary(0, steps=0)])


def test_unknown_batch_size_and_unmeasured_wait_stay_unknown():
    summary = worker_summary(0, {"count": 10, "total_s": 0.1, "samples_per_s": None,
                                 "phases": {"input_wait": None, "step": 1.0, "between": 0.0}})
    assert summary["samples"] is None and summary["input_wait_s"] is None
    report = judge_job([summary, _summary(1)])
    assert report["samples_per_s"] == pytest.approx(8 / 0.0105)
    assert report["per_worker"][0]["input_wait_ms"] is None
