"""Recall and false-alarm rate of GPUOscillationMonitor over planted faults.

    python -m pytest -m slow tests/test_monitor_sweep.py -s

20 runs per class with varied seeds, stall periods (3..20) and sleeps: a
healthy pipeline, a slow input pipeline (every batch sleeps) and a periodic
stall (every k-th batch sleeps). Goal: recall >= 0.95 on each fault class,
false alarms <= 5% on healthy runs.
"""

import numpy as np
import pytest

import keras_gpufix as kg
from planted import planted_dataset, tiny_model

RUNS = 20
TRUTH = {"healthy": "healthy", "slow": "input_bound", "periodic": "periodic_stall"}


def verdict(kind, seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 21))
    sleep = float(rng.uniform(0.01, 0.03))
    batches = max(240, 12 * k + 120)  # enough windows to see several periods
    if kind == "slow":
        batches, sleep = 160, float(rng.uniform(0.005, 0.015))
    monitor = kg.GPUOscillationMonitor(verbose=0)
    tiny_model().fit(planted_dataset(kind, batches=batches, k=k, sleep=sleep, seed=seed),
                     epochs=1, verbose=0, callbacks=[monitor])
    report = monitor.report()
    alarms = [e["verdict"] for e in report["events"] if e["verdict"] != "healthy"]
    return report["verdict"], alarms, k


@pytest.mark.slow
def test_recall_and_false_alarms():
    results = {kind: [verdict(kind, seed) for seed in range(RUNS)] for kind in TRUTH}
    recall = {kind: np.mean([v == TRUTH[kind] for v, _, _ in results[kind]])
              for kind in ("slow", "periodic")}
    false_alarms = np.mean([bool(alarms) for _, alarms, _ in results["healthy"]])
    misses = [(kind, k, v) for kind in ("slow", "periodic") for v, _, k in results[kind]
              if v != TRUTH[kind]]
    alarms = [a for _, a, _ in results["healthy"] if a]
    print(f"\nrecall input_bound {recall['slow']:.2f}, periodic_stall {recall['periodic']:.2f}; "
          f"false alarms on healthy {false_alarms:.2f} ({RUNS} runs per class); "
          f"misses {misses}; alarms on healthy runs {alarms}")
    assert recall["slow"] >= 0.95 and recall["periodic"] >= 0.95
    assert false_alarms <= 0.05
