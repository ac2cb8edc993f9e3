"""diagnose on a real trainer (MyXTTSModel), its advice checked against the trainer's own loop.

    python benchmarks/real_trainers.py XTTS_CHECKOUT [--runs N] [--rounds R] [--burner]
        [--truth-burner] [--steps 30] [--loop-steps 26] [--keep DIR] [--results JSON ...]
        [--out PATH]

XTTS_CHECKOUT: MyXTTSModel (github masoodafar-web/MyXTTSModel, commit 7e78353) prepared
as `real_trainers/xtts/README.md` says (its two patches applied, its data in
`data/xtts_train`, `data/xtts_eval`, what it imports installed). Not in CI (it needs the
checkout); about 40 minutes on 2 cores at load 3 with the defaults.

1. `keras-gpufix diagnose --json --steps 30 -- python train_main.py ...` (the recipe's
   micro model, gradient accumulation 2) in the checkout, N times (`--runs`). With
   `--burner`, one CPU burner (`python3 -c "while True: pass"`) starts when diagnose's
   first rerun starts (its main run done) and runs to the end of that diagnose run: the
   load its reruns meet is not its main run's.
2. Each run's `step.patch` is applied with `patch -p1` to a copy of the checkout (it
   must apply); the plot fix (the spectrogram call diagnose names as the periodic
   stall, replaced by `pass`, as diagnose's skipped-line rerun does) to another; both
   to a third.
3. The truth: the trainer's own `_train_epoch` timed (`train_main.main()` run unchanged
   up to `trainer.train()`, then one warm step, then an epoch of `--loop-steps` steps;
   ms per step between its first step's end and its last's: the steady steps, as
   diagnose's "steps/s" are; the epoch's start (its iterator made afresh), which a
   long epoch pays once, is left out. The default 26 gives 25 intervals, five periods
   of the plot every 5 steps. The whole loop's ms per step, its start in it, is printed
   beside it), as-is, patched, plot-fixed and both, each in a fresh process, in turn, the
   order reversed every other round, R rounds (`--rounds`, at least 3); a fix's gain is
   the median over rounds of as-is / fixed in the same round. The first step's loss
   (seeded: `keras.utils.set_random_seed(1234)`) of each way is printed: the patched
   trainer computes the same thing when it lies within the as-is runs' own spread.
   With `--truth-burner`, one CPU burner runs beside all the rounds: the truth at the
   load a `--burner` run's reruns met.
4. Per fix: diagnose's prediction (median over runs, with its range) against the
   measured gain, their ratio, within 25% or not; the load (os.getloadavg) beside each;
   the runs taken quiet and beside the burner in two tables.

Runs add up across sessions: `--keep DIR` writes each diagnose result (and its patch);
`--rounds 0` stops after diagnose; `--results DIR/*.json --runs 0` times the truth once
against every kept run.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import add_out_argument, write_results  # noqa: E402

#: The recipe's arguments: the micro model, batch 4, one epoch (accumulation 2).
TRAIN_ARGS = ["--train-data", "data/xtts_train", "--val-data", "data/xtts_eval",
              "--model-size", "micro", "--batch-size", "4", "--num-workers", "2",
              "--epochs", "1", "--max-mel-frames", "200", "--max-text-length", "128",
              "--reset-training", "--gst-num-style-tokens", "4", "--gst-style-token-dim", "32",
              "--gst-style-embedding-dim", "32", "--gst-num-heads", "2"]
#: The first-step loss's seed (the recipe's: its seeded runs spread 2.2997-2.3040).
SEED = 1234
WITHIN = 0.25

# train_main.py imports torch only to ask for CUDA
TORCH_STUB = ("class _Cuda:\n    @staticmethod\n    def is_available():\n        return False\n"
              "\n\ncuda = _Cuda()\n")

# The loop timer: train_main.main() unchanged up to trainer.train(); then the repo's own
# _train_epoch, WARM steps and then N timed steps; the seeded losses of every step.
LOOP_TIMER = r'''
import json, os, runpy, sys, time
sys.argv = ["train_main.py"] + sys.argv[1:]
sys.path.insert(0, os.getcwd())
import keras
import myxtts.training.trainer as T
keras.utils.set_random_seed(int(os.environ["SEED"]))
N, WARM = int(os.environ["LOOP_STEPS"]), int(os.environ["WARM_STEPS"])


def measure(self, train_dataset, val_dataset, epochs=None, steps_per_epoch=None):
    losses, ends = [], []
    accumulated = self.train_step_with_accumulation
    def step(*a, **k):
        out = accumulated(*a, **k)
        losses.append(float(out["total_loss"]))
        ends.append(time.perf_counter())
        return out
    self.train_step_with_accumulation = step
    self.current_step = 0
    self._train_epoch(train_dataset, WARM)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    self._train_epoch(train_dataset, N)
    loop = time.perf_counter() - t0
    steady = ends[-N:]  # step ends of the timed epoch: the intervals between them
    print("LOOPTIME", json.dumps({"ms_per_step": 1000 * (steady[-1] - steady[0]) / (N - 1),
                                  "loop_ms_per_step": 1000 * loop / N, "losses": losses,
                                  "load": [load, os.getloadavg()[0]]}), flush=True)
    raise SystemExit(0)


T.XTTSTrainer.train = measure
runpy.run_path("train_main.py", run_name="__main__")
'''


def _env(stubs):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (stubs, root, env.get("PYTHONPATH")) if p)
    return env


def _load():
    return round(os.getloadavg()[0], 2)


def _burner():
    """One CPU burner (`python3 -c "while True: pass"`); the caller kills it."""
    return subprocess.Popen(["python3", "-c", "while True: pass"])


def diagnose(checkout, log_dir, steps, stubs, burner):
    """One diagnose run in `checkout`; its JSON result, with the loads it met."""
    command = [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--steps",
               str(steps), "--log-dir", log_dir, "--", sys.executable, "train_main.py",
               *TRAIN_ARGS]
    load_before = _load()
    proc = subprocess.Popen(command, cwd=checkout, env=_env(stubs), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    hot = None
    if burner:
        while proc.poll() is None and not glob.glob(os.path.join(log_dir, "*", "spec.json")):
            time.sleep(1)
        if proc.poll() is None:
            hot = _burner()
    try:
        out, _ = proc.communicate(timeout=7200)
    finally:
        if hot is not None:
            hot.kill()
            hot.wait()
    result = json.loads(out.strip().splitlines()[-1])
    result["bench_loads"] = {"start": load_before, "end": _load(), "burner": hot is not None}
    return result


def predictions(result):
    """{fix name: predicted speedup} of one diagnose result: the eager step's patch,
    the stall's skipped line (periodic or not: the line diagnose ran without), both
    together."""
    out = {}
    for fix in result.get("fixes") or ():
        predicted = fix.get("predicted") or {}
        gain = predicted.get("speedup")
        name = ("patched" if fix.get("verdict") == "eager_step"
                else "plot_fixed" if predicted.get("source") == "skipped-run" else None)
        if name and gain:
            out[name] = gain
    together = (result.get("together") or {}).get("speedup")
    if together:
        out["both"] = together
    return out


def plot_fix(folder):
    """The spectrogram plot call in `_train_epoch` (diagnose's periodic stall) made `pass`."""
    path = os.path.join(folder, "myxtts", "training", "trainer.py")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = next(i for i, line in enumerate(lines) if i > 2300
                 and line.strip().startswith("self._log_spectrogram_from_batch("))
    end = start
    while lines[end].strip() != ")":
        end += 1
    indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
    lines[start:end + 1] = [indent + "pass  # the plot fix"] + [""] * (end - start)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return f"trainer.py:{start + 1}"


def _top_level_outputs(checkout):
    """copytree's `ignore`: the checkout's own data and outputs (its top-level `data`,
    `checkpoints`, `logs`, `runs`) and bytecode; a package's `data` module stays
    (myxtts/data)."""
    top = os.path.abspath(checkout)

    def ignore(folder, names):
        skip = {n for n in names if n.endswith(".pyc") or n == "__pycache__"}
        if os.path.abspath(folder) == top:
            skip |= {"data", "checkpoints", "logs", "runs"} & set(names)
        return skip
    return ignore


def copies(checkout, patch, work):
    """{way: folder}: as-is (the checkout), patched, plot_fixed, both."""
    ways = {"as_is": checkout}
    for way in ("patched", "plot_fixed", "both"):
        folder = os.path.join(work, way)
        shutil.copytree(checkout, folder, symlinks=True, ignore=_top_level_outputs(checkout))
        os.symlink(os.path.join(os.path.abspath(checkout), "data"), os.path.join(folder, "data"))
        if way in ("patched", "both"):
            subprocess.run(["patch", "-p1", "-i", patch], cwd=folder, check=True,
                           capture_output=True)
        if way in ("plot_fixed", "both"):
            plot_fix(folder)
        ways[way] = folder
    return ways


def loop_time(folder, timer, stubs, loop_steps):
    env = {**_env(stubs), "SEED": str(SEED), "LOOP_STEPS": str(loop_steps), "WARM_STEPS": "1"}
    proc = subprocess.run([sys.executable, timer, *TRAIN_ARGS], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=3600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("LOOPTIME ")), None)
    if line is None:
        raise RuntimeError(f"{folder}: the loop timer failed: {proc.stderr[-3000:]}")
    return json.loads(line[len("LOOPTIME "):])


