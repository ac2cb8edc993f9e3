"""The tf.data service as one command: `keras-gpufix data-service`.

The tf.data service moves input preprocessing (decoding, features,
padding, bucketing) to other processes or machines: a *dispatcher* hands
out work, *workers* run the input pipeline, the training process reads the
batches (`SpeechDatasetBuilder.build(service="grpc://host:port")`).
`DataServiceServer` starts one dispatcher or one worker in this process
(TensorFlow's own `DispatchServer` / `WorkerServer`) and `serve_forever`
keeps it up until Ctrl-C or SIGTERM, then stops it and returns:

```
keras-gpufix data-service dispatcher --port 5050
keras-gpufix data-service worker --port 5051 --dispatcher localhost:5050
```

Workers read the corpus (or the feature cache) at the paths the trainer's
builder names, so they must see the same files.

TensorFlow's servers listen on every network interface and have no
authentication: TensorFlow 2.21 binds `0.0.0.0:<port>` (dual-stack, every
IPv4 and IPv6 address) with insecure gRPC credentials and offers no bind
address. Each server says so once when it starts (`EXPOSURE_DOC` is the
docs section on restricting it).

`service_epochs` is the trainer's side: each epoch (each new iterator) draws
a seed on the trainer, builds that epoch's pipeline from it and runs it on
the service with `processing_mode="distributed_epoch"` (every batch
produced once per epoch, by one worker). The pipeline on the workers has no
random op (with one, TF 2.21 silently stops splitting the epoch between
workers: each produces all of it), so the per-epoch draw is registered as
a new dataset every epoch.
"""

import signal
import threading
import warnings

from keras_gpufix.keras_internals import worker_server_port
from keras_gpufix.output import emit

__all__ = ["DataServiceServer", "add_parser", "run_from_args", "service_epochs"]

ROLES = ("dispatcher", "worker")
EXPOSURE_DOC = "docs/distributed.md#who-can-reach-the-data-service"


class DataServiceServer:
    """One tf.data service dispatcher or worker, in this process.

    Args:
        role: `"dispatcher"` or `"worker"`.
        port: the port to listen on; 0 picks a free one. Defaults to 0.
        dispatcher: `"host:port"` of the dispatcher, required for a worker.
            Defaults to None.
        worker_address: `"host:port"` under which trainers reach this worker
            (a worker only). Defaults to None (`localhost:<port>`, for one
            machine).
        work_dir: a dispatcher's folder for its journal, so that a restarted
            dispatcher resumes its jobs. Defaults to None.
        verbose: 1 prints, when started, one line saying that the server
            listens on every interface without authentication (TensorFlow
            offers no bind address), then one line when serving and one
            when stopped. Defaults to 1.

    Raises:
        ValueError: for an unknown `role`, a port out of range, a worker
            without `dispatcher`, or `dispatcher`/`worker_address` given to
            a dispatcher.

    Example:

    >>> server = DataServiceServer("dispatcher", port=5050)
    >>> server.start().target
    'grpc://localhost:5050'
    >>> server.serve_forever()  # until Ctrl-C or SIGTERM
    """

    def __init__(self, role, port=0, dispatcher=None, worker_address=None, work_dir=None,
                 verbose=1):
        if role not in ROLES:
            raise ValueError(f"`role` must be 'dispatcher' or 'worker'. Received: role={role!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"`port` must be an int in 0..65535 (0: any free port). "
                             f"Received: port={port!r}")
        if role == "worker" and not dispatcher:
            raise ValueError("A worker needs the dispatcher's address: "
                             "`dispatcher='host:port'`. Received: dispatcher=None")
        if role == "dispatcher" and (dispatcher or worker_address):
            raise ValueError("`dispatcher` and `worker_address` are for a worker. Received: "
                             f"dispatcher={dispatcher!r}, worker_address={worker_address!r}")
        if dispatcher is not None:
            dispatcher = str(dispatcher).split("://", 1)[-1]
        self.role = role
        self.port = port
        self.dispatcher = dispatcher
        self.worker_address = worker_address
        self.work_dir = work_dir
        self.verbose = verbose
        self._server = None
        self._serving = False
        self._stop = threading.Event()

    def start(self) -> "DataServiceServer":
        """Starts the server (once); returns self."""
        if self._server is not None:
            return self
        import tensorflow as tf

        service = tf.data.experimental.service
        if self.role == "dispatcher":
            self._server = service.DispatchServer(service.DispatcherConfig(
                port=self.port, work_dir=self.work_dir,
                fault_tolerant_mode=self.work_dir is not None))
        else:
            self._server = service.WorkerServer(service.WorkerConfig(
                dispatcher_address=self.dispatcher, port=self.port,
                worker_address=self.worker_address))
        emit(f"keras-gpufix data-service: WARNING: this {self.role} listens on port "
             f"{self._port_label()} of every network interface (0.0.0.0 and ::) "
             f"with no authentication: {_EXPOSED[self.role]}, as this user. TensorFlow "
             "cannot bind one address: keep the port on a private network, behind a "
             f"firewall rule, or in a container network (see {EXPOSURE_DOC}).", self.verbose)
        return self

    @property
    def bound_port(self) -> "int | None":
        """The port a started server listens on (the free one picked for
        `port=0`); None when TensorFlow no longer tells a worker's."""
        if self.role == "dispatcher":
            return int(self.target.rsplit(":", 1)[1])
        return worker_server_port(self.start()._server)

    @property
    def target(self) -> str:
        """`grpc://localhost:<port>` of a started dispatcher (what
        `build(service=...)` takes on this machine); for a worker, the
        dispatcher it serves."""
        if self.role == "dispatcher":
            return self.start()._server.target
        return f"grpc://{self.dispatcher}"

    def serve_forever(self) -> None:
        """Starts the server and blocks until Ctrl-C (SIGINT) or SIGTERM, or
        until `stop()` from another thread; then stops the server.
        Call it once.

        Signals can only be caught in the main thread; elsewhere only
        `stop()` ends it.
        """
        self.start()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, lambda *_: self._stop.set())
        emit(f"keras-gpufix data-service: {self._describe()}; Ctrl-C or SIGTERM stops it.",
             self.verbose)
        self._serving = True
        try:
            while not self._stop.wait(0.2):
                pass
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self._serving = False
            self._stop_server()

    def stop(self) -> None:
        """Stops the server; ends `serve_forever` (from another thread)."""
        self._stop.set()
        if not self._serving:
            self._stop_server()

    def _stop_server(self):
        if self._server is not None:
            self._server.stop()
            self._server = None
            emit(f"keras-gpufix data-service: {self.role} stopped.", self.verbose)

    def _describe(self):
        if self.role == "dispatcher":
            return f"dispatcher serving at {self.target}"
        return f"worker on port {self._port_label()} serving dispatcher {self.dispatcher}"

    def _port_label(self):
        return self.bound_port or "(unknown)"


