"""The slow stage of a tf.data pipeline: measured by diagnose, judged by analysis.stages."""

import json
import os
import subprocess
import sys

import pytest

from keras_gpufix.analysis import STAGE_FIXES, THRESHOLDS, judge_stages, stages_needed
from keras_gpufix.diagnose.report import locate_input_stage

THREE_STAGES = """\
import time

import keras
import numpy as np
import tensorflow as tf


def slow_features(x):
    time.sleep(0.005)
    return x * 2.0


def features(x):
    return tf.ensure_shape(tf.numpy_function(slow_features, [x], tf.float32), [16])


xs = np.random.rand(1024, 16).astype("float32")
ys = np.random.rand(1024, 1).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, ys))
ds = ds.map(lambda x, y: (x + 1.0, y))
ds = ds.map(lambda x, y: (features(x), y))
ds = ds.map(lambda x, y: (tf.nn.relu(x), y))
ds = ds.batch(8)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(ds, epochs=1, verbose=0)
"""


def _line(source, text):
    return next(i for i, line in enumerate(source.splitlines(), start=1) if text in line)


def test_the_slow_python_stage_is_named_by_its_line_and_the_others_are_not(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(THREE_STAGES)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace", "--steps",
         "20", "--log-dir", str(tmp_path / "logs"), "--", "python", str(script)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["verdict"] == "input_bound", proc.stderr[-2000:]
    slow = f"{script}:{_line(THREE_STAGES, 'features(x), y')}"
    fast = [f"{script}:{_line(THREE_STAGES, text)}"
            for text in ("x + 1.0", "tf.nn.relu", "from_tensor_slices", "batch(8)")]
    # every stage the script built was measured, source first, with its line
    stages = result["fits"][0]["stages"]["stages"]
    assert [s["where"] for s in stages] == [fast[2], fast[0], slow, fast[1], fast[3]]
    assert [s["op"] for s in stages] == ["from_tensor_slices", "map", "map", "map", "batch"]
    assert [s["python"] for s in stages] == [False, False, True, False, False]
    assert [s["stateful"] for s in stages] == [None, False, True, False, None]
    assert stages[2]["function"] == f"{script}:{_line(THREE_STAGES, 'def slow_features')}"
    assert stages[0]["per_batch"] == 8 and stages[4]["per_batch"] == 1
    # the located fix of input_bound names the Python stage, its rate, fix and gain
    fix = result["fixes"][0]
    assert fix["verdict"] == "input_bound"
    assert fix["stage"]["where"] == slow and fix["stage"]["kind"] == "python"
    assert fix["stage"]["share"] >= THRESHOLDS["stage_share"]
    assert fix["stage"]["predicted_gain"] > 2
    assert fix["stage"]["rate_per_s"] < fix["stage"]["demand_per_s"]
    assert fix["where"][0].startswith(f"{slow}: `map`, the input's slow stage")
    assert f"the input's slow stage is `map` at {slow}" in fix["fix"]
    assert "predicted" in fix["fix"] and "move the Python work" in fix["fix"]
    # the other stages are not named as the cause
    text = fix["fix"] + " ".join(fix["where"])
    assert not any(line in text for line in fast)


def _stage(op, where, rate, **kw):
    return dict({"op": op, "where": where, "function": None, "python": False,
                 "parallel": None, "batches_per_s": rate}, **kw)


def test_judge_stages_names_the_stage_whose_addition_costs_most():
    # per final batch: source 1 ms, map 2 ms more, the py map 40 ms more, batch 1 ms
    stages = [_stage("from_tensor_slices", "t.py:1", 1000.0),
              _stage("map", "t.py:2", 1 / 0.003, parallel=-1),
              _stage("map", "t.py:3", 1 / 0.043, python=True, function="t.py:9"),
              _stage("map", "t.py:4", 1 / 0.043, parallel=-1),  # in parallel: costs nothing
              _stage("batch", "t.py:5", 1 / 0.044)]
    out = judge_stages(stages, step_per_s=200.0, observed_per_s=1 / 0.045, cpus=4)
    assert [round(s["cost_ms"], 6) for s in out["stages"]] == [1.0, 2.0, 40.0, 0.0, 1.0]
    slow = out["slow"]
    assert slow["where"] == "t.py:3" and slow["kind"] == "python"
    assert slow["share"] == pytest.approx(40 / 44)
    assert slow["rate_per_s"] == pytest.approx(25.0)
    # the share (40/44) of the input's part (44 ms) of the 45 ms cycle is saved: 5 ms left
    assert slow["predicted_gain"] == pytest.approx(45 / 5)
    assert slow["fix"] == STAGE_FIXES["python"].format(
        op="map", where="t.py:3", function=" (Python function at t.py:9)")
    assert "t.py:3" in slow["text"] and "9.00x faster" in slow["text"]
    # never faster than the step allows
    capped = judge_stages(stages, step_per_s=50.0, observed_per_s=1 / 0.045)["slow"]
    assert capped["predicted_gain"] == pytest.approx(0.045 * 50.0)


def test_judge_stages_fix_by_kind_and_no_stage_below_the_share():
    serial = [_stage("from_tensor_slices", "t.py:1", 1000.0),
              _stage("map", "t.py:2", 1 / 0.011, parallel=None, stateful=True)]
    slow = judge_stages(serial, cpus=4)["slow"]
    assert slow["kind"] == "parallel" and "AUTOTUNE" in slow["fix"]
    # a third of the map's 10 ms per batch is left with 4 cores (one stays with
    # the step): 11 -> 1 + 10 / 3 ms
    assert slow["predicted_gain"] == pytest.approx(11 / (1 + 10 / 3))
    assert judge_stages(serial, cpus=2)["slow"]["predicted_gain"] == pytest.approx(1.0)
    # tf.data parallelizes a stateless map by itself: no parallelism to gain, cache it
    serial[1]["stateful"] = False
    assert judge_stages(serial, cpus=4)["slow"]["kind"] == "cache"
    serial[1]["parallel"] = 1  # ... unless num_parallel_calls=1 was given
    assert judge_stages(serial, cpus=4)["slow"]["kind"] == "parallel"
    source = judge_stages([_stage("from_generator", "t.py:1", 10.0, python=True),
                           _stage("batch", "t.py:2", 10.0)])["slow"]
    assert source["kind"] == "python" and source["where"] == "t.py:1"
    even = [_stage("range", "t.py:1", 1 / 0.010), _stage("map", "t.py:2", 1 / 0.016, parallel=-1),
            _stage("map", "t.py:3", 1 / 0.022, parallel=-1)]  # 10, 6 and 6 ms of 22
    out = judge_stages(even)
    assert out["slow"] is None and out["input_per_s"] == pytest.approx(1 / 0.022)
    # a stage after the slow one that reads faster (tf.data fused it) takes no share
    fused = judge_stages([_stage("range", "t.py:1", 1 / 0.001),
                          _stage("map", "t.py:2", 1 / 0.021, stateful=True),
                          _stage("batch", "t.py:3", 1 / 0.011)], cpus=2)
    assert [s["share"] for s in fused["stages"]] == pytest.approx([1 / 21, 20 / 21, 0.0])
    assert fused["input_per_s"] == pytest.approx(1 / 0.011)
    unmeasured = judge_stages([_stage("range", None, None)])
    assert unmeasured["slow"] is None and unmeasured["input_per_s"] is None


def test_stages_needed_only_when_the_input_costs_time():
    assert stages_needed("input_bound")
    assert stages_needed("healthy", {"speedup_if_input_free": 1.4, "bound": "step"})
    assert stages_needed("periodic_stall", {"bound": "input"})
    assert not stages_needed("healthy", {"speedup_if_input_free": 1.0, "bound": "step"})
    assert not stages_needed("recompiling", None)
    # a what-if that does not know is no reason to measure
    assert not stages_needed("healthy", {"speedup_if_input_free": 1.4, "bound": "input",
                                         "known": False})
    # a healthy run that waited 13% for its input (a cause near its threshold): measured,
    # so it names the same line and gain as a run of it judged input_bound
    assert stages_needed("healthy", None, input_wait=0.13)
    assert not stages_needed("healthy", None, input_wait=THRESHOLDS["stage_wait_share"] / 2)


def test_locate_input_stage_replaces_the_generic_fix_and_drops_cheap_stage_lines():
    stages = [_stage("from_tensor_slices", "t.py:1", 1000.0),
              _stage("map", "t.py:2", 1 / 0.003, python=True),
              _stage("map", "t.py:3", 1 / 0.043, python=True, function="t.py:9")]
    fits = [{"wall_s": 3.0, "stages": {"stages": stages, "cpus": 2},
             "what_if": {"step_batches_per_s": 500.0, "between_ms": 0.0,
                         "observed_batches_per_s": 1 / 0.045}}]
    fixes = [{"verdict": "input_bound", "fix": "generic",
              "where": ["t.py:2: py_function in map", "t.py:3: py_function in map",
                        "u.py:7: py_function elsewhere"]}]
    locate_input_stage(fixes, fits)
    (fix,) = fixes
    assert fix["stage"]["where"] == "t.py:3" and fix["stage"]["demand_per_s"] == 500.0
    assert fix["fix"].startswith("the input's slow stage is `map` at t.py:3")
    assert fix["where"][0].startswith("t.py:3: `map`, the input's slow stage")
    assert fix["where"][1:] == ["u.py:7: py_function elsewhere"]
    # one predicted gain per fix: the stage's, the same figure its text gives
    assert fix["predicted"]["source"] == "stage"
    assert fix["predicted"]["speedup"] == fix["stage"]["predicted_gain"]
    assert f"predicted {fix['stage']['predicted_gain']:.2f}x faster per step" in fix["fix"]
    untouched = [{"verdict": "recompiling", "fix": "bucket", "where": []}]
    locate_input_stage(untouched, fits)
    assert untouched == [{"verdict": "recompiling", "fix": "bucket", "where": []}]


def test_docs_quote_the_stage_fixes():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "monitoring.md").read_text()
    missing = [k for k, v in STAGE_FIXES.items() if f"| `{k}` | {v} |" not in doc]
    assert not missing, f"docs/monitoring.md is out of date with STAGE_FIXES: {missing}"


