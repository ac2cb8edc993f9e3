"""diagnose on planted-fault scripts (subprocesses: it runs a script like cProfile)."""

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_gpufix.analysis import THRESHOLDS
from keras_gpufix.cli import main
from keras_gpufix.diagnose import rank_causes, scan_script
from keras_gpufix.diagnose.report import format_report, seen_in_code
from keras_gpufix.diagnose.what_if import (Cycles, format_what_if, input_rate, replay_rates,
                                           what_if)
from keras_gpufix.run_record import RunRecord
from report_lines import check_report_lines

SLOW_INPUT = """\
import time
import numpy as np
import tensorflow as tf
import keras

def slow_load(x):
    time.sleep(0.02)
    return x

def load(x, y):
    x = tf.py_function(slow_load, [x], tf.float32)
    x.set_shape([16])
    return x, y

xs = np.random.rand(256, 16).astype("float32")
ys = np.random.rand(256, 1).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, ys)).map(load).batch(8).prefetch(2)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(1)])
model.compile("adam", "mse", jit_compile=True)
model.fit(ds, epochs=3, verbose=0)
print("slow script done")
"""

RECOMPILING = """\
import numpy as np
import tensorflow as tf
import keras

# 20 distinct lengths (more than THRESHOLDS["max_new_shapes"]), each seen twice
lengths = np.tile(np.arange(10, 250, 12), 2)

def pad(n):
    return tf.ones([n, 4]), tf.ones([1])

ds = tf.data.Dataset.from_tensor_slices(lengths).map(pad).padded_batch(1).prefetch(2)
inp = keras.Input((None, 4))
x = keras.layers.Conv1D(8, 3, padding="same")(inp)
model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x)))
model.compile("adam", "mse", jit_compile=True)
model.fit(ds, epochs=1, verbose=0)
"""

HEALTHY = """\
import sys
import time
import numpy as np
import tensorflow as tf
import keras


class Accelerator(keras.layers.Layer):
    # The device's share of a real step: 50 ms that host load does not change (the
    # tiny model's own CPU time, which other processes on the host do change, is
    # a small part of the step, so host noise cannot look like degradation).

    def call(self, x):
        done = tf.numpy_function(lambda: np.float32(time.sleep(0.05) or 0), [], tf.float32)
        done.set_shape(())
        return x + 0.0 * done


xs = np.random.rand(512, 64).astype("float32")
ys = np.random.rand(512, 1).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(64).cache().repeat().prefetch(4)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                          Accelerator(), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(ds, epochs=1, steps_per_epoch=400, verbose=0)
print("healthy script done, exiting with", sys.argv[1])
sys.exit(int(sys.argv[1]))
"""


def diagnose(tmp_path, source, *args, steps=30, trace=True, what_if=True):
    script = tmp_path / "train.py"
    script.write_text(source)
    cmd = [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--steps", str(steps),
           "--log-dir", str(tmp_path / "logs")]
    cmd.append("--trace" if trace else "--no-trace")  # on a CPU none is taken unasked
    if not what_if:
        cmd.append("--no-what-if")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd + ["--", "python", str(script), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1]), lines


def _scalar_tags(folder):
    """The scalar tags written under `folder` (any TensorBoard run in it)."""
    import tensorflow as tf

    tags = set()
    for path in glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    return tags


def test_slow_py_function_input_is_input_bound(tmp_path):
    proc, result, lines = diagnose(tmp_path, SLOW_INPUT, steps=30)
    assert proc.returncode == 0 and result["exit_code"] == 0
    assert "slow script done" in lines[:-1]
    assert result["verdict"] == "input_bound"
    monitor = result["fits"][0]["monitor"]
    assert monitor["verdict"] == "input_bound"  # the run's own judgement, not re-judged
    top = result["evidence"][0]
    assert top["source"] == "judgement" and top["value"] == monitor["cost_share"] >= 0.5
    assert monitor["input_wait"] >= 0.5
    traces = [e for e in result["evidence"] if e["source"] == "XProf"]
    assert traces and traces[0]["value"] >= 20.0 and "input-bound" in traces[0]["text"]
    assert result["fits"][0]["stopped_by_diagnose"] is True
    # diagnose's own seconds, item by item: the trace asked for (--trace) and the
    # what-if listed aside, the rest held to the bound; they add up to the wall
    cost = result["own_cost"]
    seconds = {i["item"]: i["seconds"] for i in cost["items"]}
    aside = {i["item"] for i in cost["items"] if not i["counted"]}
    assert aside == {"trace capture", "trace analysis", "what-if", "patched run"}
    assert seconds["trace capture"] > 0 and seconds["what-if"] > 0 and seconds["start-up"] > 0
    assert cost["added_s"] == pytest.approx(sum(s for k, s in seconds.items() if k not in aside))
    # whether they stay within the bound is a wall-time figure: benchmarks/diagnose_cost.py
    # and the slow twelve-seconds test check it, not this one (a GC pause under load moves it)
    assert cost["within"] == (cost["added_s"] <= cost["bound_s"])
    assert cost["text"][0].startswith(f"diagnose's own time: {cost['added_s']:.1f} s beyond "
                                      f"the script's {cost['script_s']:.1f} s")
    # what-if: the input alone is the bound; the step alone (model.train_function
    # replayed on one cached batch) is far faster, and the model was restored
    assert result["what_if"] == result["fits"][0]["what_if"]
    assert result["what_if"]["bound"] == "input" and result["what_if"]["method"] == "side_by_side"
    assert result["what_if"]["step_batches_per_s"] > 3 * result["what_if"]["input_batches_per_s"]
    assert result["what_if"]["speedup_if_input_free"] > 2
    # TensorBoard scalars per step (the step timer) and per judgement (the monitor)
    tags = _scalar_tags(tmp_path / "logs" / "fit_1")
    assert {"step_timer/step_ms", "step_timer/epoch_mean_ms"} <= tags
    assert any(t.startswith("oscillation/") for t in tags)
    scan = [(f["trap"], f["line"]) for f in result["scan"]]
    assert ("py_function_in_map", 17) in scan
    assert result["fixes"][0]["verdict"] == "input_bound"
    assert any("train.py:17" in w for w in result["fixes"][0]["where"])
    for key in ("environment", "fits", "ranking", "log_dir"):
        assert key in result
    assert result["environment"]["tensorflow"] and result["environment"]["cpu_count"] >= 1
    # the diagnosis kept: its run record and HTML report in the log folder
    assert result["record"] == str(tmp_path / "logs" / "run_record.json")
    record = RunRecord.load(tmp_path / "logs").data
    assert record["source"] == "diagnose" and record["command"] == result["command"]
    assert record["verdict"]["verdict"] == result["verdict"]
    assert [(f["verdict"], f["where"], f["expected_speedup"]) for f in record["fixes"]] == [
        (f["verdict"], f["where"], f["predicted"]["speedup"]) for f in result["fixes"]]
    assert [c["verdict"] for c in record["causes"]] == [c["verdict"] for c in result["ranking"]]
    assert record["what_if"]["speedup_if_input_free"] == result["what_if"]["speedup_if_input_free"]
    assert record["step_time"]["p50_ms"] == monitor["step_time"]["p50_ms"]
    assert sum(record["series"]["steps"]) == result["fits"][0]["steps_run"]
    page = open(result["html_report"]).read()
    assert "id='verdict'>input_bound</span>" in page and "train.py:17" in page


