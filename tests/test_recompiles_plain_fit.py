"""XLA recompiles in a plain `fit`: no `kg.data.instrument`, the shapes are seen
inside the train step (issue 22, item 2)."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.exceptions import GpufixWarning

ROOT = Path(__file__).resolve().parent.parent
BATCH = 4


def length_batches(lengths):
    """A plain tf.data dataset (no kg.data.instrument): one batch per length."""
    def batches():
        rng = np.random.default_rng(0)
        for n in lengths:
            x = rng.random((BATCH, n, 4), dtype=np.float32)
            yield x, x.mean(axis=(1, 2))[:, None]

    return tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec([None, None, 4], tf.float32), tf.TensorSpec([None, 1], tf.float32)))


def seq_model(jit_compile=True, steps_per_execution=1, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    return model


# 16 distinct lengths, each batch a new one; fit(epochs=2, steps_per_epoch=8):
# the second epoch's lengths are new too.
MANY = list(range(3, 19))


def test_many_lengths_in_a_plain_fit_are_recompiling_with_the_shapes_named():
    monitor = kg.RetracingMonitor(verbose=0)
    with pytest.warns(GpufixWarning, match=r"steps compiled at new input shapes") as caught:
        seq_model().fit(length_batches(MANY), epochs=2, steps_per_epoch=8, verbose=0,
                        callbacks=[monitor])
    report = monitor.report()
    assert report["verdict"] == "recompiling"
    assert report["new_shapes"] == 16
    assert [s[0] for s in report["shapes"]] == [[BATCH, n, 4] for n in range(3, 19)]
    assert report["trace_count"] <= 3  # Keras traced once or twice: XLA recompiled
    recompiled = [e for e in report["shape_events"] if e["compiles"] and not e["first_compile"]]
    assert len(recompiled) == 15 and sum(e["epoch"] > 0 for e in recompiled) == 8
    assert report["recompile_ms"] > 0
    assert not any("not visible" in n for n in report["notes"])
    message = next(str(w.message) for w in caught if issubclass(w.category, GpufixWarning))
    assert "latest: new shape ((4, 18, 4), (4, 1)) at step 15, 16 distinct shapes" in message
    assert "((4, 3, 4), (4, 1))" in message


def test_the_oscillation_monitor_alone_names_recompiling():
    # The probe belongs to the step stream, not to RetracingMonitor.
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    seq_model().fit(length_batches(MANY), epochs=2, steps_per_epoch=8, verbose=0,
                    callbacks=[monitor])
    report = monitor.report()
    assert report["verdict"] == "recompiling"
    assert "pad_to_bucket_boundary" in report["fix"]


def test_one_length_is_not_recompiling():
    monitor = kg.RetracingMonitor(verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq_model().fit(length_batches([12] * 10), epochs=2, verbose=0, callbacks=[monitor])
    assert [str(w.message) for w in caught if issubclass(w.category, GpufixWarning)] == []
    report = monitor.report()
    assert report["shapes"] == [[[BATCH, 12, 4], [BATCH, 1]]]
    assert report["verdict"] != "recompiling" and report["recompile_ms"] == 0.0


def test_the_probe_changes_neither_the_data_nor_the_training():
    plain, probed = seq_model(), seq_model()
    plain.fit(length_batches(MANY[:3] * 2), epochs=1, verbose=0)  # 3 shapes: 3 compiles each
    probed.fit(length_batches(MANY[:3] * 2), epochs=1, verbose=0,
               callbacks=[kg.RetracingMonitor(verbose=0)])
    for a, b in zip(plain.get_weights(), probed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_with_steps_per_execution_each_execution_names_a_new_shape():
    # 3 batches per execution, run inside Keras's own tf.while_loop.
    monitor = kg.RetracingMonitor(verbose=0)
    seq_model(steps_per_execution=3).fit(length_batches(list(range(3, 18))), epochs=1,
                                         verbose=0, callbacks=[monitor])
    report = monitor.report()
    assert report["steps"] == 15
    # One shape per execution: the last of its three (each new), as fit's dataset
    # probe records it (the step's own probe gave the first).
    assert [s[0][1] for s in report["shapes"]] == list(range(5, 18, 3))


def test_a_second_fit_reuses_the_probe_and_its_compiled_shapes():
    model = seq_model()
    monitor = kg.RetracingMonitor(verbose=0)
    ds = length_batches([5, 9, 13] * 4)
    model.fit(ds, epochs=1, verbose=0, callbacks=[monitor])
    model.fit(ds, epochs=1, verbose=0, callbacks=[monitor])
    report = monitor.report()
    assert len(report["shapes"]) == 3
    assert all(e["compiled_before"] and not e["compiles"] for e in report["shape_events"])
    assert report["recompile_ms"] == 0.0


def test_a_step_traced_before_the_monitors_joined_still_has_its_shapes_seen():
    # The step's own probe cannot join a step traced without it; fit's dataset
    # probe (appended by the monitors) still sees every batch's shapes.
    model = seq_model()
    ds = length_batches([5, 9, 13] * 3)
    model.fit(ds, epochs=1, verbose=0)  # traced without a probe
    monitor = kg.RetracingMonitor(verbose=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[monitor])
    report = monitor.report()
    assert [s[0][1] for s in report["shapes"]] == [5, 9, 13]
    assert any("traced before keras_gpufix callbacks joined" in n
               for n in [monitor.stream.step_shapes_note or ""])
    assert not any("not visible" in n for n in report["notes"])


def test_without_xla_no_probe_is_put_in_the_step():
    model = seq_model(jit_compile=False)
    monitor = kg.RetracingMonitor(verbose=0)
    model.fit(length_batches([5, 9, 13] * 3), epochs=1, verbose=0, callbacks=[monitor])
    assert monitor.stream.step_shapes is None
    # the shapes come from fit's dataset probe, outside the step
    assert [s[0][1] for s in monitor.report()["shapes"]] == [5, 9, 13]


WORKER = """
import json, os, warnings
import numpy as np, tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import keras_gpufix as kg
from test_recompiles_plain_fit import MANY, length_batches