def test_stage_sites_record_the_scripts_calls_and_measure_stages_converts_to_batches():
    import inspect

    import tensorflow as tf

    from keras_gpufix.diagnose.stages import StageSites, measure_stages

    original_map, original_numpy_function = tf.data.Dataset.map, tf.numpy_function
    here = __file__
    with StageSites() as sites:
        line = inspect.currentframe().f_lineno + 1
        source = tf.data.Dataset.range(64)
        mapped = source.map(lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE)
        batched = mapped.batch(4)
        flat = batched.unbatch()
    assert tf.data.Dataset.map is original_map and tf.numpy_function is original_numpy_function
    assert sites.site_of(source)["where"] == f"{here}:{line}"
    assert sites.site_of(mapped)["parallel"] == -1 and sites.site_of(batched)["batch_size"] == 4
    assert sites.site_of(tf.data.Dataset.range(3)) is None  # built after the context closed
    stages = measure_stages(batched, sites, seconds=1.0)["stages"]
    assert [(s["op"], s["per_batch"]) for s in stages] == [("range", 4), ("map", 4), ("batch", 1)]
    assert all(s["batches_per_s"] > 0 for s in stages)
    stages = measure_stages(flat, sites, seconds=1.0)["stages"]
    assert [s["per_batch"] for s in stages] == [None, None, None, 1]  # unbatch: ratio unknown


