"""analysis.job: one report for a multi-worker job (pure Python, no TensorFlow)."""

import re

import pytest

from keras_gpufix.analysis import THRESHOLDS, headline, job_headline, judge_job, worker_summary
from keras_gpufix.analysis.job import SERIES_POINTS


def _summary(task, steps=100, step_ms=10.0, wait_ms=0.0, between_ms=0.5, batch=8, chief=None,
             cpu=None, points=0):
    """A worker_summary from per-step figures, as the monitor's report gives them; `cpu`:
    `(cpu wait per second of the run, own CPU share, usable CPUs[, other processes' share
    of its CPUs])`; `points`: a series."""
    cycle = (step_ms + wait_ms + between_ms) / 1e3
    total = steps * cycle
    report = {"step_time": {
        "count": steps, "total_s": total, "samples_per_s": batch / cycle,
        "phases": {"input_wait": wait_ms / 1e3 / cycle, "step": step_ms / 1e3 / cycle,
                   "between": between_ms / 1e3 / cycle}}}
    if cpu is not None:
        waited, own, cpus, others = (*cpu, 0.0)[:4]
        report["contention"] = {"wall_s": total, "waited_share": waited,
                                "own_cpu_s": own * cpus * total, "cpus": cpus,
                                "others_share": 0.5, "others_mine_share": others}
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


def test_a_slow_input_is_not_made_shorter_by_its_quieter_cpu():
    # Worker 1 sleeps 60 ms for its input; its threads, idle meanwhile, wait less for a
    # CPU than worker 0's: its lateness stays 60 ms, and its CPU work ran while it
    # waited, so the steps are split by the job's shortest.
    job = judge_job([_summary(0, step_ms=100.0, cpu=(0.4, 0.2, 1)),
                     _summary(1, step_ms=40.0, wait_ms=60.0, cpu=(0.2, 0.2, 1))])
    s = job["straggler"]
    assert (s["task"], s["cause"]) == (1, "input")
    assert s["excess_ms"] == pytest.approx(60.0)
    assert s["others_wait_share"] == pytest.approx(60.0 / 100.5)
    # Steps that hold far more than their CPU work on every worker (a custom loop's
    # next() agreeing with the others): split as without CPU figures.
    loop = judge_job([_summary(0, step_ms=100.0, cpu=(0.1, 0.1, 1)),
                      _summary(1, step_ms=40.0, wait_ms=60.0, cpu=(0.1, 0.1, 1))])
    assert [w["collective_wait_ms"] for w in loop["per_worker"]] == pytest.approx([60.0, 0.0])
    assert loop["straggler"]["excess_ms"] == pytest.approx(60.0)


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
    # two parts under the threshold each (3 ms of 40.5), over it together: no cause
    split = judge_job([_summary(0, step_ms=40.0),
                       _summary(1, step_ms=34.0, wait_ms=3.0, between_ms=3.5)])
    assert split["straggler"] is None
    one = judge_job([_summary(0, step_ms=40.0),
                     _summary(1, step_ms=32.0, wait_ms=5.0, between_ms=3.5)])
    assert one["straggler"]["cause"] == "input"


