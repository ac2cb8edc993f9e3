"""The data path's checks that need no TensorFlow: `build`'s arguments and
whether a cache folder can be written. `keras-gpufix validate` runs them
without importing TensorFlow; `BucketPlan`, `SpeechDatasetBuilder.build` and
`FeatureCache` run the same ones."""

import os
import tempfile

import numpy as np

__all__ = ["check_batching", "check_build_args", "nearest_existing", "writable_problem"]


def check_batching(batch_size, batch_frames=None, batch_multiple=None):
    """Raises the `ValueError` that these batching arguments deserve, if any."""
    for name, value in (("batch_size", batch_size), ("batch_frames", batch_frames),
                        ("batch_multiple", batch_multiple)):
        if value is not None and (not isinstance(value, (int, np.integer))
                                  or isinstance(value, bool) or value < 1):
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    if batch_size is None and batch_frames is None:
        raise ValueError("Pass `batch_size`, `batch_frames` or both. Received: "
                         "batch_size=None, batch_frames=None")
    if batch_multiple is not None and batch_frames is None:
        raise ValueError("`batch_multiple` rounds the batch sizes that `batch_frames` "
                         f"chooses. Received: batch_multiple={batch_multiple}, "
                         "batch_frames=None")


def check_build_args(batch_size=None, num_buckets=8, service=None, batch_frames=None,
                     batch_multiple=None) -> None:
    """Raises the `ValueError` that these `build` arguments deserve, if
    any, without a corpus (`kg.load_config` checks a config's `build`)."""
    check_batching(batch_size, batch_frames, batch_multiple)
    if (not isinstance(num_buckets, (int, np.integer)) or isinstance(num_buckets, bool)
            or num_buckets < 1):
        raise ValueError(f"`num_buckets` must be an integer >= 1. Received: num_buckets={num_buckets!r}")
    if service is not None and not str(service).startswith(("grpc://", "grpc+local://")):
        raise ValueError(f'`service` must be "grpc://host:port". Received: service={service!r}')


def nearest_existing(path) -> str:
    """`path` made absolute, or its nearest existing ancestor."""
    probe = os.path.abspath(os.fspath(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def writable_problem(path) -> "str | None":
    """None when a cache folder can be created at `path`, else why not.

    The nearest existing folder on the path is probed with a real write
    (a read-only mount passes `os.access` but fails the write).
    """
    probe = nearest_existing(path)
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".kg-write-test-"):
            pass
    except OSError as exc:
        return f"cannot write in {probe}: {exc.strerror or exc}"
    return None
