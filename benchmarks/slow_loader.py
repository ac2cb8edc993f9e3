"""The slow-loader example diagnosed, then its fixed twin: what docs quote.

    python benchmarks/slow_loader.py [--out PATH]   (about 20 s on 2 cores)

Runs `keras-gpufix diagnose --json -- python examples/diagnose_slow_loader.py`
and the same for `examples/diagnose_slow_loader_fixed.py` (same model and
`compile`, input through `SpeechDatasetBuilder`) on one generated corpus,
one after the other, and writes each run's verdict, median step, input
wait, samples/s and XProf input share, and which is faster, to `--out`
(default `benchmarks/results/slow_loader.json`). docs/quickstart.md and
docs/troubleshooting.md quote this file.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _results import add_out_argument, write_results

from keras_gpufix.output import faster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def diagnose(example, work):
    """`keras-gpufix diagnose --json` of one example; returns its figures."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--trace", "--",
         sys.executable, os.path.join("examples", example), "--dir", work],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{example}: diagnose exited {proc.returncode}\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    monitor = report["fits"][0]["monitor"]
    xprof = [e["value"] for e in report["traces"] if e.get("figure") == "input_percent"]
    return {
        "verdict": report["verdict"],
        "fit_monitor_verdict": monitor["verdict"],
        "median_step_ms": round(monitor["step_time"]["p50_ms"], 1),
        "samples_per_s": round(monitor["step_time"]["samples_per_s"] or 0, 1),
        "input_wait": round(monitor["input_wait"], 3),
        "xprof_input_percent": round(xprof[0], 1) if xprof else None,
        "evidence": [e["text"] for e in report["evidence"]],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(parser, "slow_loader")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kg_slow_loader_")
    slow = diagnose("diagnose_slow_loader.py", work)
    fixed = diagnose("diagnose_slow_loader_fixed.py", work)
    for name, r in (("slow", slow), ("fixed", fixed)):
        print(f"{name:6} verdict {r['verdict']:12} median step {r['median_step_ms']:7.1f} ms, "
              f"input wait {r['input_wait']:.0%}, XProf input {r['xprof_input_percent']}%, "
              f"{r['samples_per_s']:.0f} samples/s (fit monitor: {r['fit_monitor_verdict']})")
    print(faster("fixed", fixed["samples_per_s"], "slow", slow["samples_per_s"], " samples/s"))
    figures = {f"{key}_{name}": r[key] for name, r in (("slow", slow), ("fixed", fixed))
               for key in ("verdict", "fit_monitor_verdict", "median_step_ms", "input_wait",
                           "xprof_input_percent", "samples_per_s")}
    figures["ratio_samples_per_s_fixed_over_slow"] = round(
        fixed["samples_per_s"] / slow["samples_per_s"], 2)
    write_results(args.out, "slow_loader", figures, {"slow": slow, "fixed": fixed})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
