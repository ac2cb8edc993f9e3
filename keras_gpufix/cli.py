"""`keras-gpufix` command line: a thin shell over library functions.

| command                                   | library function                      |
|-------------------------------------------|---------------------------------------|
| `validate CONFIG [--fix]`                 | `config.validate_config`              |
| `diagnose [--json] [--steps N] -- CMD`    | `diagnose.run_diagnosis`              |
| `bench-data CORPUS [...]`                 | `benchdata.bench_data`                |
| `cache build|info|clear CORPUS`           | `cache_cli.cache_build/info/clear`    |
| `demo`                                    | `demo.run_demo`                       |
| `report RUN [--out FILE]`                 | `run_record.RunRecord.write_html`     |
| `compare [--json] BEFORE AFTER`           | `analysis.comparison.compare_runs`    |
| `data-service dispatcher|worker [...]`    | `data_service.DataServiceServer`      |

Each function returns a dict; `--json` prints it as one line (the last line
of stdout), otherwise it is printed for people. TensorFlow's own C++ log
lines are hidden for every command (`output.import_tensorflow_quietly`;
`TF_CPP_MIN_LOG_LEVEL=0` shows them). Exit codes: 0 success,
1 problems found (validate), 2 bad arguments or unusable input, 130
interrupted (Ctrl-C: one line, no traceback); diagnose exits with the
script's own exit code (1 when it raised, 143/130 when SIGTERM/SIGINT
stopped it), after its report.
"""

import argparse
import json
import sys
import time

from keras_gpufix import __version__, data_service, script_env
from keras_gpufix.backends import name as backend_name
from keras_gpufix.backends import tensorflow_missing
from keras_gpufix.output import import_tensorflow_quietly