def test_a_cache_of_a_map_over_a_repeat_pays_from_the_second_pass_over_the_data():
    # diagnose's input.patch moves the map's `.repeat()` after its `.cache()`: the cache
    # then serves from the second pass over the data, within the epoch
    import tensorflow as tf

    from keras_gpufix.diagnose.stages import StageSites, measure_stages

    with StageSites() as sites:
        repeated = tf.data.Dataset.range(64).repeat().map(
            lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE).batch(4)
        once = tf.data.Dataset.range(64).map(lambda x: x * 2).batch(4)
    stages = measure_stages(repeated, sites, seconds=1.0)["stages"]
    assert [(s["op"], s["pass_batches"]) for s in stages] == [
        ("range", None), ("repeat", None), ("map", 16.0), ("batch", None)]
    assert [s["pass_batches"] for s in measure_stages(once, sites, seconds=1.0)["stages"]] == [
        None, None, None]
    stages = [_stage("from_tensor_slices", "t.py:1", 1000.0),
              _stage("map", "t.py:2", 1 / 0.043, parallel=-1, stateful=False, pass_batches=32)]
    run = {"steps": 80, "steps_per_epoch": 80, "fixed_s": 0.5}
    slow = judge_stages(stages, observed_per_s=1 / 0.045, run=run)["slow"]
    assert slow["kind"] == "cache" and slow["predicted_gain"] > 2
    assert slow["run_gain"] == pytest.approx(
        (0.5 + 80 * 0.045) / (0.5 + 32 * 0.045 + 48 * 0.045 / slow["predicted_gain"]))
    assert "second pass over the data (32 batches)" in slow["text"]
    # a pass no shorter than the epoch: from the second epoch, as without a repeat
    epoch = judge_stages([stages[0], dict(stages[1], pass_batches=None)],
                         observed_per_s=1 / 0.045, run=run)["slow"]
    assert epoch["run_gain"] == 1.0 and "second epoch" in epoch["text"]