def test_variable_lengths_under_jit_are_recompiling(tmp_path):
    # no what-if: its step alone would compile the 20 shapes again (the verdict is the
    # step log's; a what-if's own test is test_what_if_budget.py)
    proc, result, _ = diagnose(tmp_path, RECOMPILING, steps=30, trace=False, what_if=False)
    assert proc.returncode == 0
    assert result["verdict"] == "recompiling"
    retracing = result["fits"][0]["retracing"]
    assert retracing["new_shapes"] == 20
    assert retracing["verdict"] == result["fits"][0]["monitor"]["verdict"] == "recompiling"
    top = result["evidence"][0]
    assert top["source"] == "judgement" and top["text"].startswith("fit 1: recompiling")
    assert result["fixes"][0]["verdict"] == "recompiling"
    assert result["scan"] == []


def test_healthy_script_keeps_its_exit_code(tmp_path):
    proc, result, lines = diagnose(tmp_path, HEALTHY, "3", steps=40, trace=False)
    assert proc.returncode == 3 and result["exit_code"] == 3
    assert "healthy script done, exiting with 3" in lines[:-1]
    assert result["verdict"] == "healthy", result["ranking"]
    fit = result["fits"][0]
    assert fit["monitor"]["step_time"]["count"] > 0
    assert fit["monitor"]["input_wait"] < 0.2
    assert result["evidence"] and "compute-bound" in result["evidence"][0]["text"]
    assert result["scan"] == [] and result["fixes"] == []
    assert result["what_if"]["bound"] == "step"  # cached input: the step is the bound


CACHED_INPUT = """\
import numpy as np
import tensorflow as tf
import keras

x = np.random.rand(256, 32, 16).astype("float32")
y = np.random.rand(256, 1).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).cache()
for _ in ds:  # warmed: training reads memory
    pass
model = keras.Sequential([keras.Input((32, 16)), keras.layers.Conv1D(32, 3, activation="relu"),
                          keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(ds.repeat().prefetch(2), steps_per_epoch=60, epochs=1, verbose=0)
"""


@pytest.mark.slow
def test_an_input_already_cached_gains_nothing_with_the_input_free(tmp_path):
    # the what-if used to promise 1.17x-1.37x here: it counted the monitors' hooks as input
    _, result, _ = diagnose(tmp_path, CACHED_INPUT, steps=60, trace=False)
    what_if = result["what_if"]
    assert what_if["method"] == "side_by_side" and what_if["cycles"] > 40
    low, high = what_if["speedup_range"]
    assert low <= what_if["speedup_if_input_free"] <= (high or float("inf"))
    # no gain claimed: ~1.0x, or the what-if says it does not know
    assert not what_if["known"] or 1 - 1 / low < THRESHOLDS["what_if_share"]
    assert not what_if["known"] or what_if["speedup_if_input_free"] < 1.25
    assert result["verdict"] != "input_bound", result["ranking"]


