"""Step-time statistics and the oscillation detector (pure NumPy).

This module is the brain of the monitors and imports neither TensorFlow nor
Keras, so it is testable anywhere and reusable outside `model.fit`. The
callbacks in `keras_gpufix.callbacks` are thin adapters that feed it.

`OscillationDetector.update(step_time, **signals)` takes one step at a time.
Signals it understands (all optional, per step):

| signal        | meaning                                                     |
|---------------|-------------------------------------------------------------|
| `input_wait`  | seconds the step waited for its batch (from `kg.data.instrument`) |
| `gpu_util`    | mean GPU utilisation during the step, 0..1 (NVML)           |
| `new_shape`   | True when the step saw an input shape never seen before     |
| `step`        | the step's number (defaults to a running count)             |

Verdicts, in the order they are tried on each window:

| verdict           | evidence                                                  |
|-------------------|-----------------------------------------------------------|
| `recompiling`     | most slow steps coincide with new input shapes            |
| `periodic_stall`  | slow steps recur with a fixed period (autocorrelation)    |
| `input_bound`     | measured input wait, or low GPU utilisation on long steps |
| `dispatch_bound`  | low GPU utilisation on short steps, input ready           |
| `irregular_stall` | slow steps without a period cost a large share of time    |
| `degrading`       | median step time grew well above the first window's       |
| `healthy`         | none of the above                                         |
"""

from collections import Counter, deque

import numpy as np

__all__ = ["summarize_step_times", "OscillationDetector", "VERDICTS", "FIXES"]

VERDICTS = (
    "recompiling",
    "periodic_stall",
    "input_bound",
    "dispatch_bound",
    "irregular_stall",
    "degrading",
    "healthy",
)

FIXES = {
    "recompiling": (
        "bound the number of input shapes: bucket by length with "
        "`pad_to_bucket_boundary` (kg.data `num_buckets`) or pad to a multiple"
    ),
    "periodic_stall": (
        "something runs every {period} steps: look for work on that schedule "
        "(a py_function or slow element in the input pipeline, checkpoints, "
        "logging, garbage collection) and move it off the step path"
    ),
    "input_bound": (
        "the step waits for data: move decoding/features into TF ops or a "
        "feature cache (kg.data.SpeechDatasetBuilder(cache_dir=...)), raise "
        "map parallelism to AUTOTUNE and prefetch"
    ),
    "dispatch_bound": (
        "steps are too short for per-step dispatch: raise steps_per_execution "
        "(kg.compile_model(steps_per_execution='auto')) or the batch size"
    ),
    "irregular_stall": (
        "occasional long steps: capture a trace of one "
        "(kg.ProfilerTrigger(trigger='slow_step')) to see what runs then"
    ),
    "degrading": (
        "step time keeps growing: look for state that accumulates per step "
        "(Python lists of tensors, retracing, unbounded caches) or throttling"
    ),
    "healthy": "nothing to fix",
}


def _percentile_ms(times, q):
    return float(np.percentile(times, q) * 1e3)


def summarize_step_times(times, batch_sizes=None):
    """Summarises step wall times.

    Args:
        times: step durations in seconds.
        batch_sizes: samples per step (one number, or one per step).
            Defaults to None (no samples/s).

    Returns:
        A dict with `count`, `total_s`, `mean_ms`, `p50_ms`, `p95_ms`,
        `p99_ms`, `max_ms`, `std_ms`, `cv` (std / mean), `steps_per_s` and
        `samples_per_s` (None without batch sizes). With no steps every
        figure but `count` is None.
    """
    t = np.asarray(list(times), dtype=np.float64)
    if t.ndim != 1:
        raise ValueError(f"`times` must be one-dimensional. Received shape {t.shape}")
    if t.size and (not np.all(np.isfinite(t)) or np.any(t < 0)):
        raise ValueError("`times` must be finite and non-negative.")
    keys = ("total_s", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms",
            "std_ms", "cv", "steps_per_s", "samples_per_s")
    if t.size == 0:
        return {"count": 0, **{k: None for k in keys}}
    total = float(t.sum())
    mean = float(t.mean())
    samples_per_s = None
    if batch_sizes is not None:
        b = np.broadcast_to(np.asarray(batch_sizes, dtype=np.float64), t.shape)
        samples_per_s = float(b.sum() / total) if total > 0 else None
    return {
        "count": int(t.size),
        "total_s": total,
        "mean_ms": mean * 1e3,
        "p50_ms": _percentile_ms(t, 50),
        "p95_ms": _percentile_ms(t, 95),
        "p99_ms": _percentile_ms(t, 99),
        "max_ms": float(t.max() * 1e3),
        "std_ms": float(t.std() * 1e3),
        "cv": float(t.std() / mean) if mean > 0 else 0.0,
        "steps_per_s": float(t.size / total) if total > 0 else None,
        "samples_per_s": samples_per_s,
    }


