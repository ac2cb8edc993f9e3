"""`EventWriter`: TensorBoard scalars and text without TensorFlow.

Writes the event files TensorBoard reads (`events.out.tfevents.*`, one
`Event` proto per record with its CRC) with the `tensorboard` package's
protos and record writer only; the Scalars and Text tabs show them, each
with its description. Used on every Keras backend but TensorFlow.
"""

import itertools
import os
import socket
import time

from keras_gpufix.backends.base import NotSupported

__all__ = ["EventWriter"]

_IDS = itertools.count()  # two writers of one folder in one second get two files


class EventWriter:
    """One event file under `path`; `write(tag, value, step, description)`.

    Raises:
        NotSupported: the `tensorboard` package is not installed.
    """

    def __init__(self, path):
        try:
            from tensorboard.compat.proto import event_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            raise NotSupported("keras_gpufix: TensorBoard scalars need the `tensorboard` "
                               f"package (`pip install tensorboard`); nothing is written to "
                               f"{path}") from None
        self._event_pb2 = event_pb2
        os.makedirs(path, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_IDS)}.keras_gpufix")
        self._file = open(os.path.join(path, name), "wb")
        self._records = RecordWriter(self._file)
        self._emit(self._event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _emit(self, event):
        self._records.write(event.SerializeToString())

    def write(self, tag, value, step, description):
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.scalar import metadata as scalar_metadata
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.util import tensor_util

        if isinstance(value, str):
            metadata = text_metadata.create_summary_metadata(tag, description)
        else:
            metadata = scalar_metadata.create_summary_metadata(tag, description)
            value = float(value)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(
            tag=tag, metadata=metadata, tensor=tensor_util.make_tensor_proto(value))])
        self._emit(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                         summary=summary))

    def flush(self):
        self._records.flush()

    def close(self):
        self._records.close()
