"""analysis.job: one report for a multi-worker job (pure Python, no TensorFlow)."""

import re

import pytest

from keras_gpufix.analysis import THRESHOLDS, headline, job_headline, judge_job, worker_summary
from keras_gpufix.analysis.job import SERIES_POINTS, SHARED_BELOW


def _summary(task, steps=100, step_ms=10.0, wait_ms=0.0, between_ms=0.5, batch=8, chief=None,
             cpu=None, points=0):
    """A worker_summary from per-step figures, as the monitor's report gives them; `cpu`:
    `(cpu wait per second of the run, own CPU share, usable CPUs)`; `points`: a series."""
    cycle = (step_ms + wait_ms + between_ms) / 1e3
    total = steps * cycle
    report = {"step_time": {
        "count": steps, "total_s": total, "samples_per_s": batch / cycle,
        "phases": {"input_wait": wait_ms / 1e3 / cycle, "step": step_ms / 1e3 / cycle,
                   "between": between_ms / 1e3 / cycle}}}
    if cpu is not None:
        waited, own, cpus = cpu
        report["contention"] = {"wall_s": total, "waited_share": waited,
                                "own_cpu_s": own * cpus * total, "cpus": cpus,
                                "others_share": 0.5}
    if points:
        report["series"] = {"first_step": [5 * k for k in range(points)], "steps": [5] * points,
                            "input_wait_ms": [wait_ms] * points, "step_ms": [step_ms] * points,
                            "between_ms": [between_ms] * points}
    return worker_summary(task, report, chief=task == 0 if chief is None else chief,
                          end_time=1.0)


def test_a_worker_slow_to_get_its_input_is_named_with_its_cause_and_the_others_loss():
    # Worker 1 waits 30 ms for input; worker 0 waits for it in the all-reduce.
    report = judge_job([_summary(1, step_ms=12.0, wait_ms=30.0),
                        _summary(0, step_ms=42.0)])
    s = report["straggler"]
    assert (s["task"], s["cause"], s["phase"]) == (1, "input", "input_wait")
    assert s["excess_ms"] == pytest.approx(30.0)
    cycle = 42.5
    assert s["share"] == pytest.approx(30.0 / cycle)
    assert s["gain"] == pytest.approx(cycle / (cycle - 30.0))
    assert s["others_wait_share"] == pytest.approx(30.0 / cycle)
    by_task = {w["task"]: w for w in report["per_worker"]}
    assert by_task[0]["collective_wait_ms"] == pytest.approx(30.0)
    assert by_task[1]["collective_wait_ms"] == 0.0
    assert by_task[0]["compute_ms"] == by_task[1]["compute_ms"] == pytest.approx(12.0)
    assert "straggler: worker 1 (its input: 30.0 ms per step later" in report["message"]
    assert "the job at most 3.40x faster if it matched them" in report["message"]
    assert "worker 1's input" in s["fix"]


def test_samples_are_counted_once_not_summed_over_workers():
    report = judge_job([_summary(0), _summary(1)])
    # 8 samples per 10.5 ms cycle on each worker: the job's figure, not twice it.
    assert report["samples_per_s"] == pytest.approx(8 / 0.0105)
    assert report["straggler"] is None and "no straggler" in report["message"]


def test_time_between_steps_is_a_cause_too_and_small_spreads_are_not_stragglers():
    slow = judge_job([_summary(0, step_ms=30.0), _summary(1, step_ms=10.0, between_ms=20.5)])
    assert slow["straggler"]["task"] == 1 and slow["straggler"]["cause"] == "between"
    share = THRESHOLDS["straggler_share"]
    small = (share / 2) * 10.5  # half the threshold's share of the cycle
    fair = judge_job([_summary(0), _summary(1, wait_ms=small, step_ms=10.0 - small)])
    assert fair["straggler"] is None


