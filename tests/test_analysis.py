import json
import subprocess
import sys

import numpy as np
import pytest

from keras_gpufix.analysis import (
    FIXES,
    THRESHOLDS,
    VERDICTS,
    OscillationDetector,
    StepLog,
    StepRecord,
    fix_for,
    judge,
    rank_causes,
    recompile_cost,
    slow_limit,
    slow_mask,
    summarize_step_times,
    weigh,
)


def run(detector, times, **signal_series):
    events = []
    for i, t in enumerate(times):
        signals = {k: v[i] for k, v in signal_series.items()}
        event = detector.update(t, **signals)
        if event is not None:
            events.append(event)
    return events


def noisy(n, base=0.010, rel=0.05, seed=0):
    rng = np.random.default_rng(seed)
    return base * (1 + rel * rng.standard_normal(n)).clip(0.5, None)


def test_summary_exact_figures():
    s = summarize_step_times([0.010, 0.020, 0.030, 0.040], batch_sizes=[8, 8, 8, 16])
    assert s["count"] == 4
    assert s["total_s"] == pytest.approx(0.1)
    assert s["mean_ms"] == pytest.approx(25.0)
    assert s["p50_ms"] == pytest.approx(25.0)
    assert s["p95_ms"] == pytest.approx(38.5)
    assert s["max_ms"] == pytest.approx(40.0)
    assert s["cv"] == pytest.approx(np.std([1, 2, 3, 4]) / 2.5)
    assert s["steps_per_s"] == pytest.approx(40.0)
    assert s["samples_per_s"] == pytest.approx(400.0)


def test_summary_scalar_batch_size_and_empty():
    assert summarize_step_times([0.5, 0.5], batch_sizes=4)["samples_per_s"] == pytest.approx(8.0)
    empty = summarize_step_times([])
    assert empty["count"] == 0 and empty["mean_ms"] is None and empty["samples_per_s"] is None


@pytest.mark.parametrize("bad", [[0.1, -0.1], [float("nan")], [[0.1, 0.2]]])
def test_summary_rejects_bad_times(bad):
    with pytest.raises(ValueError, match="times"):
        summarize_step_times(bad)


@pytest.mark.parametrize("k", range(3, 21))
def test_periodic_stall_found_with_its_period(k):
    times = noisy(600, seed=k)
    times[::k] = 0.08
    events = run(OscillationDetector(), times)
    assert [e["verdict"] for e in events] == ["periodic_stall"]
    assert events[0]["period"] == k
    assert str(k) in events[0]["fix"]
    assert events[0]["evidence"]["signals"] == ["step_time"]


def test_steady_noise_raises_no_alarm():
    for seed in range(10):
        assert run(OscillationDetector(), noisy(800, rel=0.15, seed=seed)) == []


def test_random_spikes_are_not_called_periodic():
    rng = np.random.default_rng(1)
    for seed in range(10):
        times = noisy(800, seed=seed)
        spikes = rng.random(800) < 0.08
        times[spikes] = 0.1
        verdicts = {e["verdict"] for e in run(OscillationDetector(), times)}
        assert "periodic_stall" not in verdicts
        assert verdicts <= {"irregular_stall", "healthy"}
        assert "irregular_stall" in verdicts  # 8% of steps 10x slower is a real loss


def test_rare_small_spikes_are_healthy():
    times = noisy(800)
    times[[100, 333, 600]] = 0.05
    assert run(OscillationDetector(), times) == []


def test_host_hiccups_on_millisecond_steps_are_not_stalls():
    rng = np.random.default_rng(3)
    times = noisy(800, base=0.001)
    times[rng.random(800) < 0.05] = 0.015  # a busy neighbour takes the core
    assert run(OscillationDetector(), times) == []


def test_ramp_is_degrading():
    times = np.linspace(0.010, 0.040, 600)
    events = run(OscillationDetector(), times)
    assert events and {e["verdict"] for e in events} == {"degrading"}


def test_input_wait_makes_input_bound_with_evidence():
    times = noisy(400, base=0.05)
    waits = times * 0.6
    events = run(OscillationDetector(), times, input_wait=waits)
    assert [e["verdict"] for e in events] == ["input_bound"]
    ev = events[0]["evidence"]
    assert ev["signals"] == ["step_time", "input_wait"]
    assert ev["input_wait"] == pytest.approx(0.6, abs=0.01)


def test_small_input_wait_is_healthy():
    times = noisy(400)
    assert run(OscillationDetector(), times, input_wait=times * 0.05) == []


def test_low_gpu_util_short_steps_is_dispatch_bound():
    times = noisy(400, base=0.002)
    events = run(OscillationDetector(), times, gpu_util=[0.2] * 400, input_wait=[0.0] * 400)
    assert [e["verdict"] for e in events] == ["dispatch_bound"]
    assert "gpu_util" in events[0]["evidence"]["signals"]


def test_low_gpu_util_long_steps_without_wait_signal_is_input_bound():
    times = noisy(400, base=0.05)
    events = run(OscillationDetector(), times, gpu_util=[0.3] * 400)
    assert [e["verdict"] for e in events] == ["input_bound"]


def test_new_shapes_that_keep_compiling_are_recompiling():
    times = noisy(400)
    new = np.zeros(400, bool)
    new[5::12] = True  # a new shape every 12 steps, for good: 33 shapes
    times[new] = 0.3
    events = run(OscillationDetector(jit=True), times, new_shape=new)
    assert events[0]["verdict"] == "recompiling"
    assert events[0]["evidence"]["slow_steps_at_new_shapes"] >= 1
    assert events[0]["cost_share"] >= 0.10


def test_new_shapes_are_not_priced_without_xla_or_when_jit_is_unknown():
    times = noisy(400)
    new = np.zeros(400, bool)
    new[5::12] = True
    times[new] = 0.3
    for jit in (False, None):
        verdicts = {e["verdict"] for e in run(OscillationDetector(jit=jit), times,
                                              new_shape=new)}
        assert "recompiling" not in verdicts