def test_the_fits_iterator_release_is_the_inputs_time_not_fixed_time():
    # slow_map's fit, its epoch iterator released with a py_function in flight: 2 s after
    # its last hook in some runs (TF 2.21), the input's: gone with the fix in TF ops, kept
    # by a cache for the steps it has not yet served
    from keras_gpufix.diagnose.report import input_stage

    stages = [_stage("from_tensor_slices", "t.py:1", 1000.0),
              _stage("map", "t.py:2", 1 / 0.022, python=True)]
    fit = {"kind": "fit", "epochs": 3, "steps_per_epoch": 128, "steps_run": 384,
           "wall_s": 0.3 + 384 * 0.022 + 2.0, "own_hooks_s": 0.1, "teardown_s": 2.0,
           "stages": {"stages": stages, "cpus": 2},
           "what_if": {"observed_batches_per_s": 1 / 0.022, "step_batches_per_s": 500.0}}
    slow = input_stage(fit)["slow"]
    gain, now = slow["predicted_gain"], 0.2 + 2.0 + 384 * 0.022
    assert slow["run_gain"] == pytest.approx(now / (0.2 + 384 * 0.022 / gain))
    assert slow["run_gain_cached"] == pytest.approx(now / (
        0.2 + 2.0 / 3 + 128 * 0.022 + 256 * 0.022 / gain))
    # as start-up time (no fix removes it) the whole run's gain read less than half
    assert input_stage(dict(fit, teardown_s=None))["slow"]["run_gain"] < slow["run_gain"] / 2


def test_a_zip_is_walked_into_its_slow_branch_and_a_cache_pays_from_the_second_epoch():
    import time

    import tensorflow as tf

    from keras_gpufix.diagnose.stages import StageSites, measure_stages

    def slow(x):
        time.sleep(0.002)
        return x

    with StageSites() as sites:
        audio = tf.data.Dataset.range(4096).map(  # the costly branch, already parallel
            lambda x: tf.numpy_function(slow, [x], tf.int64),
            num_parallel_calls=tf.data.AUTOTUNE)
        text = tf.data.Dataset.range(4096)
        ds = tf.data.Dataset.zip((audio, text)).batch(8)
    measured = measure_stages(ds, sites)
    assert [s["op"] for s in measured["stages"]] == ["range", "map", "zip", "batch"]
    judged = judge_stages(measured["stages"], cpus=measured["cpus"])
    assert judged["slow"]["op"] == "map" and judged["slow"]["kind"] == "python"
    # a cache (a slow TF map already in parallel) gains nothing in a one-epoch script
    stages = [_stage("from_tensor_slices", "t.py:1", 1000.0),
              _stage("map", "t.py:2", 1 / 0.043, parallel=-1, stateful=False)]
    run = {"steps": 100, "steps_per_epoch": 100, "fixed_s": 0.5}
    one = judge_stages(stages, observed_per_s=1 / 0.045, run=run)["slow"]
    assert one["kind"] == "cache" and one["predicted_gain"] > 2 and one["run_gain"] == 1.0
    assert "a cache serves from the second epoch" in one["text"]
    assert "over the script's run (100 steps, and 0.5 s of" in one["text"]
    assert "the whole run 1.00x" in one["text"]
    # ... and on disk, every later run gains from its first step (its start-up kept)
    assert one["run_gain_later"] == pytest.approx(
        (0.5 + 100 * 0.045) / (0.5 + 100 * 0.045 / one["predicted_gain"]))
    assert f"every later run of the script {one['run_gain_later']:.2f}x" in one["text"]
    three = judge_stages(stages, observed_per_s=1 / 0.045, run=dict(run, steps=300))["slow"]
    gain = three["predicted_gain"]
    assert three["run_gain"] == pytest.approx(
        (0.5 + 300 * 0.045) / (0.5 + 100 * 0.045 + 200 * 0.045 / gain))
    # a fix in the map itself (TF ops) gains from the first step; the fixed time stays
    python = judge_stages([stages[0], dict(stages[1], python=True)], observed_per_s=1 / 0.045,
                          run=run)["slow"]
    assert python["run_gain"] == pytest.approx(
        (0.5 + 100 * 0.045) / (0.5 + 100 * 0.045 / python["predicted_gain"]))
    # ... its other fix, a cache, from the second epoch: nothing in a one-epoch script
    assert python["run_gain_cached"] == 1.0 and "with a cache instead" in python["text"]