__all__ = ["main", "build_parser"]


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def _int_list(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers >= 1")
    return [_positive_int(t) for t in items]


def _parallel_list(text):
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list: auto or integers >= 1")
    return [t if t == "auto" else _positive_int(t) for t in items]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-gpufix",
        description="Find why the GPU idles while model.fit trains, and fix it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check a YAML config for performance traps",
                       description="Exit 0 valid, 1 problems found, 2 unusable input.")
    p.set_defaults(subparser=p)
    p.add_argument("config", metavar="CONFIG", help="YAML config file")
    p.add_argument("--fix", action="store_true",
                   help="rewrite the file with the fixes, keys of the 0.1 format moved to "
                        "their place (backup kept beside it)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "diagnose", help="run a training script with the monitors and name the cause",
        description="Runs the script unchanged (like python -m cProfile; also -m module "
                    "or -c CODE); every model.fit and custom training loop gets the "
                    "monitors. Exits with the script's exit code (SIGTERM/SIGINT: the "
                    "report of what was measured, exit 143/130).",
        usage="%(prog)s [--json] [--steps N] [--log-dir DIR] [--trace | --no-trace] "
              "[--no-what-if] [--what-if-budget SECONDS] [--rounds N] -- python train.py ARGS")
    p.set_defaults(subparser=p)
    p.add_argument("--json", action="store_true",
                   help="print the diagnosis as one JSON line, the last line of stdout")
    p.add_argument("--steps", type=_positive_int, metavar="N",
                   help="end the script after N training steps, fits' and custom loops' in "
                        "all: the loop stops, and where the script asks to train again it "
                        "ends there (exit 0)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="where each run's TensorBoard scalars and profiler traces go "
                        "(default: a new temp folder)")
    traced = p.add_mutually_exclusive_group()
    traced.add_argument("--trace", action="store_true",
                        help="take XProf traces of every run (default: only where one shows "
                             "what the step log cannot: on a GPU)")
    traced.add_argument("--no-trace", action="store_true", help="take no XProf trace")
    p.add_argument("--no-what-if", action="store_true",
                   help="skip the what-if (input alone vs step alone, a few seconds per run) "
                        "and the patched run (the script again with the step's patch)")
    p.add_argument("--what-if-budget", type=_positive_float, metavar="SECONDS",
                   help="the most each run's what-if may take, stages included (default: "
                        "a minute, or a tenth of the run where that is longer)")
    p.add_argument("--rounds", type=_positive_int, metavar="N",
                   help="the most rounds of the reruns that measure a fix (the script as it "
                        "is and with the fix, alternated; more while the gain's range holds "
                        "1.0 or the two runs' loads differ; default: 3, and up to 8 while the "
                        "reruns so far took under 60 s)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- python train.py ARGS",
                   help="the command to run, after `--`: python train.py ARGS, python -m "
                        "module ARGS or python -c CODE ARGS")

    p = sub.add_parser("bench-data", help="input-pipeline throughput alone, over a grid")
    p.set_defaults(subparser=p)
    p.add_argument("corpus", metavar="CORPUS", help="LJSpeech-style corpus folder")
    p.add_argument("--batch-sizes", type=_int_list, default=[16, 32, 64], metavar="16,32,64",
                   help="batch sizes to try (default 16,32,64)")
    p.add_argument("--parallel", type=_parallel_list, default=["auto"], metavar="auto,1,2",
                   help="tf.data thread-pool sizes to try (auto: TensorFlow's default)")
    p.add_argument("--seconds", type=_positive_float, default=3.0, metavar="S",
                   help="measuring time per setting (default 3)")
    p.add_argument("--num-buckets", type=_positive_int, default=8, metavar="N",
                   help="length buckets of the pipeline (default 8)")
    p.add_argument("--cache-dir", metavar="DIR", help="feature cache (built first if needed)")
    p.add_argument("--config", metavar="CONFIG", help="take audio/text/cache_dir from a config")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("cache", help="build, inspect or clear the feature cache")
    p.set_defaults(subparser=p)
    p.add_argument("action", choices=("build", "info", "clear"),
                   help="build: compute the features now; info: the entry's status; clear: "
                        "remove it")
    p.add_argument("corpus", metavar="CORPUS",
                   help="LJSpeech-style corpus folder or JSON Lines manifest")
    p.add_argument("--cache-dir", metavar="DIR", help="cache folder (or data.cache_dir of --config)")
    p.add_argument("--config", metavar="CONFIG", help="take audio/text/cache_dir from a config")
    p.add_argument("--all", action="store_true", help="clear: every entry in the cache folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("demo", help="generate a small corpus, train briefly, show the diagnosis")
    p.set_defaults(subparser=p)
    p.add_argument("--dir", metavar="DIR",
                   help="work folder, kept for the next run (default: "
                        "~/.cache/keras_gpufix/demo, or under $XDG_CACHE_HOME)")
    p.add_argument("--fresh", action="store_true",
                   help="start clean: remove the corpus, feature and compile caches and logs "
                        "an earlier demo left in the work folder")
    p.add_argument("--utterances", type=_positive_int, default=96, metavar="N",
                   help="utterances to generate, 1-4 s each (default 96)")
    p.add_argument("--epochs", type=_positive_int, default=3, metavar="N",
                   help="epochs of each way; speed is measured after the first, the trace "
                        "taken in the second (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("report", help="a run's record as one self-contained HTML file",
                       description="Renders a run record (run_record.json, written by "
                                   "diagnose, the demo and GPUOscillationMonitor(log_dir=...)) "
                                   "as one HTML file: no script, nothing fetched.")
    p.set_defaults(subparser=p)
    p.add_argument("run", metavar="RUN",
                   help="a run_record.json, or a folder holding one (directly or below it)")
    p.add_argument("--out", metavar="FILE",
                   help="the HTML file (default: report.html beside the record)")

    p = sub.add_parser("compare", help="two run records: did the change do what BEFORE "
                                       "predicted",
                       description="Prints improvement, no change or regression first: the "
                                   "steady gain measured (with its range) beside the gain "
                                   "BEFORE predicted for the causes that went away.")
    p.set_defaults(subparser=p)
    p.add_argument("before", metavar="BEFORE",
                   help="the first run's record (file or folder: a W&B run folder too), or an "
                        "MLflow run (runs:/RUN_ID, through MLFLOW_TRACKING_URI)")
    p.add_argument("after", metavar="AFTER", help="the second run's record, as BEFORE")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    data_service.add_parser(sub)
    return parser


def _print_json(result):
    print(json.dumps(result, separators=(",", ":"), default=str), flush=True)


def _validate(args, sub):
    from keras_gpufix.config import validate_config

    result = validate_config(args.config, fix=args.fix)
    if args.json:
        _print_json(result)
        return result["exit_code"]
    if result["exit_code"] == 2:
        print(f"keras-gpufix validate: {result['error']}", file=sys.stderr)
        return 2
    for change in result["changes"]:
        print(f"fixed {args.config}:{change['line']}: {change['key']}: "
              f"{'(unset)' if change['before'] is None else change['before']} -> {change['after']} "
              f"({change['reason']})")
    if result["backup"]:
        print(f"wrote {args.config} (original kept as {result['backup']})")
    for problem in result["problems"]:
        print(f"problem [{problem['kind']}] {problem['message']}")
    print(f"{args.config}: " + ("valid" if not result["problems"] else
                                f"{len(result['problems'])} problem(s)"
                                + (" left that --fix cannot fix" if args.fix else "")))
    return result["exit_code"]


def _diagnose(args, sub):
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        sub.error("the script to run is required: keras-gpufix diagnose -- python train.py ARGS")
    try:
        kind, script, _ = script_env.resolve(cmd)
    except ValueError as exc:
        sub.error(str(exc))
    if kind == "script":  # before NumPy: the BLAS threads, backend and flags it sets
        script_env.apply(script)
    from keras_gpufix.diagnose import format_report, run_diagnosis

    try:
        result = run_diagnosis(cmd, steps=args.steps, log_dir=args.log_dir,
                               trace=True if args.trace else False if args.no_trace else "auto",
                               what_if=not args.no_what_if, verbose=0 if args.json else 1,
                               what_if_budget=args.what_if_budget, rounds=args.rounds)
    except ValueError as exc:
        sub.error(str(exc))
    t0 = time.perf_counter()
    result["record"], result["html_report"] = _keep(result)
    _bill_report(result, time.perf_counter() - t0)
    if args.json:
        _print_json(result)
    else:
        print("\n" + format_report(result), flush=True)
        if result["html_report"]:
            print(f"report: {result['html_report']} (run record {result['record']})",
                  flush=True)
    _track(result, verbose=0 if args.json else 1)  # after: --json's line is stdout's last
    return result["exit_code"]


def _bill_report(result, seconds):
    """Adds writing the run record and HTML report to diagnose's own `report` item."""
    from keras_gpufix.analysis import own_cost

    cost = result.get("own_cost")
    if cost:
        own = {i["item"]: i["seconds"] for i in cost["items"]}
        own["report"] += seconds
        result["own_cost"] = own_cost(own, cost["script_s"] + sum(own.values()),
                                      opted_in_trace=cost["opted_in_trace"])


def _keep(result):
    """diagnose's run record and HTML report, written in its log folder: their paths,
    or (None, None) with one line on stderr when they could not be written."""
    from keras_gpufix.run_record import RunRecord

    try:
        record = RunRecord.from_diagnosis(result)
        return record.write(result["log_dir"]), record.write_html()
    except (OSError, ValueError) as exc:
        print(f"keras-gpufix diagnose: the run record was not written ({exc})",
              file=sys.stderr, flush=True)
        return None, None


def _track(result, verbose):
    """diagnose's record and report.html, and its headline, to the tracker runs (MLflow,
    W&B) its monitors logged to (`trackers.Trackers`)."""
    from keras_gpufix.run_record import RunRecord
    from keras_gpufix.trackers import Trackers

    record = result["record"]
    Trackers.of_diagnosis(result).end(lambda: RunRecord.load(record) if record
                                      else RunRecord.from_diagnosis(result), verbose)


def _bench(args, sub):
    from keras_gpufix.benchdata import bench_data, format_bench

    try:
        result = bench_data(args.corpus, batch_sizes=args.batch_sizes, parallel=args.parallel,
                            seconds=args.seconds, num_buckets=args.num_buckets,
                            cache_dir=args.cache_dir, config=args.config,
                            verbose=0 if args.json else 1)
    except (ValueError, FileNotFoundError) as exc:
        sub.error(str(exc))
    if args.json:
        _print_json(result)
    else:
        print(format_bench(result))
    return 0


def _cache(args, sub):
    from keras_gpufix import cache_cli

    function = {"build": cache_cli.cache_build, "info": cache_cli.cache_info,
                "clear": cache_cli.cache_clear}[args.action]
    kwargs = {"all_entries": args.all} if args.action == "clear" else {}
    try:
        result = function(args.corpus, cache_dir=args.cache_dir, config=args.config,
                          verbose=0 if args.json else 1, **kwargs)
    except (ValueError, OSError) as exc:  # bad corpus, unwritable folder, disk full
        sub.error(str(exc))
    if args.json:
        _print_json(result)
    else:
        print(cache_cli.format_cache(result))
    return 0


def _demo(args, sub):
    from keras_gpufix.demo import format_demo, run_demo

    result = run_demo(workdir=args.dir, utterances=args.utterances, epochs=args.epochs,
                      verbose=0 if args.json else 1, fresh=args.fresh)
    if args.json:
        _print_json(result)
    else:
        print("\n" + format_demo(result))
    return 0


def _report(args, sub):
    from keras_gpufix.run_record import RunRecord

    try:
        record = RunRecord.load(args.run)
        path = record.write_html(args.out)
    except (ValueError, OSError) as exc:
        sub.error(str(exc))
    print(path)
    return 0


def _compare(args, sub):
    from keras_gpufix.analysis.comparison import compare_runs, format_comparison
    from keras_gpufix.trackers import load_record

    try:
        before, after = load_record(args.before), load_record(args.after)
    except (ValueError, OSError, ImportError) as exc:
        sub.error(str(exc))
    result = compare_runs(before.data, after.data)
    if args.json:
        _print_json({**result, "before_record": before.path, "after_record": after.path})
    else:
        print(format_comparison(result, before.path, after.path))
    return 0


def main(argv=None) -> int:
    """Runs the CLI; returns the exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a bad argument (2)
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help()
        return 2
    sub = args.subparser
    # TensorFlow's log lines would bury our one-line answers (the demo turns its compile
    # cache on before TensorFlow starts; validate imports it, quietly, only for a config's
    # corpus or device list; diagnose, once it read the script's backend; other backends
    # need no TensorFlow)
    if (args.command not in ("demo", "report", "compare", "validate", "diagnose")
            and backend_name() == "tensorflow"):
        import_tensorflow_quietly()
    handler = {"validate": _validate, "diagnose": _diagnose, "bench-data": _bench,
               "cache": _cache, "demo": _demo, "report": _report, "compare": _compare,
               "data-service": data_service.run_from_args}[args.command]
    try:
        return handler(args, sub)
    except SystemExit as exc:  # argparse errors (exit 2) from inside a handler
        return exc.code if isinstance(exc.code, int) else 2
    except ModuleNotFoundError as exc:
        if not tensorflow_missing(exc):
            raise
        why = ("the script's Keras backend is tensorflow; a JAX script is diagnosed without "
               "it: KERAS_BACKEND=jax" if args.command == "diagnose"
               else "its data pipeline is tf.data")
        if args.command == "validate":  # what needs it: the builder, the device names
            why = ("this config's data.corpus is checked by the tf.data builder, "
                   "strategy.devices by tf.distribute")
        print(f"keras-gpufix {args.command}: needs TensorFlow ({why}), "
              f"which is not installed here (the Keras {backend_name()} backend): "
              "pip install tensorflow. Without it the callbacks and kg.watch still monitor "
              "training (docs/backends.md)", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("keras-gpufix: interrupted" + ("; nothing half-written: the cache entry was not "
                                             "committed" if args.command == "cache" else ""),
              file=sys.stderr, flush=True)
        return 130