def test_each_bucket_compiling_once_in_the_first_epoch_is_not_recompiling():
    times = noisy(600)
    new = np.zeros(600, bool)
    new[[6, 9, 13, 20, 31, 44, 50, 77, 90]] = True  # 9 bucket shapes, then none
    times[new] = 1.5  # each XLA compile is long
    det = OscillationDetector(jit=True)
    events = run(det, times, new_shape=new)
    assert "recompiling" not in {e["verdict"] for e in events}


def test_warmup_steps_are_ignored():
    times = noisy(300)
    times[:5] = 2.0  # compile steps
    assert run(OscillationDetector(warmup=5, min_windows=1), times) == []
    assert run(OscillationDetector(warmup=0, min_windows=1), times)  # judged when kept


def test_no_verdict_before_min_windows():
    det = OscillationDetector(window=32, hop=8, warmup=0, min_windows=3)
    times = noisy(300)
    times[::4] = 0.08
    first = None
    for i, t in enumerate(times):
        if det.update(t) is not None:
            first = i
            break
    # window full at step 31, judgements at 31, 39, 47: the third one reports
    assert first == 47


def test_events_extend_then_recover_once():
    times = np.concatenate([noisy(300), noisy(300), noisy(300)])
    times[300:600:5] = 0.08
    events = run(OscillationDetector(), times)
    assert [e["verdict"] for e in events] == ["periodic_stall", "healthy"]
    stall = events[0]
    assert 300 - 96 < stall["start_step"] < 400
    assert stall["end_step"] >= 590  # one event, extended, not one per window
    det = OscillationDetector()
    run(det, times)
    assert det.dominant_verdict() == "periodic_stall"


def test_event_fields_and_message():
    times = noisy(300)
    times[::6] = 0.08
    event = run(OscillationDetector(), times)[0]
    assert set(event) >= {"verdict", "start_step", "end_step", "cv", "period", "evidence",
                          "fix", "message"}
    assert event["message"].startswith(f"from step {event['start_step']}: periodic_stall")
    assert "every 6 steps" in event["message"]
    json.dumps(event)  # plain data, for --json and TensorBoard text


def test_explicit_step_numbers_are_used():
    times = noisy(300)
    times[::6] = 0.08
    event = run(OscillationDetector(), times, step=list(range(1000, 1300)))[0]
    assert event["start_step"] >= 1000


def test_every_verdict_has_a_fix():
    assert set(FIXES) == set(VERDICTS)


