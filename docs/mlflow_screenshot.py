"""Shoots the MLflow UI's page of a run keras_gpufix logged to: docs/img/mlflow_run.png.

MLflow's UI comes with the full `mlflow` package (not `mlflow-skinny`, the extra's
client); headless Chromium as in docs/report_screenshot.py.

    python docs/trackers_example.py --dir /tmp/kg_trackers    # the runs
    python docs/mlflow_screenshot.py /tmp/kg_trackers/mlruns RUN_ID [--mlflow /path/to/mlflow]

Starts `mlflow server` on the store (127.0.0.1 only), opens the run's page, writes
the screenshot and prints its path; the server is stopped after.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_screenshot import HERE, headless  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"mlflow server did not listen on port {port} in {seconds} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", help="the MLflow file store (a folder)")
    parser.add_argument("run_id", help="the run to show")
    parser.add_argument("--mlflow", default=shutil.which("mlflow"),
                        help="the `mlflow` command of a full MLflow install")
    parser.add_argument("--page", default="",
                        help="the run page's part, e.g. artifacts/keras_gpufix/report.html "
                             "(default: its overview)")
    parser.add_argument("--out", default=os.path.join(HERE, "img", "mlflow_run.png"))
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds the page's scripts get to draw it")
    args = parser.parse_args(argv)
    port = _free_port()
    env = dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true")
    server = subprocess.Popen([args.mlflow, "server", "--host", "127.0.0.1", "--port",
                               str(port), "--backend-store-uri",
                               f"file:{os.path.abspath(args.store)}"], env=env)
    try:
        _wait_for(port)
        with headless(width=1400, height=1300) as driver:
            driver.get(f"http://127.0.0.1:{port}/#/experiments/0/runs/{args.run_id}/"
                       + args.page)
            time.sleep(args.settle)
            driver.save_screenshot(args.out)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
