"""A plot every 5 steps whose cost the cycles' spread hides (work of another length
in every cycle: an eager step under load, a loader) is still named at its line, with
its period and its share: the loop's stack samples hold it in
the cycles of one offset of the period only (issue 56: MyXTTSModel's spectrogram plot
beside its eager step)."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''\
    import random
    import time

    import numpy as np
    import tensorflow as tf

    random.seed(0)
    data = tf.data.Dataset.range(60)
    v = tf.Variable(1.0)
    a = np.random.default_rng(0).random((120, 120))


    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = v * tf.cast(x, tf.float32)
        v.assign_sub(0.001 * tape.gradient(loss, v))
        return loss


    def plot():
        end = time.perf_counter() + 0.04
        while time.perf_counter() < end:
            np.tanh(a @ a)


    for i, x in enumerate(data):
        train_step(x)
        time.sleep(random.choice([0.005, 0.08]))  # work whose length moves a lot
        if i % 5 == 4:
            plot()
    ''')


def test_a_periodic_plot_hidden_by_the_cycles_spread_is_named_at_its_line(tmp_path):
    script = tmp_path / "noisy_loop.py"
    script.write_text(SCRIPT)
    plot_line = SCRIPT.splitlines().index("        plot()") + 1
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
         "--no-what-if", "--log-dir", str(tmp_path / "logs"), "--",
         "python", str(script)], capture_output=True, text=True, env=env, timeout=600,
        cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    stall = next(f for f in result["fixes"] if f["verdict"] == "periodic_stall")
    assert stall["where"][0].startswith(f"{script}:{plot_line}:"), stall["where"]
    # its cost share (no reruns here: --no-what-if; with them, its line is skipped in
    # a rerun beside the script as it is: test_patched_run)
    assert 0.05 < stall["predicted"]["share"] < 0.4, stall["predicted"]
    cause = next(c for c in result["ranking"] if c["verdict"] == "periodic_stall")
    assert cause["evidence"][0]["period"] == 5
    # the run's verdict is its largest cause
    assert result["verdict"] == max(result["ranking"], key=lambda c: c["score"])["verdict"]
