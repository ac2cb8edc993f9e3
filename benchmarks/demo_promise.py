"""The demo's promise: the naive way's predicted gain per fix against the gain measured.

    python benchmarks/demo_promise.py [--utterances 96] [--epochs 3] [--burners 0 2] [--out PATH]

Runs `keras-gpufix demo` (its own process each time, in one work folder, so the
corpus, the feature cache and the XLA compiles are made once) once per
`--burners` count: beside that many CPU burners (`while True: pass` processes).
For each run it prints the load average, the naive way's verdict and each of
its causes with the share of the run it cost and the gain its fix predicted,
the fixes together (`analysis.combined_speedup`), the keras_gpufix way's
measured gain (utterances/s after the first epoch, the demo's headline) and the
part no fix covered, read from the demo's own `promise:` lines. Figures go to
`--out` (default `benchmarks/results/demo_promise.json`).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _results import add_out_argument, run_stdout, write_results  # noqa: E402 (beside this file)


def _figures(out):
    """The naive way's verdict, causes and the promise's figures from the demo's output."""
    naive = out.split("\nnaive:", 1)[1].split("\nkeras_gpufix:", 1)[0]
    promise = out.split("\npromise:", 1)[1].split("\nwall:", 1)[0]
    together = re.search(r"together: predicted ([\d.]+|unbounded)x?, measured ([\d.]+)x", promise)
    left = re.search(r"not covered by any fix: ([\d.]+)x (beyond|short of) the prediction; (.*)",
                     promise)
    evidence = re.search(r"evidence: (median step .*)", naive)
    return {
        "verdict": re.search(r"verdict: +(\w+)", naive)[1],
        "evidence": evidence[1] if evidence else None,
        "causes": [{"verdict": v, "share": float(s) / 100, "predicted": float(g)}
                   for v, s, g in re.findall(r"(\w+) \((\d+)% of the naive run\): its fix "
                                             r"predicted ([\d.]+)x", promise)],
        "predicted_together": None if together[1] == "unbounded" else float(together[1]),
        "measured": float(together[2]),
        "not_covered": None if left is None else (float(left[1]) if left[2] == "beyond"
                                                  else 1 / float(left[1])),
        "not_covered_where": None if left is None else left[3],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--burners", type=int, nargs="+", default=[0, 2],
                        help="CPU burners beside each run (one run per count)")
    add_out_argument(parser, "demo_promise")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="demo_promise_")
    command = [sys.executable, "-m", "keras_gpufix", "demo", "--dir", workdir,
               "--utterances", str(args.utterances), "--epochs", str(args.epochs)]
    run_stdout(command)  # the corpus, feature cache and compiles, made once
    runs = []
    for burners in args.burners:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(burners)]
        try:
            before = os.getloadavg()[0]
            out = run_stdout(command)
            after = os.getloadavg()[0]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        run = {"burners": burners, "load_1min": [before, after], **_figures(out)}
        runs.append(run)
        causes = "; ".join(f"{c['verdict']} {c['share']:.0%} -> predicted {c['predicted']:.2f}x"
                           for c in run["causes"]) or "none"
        together = run["predicted_together"]
        print(f"{burners} burners (load {before:.1f}-{after:.1f}): naive {run['verdict']} "
              f"({run['evidence']}); causes: {causes}; together predicted "
              + ("unbounded" if together is None else f"{together:.2f}x")
              + f", measured {run['measured']:.2f}x"
              + ("" if run["not_covered"] is None else
                 f", not covered {run['not_covered']:.2f}x ({run['not_covered_where']})"))
    write_results(args.out, "demo_promise", {
        f"{key}_{r['burners']}_burners": r[key] for r in runs
        for key in ("measured", "predicted_together", "not_covered")
        if r[key] is not None}, details={"runs": runs, "command": command})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
