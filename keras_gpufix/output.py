"""One output channel for every user-facing line keras_gpufix prints.

Monitors, the dataset builder, the cache and the CLI report through `emit`,
which follows Keras's own rule (`keras.src.utils.io_utils.print_msg`): with
interactive logging on (the default) a line goes to standard output; after
`keras.config.disable_interactive_logging()` it goes to the `keras_gpufix`
logger instead, as Keras's progress lines go to absl logging. `verbose=0`
silences it. Problems the user should act on are warnings
(`GpufixWarning`), not lines from here.
"""

import logging
import os
import re
import sys
import tempfile

from keras_gpufix.backends import tensorflow_missing

__all__ = ["emit", "faster", "progress", "import_tensorflow_quietly", "write_text_atomically"]

logger = logging.getLogger("keras_gpufix")


def _interactive():
    keras = sys.modules.get("keras")
    if keras is None:  # never import Keras just to print a line
        return True
    try:
        return bool(keras.config.is_interactive_logging_enabled())
    except AttributeError:  # a Keras without the switch
        return True


_TF_LOG_LINE = re.compile(r"^([IWEF]\d{4} |WARNING: All log messages before absl)")
_hidden = False  # whether import_tensorflow_quietly imported TensorFlow


def import_tensorflow_quietly() -> bool:
    """Imports TensorFlow with its own log lines hidden, so that our output
    is what is left (every `keras-gpufix` command,
    `examples/tensorboard_snapshot.py`).

    Sets `TF_CPP_MIN_LOG_LEVEL=2` for the run (a caller may set 3 first, to
    hide TensorFlow's errors too). TensorFlow 2.21 writes its
    import-time `I0000`/`W0000`/`E0000` lines before it reads that, so
    those are filtered from stderr (at the file-descriptor level) while it
    loads and probes its devices; every other line is passed on. Nothing is
    hidden when TensorFlow is already imported or the user set another
    level (`TF_CPP_MIN_LOG_LEVEL=0` shows them all).

    Returns:
        True when the lines were hidden, by this call or an earlier one
        (say how to see them).
    """
    global _hidden
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL") not in (None, "2",
                                                                                     "3"):
        return _hidden
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
        except ModuleNotFoundError as exc:  # JAX or torch without TensorFlow: nothing to hide
            if not tensorflow_missing(exc):
                raise
            return _hidden
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        for line in captured:
            if not _TF_LOG_LINE.match(line):
                sys.stderr.write(line)
    _hidden = True
    return True


def emit(message: str, verbose: int = 1) -> None:
    """Prints one user-facing line (or block) unless `verbose` is 0.

    Args:
        message: the text, without a trailing newline.
        verbose: 0 prints nothing; anything else prints. Defaults to 1.
    """
    if not verbose:
        return
    if _interactive():
        sys.stdout.write(f"{message}\n")
        sys.stdout.flush()
    else:
        logger.info(message)


def progress(target: "int | None", unit_name: str = "step", verbose: int = 1):
    """A progress bar that is clean in log files.

    On an interactive terminal it is Keras's `Progbar`, created at the
    first update so its first frame shows no estimate made from start-up
    time (a 1.5 s job once showed "1:37 remaining"). Elsewhere (a log
    file, a pipe, `verbose=0`, interactive logging off) it writes nothing
    per update: no carriage returns, no ANSI codes; say what runs with
    `emit` before and after.

    Args:
        target: the total count, or None when unknown (then the last
            update passes `finalize=True`).
        unit_name: what is counted. Defaults to "step".
        verbose: 0 shows nothing. Defaults to 1.

    Returns:
        A function `update(current, finalize=None)`.
    """
    bar = []
    live = bool(verbose) and sys.stdout.isatty() and _interactive()

    def update(current: int, finalize: "bool | None" = None) -> None:
        if not live:
            return
        if not bar:
            import keras

            bar.append(keras.utils.Progbar(target, unit_name=unit_name, interval=0.5))
        bar[0].update(current, finalize=finalize)

    return update


def faster(name_a: str, value_a: float, name_b: str, value_b: float, unit: str = "/s",
           durations: bool = False) -> str:
    """A measured ratio as a sentence that says which side is faster.

    A bare ratio ("2.65x") leaves the reader to guess its direction; this
    puts the faster side first, so the ratio is always >= 1.

    Args:
        name_a, name_b: the two sides.
        value_a, value_b: their throughputs in `unit` (higher is faster),
            or their durations with `durations=True` (lower is faster).
        unit: unit printed after the values. Defaults to "/s".
        durations: the values are times. Defaults to False.

    Returns:
        E.g. "keras_gpufix is 4.20x faster than naive (630 vs 150 utterances/s)",
        "naive and keras_gpufix are equally fast (...)", or a sentence
        saying a value was not measured.
    """
    for name, value in ((name_a, value_a), (name_b, value_b)):
        if not value or value <= 0:
            return f"no ratio: {name} was not measured"
    sides = sorted([(name_a, value_a), (name_b, value_b)], key=lambda side: side[1],
                   reverse=not durations)
    (fast, fast_value), (slow, slow_value) = sides
    ratio = max(fast_value, slow_value) / min(fast_value, slow_value)
    values = f"({fast_value:.4g} vs {slow_value:.4g}{unit})"
    if round(ratio, 2) == 1.0:
        return f"{name_a} and {name_b} are equally fast {values}"
    return f"{fast} is {ratio:.2f}x faster than {slow} {values}"


def write_text_atomically(path, text):
    """Writes `text` to `path` through a temporary file in its folder and `os.replace`:
    a reader (or a run stopped halfway) never sees half a file. A file already at
    `path` keeps its mode; a new one gets the umask's. Returns `path`."""
    import shutil
    import threading

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
