"""`keras-gpufix data-service` and the builder's epochs through the service.

The dispatcher and the worker run as `keras-gpufix data-service` processes
on loopback ports picked free; each is stopped by its own PID (SIGTERM, as
Ctrl-C would) and must exit cleanly.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import keras_gpufix as kg
from keras_gpufix.cli import main
from keras_gpufix.data.synthetic import make_synthetic_corpus
from keras_gpufix.data_service import EXPOSURE_DOC, DataServiceServer
from test_distribute import _env, _free_port


def _start(*args):
    return subprocess.Popen([sys.executable, "-m", "keras_gpufix", "data-service", *args],
                            env=_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, text, timeout=120):
    """Reads the process's output until a line has `text`; returns the lines."""
    lines, found = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if text in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout):
        raise AssertionError(f"no {text!r} from {proc.args}: {''.join(lines)[-2000:]}")
    return lines


def _epoch(dataset):
    """The batches of one epoch as tuples of utterance ids."""
    return [tuple(i.decode() for i in batch["id"].numpy()) for batch in dataset]


def test_builder_defaults_through_the_service_cover_each_epoch_and_reshuffle(tmp_path):
    corpus = make_synthetic_corpus(tmp_path / "corpus", 30, min_seconds=0.2, max_seconds=1.0)
    port = _free_port()
    procs = []
    try:
        procs.append(_start("dispatcher", "--port", str(port)))
        dispatcher_out = _wait_for(procs[0], "serving")
        procs.append(_start("worker", "--port", str(_free_port()),
                            "--dispatcher", f"127.0.0.1:{port}"))
        worker_out = _wait_for(procs[1], "serving")
        builder = kg.data.SpeechDatasetBuilder(corpus, verbose=0)
        dataset = builder.build(batch_size=4, num_buckets=3, as_dict=True,
                                service=f"grpc://127.0.0.1:{port}")
        epochs = [_epoch(dataset) for _ in range(3)]
        for proc in procs:
            os.kill(proc.pid, signal.SIGTERM)
        codes = [proc.wait(timeout=30) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    expected = sorted(u.id for u in builder.utterances)
    for batches in epochs:
        ids = [i for batch in batches for i in batch]
        assert sorted(ids) == expected  # each id once per epoch
        assert len(batches) == builder.report["batches_per_epoch"]
    groups = [{frozenset(batch) for batch in batches} for batches in epochs]
    assert groups[0] != groups[1] != groups[2]  # new bucket members every epoch
    assert codes == [0, 0]
    time.sleep(0.2)  # the reader threads take the last lines
    assert "dispatcher stopped" in "".join(dispatcher_out)
    assert "worker stopped" in "".join(worker_out)


def test_serve_forever_stops_on_stop_from_another_thread(capsys):
    server = DataServiceServer("dispatcher")
    assert re.fullmatch(r"grpc://localhost:\d+", server.start().target)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    server.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "dispatcher stopped" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({"role": "trainer"}, "Received: role='trainer'"),
    ({"role": "worker"}, "needs the dispatcher's address"),
    ({"role": "dispatcher", "port": 70000}, "Received: port=70000"),
    ({"role": "dispatcher", "dispatcher": "localhost:1"}, "are for a worker"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DataServiceServer(**kwargs)


def test_cli_names_a_worker_without_dispatcher(capsys):
    assert main(["data-service", "worker"]) == 2
    assert "needs the dispatcher's address" in capsys.readouterr().err



def test_cli_dispatcher_warns_that_its_port_is_open_to_every_interface():
    port = _free_port()
    proc = _start("dispatcher", "--port", str(port))
    try:
        lines = _wait_for(proc, "WARNING")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    warning = next(line for line in lines if "WARNING" in line)
    assert f"listens on port {port} of every network interface" in warning
    assert "no authentication" in warning and EXPOSURE_DOC in warning


def test_port_help_names_the_exposure_section(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # argparse would wrap the link at its hyphens
    assert main(["data-service", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "every network interface and without authentication" in help_text
    assert EXPOSURE_DOC in help_text


def test_a_worker_on_a_free_port_names_the_port_it_got(capsys):
    dispatcher = DataServiceServer("dispatcher").start()
    worker = DataServiceServer("worker", dispatcher=dispatcher.target).start()
    try:
        ports = [dispatcher.bound_port, worker.bound_port]
        assert all(isinstance(port, int) and port > 0 for port in ports)
        warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
        assert len(warnings) == 2
        assert f"this dispatcher listens on port {ports[0]} " in warnings[0]
        assert f"this worker listens on port {ports[1]} " in warnings[1]
    finally:
        worker.stop()
        dispatcher.stop()
