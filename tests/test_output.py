import io
import logging

import keras

from keras_gpufix.output import emit, faster, progress


def test_emit_prints_unless_silent(capsys):
    emit("hello", verbose=1)
    emit("hidden", verbose=0)
    assert capsys.readouterr().out == "hello\n"


def test_emit_follows_keras_interactive_logging(capsys, caplog):
    keras.config.disable_interactive_logging()
    try:
        with caplog.at_level(logging.INFO, logger="keras_gpufix"):
            emit("to the log")
    finally:
        keras.config.enable_interactive_logging()
    assert capsys.readouterr().out == ""
    assert "to the log" in caplog.text


def test_faster_names_the_faster_side_first_whatever_the_order():
    assert faster("keras_gpufix", 600.0, "naive", 150.0, " utt/s") == (
        "keras_gpufix is 4.00x faster than naive (600 vs 150 utt/s)")
    assert faster("keras_gpufix", 100.0, "naive", 265.0) == (
        "naive is 2.65x faster than keras_gpufix (265 vs 100/s)")
    assert faster("a", 100.0, "b", 100.4).startswith("a and b are equally fast")
    assert faster("a", None, "b", 3.0) == "no ratio: a was not measured"
    assert faster("keras_gpufix", 15.8, "naive", 9.9, " s", durations=True) == (
        "naive is 1.60x faster than keras_gpufix (9.9 vs 15.8 s)")


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_progress_writes_nothing_per_update_into_a_log_file(monkeypatch):
    stream = _Stream(tty=False)
    monkeypatch.setattr("sys.stdout", stream)
    update = progress(50, "utterance")
    for i in range(1, 51):
        update(i)
    assert stream.getvalue() == ""


def test_progress_on_a_terminal_is_a_progbar_whose_first_frame_has_no_startup_estimate(
        monkeypatch):
    import time

    stream = _Stream(tty=True)
    monkeypatch.setattr("sys.stdout", stream)
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    update = progress(100, "utterance")
    clock[0] += 97.0  # start-up (pipeline, tracing) before the first utterance is done
    update(1)
    first = stream.getvalue()
    assert "1/100" in first and "utterance" in first
    assert "1:3" not in first and "97" not in first  # no ETA made from the start-up time
    clock[0] += 1.0
    update(100)
    assert "100/100" in stream.getvalue()
    silent = _Stream(tty=True)
    monkeypatch.setattr("sys.stdout", silent)
    progress(3, "utterance", verbose=0)(3)
    assert silent.getvalue() == ""
