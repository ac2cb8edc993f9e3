"""The monitor's live input-wait share against XProf's input-pipeline analyzer.

Both look at the same steps of one `fit`: `ProfilerTrigger` traces steps
[START, START + STEPS) with step markers and XProf reports the input share;
the monitor's `StepTimer` has each step's measured input wait. Goal: within
15 percentage points on input-bound and healthy runs.
"""

import pytest

import keras_gpufix as kg
from planted import planted_dataset, tiny_model

START, STEPS = 40, 30


def shares(kind, tmp_path, **kwargs):
    monitor = kg.GPUOscillationMonitor(verbose=0)
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=START, steps=STEPS, verbose=0)
    tiny_model().fit(planted_dataset(kind, batches=100, **kwargs), epochs=1, verbose=0,
                     callbacks=[monitor, trigger])
    (trace,) = trigger.traces
    timer = monitor.timer
    hooks = [i for i, s in enumerate(timer.steps)
             if trace["start_step"] <= s <= trace["end_step"]]
    live = sum(timer.input_waits[i] for i in hooks) / sum(timer.durations[i] for i in hooks)
    return live * 100, trace["analysis"]


@pytest.mark.parametrize("kind, expected", [
    ("slow", "highly_input_bound"),
    ("healthy", None),
])
def test_live_input_wait_matches_xprof(kind, expected, tmp_path):
    live, analysis = shares(kind, tmp_path, sleep=0.01)
    xprof = analysis["input_percent"]
    print(f"{kind}: live input wait {live:.1f}% vs XProf input {xprof:.1f}% "
          f"({analysis['classification']}, step {analysis['step_time_ms']:.2f} ms)")
    assert analysis["step_time_ms"] > 0
    if expected:
        assert analysis["classification"] == expected
    assert abs(live - xprof) <= 15.0
