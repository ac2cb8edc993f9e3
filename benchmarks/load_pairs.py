"""Two runs judged fairly: `compare` and diagnose's reruns beside a CPU burner.

    python benchmarks/load_pairs.py [--pairs eager plot map] [--steps N] [--diagnose]
                                    [--repeats N] [--truth PAIR=GAIN ...] [--out PATH]
    (about 4 min a pair for compare on 2 cores at load 3; --diagnose adds about 3 min
    a diagnose run, two a pair)

Held-out pairs, each a script and its fixed twin (written to a temp folder, no
project script reused), each run under `GPUOscillationMonitor(log_dir=...)`, which
leaves its run record:
- `eager`: a custom loop whose GradientTape step (1024-wide layers, batches of
  512) runs eagerly / the step in tf.function;
- `plot`: a tf.function step and NumPy host work (a "plot": ten 300x300 matrix
  products on one BLAS thread) every 5 steps / no plot; `plot_small`: two such
  products (10-25% of the run, about 1.2x, where a moving load can turn the answer over);
- `map`: `fit` over a `tf.py_function` map doing NumPy work per element / the
  features computed once (a feature cache).

The truth: the pair run alternated at the machine's own load (A B, B A), the gain
the median of the rounds' `compare` gains. Then three pairs, each `compare`d: a CPU
burner (`python -c "while True: pass"`) beside the slower run only, beside the
faster run only, beside neither. The table: per pair and condition, both runs'
other-processes share of the CPU, compare's word and gain against the truth
(`opposite`: a word against the truth's direction; `within_25`: a figure given,
within 25% of the truth), and both runs' verdicts (the fixed `map` reads its features
from memory, many times faster than its step: never `input_bound`).

With `--diagnose`: `keras-gpufix diagnose` of the `eager` and `plot` scripts, at
the machine's load and with a burner beside the whole diagnosis: its measured gain
(the patch; the plot's line skipped), paired reruns, against the truth of the
scripts as diagnose runs them (a plain loop, no kg.watch), each alone, alternated
right after the diagnosis (`loop_truth`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import add_out_argument, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOOP = textwrap.dedent('''\
    import contextlib
    import json
    import os
    import sys
    import time

    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "{blas}"
    import numpy as np
    import keras
    import tensorflow as tf
    import keras_gpufix as kg

    FIXED = "{fixed}" == "1"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rng = np.random.default_rng(0)
    xs = rng.random((2048, {width}), dtype=np.float32)
    data = tf.data.Dataset.from_tensor_slices((xs, xs[:, :1])).batch({batch}).repeat()
    model = keras.Sequential([keras.Input(({width},))] + [
        keras.layers.Dense({width}, activation="relu") for _ in range(3)] + [keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)


    _times = []


    def steady(i):
        """Step `i` ended (None: the mean ms a step after the first 5, stalls in it)."""
        if i is None:
            return 1000 * (_times[-1][1] - _times[0][1]) / (_times[-1][0] - _times[0][0])
        if i >= 4:
            _times.append((i, time.perf_counter()))


    def batches(iterable):
        """The loop's batches under the script's own monitor (its run record in
        argv[1]), or as they are (argv[1] `-`: under keras-gpufix diagnose)."""
        if sys.argv[1] == "-":
            return contextlib.nullcontext(iterable)
        monitor = kg.GPUOscillationMonitor(log_dir=sys.argv[1], nvml=False, verbose=0)
        return kg.watch(iterable, callbacks=[monitor], model=model)


    def train_step(x, y):
        with tf.GradientTape() as tape:
            error = model(x, training=True) - y
            loss = tf.reduce_mean(tf.square(error))
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss


    {body}
    ''')

EAGER_BODY = textwrap.dedent('''\
    step = tf.function(train_step) if FIXED else train_step
    with batches(data.take(steps)) as watched:
        for i, (x, y) in enumerate(watched):
            loss = step(x, y)
            steady(i)
    print(json.dumps({"steady_ms": steady(None)}))
    ''')

PLOT_BODY = textwrap.dedent('''\
    step = tf.function(train_step)
    a = np.random.default_rng(1).random(({n}, {n}))
    with batches(data.take(steps)) as watched:
        for i, (x, y) in enumerate(watched):
            loss = step(x, y)
            if i % 5 == 4 and not FIXED:
                for _ in range({reps}):
                    b = np.tanh(a @ a.T / {n}.0)
            steady(i)
    print(json.dumps({"steady_ms": steady(None)}))
    ''')

MAP = textwrap.dedent('''\
    import sys
    import numpy as np
    import keras
    import tensorflow as tf
    import keras_gpufix as kg

    FIXED = "{fixed}" == "1"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rng = np.random.default_rng(0)
    raw = rng.random((256, 4000), dtype=np.float32)


    def features(row):
        spec = np.abs(np.fft.rfft(np.reshape(row, (40, 100)), axis=1))
        for _ in range(6):
            spec = np.log1p(spec) + 0.5 * spec
        return spec.reshape(-1)[:64].astype(np.float32)


    if FIXED:  # computed once: a feature cache
        data = tf.data.Dataset.from_tensor_slices(np.stack([features(r) for r in raw]))
    else:
        data = tf.data.Dataset.from_tensor_slices(raw).map(
            lambda r: tf.ensure_shape(tf.py_function(lambda v: features(v.numpy()), [r],
                                                     tf.float32), (64,)))
    data = data.map(lambda f: (f, f[:1])).batch(32).repeat().take(steps)
    model = keras.Sequential([keras.Input((64,))] + [
        keras.layers.Dense(512, activation="relu") for _ in range(3)] + [keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(data, epochs=1, verbose=0, callbacks=[
        kg.GPUOscillationMonitor(log_dir=sys.argv[1], nvml=False, verbose=0)])
    ''')

# sized for gains of about 1.2-1.6x on a loaded 2-core host, where a load that moves
# between two runs can turn the answer over
SCRIPTS = {"eager": (LOOP, {"body": EAGER_BODY, "width": "1024", "batch": "512",
                           "blas": "2"}),
           # the "plot": products of one matrix (a new result each time: a product fed
           # back into the next decays to zeros, and their cost with it), on one BLAS
           # thread (threads spinning after it slow the steps by an amount the load moves)
           "plot": (LOOP, {"body": PLOT_BODY, "width": "256", "batch": "256", "reps": "10",
                          "n": "300", "blas": "1"}),
           # a small plot, 10-25% of the run: about 1.2x
           "plot_small": (LOOP, {"body": PLOT_BODY, "width": "256", "batch": "256", "reps": "2",
                                "n": "300", "blas": "1"}),
           "map": (MAP, {})}


def _write(folder, pair):
    """`(as_is.py, fixed.py)` of `pair`, written to `folder`."""
    template, parts = SCRIPTS[pair]
    paths = []
    for fixed in ("0", "1"):
        text = template.replace("{fixed}", fixed)
        for key, value in parts.items():
            text = text.replace("{" + key + "}", value)
        text = text.replace("{reps}", "0")  # a body without a plot
        path = os.path.join(folder, f"{pair}_{'fixed' if fixed == '1' else 'as_is'}.py")
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


class _Burner:
    """`python -c "while True: pass"` while the block runs (or nothing: `on=False`)."""

    def __init__(self, on):
        self.on, self.proc = on, None

    def __enter__(self):
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def _run(script, log_dir, steps, burner=False):
    """Runs `script` (beside a burner where asked); returns its run record's data."""
    from keras_gpufix.run_record import RunRecord

    with _Burner(burner):
        proc = subprocess.run([sys.executable, script, log_dir, str(steps)], env=_env(),
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return RunRecord.load(log_dir).data


def _compare_pair(folder, pair, steps, rounds):
    from keras_gpufix.analysis.comparison import compare_runs

    as_is, fixed = _write(folder, pair)
    truths = []
    for r in range(rounds):  # A B, B A
        order = [("a", as_is), ("b", fixed)][::1 if r % 2 == 0 else -1]
        got = {k: _run(s, os.path.join(folder, f"{pair}_truth{r}_{k}"), steps) for k, s in order}
        truths.append(compare_runs(got["a"], got["b"])["gain"])
    truth = statistics.median(truths)
    rows = []
    for condition in ("burner beside the slower", "burner beside the faster", "no burner"):
        tag = condition.split()[-1]
        before = _run(as_is, os.path.join(folder, f"{pair}_{tag}_a"), steps,
                      burner=tag == "slower")
        after = _run(fixed, os.path.join(folder, f"{pair}_{tag}_b"), steps,
                     burner=tag == "faster")
        result = compare_runs(before, after)
        # the figure compare gives: none where its word stands on the CPU time alone
        sized = not (result["load"] or {}).get("cpu_gain")
        gain = result["gain"] if sized else None
        opposite = (result["word"] == "regression") == (truth > 1) and result["word"] in (
            "improvement", "regression")
        figure = sized and result["word"] in ("improvement", "regression")
        rows.append({"pair": pair, "condition": condition, "truth": truth,
                     "truth_rounds": truths, "word": result["word"], "gain": gain,
                     "raw_gain": result["gain"],
                     "gain_range": result["gain_range"],
                     "others_before": result["before"]["load"]["others_share"],
                     "others_after": result["after"]["load"]["others_share"],
                     "waited_before": result["before"]["load"]["waited_share"],
                     "waited_after": result["after"]["load"]["waited_share"],
                     "verdicts": [(before.get("verdict") or {}).get("verdict"),
                                  (after.get("verdict") or {}).get("verdict")],
                     "load": result["load"], "opposite": opposite,
                     "within_25": (abs(gain / truth - 1) <= 0.25) if figure else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _loop_truth(folder, pair, steps, rounds):
    """The pair's gain as diagnose runs it (no kg.watch: argv[1] `-`), each script
    alone, alternated (A B, B A): the median of the rounds' steady ms-per-step ratios."""
    gains = []
    for r in range(rounds):
        ms = {}
        for path in _write(folder, pair)[::1 if r % 2 == 0 else -1]:
            proc = subprocess.run([sys.executable, path, "-", str(steps)], env=_env(),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{path} exited {proc.returncode}\n{proc.stderr[-3000:]}")
            ms[path] = json.loads(proc.stdout.strip().splitlines()[-1])["steady_ms"]
        as_is, fixed = _write(folder, pair)
        gains.append(ms[as_is] / ms[fixed])
    return statistics.median(gains), gains


def _diagnose(folder, pair, steps, burner, repeat=0):
    as_is, _ = _write(folder, pair)
    log = os.path.join(folder, f"{pair}_diagnose_{'burner' if burner else 'load'}_{repeat}")
    with _Burner(burner):
        proc = subprocess.run([sys.executable, "-m", "keras_gpufix", "diagnose", "--json",
                               "--no-trace", "--log-dir", log, "--", "python", as_is, "-",
                               str(steps)], env=_env(), capture_output=True, text=True,
                              cwd=folder)  # its patch is written for files under the cwd
    if proc.returncode != 0:
        raise SystemExit(f"diagnose of {as_is} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    fix = next((f for f in result["fixes"]
                if f["predicted"].get("source") in ("patched-run", "skipped-run")), None)
    top = (result.get("fixes") or [{}])[0]
    return {"verdict": result["verdict"], "top_fix": top.get("verdict"),
            "top_where": (top.get("where") or [""])[0].split(": ")[0] or None,
            "fix": fix and fix["verdict"],
            "gain": fix and fix["predicted"]["speedup"],
            "gain_range": fix and fix["predicted"]["speedup_range"],
            "known": fix and fix["predicted"].get("known"),
            "text": fix and fix["predicted"]["text"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="truth rounds (A B, B A)")
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="diagnose runs of each script each way (at load, beside a burner)")
    parser.add_argument("--truth", nargs="+", default=[], metavar="PAIR=GAIN",
                        help="a pair's truth from an earlier run of this benchmark: its "
                             "compare runs are skipped (with --diagnose)")
    add_out_argument(parser, "load_pairs")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="load_pairs_")
    known = {k: float(v) for k, v in (t.split("=") for t in args.truth)}
    rows = [row for pair in args.pairs if pair not in known
            for row in _compare_pair(folder, pair, args.steps, args.rounds)]
    print(f"{'pair':6} {'condition':26} {'others b/a':>11} {'word':13} {'gain':>6} "
          f"{'truth':>6}  opposite within_25  verdicts b/a")
    for r in rows:
        gain = "-" if r["gain"] is None else f"{r['gain']:.2f}"
        print(f"{r['pair']:6} {r['condition']:26} {r['others_before']:.2f}/"
              f"{r['others_after']:.2f}   {r['word']:13} {gain:>6} {r['truth']:6.2f}  "
              f"{r['opposite']!s:8} {r['within_25']!s:10} {'/'.join(map(str, r['verdicts']))}")
    diagnosed = []
    if args.diagnose:
        truth = {**{r["pair"]: r["truth"] for r in rows}, **known}
        for pair in [p for p in ("plot_small", "plot", "eager") if p in args.pairs]:
            for burner in (False, True):
                for repeat in range(args.repeats):
                    d = _diagnose(folder, pair, args.steps, burner, repeat)
                    loop, rounds = _loop_truth(folder, pair, args.steps, args.rounds)
                    d.update(pair=pair, burner=burner, repeat=repeat, truth=truth.get(pair),
                             loop_truth=loop, loop_truth_rounds=rounds)
                    diagnosed.append(d)
                    print(json.dumps(d), flush=True)
    figures = {f"{r['pair']}_{r['condition'].split()[-1]}_gain": r["gain"] for r in rows}
    figures.update({f"{d['pair']}_diagnose_{'burner' if d['burner'] else 'load'}_{d['repeat']}"
                    "_gain": d["gain"] for d in diagnosed})
    figures.update({f"{r['pair']}_truth_gain": r["truth"] for r in rows})
    figures["opposite_count"] = sum(bool(r["opposite"]) for r in rows)
    # the fixed `map` reads its features from memory: a fast pipeline, never input_bound
    figures["fast_map_input_bound_count"] = sum(
        r["verdicts"][1] == "input_bound" for r in rows if r["pair"] == "map")
    write_results(args.out, "load_pairs", figures, {"rows": rows, "diagnose": diagnosed})


if __name__ == "__main__":
    main()
