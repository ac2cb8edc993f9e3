"""`keras-gpufix diagnose` of JAX scripts with TensorFlow never imported (issue 41).

All cases run in ONE subprocess with KERAS_BACKEND=jax and TensorFlow blocked
from import (`test_backends._Blocked`, a `sys.meta_path` finder that refuses
it and records every try). Each script is tiny and runs on the CPU:

- `fit` over a `PyDataset` sleeping 20 ms per batch (through the CLI, `--json`)
  -> `input_bound` with its predicted gain, the run record written, the
  environment's jax version, the what-if measured (the `PyDataset` drained
  alone, the step as timed in the run), the stages saying why they are not
  measured on JAX; the same fit with `--steps 12` stops at 12 steps;
- a `jax.jit` loop over a list that reads its loss and sleeps every 5th step
  -> `periodic_stall`, period 5, at the loop's line; its step is the jitted
  function whose output comes back (`step`), not a jitted augmentation;
- a `jax.jit` loop over a `PyDataset` whose length changes each batch
  -> `recompiling`, with the shapes and JAX's compile seconds;
- `--steps 20` on the list loop: the loop ends at its 21st step call;
- the same stall in a loop the script already wraps in `kg.watch`, with
  `--steps 40`: diagnose's monitors join that watch (one run, no second
  loop), `periodic_stall`, stopped;
- no import of TensorFlow tried, `tensorflow` not in `sys.modules`.

Run as a script, the cases print their results as one JSON line.
"""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

SLEEP_S = 0.02

FIT_SLOW = f"""
import time

import keras
import numpy as np


class Slow(keras.utils.PyDataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep({SLEEP_S})
        return np.zeros((8, 16), "float32"), np.zeros((8, 1), "float32")


model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(Slow(), epochs=1, verbose=0)
"""

JIT_STEP = """
import jax
import jax.numpy as jnp


@jax.jit
def step(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.01 * grad, loss
"""

LOOP_STALL = JIT_STEP + """
import time

import numpy as np

scale = jax.jit(lambda x: x * 1.0)  # a jitted augmentation: not a step
w = jnp.zeros((32, 32))
batches = [np.ones((16, 32), "float32")] * 60
for i, x in enumerate(batches):
    w, loss = step(w, scale(jnp.asarray(x)))
    if i % 5 == 4:
        float(loss); time.sleep(0.03)  # the periodic host work
"""

WATCH_STALL = JIT_STEP + """
import time

import numpy as np

import keras_gpufix as kg

w = jnp.zeros((32, 32))
with kg.watch([np.ones((16, 32), "float32")] * 60) as watched:
    for i, x in enumerate(watched):
        w, loss = step(w, x)
        if i % 5 == 4:
            float(loss); time.sleep(0.03)
"""

LOOP_SHAPES = JIT_STEP + """
import keras
import numpy as np


class Lengths(keras.utils.PyDataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return np.ones((4, 8 + i, 8), "float32")


w = jnp.zeros((8, 8))
for x in Lengths():
    w, loss = step(w, x)
"""


def _diagnose(folder, name, code, *options):
    """`keras-gpufix diagnose --json` of `code` saved as `folder/name.py`: its JSON."""
    from keras_gpufix.cli import main

    script = os.path.join(folder, f"{name}.py")
    with open(script, "w") as f:
        f.write(code)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = main(["diagnose", "--json", "--no-trace", "--log-dir",
                     os.path.join(folder, f"{name}_logs"), *options, "--", "python", script])
    result = json.loads(said.getvalue().strip().splitlines()[-1])  # the script prints too
    assert code == result["exit_code"]
    return script, result