def test_the_report_ranks_priced_fixes_and_lists_code_only_findings_apart():
    stall = {"verdict": "periodic_stall", "cost_share": 0.2, "period": 200, "phase": "between",
             "message": "from step 10: periodic_stall", "start_step": 10, "end_step": 600}
    fits = [_fit("periodic_stall", 0.2, events=[stall])]
    fits[0]["monitor"]["phase"] = "between"
    fits[0]["monitor"]["step_time"]["p50_ms"] = 2.0  # short steps: dispatch may matter
    scan = [{"trap": "numpy_in_loop", "file": "t.py", "line": 9, "why": "w", "fix": "f",
             "verdict": "dispatch_bound", "training_path": True, "code": "loss.numpy()"}]
    verdict, ranking, fixes = rank_causes(fits, scan)
    seen = seen_in_code(fits, scan, fixes)
    assert verdict == "periodic_stall"
    assert [(f["rank"], f["verdict"]) for f in fixes] == [(1, "periodic_stall")]
    predicted = fixes[0]["predicted"]
    assert predicted["share"] == 0.2 and predicted["speedup"] == pytest.approx(1.25)
    assert seen == [{"verdict": "dispatch_bound", "fix": "f", "where": ["t.py:9: w"]}]
    env = {"gpus": [], "nvml": {"available": False, "reason": "no GPU"}, "xla": {
        "built_with_xla": True}, "tensorflow": "2", "keras": "3", "keras_backend": "tensorflow",
        "python": "3", "cpu_count": 2, "cpus_usable": 2, "dtype_policy": "float32"}
    text = format_report({"command": ["train.py"], "exit_code": 0, "verdict": verdict,
                          "evidence": [], "fixes": fixes, "seen_in_code": seen, "scan": scan,
                          "environment": env, "fits": [], "traces": [], "notes": []})
    assert ("fixes (ranked):\n  1. [periodic_stall] work between steps every 200 steps costs "
            "20% of the run") in text
    assert ("predicted: the whole run 1.25x faster once the fix removes this cause's time "
            "(20% of the run, measured; a fix that removes part of it gains that part)") in text
    assert ("seen in the code (no effect measured in this run: not ranked):\n"
            "  - [dispatch_bound] f\n    t.py:9: w") in text


CRASHES_AT_STEP_7 = """\
import numpy as np
import keras


class Boom(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 6:
            raise ValueError("planted at step 7")


x = np.random.rand(64, 4).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("adam", "mse")
print("before the error")
model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[Boom()])
"""


def test_a_crash_is_named_with_where_and_the_steps_before_also_from_python_dash_c(tmp_path):
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "keras_gpufix", "diagnose", "--no-trace",
                           "--no-what-if", "--log-dir", str(logs), "--", "python", "-c",
                           CRASHES_AT_STEP_7], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 1  # as `python -c` exits
    assert "before the error" in proc.stdout
    assert "ValueError: planted at step 7" in proc.stderr  # the traceback, as python prints it
    script = logs / "command.py"  # where -c code is saved, so its lines can be named
    assert script.read_text() == CRASHES_AT_STEP_7
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("keras-gpufix diagnose:"))
    assert lines[header].endswith("(exit code 1)")
    # the 7th step's end hook raised: six steps were complete
    assert lines[header + 1] == (f"ended by: ValueError: planted at step 7 (raised at "
                                 f"{script}:8) after 6 training steps")
    assert any(line.startswith("verdict: unknown; ") for line in lines)
    assert not any("the script ran" in line for line in lines)
    assert f"note: the -c code was saved as {script}: the lines below refer to it" in lines