_EXPOSED = {
    "dispatcher": "anyone who reaches it can register a dataset graph that the workers "
                  "run on their hosts (reading files there)",
    "worker": "anyone who reaches it can send it a task (a dataset graph it runs on this "
              "host, reading files here) and read the batches it produces",
}


def service_epochs(make_epoch, service, seed=None):
    """Per-epoch draws run on the tf.data service.

    Args:
        make_epoch: `seed -> tf.data.Dataset`, one epoch's pipeline from a
            scalar int64 seed tensor, with no random op in it.
        service: `"grpc://host:port"` of the dispatcher.
        seed: seed of the per-epoch draws. Defaults to None (new each run).

    Returns:
        A `tf.data.Dataset`: each iteration draws a seed on this process
        and reads that epoch from the service's workers
        (`distributed_epoch`: each element produced once).
    """
    import tensorflow as tf

    distribute = tf.data.experimental.service.distribute(
        processing_mode="distributed_epoch", service=service)

    def epoch(value):
        return make_epoch(value).apply(distribute)

    draws = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1)
    with warnings.catch_warnings():
        # `distribute` reads the dataset's options, which TF warns about
        # inside a traced function; the options are the pipeline's own.
        warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")
        return draws.flat_map(epoch)


def add_parser(sub):
    """Adds the `data-service` subcommand to the CLI's subparsers."""
    p = sub.add_parser("data-service",
                       help="run a tf.data service dispatcher or worker until Ctrl-C")
    p.set_defaults(subparser=p)
    p.add_argument("role", choices=ROLES,
                   help="dispatcher (hands out the work) or worker (runs the input pipeline)")
    p.add_argument("--port", type=int, default=0,
                   help="port to listen on, on every network interface and without "
                        "authentication (TensorFlow binds no single address; "
                        f"restrict it as {EXPOSURE_DOC} says) (default: any free)")
    p.add_argument("--dispatcher", metavar="HOST:PORT", help="worker: the dispatcher's address")
    p.add_argument("--worker-address", metavar="HOST:PORT",
                   help="worker: the address trainers reach it at (default localhost:PORT)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="dispatcher: journal folder, so a restart resumes its jobs")
    return p


def run_from_args(args, sub) -> int:
    """The `data-service` subcommand: serves until Ctrl-C or SIGTERM."""
    try:
        server = DataServiceServer(args.role, port=args.port, dispatcher=args.dispatcher,
                                   worker_address=args.worker_address, work_dir=args.work_dir)
    except ValueError as exc:
        sub.error(str(exc))
    server.serve_forever()
    return 0
