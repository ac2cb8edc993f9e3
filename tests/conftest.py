"""Shared test setup: no test hands its XLA compile cache to the next ones."""

import os

import pytest


@pytest.fixture(autouse=True)
def _compile_cache_flag_stays_in_its_test():
    """`kg.from_config` and `CompileCache.enable` set `TF_XLA_FLAGS` when
    TensorFlow has not started yet; it is restored after each test, so later
    tests' subprocesses do not inherit a compile cache folder."""
    before = os.environ.get("TF_XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("TF_XLA_FLAGS", None)
    else:
        os.environ["TF_XLA_FLAGS"] = before