def _period(spikes, min_spikes, threshold):
    """Period (in steps) of a spike series by autocorrelation, or None.

    `spikes` holds each slow step's excess time (0 elsewhere), so large
    stalls weigh more than small slow steps.
    """
    n = spikes.size
    if np.count_nonzero(spikes) < min_spikes:
        return None, 0.0
    x = spikes - spikes.mean()
    denom = float(np.dot(x, x))
    if denom == 0.0:
        return None, 0.0
    lags = np.arange(2, n // 2 + 1)
    acf = np.array([np.dot(x[:-lag], x[lag:]) / denom for lag in lags])
    best = int(np.argmax(acf))
    # Prefer the fundamental: the smallest lag whose correlation is close to
    # the best one (multiples of the period correlate too).
    candidates = np.nonzero(acf >= max(threshold, 0.8 * acf[best]))[0]
    if candidates.size == 0:
        return None, float(acf[best])
    lag = int(candidates[0])
    return int(lags[lag]), float(acf[lag])


class OscillationDetector:
    """Finds oscillating, stalling or starved training from per-step signals.

    Steps are kept in a rolling window of `window` steps; every `hop` steps
    (once the window is full) the window is judged. A verdict other than
    `healthy` becomes an event only after it held for `min_windows`
    consecutive judgements; consecutive judgements with the same verdict
    extend one event instead of making new ones. After a problem, a `healthy`
    judgement emits one `healthy` event (recovery).

    Args:
        window: steps per judged window. Defaults to 96 (long enough to see
            at least four periods of a stall every 20 steps).
        hop: steps between judgements. Defaults to `window // 4`.
        warmup: steps ignored at the start (compilation, first batches).
            Defaults to 5.
        min_windows: consecutive judgements a verdict must hold before it is
            reported. Defaults to 2.
        spike_factor: a step slower than `spike_factor` x the window median
            is a slow step. Defaults to 2.0.
        min_spike_ms: ... and slower than the median by at least this much
            and by 4 robust standard deviations (1.4826 x median absolute
            deviation). Defaults to 2.0 (OS jitter on short steps is not a
            stall).
        min_stall_share: share of the window's time lost to slow steps
            before a stall is reported. Defaults to 0.05.
        irregular_share: the same for stalls without a period. Defaults
            to 0.15.
        min_stall_ms: time a window must lose to slow steps before a
            periodic stall is reported; five times as much for an irregular
            one. Defaults to 40 (a hiccup of the host in a window of
            one-millisecond steps is not worth a verdict).
        input_wait_threshold: share of step time spent waiting for input
            that makes a run input-bound. Defaults to 0.2 (XProf's
            "highly input-bound" threshold).
        low_gpu_util: mean GPU utilisation below which the GPU is starved.
            Defaults to 0.5.
        short_step_ms: with low GPU utilisation, steps shorter than this
            are dispatch-bound, longer ones input-bound. Defaults to 10.
        acf_threshold: autocorrelation needed to call a period. Defaults
            to 0.5.
        growth_threshold: growth of the median step time over the first
            judged window's median that counts as degrading (and by at least
            `min_spike_ms`). Defaults to 0.5.

    Example:

    >>> det = OscillationDetector(window=32, warmup=0)
    >>> events = [det.update(0.3 if i % 5 == 0 else 0.01) for i in range(200)]
    >>> [e["verdict"] for e in events if e]
    ['periodic_stall']
    """

    def __init__(
        self,
        window=96,
        hop=None,
        warmup=5,
        min_windows=2,
        spike_factor=2.0,
        min_spike_ms=2.0,
        min_stall_share=0.05,
        irregular_share=0.15,
        min_stall_ms=40.0,
        input_wait_threshold=0.2,
        low_gpu_util=0.5,
        short_step_ms=10.0,
        acf_threshold=0.5,
        growth_threshold=0.5,
    ):
        if window < 8:
            raise ValueError(f"`window` must be >= 8. Received: window={window}")
        hop = window // 4 if hop is None else hop
        if not 1 <= hop <= window:
            raise ValueError(
                f"`hop` must be in [1, window]. Received: hop={hop}, window={window}"
            )
        if warmup < 0:
            raise ValueError(f"`warmup` must be >= 0. Received: warmup={warmup}")
        if min_windows < 1:
            raise ValueError(
                f"`min_windows` must be >= 1. Received: min_windows={min_windows}"
            )
        if spike_factor <= 1.0:
            raise ValueError(
                f"`spike_factor` must be > 1. Received: spike_factor={spike_factor}"
            )
        self.window = window
        self.hop = hop
        self.warmup = warmup
        self.min_windows = min_windows
        self.spike_factor = spike_factor
        self.min_spike_ms = min_spike_ms
        self.min_stall_share = min_stall_share
        self.irregular_share = irregular_share
        self.min_stall_ms = min_stall_ms
        self.input_wait_threshold = input_wait_threshold
        self.low_gpu_util = low_gpu_util
        self.short_step_ms = short_step_ms
        self.acf_threshold = acf_threshold
        self.growth_threshold = growth_threshold
        self.reset()

    def reset(self):
        """Forgets every step and event."""
        self._seen = 0
        self._since_judgement = 0
        self._steps = deque(maxlen=self.window)
        self._times = deque(maxlen=self.window)
        self._wait = deque(maxlen=self.window)
        self._util = deque(maxlen=self.window)
        self._new_shape = deque(maxlen=self.window)
        self._streak = (None, 0)
        self._current = None
        self.events = []
        self.judgements = 0
        self.last_judgement = None
        self._baseline_ms = None

    def update(self, step_time, **signals):
        """Adds one step; returns a new event (dict) or None.

        Args:
            step_time: the step's wall time in seconds.
            **signals: `input_wait` (seconds), `gpu_util` (0..1),
                `new_shape` (bool), `step` (int); unknown names raise.

        Returns:
            None, or a dict with `verdict`, `start_step`, `end_step`, `cv`,
            `period`, `evidence` (figures and `signals`, the evidence
            used), `fix` and `message` (one line for people).
        """
        unknown = set(signals) - {"input_wait", "gpu_util", "new_shape", "step"}
        if unknown:
            raise ValueError(f"Unknown signals {sorted(unknown)}; expected "
                             "input_wait, gpu_util, new_shape, step")
        step = signals.get("step")
        step = self._seen if step is None else int(step)
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        self._steps.append(step)
        self._times.append(float(step_time))
        self._wait.append(signals.get("input_wait"))
        self._util.append(signals.get("gpu_util"))
        self._new_shape.append(bool(signals.get("new_shape", False)))
        self._since_judgement += 1
        if len(self._times) < self.window or self._since_judgement < self.hop:
            return None
        return self._judge_now()

    def finish(self):
        """Judges the steps not judged yet at the end of a run.

        A run shorter than a window, or the tail after the last judgement,
        is judged once over what the window holds (at least `hop` steps).
        Returns a new event or None, like `update`.
        """
        if self._since_judgement == 0 or len(self._times) < self.hop:
            return None
        return self._judge_now()

    def _judge_now(self):
        self._since_judgement = 0
        self.judgements += 1
        self.last_judgement = self.judge()
        return self._consider(self.last_judgement)

    def judge(self):
        """Judges the current window; returns (verdict, evidence, period)."""
        t = np.asarray(self._times)
        med = float(np.median(t))
        if self._baseline_ms is None:
            self._baseline_ms = med * 1e3
        # A slow step stands out from the window's own spread (median absolute
        # deviation), so a noisy neighbour on the host is not a stall.
        spread = 1.4826 * float(np.median(np.abs(t - med)))
        limit = max(self.spike_factor * med, med + self.min_spike_ms / 1e3, med + 4 * spread)
        slow = t > limit
        lost_ms = float(np.sum(t[slow] - med)) * 1e3
        lost_share = lost_ms / 1e3 / float(t.sum()) if t.sum() > 0 else 0.0
        cv = float(t.std() / t.mean()) if t.mean() > 0 else 0.0
        evidence = {
            "signals": ["step_time"],
            "median_ms": med * 1e3,
            "cv": cv,
            "slow_steps": int(slow.sum()),
            "slow_time_share": lost_share,
        }
        new_shape = np.asarray(self._new_shape)
        if new_shape.any():
            evidence["signals"].append("new_shape")
            evidence["new_shapes"] = int(new_shape.sum())
            if slow.any() and np.sum(slow & new_shape) >= 0.5 * slow.sum():
                evidence["slow_steps_at_new_shapes"] = int(np.sum(slow & new_shape))
                return "recompiling", evidence, None

        waits = [w for w in self._wait if w is not None]
        wait_share = None
        if len(waits) == len(t):
            evidence["signals"].append("input_wait")
            wait_share = float(min(1.0, np.sum(waits) / t.sum())) if t.sum() else 0.0
            evidence["input_wait"] = wait_share
        utils = [u for u in self._util if u is not None]
        util = None
        if utils:
            evidence["signals"].append("gpu_util")
            util = float(np.mean(utils))
            evidence["gpu_util"] = util

        # Stalls recur in the step times, or, more cleanly when measured, in
        # the input waits (host noise makes compute slower, not input later).
        series = []
        if lost_share >= self.min_stall_share and lost_ms >= self.min_stall_ms:
            series.append(("step_time", np.where(slow, t - med, 0.0)))
        if wait_share is not None:
            w = np.asarray(waits)
            stalls = np.where(w * 1e3 > max(self.min_spike_ms, 1e3 * med), w, 0.0)
            if (stalls.sum() >= self.min_stall_share * t.sum()
                    and stalls.sum() * 1e3 >= self.min_stall_ms):
                series.append(("input_wait", stalls))
        for source, excess in series:
            period, acf = _period(excess, 3, self.acf_threshold)
            if period is not None:
                evidence["period"] = period
                evidence["autocorrelation"] = acf
                evidence["period_from"] = source
                if wait_share is not None:
                    evidence["slow_steps_waiting_for_input"] = float(
                        np.mean(w[slow] > 0.5 * (t[slow] - med))) if slow.any() else 0.0
                return "periodic_stall", evidence, period

        if wait_share is not None and wait_share >= self.input_wait_threshold:
            return "input_bound", evidence, None
        if util is not None and util < self.low_gpu_util:
            if wait_share is None and med * 1e3 >= self.short_step_ms:
                return "input_bound", evidence, None
            if wait_share is None or wait_share < self.input_wait_threshold:
                return "dispatch_bound", evidence, None
        if lost_share >= self.irregular_share and lost_ms >= 5 * self.min_stall_ms:
            return "irregular_stall", evidence, None
        growth = med * 1e3 / self._baseline_ms - 1.0 if self._baseline_ms > 0 else 0.0
        evidence["growth"] = growth
        grown_ms = med * 1e3 - self._baseline_ms
        if growth >= self.growth_threshold and grown_ms >= self.min_spike_ms and not slow.any():
            return "degrading", evidence, None
        return "healthy", evidence, None

    def _consider(self, judgement):
        verdict, evidence, period = judgement
        start, end = self._steps[0], self._steps[-1]
        last, count = self._streak
        self._streak = (verdict, count + 1 if verdict == last else 1)
        current = self._current
        if current is not None and current["verdict"] == verdict:
            current["end_step"] = end
            return None
        if verdict == "healthy":
            if current is None or current["verdict"] == "healthy":
                return None
        elif self._streak[1] < (1 if verdict == "recompiling" else self.min_windows):
            # New shapes are direct evidence; other verdicts must persist.
            return None
        event = {
            "verdict": verdict,
            "start_step": start,
            "end_step": end,
            "cv": evidence["cv"],
            "period": period,
            "evidence": evidence,
            "fix": FIXES[verdict].format(period=period),
            "message": _message(verdict, start, evidence, period),
        }
        self._current = event
        self.events.append(event)
        return event

    def dominant_verdict(self):
        """The verdict that covered the most steps, `healthy` if none."""
        steps = Counter()
        for e in self.events:
            if e["verdict"] != "healthy":
                steps[e["verdict"]] += e["end_step"] - e["start_step"] + 1
        return steps.most_common(1)[0][0] if steps else "healthy"


def _message(verdict, start, ev, period):
    parts = [f"from step {start}: {verdict}", f"median {ev['median_ms']:.1f} ms",
             f"cv {ev['cv']:.2f}"]
    if period:
        parts.append(f"slow step every {period} steps "
                     f"({ev['slow_time_share']:.0%} of time lost)")
    if "input_wait" in ev:
        parts.append(f"input wait {ev['input_wait']:.0%}")
    if "gpu_util" in ev:
        parts.append(f"GPU util {ev['gpu_util']:.0%}")
    if "slow_steps_at_new_shapes" in ev:
        parts.append(f"{ev['slow_steps_at_new_shapes']} of {ev['slow_steps']} "
                     "slow steps at new input shapes")
    parts.append("evidence: " + "+".join(ev["signals"]))
    return "; ".join(parts)
