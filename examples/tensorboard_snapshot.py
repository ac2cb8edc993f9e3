"""Serve a keras_gpufix log dir with TensorBoard and check what it shows.

    python examples/tensorboard_snapshot.py --logdir runs/tb_demo
    python examples/tensorboard_snapshot.py --logdir runs/tb_demo --screenshot docs/img/profile_tab.png

When `--logdir` holds no event files yet, a short demo `fit` writes one:
`kg.StepTimer` and `kg.GPUOscillationMonitor` scalars, and one
`kg.ProfilerTrigger` trace (taken at a fixed step) with its XProf analysis.
Then TensorBoard starts on loopback and the script asks its HTTP API for:

- `/data/plugins_listing`: the scalars and profile plugins are active;
- `/data/plugin/scalars/tags`: our tags (`step_timer/...`, `oscillation/...`);
- `/data/plugin/profile/runs` and `/run_tools`: the trace's run and its tools
  (`overview_page`, `input_pipeline_analyzer`, `trace_viewer`, ...).

With `--screenshot`, headless Chromium (Debian's `chromium` package) saves
the Profile tab as a PNG. Prints what it found; `--json` prints it as one
JSON line. Exit code 0 when scalars and the profile run are served.
"""

import argparse
import glob
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

OUR_TAG_PREFIXES = ("step_timer/", "oscillation/")


def write_demo_logs(logdir, steps=60):
    """A short fit with the monitors writing under `logdir` and one trace."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_gpufix as kg

    rng = np.random.default_rng(0)
    x = rng.random((steps * 16, 32), dtype=np.float32)
    y = x @ rng.random((32, 1), dtype=np.float32)
    ds = kg.data.instrument(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    trigger = kg.ProfilerTrigger(logdir, trigger=20, steps=5, max_traces=1, verbose=0)
    model.fit(ds.prefetch(tf.data.AUTOTUNE), epochs=2, verbose=0, shuffle=False, callbacks=[
        kg.StepTimer(log_dir=logdir),
        kg.GPUOscillationMonitor(log_dir=logdir, window=16, verbose=0),
        trigger,
    ])
    return trigger.traces


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base, path, timeout=30):
    with urllib.request.urlopen(base + path, timeout=timeout) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return json.loads(body.decode())


def start_tensorboard(logdir, port):
    """Starts TensorBoard on 127.0.0.1:port; returns (process, base URL) once it answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"TensorBoard exited: {process.stderr.read()[-2000:]}")
        try:
            _get(base, "/data/logdir", timeout=2)
            return process, base
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("TensorBoard did not answer within 90 s")


def check(base, wait_s=60):
    """Asks TensorBoard's HTTP API for our scalars and the profile run."""
    found = {"plugins": [], "scalar_tags": [], "profile_runs": [], "profile_tools": {}}
    deadline = time.monotonic() + wait_s
    while True:  # TensorBoard loads event files in the background
        plugins = _get(base, "/data/plugins_listing")
        found["plugins"] = sorted(k for k, v in plugins.items() if v.get("enabled"))
        tags = _get(base, "/data/plugin/scalars/tags")
        found["scalar_tags"] = sorted({t for run in tags.values() for t in run})
        found["scalar_runs"] = sorted(tags)
        if "profile" in found["plugins"]:
            found["profile_runs"] = _get(base, "/data/plugin/profile/runs")
        ours = [t for t in found["scalar_tags"] if t.startswith(OUR_TAG_PREFIXES)]
        if (ours and found["profile_runs"]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for run in found["profile_runs"]:
        query = urllib.parse.urlencode({"run": run})
        found["profile_tools"][run] = _get(base, f"/data/plugin/profile/run_tools?{query}")
    found["ok"] = bool([t for t in found["scalar_tags"] if t.startswith(OUR_TAG_PREFIXES)]
                       and found["profile_runs"])
    return found


def screenshot(base, path, width=1280, height=800, wait_ms=20000):
    """Saves the Profile tab as a PNG with headless Chromium."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise RuntimeError("--screenshot needs Chromium: apt-get install -y chromium")
    profile = tempfile.mkdtemp(prefix="kg_chromium_")
    try:
        subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
             "--hide-scrollbars", f"--window-size={width},{height}",
             f"--virtual-time-budget={wait_ms}", f"--screenshot={os.path.abspath(path)}",
             f"{base}/#profile"],
            check=True, capture_output=True, timeout=180,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return os.path.getsize(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/tb_demo",
                        help="log dir to serve; a demo run is written when it has no events")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--screenshot", help="save the Profile tab as this PNG (Chromium)")
    parser.add_argument("--keep-serving", action="store_true",
                        help="leave TensorBoard running until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)

    from keras_gpufix.output import import_tensorflow_quietly

    import_tensorflow_quietly()  # TensorFlow's and XProf's C++ log lines hidden
    os.makedirs(args.logdir, exist_ok=True)
    if not glob.glob(os.path.join(args.logdir, "**", "events.out.tfevents.*"), recursive=True):
        print(f"Writing a demo run into {args.logdir} ...", flush=True)
        write_demo_logs(args.logdir)
    process, base = start_tensorboard(args.logdir, args.port or _free_port())
    try:
        result = check(base)
        result["url"] = base
        if args.screenshot:
            os.makedirs(os.path.dirname(os.path.abspath(args.screenshot)), exist_ok=True)
            result["screenshot_bytes"] = screenshot(base, args.screenshot)
        if args.keep_serving:
            print(f"TensorBoard at {base} (Ctrl-C to stop)", flush=True)
            process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"TensorBoard {result['url']}: plugins {result['plugins']}")
        print(f"scalar runs {result['scalar_runs']}")
        print("our scalar tags: "
              + ", ".join(t for t in result["scalar_tags"] if t.startswith(OUR_TAG_PREFIXES)))
        for run, tools in result["profile_tools"].items():
            print(f"profile run {run}: tools {tools}")
        print("OK" if result["ok"] else "MISSING: scalars or profile run not served")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