@pytest.mark.parametrize("kwargs, name", [
    ({"window": 4}, "window"), ({"hop": 0}, "hop"), ({"warmup": -1}, "warmup"),
    ({"min_windows": 0}, "min_windows"), ({"slow_factor": 1.0}, "slow_factor"),
    ({"spike_factor": 2.0}, "spike_factor"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        OscillationDetector(**kwargs)


def test_unknown_signal_is_an_error():
    with pytest.raises(ValueError, match="gpu_utilisation"):
        OscillationDetector().update(0.1, gpu_utilisation=0.5)


def test_analysis_and_package_import_without_tensorflow_or_keras():
    code = (
        "import sys, keras_gpufix, keras_gpufix.analysis, keras_gpufix.nvml; "
        "print(sorted(m for m in ('tensorflow', 'keras', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def records(times, **fields):
    """StepRecords with `times` as the step phase and per-step `fields` arrays."""
    return [StepRecord(index=i, steps=1, input_wait=None, step=float(t), between=0.0,
                       **{k: (v[i].item() if hasattr(v[i], "item") else v[i])
                          for k, v in fields.items()})
            for i, t in enumerate(times)]


def test_short_run_with_new_shapes_is_judged_at_finish():
    det = OscillationDetector(jit=True)  # window 96: never full in this run
    times = noisy(60)
    new = np.zeros(60, bool)
    new[[10, 20, 30, 40]] = True
    times[new] = 0.4
    for r in records(times, new_shape=new, epoch=np.ones(60, int)):  # after the first epoch
        assert det.update(r) is None
    event = det.finish()
    assert event["verdict"] == "recompiling"
    assert det.finish() is None  # nothing new to judge


def test_a_short_run_is_judged_at_its_end():
    det = OscillationDetector()
    times = noisy(60)
    times[::5] = 0.08
    run(det, times)
    assert det.finish()["verdict"] == "periodic_stall"  # one judgement suffices at the end
    healthy = OscillationDetector()
    run(healthy, noisy(60))
    assert healthy.finish() is None and healthy.dominant_verdict() == "healthy"
    waiting = OscillationDetector()
    run(waiting, noisy(40), input_wait=np.full(40, 0.0042))  # 42% input wait
    assert waiting.finish()["verdict"] == "input_bound"
    tiny = OscillationDetector()
    run(tiny, noisy(10))  # 5 steps after warmup: too few to judge
    assert tiny.finish() is None and tiny.dominant_verdict() == "unknown"


def test_period_found_in_input_waits_when_host_noise_hides_it_in_step_times():
    rng = np.random.default_rng(5)
    times = noisy(500, base=0.002)
    waits = np.zeros(500)
    waits[::9] = 0.02
    times[::9] += 0.02
    noise = rng.random(500) < 0.15  # a busy host: many slow steps, no input wait
    times[noise] += rng.uniform(0.005, 0.03, noise.sum())
    events = run(OscillationDetector(), times, input_wait=waits)
    assert events[0]["verdict"] == "periodic_stall"
    assert events[0]["period"] == 9
    assert events[0]["evidence"]["period_from"] in ("cycle", "input_wait")
    det = OscillationDetector()
    run(det, times, input_wait=waits)
    assert det.dominant_verdict() == "periodic_stall"


def test_submillisecond_drift_is_not_degrading():
    times = np.linspace(0.0008, 0.0016, 600)  # doubles, but by 0.8 ms
    assert run(OscillationDetector(), times) == []


def cycles(n, step=0.010, between=0.0, wait=0.0, seed=0, **fields):
    """StepRecords of a steady loop (5% noise on the step)."""
    rng = np.random.default_rng(seed)
    steps = step * (1 + 0.05 * rng.standard_normal(n)).clip(0.5, None)
    return [StepRecord(index=i, steps=1, input_wait=wait, step=float(s), between=between,
                       **fields) for i, s in enumerate(steps)]


def test_irregular_late_batches_are_an_irregular_stall_whose_fix_names_input_wait():
    # A batch 25 ms late after gaps of 13, 6, 19, ... steps (no period within
    # a window): 17% of the time, under the input_bound share (20%).
    rs = cycles(400, seed=3)
    late = np.cumsum(np.resize([13, 6, 19, 8, 15, 5, 17, 11], 40))
    for i in late[late < 400]:
        rs[i] = rs[i]._replace(input_wait=0.025)
    detector = OscillationDetector()
    for r in rs:
        detector.update(r)
    assert {e["verdict"] for e in detector.events} == {"irregular_stall"}
    event = detector.events[0]
    assert event["phase"] == "input_wait"
    # the run measured where the time went (the input): the fix is the input's, no trace
    assert event["fix"].startswith(f"occasional late batches cost {event['cost_share']:.0%} of "
                                   "the run") and "trace" not in event["fix"]


@pytest.mark.parametrize("k", [3, 6, 11, 20])
def test_work_between_steps_is_a_periodic_stall_in_the_between_phase(k):
    rs = cycles(400, seed=k)
    for i in range(0, 400, k):
        rs[i] = rs[i]._replace(between=0.030)  # a callback sleeping 3x the step every k steps
    det = OscillationDetector()
    events = [e for e in (det.update(r) for r in rs) if e]
    assert events[0]["verdict"] == "periodic_stall"
    assert events[0]["phase"] == "between" and events[0]["period"] == k
    assert events[0]["fix"].startswith(f"work between steps every {k} steps costs")
    assert "callback, logging or checkpointing" in events[0]["fix"]


def test_one_and_a_half_times_the_median_every_3_steps_costs_enough():
    rs = cycles(400)
    for i in range(0, 400, 3):
        rs[i] = rs[i]._replace(step=rs[i].step * 1.5)  # 14% of the time, 1.5x the median
    judgement = judge(rs[-96:])
    assert judgement["verdict"] == "periodic_stall" and judgement["period"] == 3
    assert 0.10 <= judgement["cost_share"] <= 0.2
    small = cycles(400)
    for i in range(0, 400, 20):
        small[i] = small[i]._replace(step=small[i].step * 1.5)  # 2.4% of the time
    assert judge(small[-96:])["verdict"] == "healthy"


def test_periodic_excess_of_an_unsplit_loop_body_is_work_in_the_loop_body():
    rs = cycles(200, split=False)
    for i in range(0, 200, 5):
        rs[i] = rs[i]._replace(step=0.02)
    judgement = judge(rs[-96:])
    assert judgement["phase"] == "loop_body"
    assert fix_for("periodic_stall", phase="loop_body", period=5,
                   share=0.18).startswith("work in the loop body every 5 steps costs 18%")


def test_a_periodic_stall_is_priced_with_the_slower_cycle_after_it_and_never_twice():
    # A plot every 5 steps (100 ms after a 20 ms eager step) and the step after it
    # 6 ms slower (its after-effect: tests/loop_patterns.py xtts and accum_plot ran
    # the step after the plot's sleep 30-35% slower): removing the plot removes both.
    rs = cycles(96, step=0.020, split=False)
    for i in range(4, 96, 5):
        rs[i] = rs[i]._replace(step=rs[i].step + 0.100)
        if i + 1 < 96:
            rs[i + 1] = rs[i + 1]._replace(step=rs[i + 1].step + 0.006)
    total = sum(r.cycle for r in rs)
    removed = 19 * 0.100 + 18 * 0.006  # what the fixed loop no longer runs
    judgement = judge(rs, eager=True)
    stall = next(c for c in judgement["causes"] if c["verdict"] == "periodic_stall")
    assert stall["period"] == 5
    assert stall["share"] == pytest.approx(removed / total, rel=0.05)
    assert stall["speedup"] == pytest.approx(total / (total - removed), rel=0.05)
    assert judgement["evidence"]["after_effect_share"] > 0
    assert sum(c["share"] for c in judgement["causes"]) <= 1.0
    # without an after-effect nothing is added: steady steps around the plot
    plain = cycles(96, step=0.020, split=False)
    for i in range(4, 96, 5):
        plain[i] = plain[i]._replace(step=plain[i].step + 0.100)
    plain_judgement = judge(plain)
    assert plain_judgement["evidence"]["after_effect_share"] == 0.0
    assert plain_judgement["cost_share"] == pytest.approx(
        19 * 0.100 / sum(r.cycle for r in plain), rel=0.05)


def test_judge_has_no_side_effects():
    det = OscillationDetector(window=16, warmup=0)
    for r in cycles(40):
        det.update(r)
    state = (det.judgements, len(det.events), det.last_judgement, det.log.summary())
    assert det.judge()["verdict"] == "healthy"
    assert (det.judgements, len(det.events), det.last_judgement, det.log.summary()) == state


def test_step_log_is_bounded_and_sums_the_whole_run():
    log = StepLog(window=8)
    for i in range(1000):
        log.add(StepRecord(i * 2, 2, 0.002, 0.016, 0.002, samples=64, audio_seconds=128.0,
                           real_frames=10000))
    assert len(log.records()) == 8 and log.records()[0].index == 1984
    s = log.summary()
    assert s["count"] == 2000 and s["records"] == 1000
    assert s["total_s"] == pytest.approx(20.0)
    assert s["mean_ms"] == pytest.approx(10.0)
    assert s["p50_ms"] == pytest.approx(10.0, rel=0.01)  # from the histogram
    assert s["samples_per_s"] == pytest.approx(3200.0)
    assert s["audio_seconds_per_s"] == pytest.approx(6400.0)
    assert s["real_frames_per_s"] == pytest.approx(500000.0)
    assert s["phases"] == pytest.approx({"input_wait": 0.1, "step": 0.8, "between": 0.1})
    assert s["steps_per_record"] == 2


def test_step_log_percentiles_are_exact_while_the_run_fits():
    log = StepLog(window=8)
    for i, t in enumerate([0.010, 0.020, 0.030, 0.040]):
        log.add(StepRecord(i, 1, None, t, 0.0))
    s = log.summary()
    assert s["p95_ms"] == pytest.approx(38.5) and s["max_ms"] == pytest.approx(40.0)
    assert s["input_wait"] is None and s["samples_per_s"] is None
    assert StepLog().summary()["count"] == 0
    with pytest.raises(ValueError, match="`window`"):
        StepLog(window=1)


def test_the_one_slow_step_rule():
    t = np.full(20, 0.010)
    t[5] = 0.0126  # 1.26x: slow
    t[6] = 0.0124  # 1.24x: not
    assert list(np.nonzero(slow_mask(t))[0]) == [5]
    tiny = np.full(20, 0.0005)
    tiny[3] = 0.0015  # 3x but only 1 ms: jitter
    assert not slow_mask(tiny).any()


def test_the_slow_limit_is_the_rule_slow_mask_applies():
    t = noisy(64)
    limit = slow_limit(t, factor=3.0, min_ms=5.0)
    assert limit == pytest.approx(max(3.0 * np.median(t), np.median(t) + 0.005))
    probe = np.array([limit * 0.99, limit * 1.01])
    assert list(slow_mask(np.concatenate([t, probe]), float(np.median(t)), factor=3.0,
                          min_ms=5.0)[-2:]) == [False, True]
    wide = np.concatenate([t, [0.030, 0.001] * 20])  # a spread of 4 MADs wins
    assert slow_limit(wide, factor=1.1, min_ms=0.0) > 1.1 * np.median(wide)
    assert slow_limit(wide, factor=1.1, min_ms=0.0, spread=False) == pytest.approx(
        1.1 * np.median(wide))


def test_recompile_pricing():
    assert recompile_cost(0.5, 0.01, new_shape=True, jit=True) == pytest.approx(0.49)
    assert recompile_cost(0.5, 0.01, new_shape=True, jit=False) == 0.0
    assert recompile_cost(0.5, 0.01, new_shape=True, jit=None) == 0.0  # not verified
    assert recompile_cost(0.5, 0.01) == 0.0  # a slow step of unknown shape is no compile
    assert recompile_cost(0.5, 0.01, traces=1) == pytest.approx(0.49)
    assert recompile_cost(0.5, 0.01, new_shape=True, jit=True, compiled_before=True) == 0.0
    assert recompile_cost(0.5, 0.01, steps=4, traces=1) == pytest.approx(0.46)


def test_rank_causes_orders_by_cost_and_fills_the_fix():
    ranking = rank_causes([("input_bound", 0.3, {}), ("periodic_stall", 0.18,
                                                     {"period": 6, "phase": "between"}),
                           ("input_bound", 0.42, {}), ("healthy", 1.0, {})])
    assert [c["verdict"] for c in ranking] == ["input_bound", "periodic_stall"]
    assert ranking[0]["score"] == pytest.approx(0.42)
    assert ranking[1]["fix"].startswith("work between steps every 6 steps costs 18% of the run")
    eager = rank_causes([("eager_step", 0.8, {"where": "train.py:12"})])[0]["fix"]
    assert eager.endswith("at train.py:12")


def test_fix_texts_keep_their_format_fields():
    assert "every 7 steps" in FIXES["periodic_stall"].format(period=7)
    assert fix_for("eager_step").endswith("at ?")
    assert THRESHOLDS["cost_share"] == 0.10 and THRESHOLDS["input_wait_share"] == 0.20
    with pytest.raises(ValueError, match="verdict"):
        fix_for("slow")


def test_docs_quote_the_one_table_and_thresholds():
    from pathlib import Path

    from keras_gpufix.analysis.verdicts import PHASE_FIXES, STALL_FIXES

    doc = (Path(__file__).parent.parent / "docs" / "monitoring.md").read_text()
    rows = [f"| `{v}` | {FIXES[v]} |" for v in VERDICTS]
    rows += [f"| `{p}` | {text} |" for p, text in PHASE_FIXES.items()]
    rows += [f"| `{p}` | {text} |" for p, text in STALL_FIXES.items()]
    rows += [f"| `{k}` | {v} |" for k, v in THRESHOLDS.items()]
    missing = [row for row in rows if row not in doc]
    assert not missing, f"docs/monitoring.md is out of date with analysis/verdicts.py: {missing}"


def test_is_recompiling_only_when_compiles_keep_coming_and_cost():
    from keras_gpufix.analysis import is_recompiling

    # 8 buckets compiled once each in the first epoch: warm-up, whatever it cost
    assert is_recompiling(9.0, 10.0, shapes=8) == (False, pytest.approx(0.9))
    # a new shape after the first epoch, a retrace, or too many shapes: compiles keep coming
    assert is_recompiling(2.0, 10.0, late_compiles=1, shapes=8)[0]
    assert is_recompiling(2.0, 10.0, retraces=1)[0]
    assert is_recompiling(2.0, 10.0, shapes=THRESHOLDS["max_new_shapes"] + 1)[0]
    # ... but only when they cost at least cost_share of the time
    assert not is_recompiling(0.5, 10.0, late_compiles=3)[0]
    assert is_recompiling(0.5, 10.0, late_compiles=3, cost_share=0.05)[0]
    assert not is_recompiling(2.0, 10.0, shapes=5, max_new_shapes=4, cost_share=0.5)[0]
    assert is_recompiling(0.0, 0.0, retraces=2) == (False, 0.0)


def test_the_detector_judges_recompiling_by_the_one_rule():
    # The same figures as RetracingMonitor's: compiles that keep coming (here: new
    # shapes after the first epoch) AND cost >= cost_share; otherwise warm-up.
    times = noisy(120)
    new = np.zeros(120, bool)
    new[[10, 20, 30, 70, 80, 90]] = True
    times[new] = 0.2  # each compile costs ~19 median steps: ~50% of the time
    epoch = (np.arange(120) >= 60).astype(int)  # the last three in the second epoch
    assert judge(records(times, new_shape=new, epoch=epoch), jit=True)["verdict"] \
        == "recompiling"
    assert judge(records(times, new_shape=new), jit=True)["verdict"] == "healthy"  # epoch 0
    cheap = times.copy()
    cheap[new] = 0.015  # compiles keep coming but cost ~2%: no verdict, no stall either
    verdict = judge(records(cheap, new_shape=new, epoch=epoch), jit=True)
    assert verdict["verdict"] == "healthy" and verdict["evidence"]["recompile_ms"] > 0
    det = OscillationDetector(jit=True)
    events = [det.update(r) for r in records(times, new_shape=new, epoch=epoch)]
    assert [e["verdict"] for e in events if e] == ["recompiling"]


def test_slow_steps_of_unknown_shape_are_never_priced_as_recompiles():
    # Without kg.data.instrument (no shapes) nor counted traces, a slow step under
    # XLA is a slow step: a periodic stall, never "recompile cost ...".
    times = noisy(200)
    times[7::8] = 0.05
    judgement = judge(records(times), jit=True)
    assert judgement["verdict"] == "periodic_stall" and judgement["period"] == 8
    assert "recompile_ms" not in judgement["evidence"]


def test_the_runs_verdict_names_the_live_events_it_overrides():
    det = OscillationDetector(window=32, warmup=0)
    # 100 steps stalling every 5th, then 300 input-bound steps (half the cycle waiting)
    run(det, [0.03 if i % 5 == 0 else 0.01 for i in range(100)] + [0.02] * 300,
        input_wait=[0.0] * 100 + [0.01] * 300)
    verdict = det.verdict()
    assert [e["verdict"] for e in det.events] == ["periodic_stall", "input_bound"]
    assert verdict["verdict"] == "input_bound" and verdict["phase"] == "input_wait"
    assert verdict["cost_share"] == det.events[-1]["cost_share"]
    assert verdict["because"][0].startswith("input_bound from step")
    assert verdict["changed"].startswith("during the run: periodic_stall at steps ")
    assert verdict["changed"].endswith("input_bound covered the most steps")
    quiet = OscillationDetector(window=32, warmup=0)
    run(quiet, [0.01] * 40)
    assert quiet.verdict() == {"verdict": "healthy", "fix": FIXES["healthy"], "phase": None,
                               "cost_share": None, "because": [], "changed": None,
                               "causes": [], "input_unmeasured": None}


def test_weigh_says_which_reading_it_believes_and_why():
    healthy = {"verdict": "healthy", "fix": FIXES["healthy"], "phase": None,
               "cost_share": None, "because": [], "changed": None, "input_wait": 0.02}
    xprof = {"classification": "moderately_input_bound", "input_percent": 12.0, "steps": 10,
             "start_step": 10, "end_step": 19}
    kept = weigh(healthy, xprof=[xprof])
    assert kept["verdict"] == "healthy"  # a few traced steps never overturn the step log
    (why,) = kept["because"]
    assert why.startswith("XProf's trace of steps 10-19 reads input 12.0% "
                          "(moderately_input_bound); the verdict stays healthy")
    # the what-if: 1.66x faster with the input free = the input costs 40% of the run,
    # with its input wait unmeasured: input_bound, the time in the input wait
    unmeasured = dict(healthy, input_wait=None)
    moved = weigh(unmeasured, what_if={"speedup_if_input_free": 1.66})
    assert (moved["verdict"], moved["phase"]) == ("input_bound", "input_wait")
    assert moved["cost_share"] == pytest.approx(1 - 1 / 1.66)
    assert "the step log read healthy (input wait not measured)" in moved["because"][0]
    assert moved["fix"] == FIXES["input_bound"]
    # under what_if_share (at the low end of its range) the what-if is no cause; a what-if
    # that does not know is ignored; agreeing evidence adds nothing
    assert weigh(healthy, what_if={"speedup_if_input_free": 1.08})["verdict"] == "healthy"
    assert weigh(healthy, what_if={"speedup_if_input_free": 1.3, "speedup_range": [1.05, 1.5]}
                 )["verdict"] == "healthy"
    unknown = {"speedup_if_input_free": 1.66, "speedup_range": [1.1, 2.4], "known": False}
    assert weigh(healthy, what_if=unknown) == dict(healthy, because=[])
    bound = dict(healthy, verdict="input_bound", input_wait=0.6)
    agree = weigh(bound, xprof=[dict(xprof, classification="highly_input_bound")],
                  what_if={"speedup_if_input_free": 2.5})
    assert agree["verdict"] == "input_bound" and agree["because"] == []
    stays = weigh(bound, what_if={"speedup_if_input_free": 1.0})
    assert stays["verdict"] == "input_bound" and "stays input_bound" in stays["because"][0]


def uneven(n, seed=0, lengths=None, shapes=True):
    """StepRecords of batches of uneven length: the step grows with the length."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice(np.arange(40, 400, 24), n) if lengths is None else lengths
    step = 0.00005 * lengths * (1 + 0.03 * rng.standard_normal(n))
    return [StepRecord(index=i, steps=1, input_wait=0.0002, step=float(s), between=0.0003,
                       shape=((16, int(t), 80),) if shapes else None)
            for i, (s, t) in enumerate(zip(step, lengths))]


@pytest.mark.parametrize("shapes", [True, False])
def test_work_between_uneven_steps_every_5_is_a_periodic_stall_between(shapes):
    rs = uneven(200, shapes=shapes)
    median = float(np.median([r.cycle for r in rs]))
    for i in range(0, 200, 5):  # a callback doing 0.6x a median step every 5th batch
        rs[i] = rs[i]._replace(between=rs[i].between + 0.6 * median)
    judgement = judge(rs[-96:])
    assert (judgement["verdict"], judgement["phase"], judgement["period"]) == (
        "periodic_stall", "between", 5)
    assert 0.10 <= judgement["cost_share"] <= 0.13  # 0.6 / 5.6 = 11%
    assert judge(uneven(200, shapes=shapes)[-96:])["verdict"] == "healthy"


def test_uneven_steps_are_judged_against_steps_of_their_own_shape():
    # Lengths cycling in order (an unshuffled bucketed dataset): the long
    # buckets are slow every 8 steps, but not slower than steps of their shape.
    cycled = uneven(200, lengths=np.resize(np.arange(50, 450, 50), 200))
    assert judge(cycled[-96:])["verdict"] == "healthy"
    # A stall inside the step every 5th step, 0.6x the median step, on
    # uneven lengths seen once or twice each (the Theil-Sen line's expectation)
    rs = uneven(200, seed=2, lengths=np.random.default_rng(2).integers(40, 400, 200))
    median = float(np.median([r.step for r in rs]))
    for i in range(0, 200, 5):
        rs[i] = rs[i]._replace(step=rs[i].step + 0.6 * median)
    judgement = judge(rs[-96:])
    assert (judgement["verdict"], judgement["phase"], judgement["period"]) == (
        "periodic_stall", "step", 5)


def test_locate_periodic_names_the_line_the_slow_cycles_spend_their_extra_time_at():
    from keras_gpufix.analysis import locate_periodic

    rng = np.random.default_rng(0)
    cycles, samples = [], []
    for i in range(100):  # the step (line 10) every cycle, plots (line 14) every 5th
        counts = {"loop.py:10": int(rng.integers(4, 7)), "loop.py:12": int(rng.integers(0, 2))}
        if i % 5 == 3:
            counts["loop.py:14"] = 20
        cycles.append(0.002 * sum(counts.values()))
        samples.append(counts)
    place, share, period = locate_periodic(cycles, samples, period=5)
    assert place == "loop.py:14" and share > 0.9 and period == 5
    # noise alone, or too few cycles, names nothing
    flat = [{"loop.py:10": int(rng.integers(4, 7)), "loop.py:12": int(rng.integers(0, 4))}
            for _ in range(100)]
    assert locate_periodic([0.002 * sum(c.values()) for c in flat], flat, period=5) is None
    assert locate_periodic(cycles[:9], samples[:9], period=5) is None
    assert fix_for("periodic_stall", phase="loop_body", period=5, share=0.2,
                   where="loop.py:14").endswith("move it off the step path, at loop.py:14")


def test_locate_periodic_finds_the_plots_line_and_period_where_load_hid_the_period():
    # load 6-7 on 2 cores: other processes' slices make any cycle 1-5x slower, so the
    # cycles' times hold no period (the run found stalls with none); the plot's line is
    # still sampled in every 5th cycle only, fewer times (the sampler starves too)
    from keras_gpufix.analysis import locate_periodic

    rng = np.random.default_rng(1)
    cycles, samples = [], []
    for i in range(120):
        slow = float(rng.choice([1, 1, 1, 2, 3, 5]))  # load's slices, any cycle
        counts = {"loop.py:10": int(rng.integers(3, 7) * slow),
                  "loop.py:12": int(rng.integers(0, 2))}
        if i % 5 == 2:
            counts["loop.py:14"] = int(rng.integers(2, 9))
        cycles.append(0.002 * sum(counts.values()) * float(rng.uniform(1, 3)))
        samples.append(counts)
    assert locate_periodic(cycles, samples, period=None)[::2] == ("loop.py:14", 5)
    # the period a run found, held by the line's own (10 holds 5), or none: named
    assert locate_periodic(cycles, samples, period=10)[::2] == ("loop.py:14", 10)
    # a line every cycle runs and noise name nothing
    flat = [{"loop.py:10": int(rng.integers(3, 7)), "loop.py:12": int(rng.integers(0, 4))}
            for _ in range(120)]
    assert locate_periodic([0.002 * sum(c.values()) for c in flat], flat, None) is None


def test_weigh_names_contention_when_the_what_if_gains_and_the_wait_reads_zero():
    # a librosa-style loader with parallel maps on 2 cores: the step log reads healthy with
    # 1% input wait, the what-if finds 1.34x (1.25x-1.42x) with the input free
    healthy = {"verdict": "healthy", "fix": FIXES["healthy"], "phase": None,
               "cost_share": None, "because": [], "changed": None, "input_wait": 0.01}
    what_if = {"speedup_if_input_free": 1.34, "speedup_range": [1.25, 1.42], "known": True,
               "bound": "step", "method": "side_by_side"}
    out = weigh(healthy, what_if=what_if)
    assert (out["verdict"], out["phase"]) == ("input_bound", "step")
    assert out["cost_share"] == pytest.approx(1 - 1 / 1.34)
    assert out["fix"] == fix_for("input_bound", phase="step", share=1 - 1 / 1.34)
    assert out["fix"].startswith("the input pipeline competes with the step for the CPU and "
                                 "costs 25% of the run")
    (why,) = out["because"]
    assert "1.34x faster (1.25x-1.42x)" in why and "contention" in why
    # the same gain where the run waited for it (15% wait): the input wait, not contention
    waited = weigh(dict(healthy, input_wait=0.15), what_if=what_if)
    assert (waited["verdict"], waited["phase"]) == ("input_bound", "input_wait")
    assert waited["fix"] == FIXES["input_bound"]
    from pathlib import Path

    from keras_gpufix.analysis.verdicts import CONTENTION_FIX

    doc = (Path(__file__).parent.parent / "docs" / "monitoring.md").read_text()
    assert f"| `step` | {CONTENTION_FIX} |" in doc


def test_measured_compile_seconds_price_a_step_and_decide_whether_it_compiled():
    from keras_gpufix.analysis import recompile_cost, step_compiled

    # JAX counted the compiles: a new shape that compiled nothing (cached) costs 0,
    # a step that compiled costs its measured seconds (at most the step).
    assert not step_compiled(new_shape=True, jit=True, compile_s=0.0)
    assert recompile_cost(0.5, 0.001, new_shape=True, jit=True, compile_s=0.0) == 0.0
    assert recompile_cost(0.5, 0.001, compile_s=0.3) == pytest.approx(0.3)
    assert recompile_cost(0.2, 0.001, compile_s=0.3) == pytest.approx(0.2)


def test_callbacks_that_stop_async_dispatch_are_named_and_priced_by_their_host_time():
    from keras_gpufix.analysis import judge

    rs = [StepRecord(index=i, steps=1, input_wait=0.0, step=0.004, between=0.002)
          for i in range(40)]
    found = judge(rs, async_blockers=["TensorBoard", "Mine"])
    assert found["verdict"] == "sync_callbacks"
    assert found["cost_share"] == pytest.approx(0.002 / 0.006)
    assert found["evidence"]["sync_callbacks"] == ["TensorBoard", "Mine"]
    from keras_gpufix.analysis import RunFacts

    det = OscillationDetector()
    det.tell(RunFacts(async_blockers=("TensorBoard",)))
    for r in rs:
        det.update(r)
    det.finish()
    assert det.verdict()["fix"].startswith("TensorBoard override a batch-end hook")
    # Dispatch on (no blockers), or host time too small to matter: no finding.
    assert judge(rs)["verdict"] == "healthy"
    cheap = [r._replace(between=0.0002) for r in rs]
    assert judge(cheap, async_blockers=["Mine"])["verdict"] == "healthy"


def test_input_bound_fix_names_fits_python_source():
    from keras_gpufix.analysis.verdicts import INPUT_SOURCE_FIXES

    assert fix_for("input_bound", source="PyDataset") == INPUT_SOURCE_FIXES["PyDataset"]
    assert fix_for("input_bound", source="TFDataset") == FIXES["input_bound"]


def test_a_wait_every_workers_batches_is_the_input_being_slow_not_a_schedule():
    from keras_gpufix.analysis import judge

    # 2 PyDataset workers, 20 ms each, 1 ms steps: batches arrive in pairs.
    rs = [StepRecord(index=i, steps=1, input_wait=0.02 if i % 2 else 0.0, step=0.001,
                     between=0.0) for i in range(60)]
    assert judge(rs)["verdict"] == "periodic_stall"
    assert judge(rs, input_workers=2)["verdict"] == "input_bound"
    # A stall every 7 batches stays a schedule beside 2 workers.
    every7 = [r._replace(input_wait=0.02 if i % 7 == 6 else 0.0) for i, r in enumerate(rs)]
    assert judge(every7, input_workers=2)["verdict"] == "periodic_stall"


def test_sync_callbacks_price_splits_each_step_at_its_dispatch_where_measured():
    from keras_gpufix.analysis import judge

    # 6 ms cycles: 1 ms between, the step dispatched after 2 ms of host work,
    # then 3 ms awaited on the device: 3 ms of host and 3 of device, 3 lost.
    rs = [StepRecord(index=i, steps=1, input_wait=0.0, step=0.005, between=0.001,
                     awaited=0.003) for i in range(40)]
    found = judge(rs, async_blockers=("Mine",))
    assert found["verdict"] == "sync_callbacks"
    assert found["cost_share"] == pytest.approx(0.5)


def test_diagnose_cause_rules_from_analysis():
    from keras_gpufix import analysis as a

    share = THRESHOLDS["what_if_share"]
    # The what-if's input cost makes input_bound a cause from what_if_share up; where
    # the input wait explains that much less of it, the time goes in the step.
    assert a.what_if_cause((share * 0.99, share, True), 0.0, "healthy") is None
    assert a.what_if_cause((0.3, 0.3, True), 0.25, "periodic_stall") == (
        "input_bound", 0.3, "input_wait")
    assert a.what_if_cause((0.3, 0.3, True), 0.0, "periodic_stall")[2] == "step"
    assert a.what_if_cause((0.3, 0.3, True), 0.0, "input_bound") is None
    assert a.ruled_out("eager_step", judged=True, input_wait_measured=True,
                       compiles_counted=False) == {"input_bound"}
    assert a.ruled_out("healthy", judged=False, input_wait_measured=True,
                       compiles_counted=True) == set()
    ran = [{"trap": "run_eagerly", "file": "t.py", "line": 3, "ran": False},
           {"trap": "run_eagerly", "file": "t.py", "line": 9}]
    assert a.cause_where("eager_step", {}, ran) == "t.py:9"
    assert a.cause_where("input_bound", {"eager_where": "x"}, ran) is None
    gain = THRESHOLDS["min_speedup"]
    assert a.located_stage([None, {"slow": {"predicted_gain": gain * 0.99}},
                            {"slow": {"predicted_gain": gain}, "id": 2}])["id"] == 2
    assert a.traps_of("input_bound") == {"py_function_in_map", "python_generator",
                                         "no_prefetch"}
    assert (a.divisible_batch(10, 4), a.divisible_batch(12, 4)) == (12, None)
    assert a.missing_gpus(["/gpu:0", "/device:GPU:1", "/cpu:0"], 1) == ["/device:GPU:1"]
    assert a.classify_input_percent(4.9) == "not_input_bound"


def test_the_verdict_fits_the_ranked_fixes():
    from keras_gpufix.analysis import verdict_of_ranking

    beside = rank_causes([("input_bound", 0.22, {})])  # the what-if's input cost
    assert verdict_of_ranking("healthy", beside) == "input_bound"
    # below what the judgement needs for input_bound (the input wait's 20%): healthy
    assert verdict_of_ranking("healthy", rank_causes([("input_bound", 0.11, {})])) == "healthy"
    assert verdict_of_ranking("healthy", rank_causes([("periodic_stall", 0.11, {})])) \
        == "periodic_stall"
    assert verdict_of_ranking("periodic_stall", beside) == "periodic_stall"
    assert verdict_of_ranking("unknown", beside) == "unknown"


def test_weigh_takes_stalls_the_input_cost_covers_as_contention():
    # the contention case beside a CPU burner: the step log reads irregular_stall
    # (18% of the run in stalls), the what-if finds the input costing 30% at its low end
    stalled = {"verdict": "irregular_stall", "fix": FIXES["irregular_stall"], "phase": "step",
               "cost_share": 0.18, "because": [], "changed": None, "input_wait": 0.02}
    what_if = {"speedup_if_input_free": 1.6, "speedup_range": [1.45, 1.8], "known": True,
               "bound": "step", "method": "side_by_side"}
    out = weigh(stalled, what_if=what_if)
    assert (out["verdict"], out["phase"], out["covers"]) == ("input_bound", "step",
                                                             "irregular_stall")
    (why,) = out["because"]
    assert why.startswith("the step log read irregular_stall (stalls with no period, 18% of")
    # an input cost below the stalls' does not explain them: the stall verdict stays
    small = {"speedup_if_input_free": 1.15, "speedup_range": [1.12, 1.2], "known": True,
             "bound": "step", "method": "side_by_side"}
    assert weigh(stalled, what_if=small)["verdict"] == "irregular_stall"


def test_a_one_off_cost_lowers_a_short_runs_gain_and_can_make_it_slower():
    from keras_gpufix.analysis import one_off_gain

    assert one_off_gain(2.0, 0.0, 10.0) == pytest.approx(2.0)
    assert one_off_gain(2.0, 1.0, 10.0) == pytest.approx(10 / 6)  # 5 s of steps + 1 s once
    assert one_off_gain(2.0, 10.0, 10.0) < 1.0  # a trace longer than what it saves
    assert one_off_gain(None, 1.0, 10.0) is None


def test_a_compiled_steps_saving_is_its_calls_excess_over_the_runs_cycle():
    from keras_gpufix.analysis import compiled_cause_share

    causes = [{"verdict": "eager_step", "share": 0.35}]
    compiled = {"eager_ms": 11.0, "best_ms": 1.0}
    # without its calls a step: the steady step share times 1 - compiled / eager
    assert compiled_cause_share(causes, compiled, 50.0) == pytest.approx(0.35 * 10 / 11)
    # one call a step in a 50 ms cycle saves 10 ms of it: 20%, not the 32% above
    once = dict(compiled, calls_per_step=1.0)
    assert compiled_cause_share(causes, once, 50.0) == pytest.approx(0.2)
    # above the steady share where its calls save more (the step's time above its
    # median is compiled away too): four micro-batches a step save 40 ms of 50
    four = dict(once, calls_per_step=4.0)
    assert compiled_cause_share(causes, four, 50.0) == pytest.approx(0.8)
    # never more than the run less the other causes' shares (a plot's time is its own)
    # and the compiled calls' own time (4 ms of 50)
    plot = causes + [{"verdict": "periodic_stall", "share": 0.3}]
    assert compiled_cause_share(plot, four, 50.0) == pytest.approx(0.7 - 0.08)
    assert compiled_cause_share(plot, once, 50.0) == pytest.approx(0.2)
    # an isolated eager call slower than the whole cycle: the run keeps its compiled calls
    assert compiled_cause_share(causes, dict(once, calls_per_step=9.0), 50.0) \
        == pytest.approx(1 - 9 / 50)
    assert compiled_cause_share(causes, {"reason": "could not trace"}, 50.0) is None


def test_a_compiled_steps_saving_is_put_on_the_runs_clock_by_its_gradients_times():
    from keras_gpufix.analysis import compiled_cause_share, run_clock

    causes = [{"verdict": "eager_step", "share": 0.35}]
    once = {"eager_ms": 11.0, "best_ms": 1.0, "calls_per_step": 1.0}
    # its gradients took 1.5x as long in the run as alone: the call saved 15 ms of the run's
    slow = dict(once, gradient_ms=4.0, run_gradient_ms=6.0)
    assert run_clock(slow) == pytest.approx(1.5)
    assert compiled_cause_share(causes, slow, 50.0) == pytest.approx(0.3)
    # faster in the run than alone (a load spike after it): less saved
    assert compiled_cause_share(causes, dict(once, gradient_ms=4.0, run_gradient_ms=2.0),
                                50.0) == pytest.approx(0.1)
    # either time unknown: the run's clock is the timing's
    assert run_clock(once) == run_clock(dict(once, run_gradient_ms=6.0)) == 1.0
    # the compiled calls' own time is on the run's clock too: 9 calls of 1.5 ms of 50 left
    assert compiled_cause_share(causes, dict(slow, calls_per_step=9.0), 50.0) \
        == pytest.approx(1 - 9 * 1.5 / 50)


def padded(n, seed=0, wait=0.0002):
    """StepRecords of speech batches padded to their longest utterance: 8 utterances of
    40-400 frames, the step 2 ms plus 25 ns per element of the batch (real and padded)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lengths = rng.integers(40, 400, 8)
        longest = int(lengths.max())
        elements = 8 * longest * 80 + 8 * 60
        step = (0.002 + 25e-9 * elements) * (1 + 0.03 * rng.standard_normal())
        out.append(StepRecord(index=i, steps=1, input_wait=wait, step=float(step),
                              between=0.0003, real_frames=int(lengths.sum()),
                              shape=((8, 60), (8, longest, 80), (8,))))
    return out


def test_padding_that_costs_the_step_is_padded_batches_with_an_edit_for_fix():
    rs = padded(96)
    frames = sum(r.shape[1][0] * r.shape[1][1] for r in rs)
    truth = 1 - sum(r.real_frames for r in rs) / frames
    judgement = judge(rs)
    ev = judgement["evidence"]
    assert (judgement["verdict"], judgement["phase"]) == ("padded_batches", "step")
    assert ev["padding"] == pytest.approx(truth)
    # the step's time per element, measured from the run (25 ns), prices the padding
    cost = sum(25e-9 * (r.shape[1][0] * r.shape[1][1] - r.real_frames) * 80 for r in rs)
    assert judgement["cost_share"] == pytest.approx(cost / sum(r.cycle for r in rs), rel=0.15)
    fix = judgement["causes"][0]["fix"]
    assert f"{truth:.0%} of the batches' frames are padding" in fix and "num_buckets" in fix
    assert f"{1 / (1 - judgement['cost_share']):.2f}x" in fix and "trace" not in fix
    # the same batches with real lengths unknown: nothing to price
    assert judge([r._replace(real_frames=None) for r in rs])["verdict"] == "healthy"
    # bucketed batches (little padding) cost little
    assert judge([r._replace(real_frames=int(0.95 * r.shape[1][0] * r.shape[1][1]))
                  for r in rs])["verdict"] == "healthy"


def test_an_input_bound_run_ranks_its_padding_beside_the_input():
    rs = padded(96, wait=0.004)
    judgement = judge(rs)
    assert judgement["verdict"] == "input_bound"
    causes = {c["verdict"]: c for c in judgement["causes"]}
    assert set(causes) == {"input_bound", "padded_batches"}
    assert causes["padded_batches"]["share"] >= THRESHOLDS["cost_share"]
    assert "bucket" in causes["padded_batches"]["fix"]
    # the run's one verdict names both, each with its own fix
    det = OscillationDetector(window=32, warmup=0)
    for r in rs:
        det.update(r)
    assert {c["verdict"] for c in det.verdict()["causes"]} == {"input_bound", "padded_batches"}
