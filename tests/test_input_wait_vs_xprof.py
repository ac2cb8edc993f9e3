"""The monitor's live input-wait share against XProf's input-pipeline analyzer.

Both look at the same steps of one `fit`: `ProfilerTrigger` traces steps
[START, START + STEPS) with step markers and XProf reports the input share;
a `StepTimer` in the same fit has each step's record with its measured input wait. Goal: within
15 percentage points on input-bound and healthy runs.
"""

import pytest

import keras_gpufix as kg
from planted import planted_dataset, tiny_model

START, STEPS = 40, 30


def shares(kind, tmp_path, **kwargs):
    timer = kg.StepTimer()
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=START, steps=STEPS, verbose=0)
    tiny_model().fit(planted_dataset(kind, batches=100, **kwargs), epochs=1, verbose=0,
                     callbacks=[timer, monitor, trigger])
    (trace,) = trigger.traces
    traced = [r for r in timer.records()
              if trace["start_step"] <= r.index <= trace["end_step"]]
    live = (sum(r.input_wait for r in traced)
            / sum(r.input_wait + r.step for r in traced))
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
