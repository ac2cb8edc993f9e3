import json
import subprocess
import sys

import numpy as np
import pytest

from keras_gpufix.analysis import FIXES, VERDICTS, OscillationDetector, summarize_step_times


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


def test_spikes_at_new_shapes_are_recompiling():
    times = noisy(400)
    new = np.zeros(400, bool)
    new[[50, 90, 130, 170, 210, 250]] = True
    times[new] = 0.3
    events = run(OscillationDetector(), times, new_shape=new)
    assert events[0]["verdict"] == "recompiling"
    assert events[0]["evidence"]["slow_steps_at_new_shapes"] >= 1


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
    ({"min_windows": 0}, "min_windows"), ({"spike_factor": 1.0}, "spike_factor"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
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


def test_short_run_with_new_shapes_is_judged_at_finish():
    det = OscillationDetector()  # window 96: never full in this run
    times = noisy(60)
    new = np.zeros(60, bool)
    new[[10, 20, 30, 40]] = True
    times[new] = 0.4
    assert run(det, times, new_shape=new) == []
    event = det.finish()
    assert event["verdict"] == "recompiling"  # direct evidence: one judgement suffices
    assert det.finish() is None  # nothing new to judge


def test_finish_does_not_alarm_on_a_short_healthy_run():
    det = OscillationDetector()
    times = noisy(60)
    times[::5] = 0.08  # a stall pattern, but seen by one judgement only
    run(det, times)
    assert det.finish() is None


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
    assert events[0]["evidence"]["period_from"] in ("step_time", "input_wait")
    det = OscillationDetector()
    run(det, times, input_wait=waits)
    assert det.dominant_verdict() == "periodic_stall"


def test_submillisecond_drift_is_not_degrading():
    times = np.linspace(0.0008, 0.0016, 600)  # doubles, but by 0.8 ms
    assert run(OscillationDetector(), times) == []
