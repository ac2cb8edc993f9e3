"""TensorBoard (and the standalone XProf server) serve our traces and scalars.

Each server runs in a subprocess on 127.0.0.1 and a free port, is polled
with a bounded timeout, queried through its HTTP data APIs, then killed.
"""

import contextlib
import gzip
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

import keras_gpufix as kg
from planted import planted_dataset, tiny_model

STARTUP_S = 90


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port, path, **params):
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}{query}", timeout=30) as r:
        body = r.read()
        if r.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return json.loads(body.decode("utf-8"))


@contextlib.contextmanager
def serving(args, port, ready_path, log_path):
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{args[2]} exited with {proc.returncode}: "
                            f"{open(log_path, 'rb').read()[-2000:]!r}")
            try:
                get_json(port, ready_path)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"{args[2]} did not answer within {STARTUP_S} s: "
                                f"{open(log_path, 'rb').read()[-2000:]!r}")
                time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One fit writing StepTimer scalars and a ProfilerTrigger trace to one log dir."""
    log_dir = tmp_path_factory.mktemp("tb")
    timer = kg.StepTimer(log_dir=str(log_dir))
    trigger = kg.ProfilerTrigger(str(log_dir), trigger=3, steps=5, verbose=0)
    tiny_model().fit(planted_dataset("slow", batches=16, sleep=0.01), epochs=1, verbose=0,
                     callbacks=[timer, trigger])
    (trace,) = trigger.traces
    return log_dir, os.path.basename(trace["path"]), trace


def test_tensorboard_lists_our_trace_and_scalars(logged_run, tmp_path):
    pytest.importorskip("tensorboard")
    log_dir, run, trace = logged_run
    port = free_port()
    args = [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir),
            "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"]
    with serving(args, port, "/data/plugins_listing", tmp_path / "tensorboard.log"):
        plugins = get_json(port, "/data/plugins_listing")
        assert plugins["profile"]["enabled"]
        assert run in get_json(port, "/data/plugin/profile/runs")
        tools = get_json(port, "/data/plugin/profile/run_tools", run=run)
        assert "input_pipeline_analyzer" in tools and "trace_viewer@" in tools
        tags = get_json(port, "/data/plugin/scalars/tags")
        assert "step_timer/step_ms" in tags["keras_gpufix"]
        points = get_json(port, "/data/plugin/scalars/scalars", run="keras_gpufix",
                          tag="step_timer/step_ms")
        assert [p[1] for p in points] == list(range(16))  # one point per step
        assert all(p[2] > 0 for p in points)
        # The Profile tab's input-pipeline page shows the step times we marked.
        host = os.path.basename(trace["analysis"]["files"][0])[:-len(".xplane.pb")]
        tables = get_json(port, "/data/plugin/profile/data", run=run,
                          tag="input_pipeline_analyzer", host=host)
        steps = next(t for t in tables if t.get("rows") and "steptime_ms_average" in t["p"])
        assert len(steps["rows"]) == trace["analysis"]["steps"]
        assert float(steps["p"]["steptime_ms_average"]) > 0


def test_the_standalone_xprof_server_lists_our_trace(logged_run, tmp_path):
    log_dir, run, _ = logged_run
    port = free_port()
    args = [sys.executable, "-m", "xprof.server", "--logdir", str(log_dir),
            "--port", str(port), "--grpc_port", str(free_port())]
    with serving(args, port, "/data/plugin/profile/runs", tmp_path / "xprof.log"):
        assert run in get_json(port, "/data/plugin/profile/runs")
        assert "input_pipeline_analyzer" in get_json(
            port, "/data/plugin/profile/run_tools", run=run)


def test_profiling_docs_offline_note_holds_for_the_installed_xprof():
    """docs/profiling.md: the Profile charts load Google's chart library from the
    web (blank offline); the trace viewer ships its own code (works offline)."""
    xprof = pytest.importorskip("xprof")
    static = os.path.join(os.path.dirname(xprof.__file__), "static")
    with open(os.path.join(static, "index.html"), encoding="utf-8") as f:
        page = f.read()
    with open(os.path.join(static, "trace_viewer_index.html"), encoding="utf-8") as f:
        trace_viewer = f.read()
    docs_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "docs", "profiling.md")
    with open(docs_path, encoding="utf-8") as f:
        docs = " ".join(f.read().split())
    assert "loadChart('www.gstatic.com')" in page and "www.gstatic.cn" in page
    assert "gstatic" not in trace_viewer and 'src="http' not in trace_viewer  # links only
    assert "Without internet the Profile charts are blank." in docs
    assert "https://www.gstatic.com/charts/loader.js" in docs
    assert f"xprof {importlib.metadata.version('xprof')}" in docs  # the version it was checked in
    assert "the trace viewer (`trace_viewer@`), which ships its own code" in docs