def test_a_worker_whose_threads_wait_for_a_cpu_others_took_is_named_cpu_shared():
    # Both do 20.25 ms of CPU work a 40.5 ms cycle (one CPU each), and their threads
    # wait for each other alike (0.9 s a second); on worker 1's CPU another process ran
    # 40% of the time (16.2 ms a cycle), and its threads waited 2 s a second.
    shared = judge_job([_summary(0, step_ms=40.0, cpu=(0.9, 0.5, 1)),
                        _summary(1, step_ms=39.0, wait_ms=1.0, cpu=(2.0, 0.5, 1, 0.4))])
    s = shared["straggler"]
    assert (s["task"], s["cause"], s["phase"]) == (1, "cpu_shared", "cpu")
    cycle, cpu = 40.5, 0.5 * 40.5
    # its lateness: the other process's time on its CPU (less than its threads' wait),
    # and its 1 ms more input wait
    assert s["excess_ms"] == pytest.approx(0.4 * cycle + 1.0)
    by_task = {w["task"]: w for w in shared["per_worker"]}
    assert by_task[1]["others_cpu_ms"] == pytest.approx(0.4 * cycle)
    # worker 1's step: its CPU time, the other's time on its CPU, and what every step
    # holds besides (39 - 20.25 - 16.2 ms: the all-reduce's latency); worker 0's the same
    # latency and its CPU time, the rest its wait for worker 1
    common = 39.0 - cpu - 0.4 * cycle
    assert by_task[1]["collective_wait_ms"] == pytest.approx(0.0)
    assert by_task[0]["compute_ms"] == pytest.approx(cpu + common)
    assert by_task[0]["collective_wait_ms"] == pytest.approx(40.0 - cpu - common)
    assert by_task[1]["cpu_ms"] == pytest.approx(cpu)
    assert "its CPU shared with another process" in shared["message"]
    assert f"the job at most {s['gain']:.2f}x faster" in shared["message"]  # an upper bound
    assert "its host" in s["fix"]
    # its threads' wait bounds what the other process took from its step
    bound = judge_job([_summary(0, step_ms=40.0, cpu=(0.1, 0.5, 1)),
                       _summary(1, step_ms=40.0, cpu=(0.45, 0.5, 1, 0.5))])
    assert bound["straggler"]["excess_ms"] == pytest.approx(0.45 * 40.5)
    # an input wait longer than the other process's time: the input is the cause
    slow = judge_job([_summary(0, step_ms=40.0, cpu=(0.9, 0.5, 1)),
                      _summary(1, step_ms=25.0, wait_ms=15.0, cpu=(1.2, 0.5, 1, 0.1))])
    assert slow["straggler"]["cause"] == "input"
    # Per usable CPU: two CPUs' threads wait twice as long, for the same lateness.
    two = judge_job([_summary(0, step_ms=40.0, cpu=(1.8, 0.5, 2)),
                     _summary(1, step_ms=39.0, wait_ms=1.0, cpu=(4.0, 0.5, 2, 0.4))])
    assert two["straggler"]["excess_ms"] == pytest.approx(0.4 * cycle + 1.0)
    # Its own CPU work 2 ms a step above worker 0's: moving the other process off its
    # CPU leaves that, so its lateness is the other process's time and its input wait
    heavier = judge_job([_summary(0, step_ms=40.0, cpu=(0.9, 0.5, 1)),
                         _summary(1, step_ms=39.0, wait_ms=1.0,
                                  cpu=(2.0, 0.5 + 2.0 / cycle, 1, 0.4))])
    assert heavier["straggler"]["cause"] == "cpu_shared"
    assert heavier["straggler"]["excess_ms"] == pytest.approx(0.4 * cycle + 1.0)
    # Threads that wait long for each other (many threads on one CPU), or both workers'
    # CPUs alike shared (a host loaded by other work): no straggler.
    crowded = judge_job([_summary(0, step_ms=40.0, cpu=(0.9, 0.95, 1)),
                         _summary(1, step_ms=40.0, cpu=(2.5, 0.95, 1))])
    assert crowded["straggler"] is None and crowded["message"].endswith("; no straggler")
    loaded = judge_job([_summary(0, step_ms=40.0, cpu=(2.0, 0.65, 1, 0.3)),
                        _summary(1, step_ms=40.0, cpu=(2.1, 0.65, 1, 0.32))])
    assert loaded["straggler"] is None and loaded["message"].endswith("; no straggler")


def test_a_worker_with_more_work_in_its_step_is_named_slow_step_not_shared_cpu():
    # Both steps 40 ms (the all-reduce ends them together), both wait alike for a CPU;
    # worker 1's step takes 16.2 ms more CPU time.
    job = judge_job([_summary(0, step_ms=40.0, cpu=(0.5, 0.5, 1)),
                     _summary(1, step_ms=40.0, cpu=(0.5, 0.9, 1))])
    s = job["straggler"]
    assert (s["task"], s["cause"], s["phase"]) == (1, "step", "step")
    assert s["excess_ms"] == pytest.approx(0.4 * 40.5)
    assert s["others_wait_share"] == pytest.approx(0.4)
    assert f"its own step's work: {s['excess_ms']:.1f} ms per step later" in job["message"]
    assert "worker 1 does more work per step" in s["fix"]
    assert f"the job about {s['gain']:.2f}x faster if it matched them" in job["message"]
    # CPU time 15% of the cycle above (identical workers on a shared host differ so): no
    # straggler; 25%: the slow step
    for share, named in ((0.15, False), (0.25, True)):
        near = judge_job([_summary(0, step_ms=40.0, cpu=(0.5, 0.95 - share, 1)),
                          _summary(1, step_ms=40.0, cpu=(0.5, 0.95, 1))])
        assert (near["straggler"] is not None) == named, near["message"]
    # without every worker's CPU figures, the same pair names no one, and says why
    blind = judge_job([_summary(0, step_ms=40.0),
                       _summary(1, step_ms=40.0, cpu=(0.5, 0.9, 1))])
    assert blind["straggler"] is None
    assert blind["message"].endswith("(a slow step on one worker is not told apart: no CPU "
                                     "figures split the workers' steps)")


def test_cpu_figures_are_the_steady_steps_when_the_monitor_has_them():
    report = {"step_time": {"count": 10, "total_s": 0.1, "samples_per_s": 80.0,
                            "phases": {"input_wait": 0.0, "step": 1.0, "between": 0.0}},
              "contention": {"wall_s": 5.0, "own_cpu_s": 5.0, "waited_share": 0.5, "cpus": 1},
              "steady_contention": {"wall_s": 0.1, "own_cpu_s": 0.05, "waited_share": 0.2,
                                    "cpus": 1}}
    summary = worker_summary(0, report)
    assert (summary["wall_s"], summary["own_cpu_s"]) == (0.1, 0.05)
    assert summary["waited_s"] == pytest.approx(0.02)
    del report["steady_contention"]
    assert worker_summary(0, report)["own_cpu_s"] == 5.0


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
