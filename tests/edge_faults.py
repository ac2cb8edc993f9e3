"""Real faults at the edges, for tests: a tiny disk that fills up (a
tmpfs), a read-only folder; and `TF_LOG_LINE`, TensorFlow's own C++/absl log
lines (tests check that our one-line messages are all that is left).

A tmpfs needs root (the test is skipped without it); a read-only folder is
a read-only bind mount for root (who may write through `chmod 555`) and
`chmod 555` for anyone else.
"""

import contextlib
import os
import re
import subprocess

import pytest

__all__ = ["TF_LOG_LINE", "tmpfs", "read_only_folder"]

# I0000 ..., W0000 ..., E0000 ...: printed at TensorFlow's import whatever
# TF_CPP_MIN_LOG_LEVEL says, and later unless it hides them
TF_LOG_LINE = re.compile(r"^([IWEF]\d{4} |WARNING: All log messages before absl)")


def _mount(*args):
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


@contextlib.contextmanager
def tmpfs(path, size_bytes):
    """A tmpfs of `size_bytes` mounted at `path` (created) for the block."""
    os.makedirs(path, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path))
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only_folder(path):
    """`path` (created) read-only for this process for the block."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield str(path)
        finally:
            os.chmod(path, 0o755)
        return
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,ro,bind", str(path))
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