def _cases(folder):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_backends import _Blocked

    finder = _Blocked(("tensorflow",))
    sys.meta_path.insert(0, finder)
    out = {}
    # the what-if and the reruns only where a case checks them (loop_stall: one round;
    # the pairing itself is test_patched_run's): each rerun is a process
    _, fit = _diagnose(folder, "fit_slow", FIT_SLOW)
    first = fit["fits"][0]
    out["fit_slow"] = {"verdict": fit["verdict"], "fix": fit["fixes"][0]["verdict"],
                       "speedup": fit["fixes"][0]["predicted"]["speedup"],
                       "fix_text": fit["fixes"][0]["fix"],
                       "predicted_text": fit["fixes"][0]["predicted"]["text"],
                       "record": fit["record"] and os.path.isfile(fit["record"]),
                       "jax": fit["environment"]["jax"],
                       "tensorflow": fit["environment"]["tensorflow"],
                       "what_if": [first["what_if"].get(k) for k in ("method",
                                                                     "speedup_if_input_free",
                                                                     "known")],
                       "stages": (first.get("stages") or {}).get("reason")}
    _, fit = _diagnose(folder, "fit_steps", FIT_SLOW, "--steps", "12", "--no-what-if")
    out["fit_steps"] = {"steps_run": fit["fits"][0]["steps_run"], "exit_code": fit["exit_code"]}
    script, stall = _diagnose(folder, "loop_stall", LOOP_STALL, "--rounds", "1")
    line = next(i for i, text in enumerate(LOOP_STALL.splitlines(), 1) if "host work" in text)
    out["loop_stall"] = {"verdict": stall["verdict"], "kind": stall["fits"][0]["kind"],
                         "period": stall["ranking"][0]["evidence"][0].get("period"),
                         "where": stall["fits"][0]["step"]["stall_where"],
                         "steps": [f["name"] for f in stall["fits"][0]["step"]["functions"]],
                         "expected": f"{script}:{line}",
                         "predicted": next(f["predicted"] for f in stall["fixes"]
                                           if f["verdict"] == "periodic_stall")}
    _, steps = _diagnose(folder, "loop_steps", LOOP_STALL, "--steps", "20", "--no-what-if")
    out["loop_steps"] = {"exit_code": steps["exit_code"], "ended": steps["stopped"],
                         "stopped": steps["fits"][0]["stopped_by_diagnose"],
                         "timed": steps["fits"][0]["steps"]}
    _, watch = _diagnose(folder, "watch_stall", WATCH_STALL, "--steps", "40",
                         "--no-what-if")
    out["watch_stall"] = {"verdict": watch["verdict"], "runs": len(watch["fits"]),
                          "x": watch["fits"][0]["x"], "timed": watch["fits"][0]["steps"],
                          "stopped": watch["fits"][0]["stopped_by_diagnose"],
                          "exit_code": watch["exit_code"]}
    _, shapes = _diagnose(folder, "loop_shapes", LOOP_SHAPES, "--no-what-if")
    retracing = shapes["fits"][0]["retracing"]
    out["loop_shapes"] = {"verdict": shapes["verdict"], "evidence": shapes["evidence"],
                          "shapes": len(retracing["shapes"]),
                          "compile_s": [e["compile_s"] for e in retracing["shape_events"]]}
    out["tensorflow_imported"] = finder.imported
    out["tensorflow_in_sys_modules"] = "tensorflow" in sys.modules
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    pytest.importorskip("jax")
    folder = tmp_path_factory.mktemp("diagnose_jax")
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=os.getcwd(), TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run([sys.executable, __file__, str(folder)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_jax_fit_over_a_slow_pydataset_is_input_bound_with_its_gain(cases):
    case = cases["fit_slow"]
    assert case["verdict"] == "input_bound" and case["fix"] == "input_bound", case
    assert case["speedup"] > 1.5 and case["record"], case
    assert case["jax"] and case["tensorflow"] is None, case
    method, speedup, known = case["what_if"]  # the PyDataset drained alone, the step as in the run
    assert method == "in_run" and speedup > 1.5 and "tf.data" in case["stages"], case
    # advice for a PyDataset (workers, a feature cache), not tf.data's; the prediction
    # says how the what-if measured it, or (its range too wide to know, under load) that
    # it is the share the input cost
    assert "PyDataset(workers=N" in case["fix_text"] and "AUTOTUNE" not in case["fix_text"]
    assert ("the step as timed in the run, against the input drained alone" if known else
            "of the run, measured") in case["predicted_text"], case


def test_jax_jit_loop_with_periodic_host_work_is_periodic_stall_at_its_line(cases):
    case = cases["loop_stall"]
    assert case["verdict"] == "periodic_stall" and case["kind"] == "loop", case
    assert case["period"] == 5 and case["where"] == case["expected"], case
    assert case["steps"] == ["step"], case  # not the jitted augmentation
    # its gain measured by running the script again with that line skipped (JAX too)
    predicted = case["predicted"]
    assert predicted["source"] == "skipped-run", predicted["text"]
    assert f"{case['where']} skipped" in predicted["text"]


def test_a_scripts_own_kg_watch_loop_gets_the_monitors_and_steps(cases):
    case = cases["watch_stall"]
    assert case["verdict"] == "periodic_stall" and case["runs"] == 1, case
    assert case["x"].startswith("kg.watch(") and case["stopped"] and case["exit_code"] == 0, case
    assert case["timed"] <= 40, case


def test_jax_jit_loop_over_new_lengths_is_recompiling_with_shapes_and_compile_seconds(cases):
    case = cases["loop_shapes"]
    assert case["verdict"] == "recompiling", case
    assert case["shapes"] >= 15 and sum(1 for s in case["compile_s"] if s) >= 10, case


def test_steps_stop_a_jax_fit_and_a_jit_loop_over_a_list(cases):
    assert cases["fit_steps"] == {"steps_run": 12, "exit_code": 0}, cases["fit_steps"]
    case = cases["loop_steps"]
    assert case["stopped"] and case["exit_code"] == 0, case
    # the loop over a list ends at its 21st step call: the script ends there, exit 0
    assert case["ended"]["how"] == "asked_again", case
    assert case["ended"]["text"].startswith("stopped by --steps after 20 steps; the script "
                                            "then asked for a train step at "), case


def test_a_jax_diagnose_never_imports_tensorflow(cases):
    assert cases["tensorflow_imported"] == [] and not cases["tensorflow_in_sys_modules"], cases


if __name__ == "__main__":
    print(json.dumps(_cases(sys.argv[1])))