def test_a_worker_whose_threads_wait_for_a_cpu_others_took_is_named_cpu_shared():
    # Both steps 40 ms (the all-reduce ends them together); worker 1's input wait is
    # only a symptom: its threads waited 0.5 s per second for a CPU it used half of.
    shared = judge_job([_summary(0, step_ms=40.0, cpu=(0.05, 0.4, 1)),
                        _summary(1, step_ms=35.0, wait_ms=5.0, cpu=(0.5, 0.45, 1))])
    s = shared["straggler"]
    assert (s["task"], s["cause"], s["phase"]) == (1, "cpu_shared", "cpu")
    cycle = 40.5
    # its lateness: its threads' extra wait (more than its host excess, 5 ms)
    assert s["excess_ms"] == pytest.approx((0.5 - 0.05) * cycle)
    # an input wait longer than the extra CPU wait: the input is the cause
    slow = judge_job([_summary(0, step_ms=60.0, cpu=(0.05, 0.4, 1)),
                      _summary(1, step_ms=35.0, wait_ms=25.0, cpu=(0.3, 0.45, 1))])
    assert slow["straggler"]["cause"] == "input"
    assert "its CPU shared with another process" in shared["message"]
    # the others' wait is inside their steps: no share of it is claimed at the all-reduce
    assert "its slowed steps end the others' steps late (their wait" in shared["message"]
    assert job_headline(shared)[0].endswith("costs the job 45% of its time: its slowed steps "
                                            "end the other workers' steps late (their wait at "
                                            "the all-reduce is inside their step times)")
    assert "its host" in s["fix"]
    # The same wait while it used all of its CPUs: its own threads compete; the phase says.
    own = judge_job([_summary(0, step_ms=40.0, cpu=(0.05, 0.4, 1)),
                     _summary(1, step_ms=35.0, wait_ms=5.0, cpu=(0.5, SHARED_BELOW, 1))])
    assert own["straggler"]["cause"] == "input"
    # The wait spreads over the CPUs it may use: two CPUs' threads wait twice as long.
    two = judge_job([_summary(0, step_ms=40.0, cpu=(0.1, 0.4, 2)),
                     _summary(1, step_ms=35.0, wait_ms=5.0, cpu=(1.0, 0.45, 2))])
    assert two["straggler"]["excess_ms"] == pytest.approx((1.0 - 0.1) * cycle / 2)
    assert judge_job([_summary(0, cpu=(0.2, 0.4, 1)),
                      _summary(1, cpu=(0.4, 0.4, 2))])["straggler"] is None
    # Two workers whose threads wait alike: no straggler; nor where every worker's
    # threads wait long (a host loaded by other work), even if one waits more.
    even = judge_job([_summary(0, cpu=(0.5, 0.5, 1)), _summary(1, cpu=(0.52, 0.5, 1))])
    assert even["straggler"] is None
    loaded = judge_job([_summary(0, step_ms=40.0, cpu=(0.6, 0.3, 1)),
                        _summary(1, step_ms=40.0, cpu=(2.5, 0.3, 1))])
    assert loaded["straggler"] is None
    # the lateness is at most what its own CPU work leaves of the cycle
    capped = judge_job([_summary(0, step_ms=40.0, cpu=(0.05, 0.4, 1)),
                        _summary(1, step_ms=40.0, cpu=(3.0, 0.4, 1))])["straggler"]
    assert capped["excess_ms"] == pytest.approx(0.6 * 40.5)


def test_the_timeline_aligns_the_workers_and_puts_the_skew_in_the_all_reduce():
    summaries = [_summary(0, step_ms=42.0, points=3 * SERIES_POINTS),
                 _summary(1, step_ms=12.0, wait_ms=30.0, points=3 * SERIES_POINTS)]
    assert len(summaries[0]["series"]["steps"]) == SERIES_POINTS
    assert sum(summaries[0]["series"]["steps"]) == 5 * 3 * SERIES_POINTS
    series = judge_job(summaries)["series"]
    assert len(series["first_step"]) == SERIES_POINTS
    w0, w1 = series["workers"]["0"], series["workers"]["1"]
    assert set(w0["collective_wait_ms"]) == {30.0} and set(w1["collective_wait_ms"]) == {0.0}
    assert set(w1["input_wait_ms"]) == {30.0} and set(w0["compute_ms"]) == {12.0}
    # points one worker lacks are left out
    summaries[1]["series"]["first_step"][0] = -1
    assert len(judge_job(summaries)["series"]["first_step"]) == SERIES_POINTS - 1


def test_the_headline_opens_with_the_straggler():
    job = judge_job([_summary(1, step_ms=12.0, wait_ms=30.0), _summary(0, step_ms=42.0)])
    first, fix = job_headline(job)
    assert first == ("straggler; worker 1 (its input) costs the job 71% of its time: the other "
                     "workers wait 71% of the job's time for it in the all-reduce")
    assert fix.endswith("the job at most 3.40x faster if worker 1 matched the others "
                        "(its lateness removed)")
    record = {"verdict": {"verdict": "healthy"}, "job": job}
    lines = headline(record)
    assert lines[0] == f"verdict: {first} (this worker's own steps: healthy)"
    assert lines[1] == f"fix:     {fix}" and lines[2].startswith("check:")
    assert job_headline(judge_job([_summary(0), _summary(1)])) is None
    assert job_headline(None) is None


def test_a_missing_worker_is_named_and_bad_input_is_refused():
    report = judge_job([_summary(0)], expected=3)
    assert report["missing"] == [1, 2] and report["straggler"] is None
    assert "no summary from task(s) [1, 2]" in report["message"]
    with pytest.raises(ValueError, match=re.escape("names a task twice")):
        judge_job([_summary(0), _summary(0)])
    with pytest.raises(ValueError, match="at least one worker"):
        judge_job([_summary(0, steps=0)])


def test_unknown_batch_size_and_unmeasured_wait_and_cpu_stay_unknown():
    summary = worker_summary(0, {"step_time": {
        "count": 10, "total_s": 0.1, "samples_per_s": None,
        "phases": {"input_wait": None, "step": 1.0, "between": 0.0}}})
    assert summary["samples"] is None and summary["input_wait_s"] is None
    assert summary["waited_s"] is None and summary["series"] is None
    report = judge_job([summary, _summary(1)])
    assert report["samples_per_s"] == pytest.approx(8 / 0.0105)
    assert report["per_worker"][0]["input_wait_ms"] is None
    assert report["per_worker"][0]["cpu_wait_ms"] is None and report["series"] is None