LONG_FIT = """\
import os
import time
import numpy as np
import keras


class Marker(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        try:
            time.sleep(0.01)
        except KeyboardInterrupt:  # lost, as when it lands in a finalizer (Exception ignored in)
            pass
        if batch == 30:
            open(os.environ["MARKER"], "w").close()


x = np.random.rand(4096, 4).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(x, x[:, :1], batch_size=4, epochs=100, verbose=0, callbacks=[Marker()])
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_prints_the_report_of_what_was_measured(tmp_path, signum):
    """Also when the script loses the KeyboardInterrupt (the long script drops the
    ones that land in its callback's sleep): the next step raises it again."""
    script = tmp_path / "long.py"
    script.write_text(LONG_FIT)
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-m", "keras_gpufix", "diagnose", "--json",
                             "--no-trace", "--", "python", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MARKER=str(marker),
                                     PYTHONFAULTHANDLER="1"),
                            # as from a terminal, also when pytest runs as a background job
                            # (which ignores SIGINT, and its children with it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), proc.communicate()[1][-3000:]
        proc.send_signal(signum)  # a job scheduler's time limit, or Ctrl-C
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # where it hangs: every thread's stack
            proc.send_signal(signal.SIGABRT)
            stacks = proc.communicate()[1].split("\nExtension modules")[0]
            pytest.fail(f"no report 120 s after the signal:\n{stacks[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["exit_code"] == 128 + signum
    ended = result["ended_by"]
    name = signal.Signals(signum).name
    assert ended["kind"] == "signal" and ended["type"] == name
    fit = result["fits"][0]
    assert ended["steps_seen"] == fit["steps_run"] >= 31
    assert ended["text"] == (f"{name} stopped the script after {fit['steps_run']} training "
                             "steps; this report covers what was measured until then")
    assert fit["monitor"]["step_time"]["count"] > 0  # what was measured is reported
    assert "what_if" not in fit  # nothing more is measured after the signal


THREE_FITS = """\
import numpy as np, tensorflow as tf, keras
x = np.random.rand(256, 8).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8).prefetch(2)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)  # arrays: input shapes not seen
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
model.fit(ds, epochs=2, verbose=2)
"""


def test_each_line_once_no_nvml_line_without_a_gpu_and_a_progress_bar_of_the_reports_figures(
        tmp_path):
    from keras_gpufix.compile.hardware import device_info

    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--no-trace", "--no-what-if",
         "--log-dir", str(tmp_path / "logs"), "--", "python", "-c", THREE_FITS],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    report = out[out.index("keras-gpufix diagnose: "):]
    assert out.count("TensorBoard (step times") == 1
    # arrays and tf.data go through the monitors' own probe: their shapes are seen
    assert out.count("input shapes are not visible") == 0
    notes = [line for line in report.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2 and len(set(notes)) == 2  # the -c file, TensorFlow's hidden lines
    for note in notes:  # said once, in the report: not also during the run
        assert (out + proc.stderr).count(note[len("note: "):]) == 1, note
    if not device_info()["gpus"]:  # no GPU: nothing about NVML's bindings
        assert "nvidia-ml-py" not in out + proc.stderr
    # Keras's progress lines (verbose=2) show the report's input wait, and no verdict index
    bars = [line for line in out.splitlines() if " - loss: " in line]
    assert len(bars) == 2 and not any("verdict" in line for line in bars), bars
    shown = float(bars[-1].split("input_wait: ")[1].split()[0])
    # the last fit's final lines, the figure of its report() (rounded to 1%)
    last = out.split("GPUOscillationMonitor: verdict")[3]
    reported = float(last.split("input wait ")[1].split("%")[0])
    assert abs(100 * shown - reported) <= 1.0, (bars[-1], last)
    # every printed line holds together: three fits, each counted by its monitor too
    checked = check_report_lines(out)
    assert checked["fits"] == 3 and checked["monitors"] == 3, checked


def test_diagnose_argument_errors(tmp_path, capsys):
    assert main(["diagnose"]) == 2
    assert "the script to run is required" in capsys.readouterr().err
    assert main(["diagnose", "--", "python", str(tmp_path / "nope.py")]) == 2
    assert "script not found" in capsys.readouterr().err
    assert main(["diagnose", "--", "python", "-c"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "keras-gpufix diagnose: error: `-c` needs the code to run: keras-gpufix diagnose -- "
        "python -c 'CODE'")


def test_static_scan_finds_each_trap(tmp_path):
    script = tmp_path / "traps.py"
    script.write_text(textwrap.dedent("""\
        import tensorflow as tf

        def decode(path):
            return tf.numpy_function(lambda p: p, [path], tf.string)

        def batches():
            for i in range(10):
                yield i, i

        ds = tf.data.Dataset.from_tensor_slices(["a"]).map(decode).batch(2)
        ds2 = tf.data.Dataset.from_generator(batches, output_types=(tf.int32, tf.int32))
        model.compile("adam", "mse", run_eagerly=True, jit_compile=False)
        model.fit(batches(), epochs=1)
        gen = (x for x in range(3))
        model.fit(gen)
        for batch in ds:
            print(batch.numpy())
        model.run_eagerly = True
        """))
    found = [(f["trap"], f["line"]) for f in scan_script(script)]
    assert found == [
        ("no_prefetch", 10), ("py_function_in_map", 10), ("python_generator", 11),
        ("jit_compile_false", 12), ("run_eagerly", 12), ("python_generator", 13),
        ("python_generator", 15), ("numpy_in_loop", 17), ("run_eagerly", 18),
    ]
    first = scan_script(script)[1]
    assert first["file"] == str(script) and first["code"].startswith("ds = tf.data")
    assert "line 4" in first["detail"]


EAGER_SUBCLASS = """\
import numpy as np
import keras


class Speech(keras.Model):
    def compile(self, optimizer="adam", loss="mse", run_eagerly=True, **kwargs):
        super().compile(optimizer=optimizer, loss=loss, run_eagerly=run_eagerly, **kwargs)


inp = keras.Input((8,))
model = Speech(inp, keras.layers.Dense(1)(inp))
model.compile()
x = np.random.rand(256, 8).astype("float32")
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
"""


def test_run_eagerly_handed_to_super_compile_is_located(tmp_path):
    # the literal and a parameter defaulting to True, in a compile override
    literal = tmp_path / "literal.py"
    literal.write_text(EAGER_SUBCLASS.replace("run_eagerly=run_eagerly", "run_eagerly=True"))
    assert [(f["trap"], f["line"]) for f in scan_script(literal)] == [("run_eagerly", 7)]
    proc, result, _ = diagnose(tmp_path, EAGER_SUBCLASS, steps=20, trace=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["verdict"] == "eager_step"
    (finding,) = result["scan"]
    assert (finding["line"], finding["detail"]) == (
        7, "`run_eagerly` defaults to True in `compile` (line 6)")
    assert result["fixes"][0]["fix"].endswith(f"at {finding['file']}:7")
    assert finding["file"].endswith("train.py")


def _fit(verdict, cost_share=None, events=(), input_wait=0.0, count=50, **extra):
    """One run's entry as diagnose collects it: the monitor's report of its verdict."""
    return {"index": 1, "wall_s": 10.0, **extra,
            "monitor": {"verdict": verdict, "cost_share": cost_share, "phase": None,
                        "fix": "f", "because": [], "changed": None, "events": list(events),
                        "input_wait": input_wait,
                        "step_time": {"count": count, "p50_ms": 10.0, "p95_ms": 12.0,
                                      "cv": 0.1}}}


def test_rank_names_the_runs_verdict_and_orders_its_findings_by_cost():
    stall = {"verdict": "periodic_stall", "cost_share": 0.14, "period": 5, "phase": "between",
             "message": "from step 10: periodic_stall", "start_step": 10, "end_step": 60}
    fits = [_fit("recompiling", 0.6, events=[stall])]
    scan = [{"trap": "no_prefetch", "file": "t.py", "line": 3, "why": "w", "fix": "f",
             "verdict": "input_bound"}]
    verdict, ranking, fixes = rank_causes(fits, scan)
    assert verdict == "recompiling"
    assert [c["verdict"] for c in ranking] == ["recompiling", "periodic_stall"]
    assert ranking[1]["score"] == 0.14  # a 14% stall is ranked, never dropped
    # the input wait was measured (0%): the scan's input_bound finding is no fix
    assert [(f["rank"], f["verdict"]) for f in fixes] == [(1, "recompiling"),
                                                         (2, "periodic_stall")]
    assert rank_causes([], [])[0] == "unknown"  # nothing seen: never healthy
    # The run's verdict is the top line even where a live event cost more
    fits = [_fit("input_bound", 0.25, events=[dict(stall, cost_share=0.4)])]
    assert [c["verdict"] for c in rank_causes(fits, [])[1]] == ["input_bound", "periodic_stall"]
    assert rank_causes([_fit("healthy")], [])[0] == "healthy"
    assert rank_causes([_fit("unknown")], [])[0] == "unknown"  # too few steps
    eager = [{"trap": "run_eagerly", "file": "t.py", "line": 7, "why": "w", "fix": "f",
              "verdict": "eager_step", "training_path": True}]
    verdict, ranking, fixes = rank_causes([_fit("eager_step", 1.0)], eager)
    assert verdict == "eager_step"
    assert ranking[0]["fix"].endswith("at t.py:7")  # the verdict table's text, filled
    assert fixes[0]["where"] == ["t.py:7: w; f"]


def test_the_what_if_and_xprof_are_weighed_into_the_verdict_not_printed_beside_it():
    xprof = {"traces": [{"start_step": 10, "end_step": 19, "reason": "step 10", "analysis": {
        "classification": "moderately_input_bound", "input_percent": 12.0, "steps": 10,
        "step_time_ms": 5.0, "conclusion": "MODERATELY input-bound"}}]}
    fits = [_fit("healthy", profiler=xprof)]
    verdict, ranking, _ = rank_causes(fits, [])
    assert verdict == "healthy" and ranking == []
    from keras_gpufix.diagnose.report import healthy_evidence

    text = healthy_evidence(fits)[0]["text"]
    assert "moderately_input_bound); the verdict stays healthy" in text
    fits[0]["what_if"] = {"speedup_if_input_free": 1.66, "bound": "step", "method": "replay"}
    verdict, ranking, _ = rank_causes(fits, [])
    assert verdict == "input_bound"  # the input costs 40%: the what-if is believed, and said
    assert "the step log read healthy" in ranking[0]["evidence"][0]["text"]


def test_a_trace_xprof_could_not_analyse_is_said_so_never_step_zero():
    from keras_gpufix.diagnose.report import trace_evidence

    # what profiling.analyze_trace returns for a trace without step markers
    # (tests/test_profiling.py::test_stock_tensorboard_traces_have_no_step_marker)
    unanalysed = {"steps": 0, "step_time_ms": None, "input_percent": None, "classification": None,
                  "diagnostics": ["No step marker observed"],
                  "conclusion": "No step time measured. Therefore we cannot tell where the "
                                "performance bottleneck is."}
    fits = [{"kind": "fit", "index": 1, "profiler": {"traces": [
        {"start_step": 10, "end_step": 19, "reason": "step 10", "analysis": unanalysed,
         "path": "logs/fit_1"}]}}]
    (item,) = trace_evidence(fits)
    assert item["value"] is None
    assert "fit 1: XProf trace of steps 10-19 (step 10): XProf could not analyse it: it found no " \
           "steps in the trace to time" in item["text"]
    assert "0.0 ms" not in item["text"] and "0.0%" not in item["text"]
    # XProf's summary that calls 'All Others' time potentially input-bound beside 0% input
    # wait is told as one story, never "not_input_bound; ... POTENTIALLY input-bound"
    others = {"steps": 8, "step_time_ms": 120.0, "input_percent": 0.0,
              "classification": "not_input_bound",
              "conclusion": "Your program is POTENTIALLY input-bound because 43.2% of the total "
                            "step time sampled is spent on 'All Others' time (which could be due "
                            "to I/O or Python execution or both)."}
    fits[0]["profiler"]["traces"][0]["analysis"] = others
    (item,) = trace_evidence(fits)
    assert "POTENTIALLY" not in item["text"] and "not_input_bound" not in item["text"]
    assert "43.2% of the step is 'All Others' time" in item["text"]


def _cycles(cycle_s, input_s, step_s, n=10, jitter=0.0):
    cycles = Cycles(skip=2)
    for i in range(n + 2):
        wobble = jitter * (-1) ** i
        cycles.add(cycle_s + wobble, input_s, step_s + wobble)
    return cycles


def _blocks(*per_block):
    return [[rate] * 4 for rate in per_block]


def test_what_if_figures():
    cycles = Cycles(skip=2)
    for cycle in (9.0, 9.0, 0.1, 0.1):  # the first two of each epoch are left out
        cycles.add(cycle, 0.08, 0.01)
    cycles.epoch()
    cycles.add(7.0, 0.0, 0.01)
    assert cycles.cycle_s == [0.1, 0.1] and cycles.input_s == [0.08, 0.08]
    # input-bound: the step alone takes 90 ms a batch on the real input, 5 ms on a cached
    # batch; 10 ms of each cycle are hooks and loop work, which stay with the input free
    rates = {"real": _blocks(1 / 0.09, 1 / 0.09, 1 / 0.09, 1 / 0.09),
             "cached": _blocks(200.0, 200.0, 200.0, 200.0)}
    result = what_if(_cycles(0.1, 0.085, 0.005), 10.0, rates)
    assert result["speedup_if_input_free"] == pytest.approx(0.1 / 0.015)
    assert result["between_ms"] == pytest.approx(10.0)
    assert result["observed_batches_per_s"] == pytest.approx(10.0)
    assert result["input_and_step_batches_per_s"] == pytest.approx(1 / 0.09)
    assert result["bound"] == "input" and result["method"] == "side_by_side"
    assert result["cycles"] == 10
    assert result["known"] and result["speedup_range"] == pytest.approx([0.1 / 0.015] * 2)
    text = format_what_if(result)
    assert text.startswith("what-if: input supplies 10.0 batches/s, the step consumes 200.0")
    assert "the run would be 6.67x faster (6.67x-6.67x)" in text
    # an input already cached: the step takes what it takes on a cached batch, nothing is
    # gained (the hooks around it, 30 ms of a 50 ms cycle, stay)
    rates = {"real": _blocks(50.0, 50.0, 49.0, 51.0), "cached": _blocks(50.0, 49.0, 50.0, 51.0)}
    result = what_if(_cycles(0.05, 0.0, 0.02), 500.0, rates)
    assert result["speedup_if_input_free"] == pytest.approx(1.0, abs=0.01)
    assert result["known"] and "no faster (1.00x" in format_what_if(result)
    # contention: the input keeps up, but the step runs 1.5x slower beside the pipeline;
    # each real block against the cached block beside it gives the range
    rates = {"real": _blocks(33.0, 34.0, 32.0, 33.5), "cached": _blocks(50.0, 50.0, 49.0, 51.0)}
    result = what_if(_cycles(0.03, 0.0, 0.03), 500.0, rates)
    low, high = result["speedup_range"]
    assert result["bound"] == "step" and low < result["speedup_if_input_free"] < high
    assert result["speedup_if_input_free"] == pytest.approx(1.5, abs=0.03) and result["known"]
    assert "the step is the bound" in format_what_if(result)
    assert "competes with the step" in format_what_if(result)
    # the input alone a little slower than the step alone (the contention pattern: 62.9
    # against 66.9 batches/s), yet faster than the run's cycle with the input free
    text = format_what_if(dict(result, input_batches_per_s=62.9, step_batches_per_s=66.9,
                               speedup_if_input_free=1.71, observed_batches_per_s=35.0))
    assert "could feed a step" not in text  # not "0.9x faster"
    assert "the input alone keeps up with the cycle the run would have with it free, 59.9" in text
    # the host's load changed between blocks: the pairs disagree, the what-if does not know
    rates = {"real": _blocks(33.0, 34.0, 100.0, 33.5), "cached": _blocks(50.0, 50.0, 20.0, 51.0)}
    result = what_if(_cycles(0.03, 0.0, 0.03), 500.0, rates)
    assert result["known"] is False and "does not know" in format_what_if(result)
    # only the cached step (no real batches to replay): against the run's own cycles
    result = what_if(_cycles(0.03, 0.0, 0.03), 500.0, {"cached": _blocks(50.0, 50.0, 50.0, 50.0),
                                                       "real": None})
    assert result["method"] == "replay"
    assert result["speedup_if_input_free"] == pytest.approx(1.5) and result["known"]
    # a step that cannot be replayed: the step stays as it ran, only the wait goes
    result = what_if(_cycles(0.1, 0.06, 0.03), 12.0, None)
    assert result["method"] == "in_run" and result["step_batches_per_s"] == pytest.approx(25.0)
    assert result["speedup_if_input_free"] == pytest.approx(2.5)
    assert what_if(Cycles(), 10.0, None) is None


def test_input_rate_and_replay_rates_leave_the_state_alone():
    import tensorflow as tf

    ds = tf.data.Dataset.range(40).batch(4)
    it = iter(ds)
    assert int(next(it)[0]) == 0
    assert input_rate(ds, seconds=0.5) > 0
    assert int(next(it)[0]) == 4  # the user's iterator was not consumed
    assert input_rate(ds.take(1)) is None
    v = tf.Variable(1.0)
    step = tf.function(lambda: v.assign_add(1.0))
    rates = replay_rates(step, [v], batches_per_call=2, seconds=0.2, rounds=3)
    assert rates["real"] is None and len(rates["cached"]) == 8
    assert all(len(b) == 3 and min(b) > 0 for b in rates["cached"])
    assert float(v.numpy()) == 1.0
    starts = []

    def real():  # a fresh iterator of the real input for each run of real blocks
        starts.append(iter(ds.repeat()))
        return lambda: step() if next(starts[-1]) is not None else None

    rates = replay_rates(step, [v], real=real, seconds=0.2, rounds=2)
    assert len(rates["real"]) == len(rates["cached"]) == 4 and len(starts) == 2
    assert float(v.numpy()) == 1.0


def test_static_scan_follows_own_modules_and_ranks_only_the_training_path(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "train.py").write_text(textwrap.dedent("""\
        import numpy as np
        import helpers
        from pkg.viz import plot_batch
        from pkg import decode

        ds = helpers.make_dataset()
        for epoch in range(2):
            for x, y in ds:
                loss = helpers.train_step(x, y)
                helpers.log_loss(loss)
            plot_batch(x)
        for x, y in ds:
            print(decode.greedy(x))
        """))
    (tmp_path / "helpers.py").write_text(textwrap.dedent("""\
        import tensorflow as tf

        def make_dataset():
            ds = tf.data.Dataset.from_tensor_slices([1.0, 2.0])
            return ds.map(lambda x: tf.numpy_function(abs, [x], tf.float32)).batch(2)

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = x * y
            return tape.gradient(loss, [x])

        def log_loss(loss):
            for value in [loss]:
                print(value.numpy())
        """))
    (tmp_path / "pkg" / "viz.py").write_text(textwrap.dedent("""\
        def plot_batch(x):
            for row in x:
                print(row.numpy())
        """))
    (tmp_path / "pkg" / "decode.py").write_text(textwrap.dedent("""\
        def greedy(x):
            return [t.numpy() for t in x]
        """))
    scan = scan_script(tmp_path / "train.py")
    found = {(os.path.relpath(f["file"], tmp_path), f["line"], f["trap"]): f["training_path"]
             for f in scan}
    assert found == {
        ("helpers.py", 5, "py_function_in_map"): True,
        ("helpers.py", 5, "no_prefetch"): True,
        ("helpers.py", 14, "numpy_in_loop"): True,  # called once per step by the loop
        (os.path.join("pkg", "viz.py"), 3, "numpy_in_loop"): False,  # once per epoch
        (os.path.join("pkg", "decode.py"), 2, "numpy_in_loop"): False,  # inference only
    }
    fits = [_fit("healthy", count=20)]
    fits[0]["monitor"]["step_time"]["p50_ms"] = 2.0  # short steps: a sync per step may matter
    verdict, _, fixes = rank_causes(fits, scan)
    assert verdict == "healthy" and fixes == []  # nothing measured costs time: nothing ranked
    # the per-step .numpy() is seen in the code, apart: this run measured no effect for it
    seen = [w for f in seen_in_code(fits, scan, fixes) for w in f["where"]]
    assert any("helpers.py:14" in w for w in seen)
    assert not any("viz.py" in w or "decode.py" in w for w in seen)
    # the input was measured fine (0% wait, no what-if gain): its findings are not even seen
    assert not any("helpers.py:5" in w for w in seen)
    # the input competes for the cores (the what-if, 0% wait): a ranked, priced fix
    fits[0]["what_if"] = {"speedup_if_input_free": 1.5, "speedup_range": [1.4, 1.6],
                          "known": True}
    verdict, _, fixes = rank_causes(fits, scan)
    assert verdict == "input_bound" and [f["rank"] for f in fixes] == [1]
    assert any("helpers.py:5" in w for w in fixes[0]["where"])
    assert fixes[0]["predicted"]["speedup"] == 1.5 and fixes[0]["predicted"]["source"] == "what-if"
    assert fixes[0]["fix"].startswith("the input pipeline competes with the step for the CPU")


def test_a_diagnose_note_points_at_the_scripts_fit_line(tmp_path, monkeypatch):
    import warnings

    from keras_gpufix.diagnose import run
    from keras_gpufix.exceptions import GpufixWarning

    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent("""\
        import numpy as np
        import keras
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(np.ones((16, 4)), np.ones((16, 1)), epochs=1, verbose=0)
        """))

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(run.FitPatch, "_prepare", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run.run_diagnosis([str(script)], trace=False, what_if=False, verbose=0)
    assert result["exit_code"] == 0  # the fit ran without the monitors
    (note,) = [w for w in caught if issubclass(w.category, GpufixWarning)]
    assert "could not attach the monitors (RuntimeError: injected)" in str(note.message)
    assert (note.filename, note.lineno) == (str(script), 5)  # the script's fit(...) line


def test_the_step_counter_keeps_async_dispatch_and_stops_at_the_steps(monkeypatch):
    import threading
    import types

    import keras
    from keras.src.callbacks import callback_list

    from keras_gpufix.diagnose.run import _step_counter
    from keras_gpufix.keras_internals import async_train_dispatch

    monkeypatch.setattr(callback_list.backend, "IS_THREAD_SAFE", True)  # as on JAX
    assert async_train_dispatch(keras.callbacks.CallbackList([_step_counter(5)])) is True
    model = types.SimpleNamespace(steps_per_execution=2, stop_training=False)
    counter = _step_counter(5)
    counter.set_model(model)
    counter.on_train_begin()
    stops = []
    for first in (0, 2, 4):  # executions of 2 steps; the end hooks in another thread
        counter.on_train_batch_begin(first)
        stops.append(model.stop_training)
        end = threading.Thread(target=counter.on_train_batch_end, args=(first + 1,))
        end.start()
        end.join()
    assert stops == [False, False, True]  # set before the execution that reaches 5 steps
    assert counter.seen == 6 and counter.stopped
    # epochs of 6 steps in executions of 4: each epoch's last one has 2 steps
    model = types.SimpleNamespace(steps_per_execution=4, stop_training=False)
    counter = _step_counter(20)
    counter.set_model(model)
    counter.set_params({"steps": 6})
    counter.on_train_begin()
    begun = []
    for epoch in range(4):
        for first, last in ((0, 3), (4, 5)):
            if model.stop_training:
                break
            counter.on_train_batch_begin(first)
            begun.append((epoch, first))
            counter.on_train_batch_end(last)
        counter.on_epoch_end(epoch)
    assert begun[-1] == (3, 0) and counter.seen == 22  # as a synchronous stop at >= 20


def test_a_loops_cycles_are_its_records_with_the_train_functions_time_as_step():
    from keras_gpufix.analysis import StepRecord, stall_period, trace_plan

    # a custom loop's records hold its whole body in `step` (split False)
    records = [StepRecord(index=i, steps=1, input_wait=0.01, step=0.02, between=0.001,
                          epoch_first=i in (0, 4), split=False) for i in range(8)]
    cycles = Cycles.of(records, steps={i: 0.005 for i in range(8)})
    assert cycles.cycle_s == pytest.approx([0.031] * 4)  # 2 left out of each epoch
    assert cycles.input_s == [0.01] * 4 and cycles.step_s == [0.005] * 4
    assert Cycles.of(records).step_s == [0.02] * 4  # fit's: the record's own step
    # the stall whose line the loop patch looks for: the latest periodic one
    monitor = {"events": [{"verdict": "periodic_stall", "period": 4}],
               "causes": [{"verdict": "input_bound"}, {"verdict": "periodic_stall", "period": 5}]}
    assert stall_period(monitor) == 5 and stall_period({"events": []}) is None
    # diagnose's trace schedule, as before it moved to analysis
    assert [trace_plan(t) for t in (None, 12, 60)] == [
        {"at": 10, "steps": 10, "max_traces": 2}, {"at": 5, "steps": 3, "max_traces": 2},
        {"at": 10, "steps": 10, "max_traces": 2}]


def test_diagnose_bills_its_own_seconds_item_by_item_against_its_bound():
    from keras_gpufix.analysis import (OWN_ITEMS, TRACE_SLOWDOWN, own_cost, trace_cost_text,
                                       trace_question, traced_extra_s)

    seconds = {"start-up": 0.5, "scan": 0.1, "monitors": 0.4, "trace capture": 2.0,
               "trace analysis": 1.0, "what-if": 9.0, "report": 0.2}
    # a 60 s process: the script's own time is what diagnose's items leave
    cost = own_cost(seconds, 60.0)
    assert [i["item"] for i in cost["items"]] == list(OWN_ITEMS)
    assert cost["script_s"] == pytest.approx(60.0 - 13.2)
    assert cost["added_s"] == pytest.approx(4.2) and cost["aside_s"] == pytest.approx(9.0)
    assert cost["bound_s"] == 5.0 and cost["within"]  # 10% of 46.8 s is under the 5 s floor
    assert cost["text"][1] == ("  start-up 0.5 s, scan 0.1 s, monitors 0.4 s, trace capture "
                               "2.0 s, trace analysis 1.0 s, report 0.2 s")
    assert cost["text"][2] == "  aside, not held to the bound: what-if 9.0 s (its own budget)"
    # an opted-in trace is listed aside; a long script's bound is its 10%
    cost = own_cost(dict(seconds, **{"trace capture": 40.0}), 400.0, opted_in_trace=True)
    assert cost["added_s"] == pytest.approx(1.2) and cost["bound_s"] == pytest.approx(34.88)
    assert "trace capture 40.0 s (asked for: --trace)" in cost["text"][2]
    over = own_cost(dict(seconds, **{"trace capture": 40.0}), 400.0)
    assert not over["within"] and " OVER its bound of 34.9 s" in over["text"][0]
    # the traced steps' cost: their cycles less as many untraced medians
    cycles = {i: 1.0 for i in range(20)}
    cycles.update({10: 1.6, 11: 1.4, 12: 0.9})
    assert traced_extra_s(cycles, [(10, 12)]) == pytest.approx(0.9)
    assert traced_extra_s(cycles, []) == 0.0
    # a trace only where it answers what the step log cannot: on a GPU, or asked for
    assert trace_question("auto", []) is None and trace_question(False, ["H200"]) is None
    assert "GPU" in trace_question("auto", ["H200"]) and trace_question(True, []) is not None
    assert "10 steps of about 900 ms" in trace_cost_text(10, 0.9)
    assert f"up to about {TRACE_SLOWDOWN * 9:.1f} s more" in trace_cost_text(10, 0.9)




@pytest.mark.slow  # a 10-15 s fit (4 epochs of 64 input-bound steps), then its what-if
def test_a_fit_of_twelve_seconds_bills_diagnose_within_its_bound(tmp_path, monkeypatch):
    # the input-bound fit benchmarks/diagnose_cost.py bills (`short_steps`), 4 epochs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    from diagnose_cost import SHORT_STEPS

    script = tmp_path / "train.py"
    script.write_text(SHORT_STEPS.replace("EPOCHS", "4") + 'print("twelve seconds done")\n')
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "keras_gpufix", "diagnose", "--log-dir",
                           str(tmp_path / "logs"), "--", "python", str(script)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "twelve seconds done" in lines and "ProfilerTrigger" not in proc.stdout  # no GPU
    head = next(i for i, line in enumerate(lines) if line.startswith("diagnose's own time: "))
    bound = float(lines[head].split(", within its bound of ")[1].split(" s ")[0])
    assert bound >= 5.0  # the larger of 10% of the script's time and 5 s
    listed = dict(item.rsplit(" ", 2)[0:2] for item in lines[head + 1].strip().split(", "))
    assert list(listed) == ["start-up", "scan", "monitors", "trace capture", "trace analysis",
                            "report"]
    assert float(listed["trace capture"]) == 0.0  # none taken on a CPU unasked
    assert sum(map(float, listed.values())) <= bound
    assert lines[head + 2].startswith("  aside, not held to the bound: what-if ")