strategy = kg.setup_strategy(devices=["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    kg.compile_model(model, optimizer="sgd", loss="mse", jit_compile=True,
                     steps_per_execution=1)
monitor = kg.RetracingMonitor(verbose=0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(length_batches(MANY), epochs=2, steps_per_epoch=8, verbose=0,
              callbacks=[monitor])
report = monitor.report()
print("RESULT " + json.dumps({"verdict": report["verdict"], "shapes": report["shapes"],
                              "jit": report["jit_compile"]}))
"""


@pytest.mark.slow  # a subprocess with two logical devices: 20-30 s on 2 loaded cores
def test_under_mirrored_strategy_the_global_batch_shapes_are_seen(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["jit"] is True  # the per-replica XLA step
    # Each replica gets 2 rows; the shapes are of the global batch.
    assert [s[0] for s in result["shapes"]] == [[BATCH, n, 4] for n in range(3, 19)]
    assert result["verdict"] == "recompiling"


def test_the_ring_gives_each_hook_its_new_shape_and_none_for_lost_rows(monkeypatch):
    from keras_gpufix._step_shapes import StepShapes

    monkeypatch.setattr(StepShapes, "CAPACITY", 8)
    probe = StepShapes(tf.distribute.get_strategy())

    def step(n):  # what the train step does with each batch, eagerly here
        probe._record((tf.zeros((BATCH, n, 4)), tf.zeros((BATCH, 1)), tf.constant(1.0)))

    key = {n: ((BATCH, n, 4), (BATCH, 1)) for n in range(20)}  # rank-0 tensors left out
    for n in (3, 4, 4, 5, 3, 6, 6):
        step(n)
    # Hooks of 3 steps (steps_per_execution=3): the first new shape, else the last;
    # a hook whose step never ran (the end of an epoch of unknown length): None.
    assert probe.take([3, 3, 1, 1]) == [key[3], key[5], key[6], None]
    assert probe.take([]) == [] and probe.take([1]) == [None]  # nothing new: no row
    for n in range(7, 17):  # 10 steps into a ring of 8: the first 2 are overwritten
        step(n)
    assert probe.take([1] * 10) == [None, None] + [key[n] for n in range(9, 17)]


@pytest.mark.usefixtures("auto_hardware")  # its default mixed_precision="auto"
def test_after_compile_model_sample_steps_the_shapes_are_still_seen():
    # compile_model's sample steps trace the step fit reuses: the probe goes in first.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    ds = length_batches([5, 9, 13, 17])
    kg.compile_model(model, optimizer="sgd", loss="mse", jit_compile=True,
                     steps_per_execution=1, sample_batch=ds)
    monitor = kg.RetracingMonitor(verbose=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[monitor])
    report = monitor.report()
    assert [s[0][1] for s in report["shapes"]] == [5, 9, 13, 17]
    assert not any("not visible" in n for n in report["notes"])
