import logging

import keras

from keras_gpufix.output import emit


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