def _keep(folder, result, fix):
    """`result` (and its step.patch, its path then pointing at the copy) in `folder`, named
    by the time it ended and its burner."""
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, time.strftime("diagnose_%Y%m%d_%H%M%S")
                        + ("_burner" if result["bench_loads"]["burner"] else ""))
    if fix.get("patch") and os.path.exists(fix["patch"]):
        shutil.copy(fix["patch"], stem + ".patch")
        fix["patch"] = os.path.abspath(stem + ".patch")
    with open(stem + ".json", "w") as f:
        f.write(json.dumps(result) + "\n")
    print(f"kept {stem}.json", flush=True)


def _x(values):
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.2f}x"
    return f"{mid:.2f}x ({min(values):.2f}-{max(values):.2f}x)"


def _round(r, order, ways, timer, stubs, loop_steps):
    """Truth round `r`: each way's loop timed in turn (the order reversed every other)."""
    timed = {}
    for way in (order if r % 2 == 0 else order[::-1]):
        timed[way] = loop_time(ways[way], timer, stubs, loop_steps)
        print(f"round {r + 1} {way:10} {timed[way]['ms_per_step']:8.1f} ms/step (the loop "
              f"{timed[way]['loop_ms_per_step']:.1f}), first loss "
              f"{timed[way]['losses'][0]:.4f}, load {timed[way]['load']}", flush=True)
    return timed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a MyXTTSModel checkout prepared as the recipe says")
    parser.add_argument("--runs", type=int, default=1, help="diagnose runs (default 1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="truth rounds (at least 3; 0: diagnose only, its results kept "
                             "with --keep for a later --results)")
    parser.add_argument("--steps", type=int, default=30, help="diagnose --steps (default 30)")
    parser.add_argument("--loop-steps", type=int, default=26, help="timed loop steps")
    parser.add_argument("--burner", action="store_true",
                        help="one CPU burner from diagnose's first rerun to its end")
    parser.add_argument("--truth-burner", action="store_true",
                        help="one CPU burner beside the truth's rounds, first to last (the "
                             "gain at the load a --burner run's reruns met)")
    parser.add_argument("--results", nargs="*", default=(), metavar="JSON",
                        help="diagnose results already taken (`diagnose --json`'s last line "
                             "in a file, as --keep writes them), used beside --runs new ones")
    parser.add_argument("--keep", metavar="DIR",
                        help="write each new diagnose result (and its step.patch) here, for "
                             "a later --results")
    add_out_argument(parser, "real_trainers")
    args = parser.parse_args(argv)
    if 0 < args.rounds < 3 or args.rounds < 0:
        parser.error(f"`--rounds` must be 0 or >= 3. Received: rounds={args.rounds}")
    checkout = os.path.abspath(args.checkout)
    work = tempfile.mkdtemp(prefix="kg_real_trainers_")
    stubs = os.path.join(work, "stubs")
    os.makedirs(os.path.join(stubs, "torch"))
    with open(os.path.join(stubs, "torch", "__init__.py"), "w") as f:
        f.write(TORCH_STUB)
    timer = os.path.join(work, "loop_time.py")
    with open(timer, "w") as f:
        f.write(LOOP_TIMER)
    runs, patch = [], None
    for path in args.results:
        with open(path) as f:
            result = json.loads(f.read().strip().splitlines()[-1])
        result["bench_loads"] = {**(result.get("bench_loads") or {}), "from": path}
        runs.append(result)
        fix = next((f for f in result.get("fixes") or () if f.get("verdict") == "eager_step"),
                   {})
        patch = patch or fix.get("patch")
    for i in range(args.runs):
        result = diagnose(checkout, os.path.join(work, f"diagnose_{i}"), args.steps, stubs,
                          args.burner)
        fix = next((f for f in result.get("fixes") or () if f.get("verdict") == "eager_step"),
                   {})
        if args.keep:
            _keep(args.keep, result, fix)
        runs.append(result)
        patch = patch or fix.get("patch")
    for i, result in enumerate(runs):
        print(f"diagnose {i + 1}: {result['verdict']}; predicted {predictions(result)}; "
              f"load {result['bench_loads']}", flush=True)
    if patch is None:
        print("no run wrote step.patch: nothing to apply", flush=True)
        return 1
    if args.rounds == 0:
        return 0
    with open(patch) as f:
        diff = f.read()
    ways = copies(checkout, patch, work)  # raises where the patch does not apply
    print(f"step.patch ({patch}): applies with patch -p1; {diff.count(chr(10))} lines, "
          f"{sum(1 for l in diff.splitlines() if l.startswith('+') and not l.startswith('+++'))}"
          " added", flush=True)
    order = ["as_is", "patched", "plot_fixed", "both"]
    rounds = []
    hot = _burner() if args.truth_burner else None
    try:
        for r in range(args.rounds):
            rounds.append(_round(r, order, ways, timer, stubs, args.loop_steps))
    finally:
        if hot is not None:
            hot.kill()
            hot.wait()
    figures, table = {}, []
    measured = {way: [t["as_is"]["ms_per_step"] / t[way]["ms_per_step"] for t in rounds]
                for way in order[1:]}
    truth = {way: statistics.median(measured[way]) for way in order[1:]}
    for group in ("quiet", "burner"):
        among = [r for r in runs if bool(r["bench_loads"].get("burner")) == (group == "burner")]
        if not among:
            continue
        predicted = {way: [p[way] for p in map(predictions, among) if way in p]
                     for way in order[1:]}
        print(f"\n{group} ({len(among)} diagnose runs)\n{'fix':12} {'predicted':>22} "
              f"{'measured':>22} {'pred/meas':>9}  within 25%")
        for way in order[1:]:
            got = truth[way]
            want = statistics.median(predicted[way]) if predicted[way] else None
            ratio = want / got if want else None
            ok = ratio is not None and abs(ratio - 1) <= WITHIN
            print(f"{way:12} {_x(predicted[way]):>22} {_x(measured[way]):>22} "
                  f"{ratio if ratio is None else round(ratio, 2)!s:>9}  {'yes' if ok else 'no'}")
            tag = "" if group == "quiet" else "burner_"
            figures[f"{way}_measured_speedup"] = round(got, 3)
            figures[f"{tag}{way}_predicted_speedup"] = want and round(want, 3)
            figures[f"{tag}{way}_ratio_predicted_over_measured"] = ratio and round(ratio, 3)
            table.append({"group": group, "way": way, "predicted": predicted[way],
                          "measured": measured[way]})
    for way in order[1:]:  # the whole loop's, the epoch's start in it: beside, not judged
        figures[f"{way}_loop_measured_speedup"] = round(statistics.median(
            t["as_is"]["loop_ms_per_step"] / t[way]["loop_ms_per_step"] for t in rounds), 3)
    per_run = []  # each diagnose run on its own: every fix within 25% of the truth or not
    for result in runs:
        got = predictions(result)
        ratios = {way: got[way] / truth[way] for way in order[1:] if way in got}
        per_run.append({"burner": bool(result["bench_loads"].get("burner")),
                        "predicted": got, "ratio": ratios,
                        "within": all(abs(r - 1) <= WITHIN for r in ratios.values())
                        and len(ratios) == len(truth)})
        print(f"run ({'burner' if per_run[-1]['burner'] else 'quiet'}): " + ", ".join(
            f"{way} {got[way]:.2f}x ({ratios[way]:.2f})" for way in ratios)
            + f"; all within 25%: {'yes' if per_run[-1]['within'] else 'no'}", flush=True)
    for group in ("quiet", "burner"):
        among = [r for r in per_run if r["burner"] == (group == "burner")]
        figures[f"{group}_runs_all_within"] = f"{sum(r['within'] for r in among)}/{len(among)}"
    first = {way: [t[way]["losses"][0] for t in rounds] for way in order}
    print("first-step loss (seeded):", {w: [round(x, 4) for x in v] for w, v in first.items()})
    figures["patched_first_loss_within_as_is_spread"] = (
        min(first["as_is"]) - 1e-3 <= statistics.median(first["patched"])
        <= max(first["as_is"]) + 1e-3)
    write_results(args.out, "real_trainers", figures, {
        "table": table, "per_run": per_run, "first_losses": first, "burner": args.burner,
        "truth_burner": args.truth_burner,
        "diagnose_loads": [r["bench_loads"] for r in runs],
        "round_loads": [{w: t[w]["load"] for w in t} for t in rounds],
        "loop_ms_per_step": [{w: t[w]["loop_ms_per_step"] for w in t} for t in rounds],
        "steady_ms_per_step": [{w: t[w]["ms_per_step"] for w in t} for t in rounds],
        "patch_text": diff})
    return 0


if __name__ == "__main__":
    sys.exit(main())
