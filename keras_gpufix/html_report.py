"""`keras-gpufix report`: a run record (`RunRecord`) as one self-contained HTML file.

No script, nothing fetched: styles inline, the charts inline SVG written
here (rectangles and lines; no plotting library to install), and a
Content-Security-Policy that forbids every request, so the file can be
attached to a bug report and opened anywhere. In order:

1. the headline (`analysis.headline`, the lines the console opens with): the
   verdict and its share of the run, the top fix in one sentence with its
   line and one gain, the `compare` command that checks it; then what the
   verdict rests on and the ranked fixes, each with its predicted effect and
   the lines (file:line) to change;
2. in a multi-worker job (the chief's record), the job: one row per worker
   (its input wait, own step, wait at the all-reduce for the others, time
   between steps and its CPU) with the straggler marked, and the job's
   timeline, one lane per worker on one scale, which shows the skew;
3. the timeline: one stacked bar per point of the record's series (input
   wait, step, time between steps, per step), compiles and stalls marked,
   epoch starts drawn, steps not judged (warm-up, epoch starts) shaded; GPU
   utilisation beside it where it was sampled;
4. the step-time distribution, every cause with its share, the what-if;
5. the environment and the command.
"""

import html

from keras_gpufix.analysis import headline

__all__ = ["html_report"]

#: Colours of the timeline's phases (and its legend).
PHASE_COLOURS = {"input_wait": "#d62728", "step": "#1f77b4", "between": "#ff7f0e"}
#: Colours of a job's per-worker lanes (its own step, its wait for the others).
JOB_COLOURS = {"input_wait": "#d62728", "compute": "#1f77b4", "collective_wait": "#9e9e9e",
               "between": "#ff7f0e"}
_LANE = 90
_WIDTH, _HEIGHT, _PAD = 960, 240, 40

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;
max-width:1000px;color:#222;line-height:1.4;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.6em;
border-bottom:1px solid #ddd}
.verdict{display:inline-block;padding:.1em .5em;border-radius:4px;color:#fff;
background:#b22222} .verdict.healthy{background:#2e7d32} .verdict.unknown{background:#777}
.fix{font-size:1.1em} ol.fixes li{margin-bottom:.8em} .where{font-family:monospace;
font-size:.9em;color:#444} table{border-collapse:collapse} td,th{padding:.2em .8em;
text-align:left;border-bottom:1px solid #eee} .muted{color:#666;font-size:.9em}
code{background:#f4f4f4;padding:0 .2em} svg{background:#fafafa;border:1px solid #ddd}
tr.straggler{background:#fdecea}
.legend span{display:inline-block;width:.9em;height:.9em;margin:0 .3em 0 1em;
vertical-align:middle}
"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def _ms(x):
    return "-" if x is None else f"{x:.1f} ms"


def html_report(record) -> str:
    """The record as one HTML page (a string).

    Args:
        record: a `RunRecord` (or its `data` dict).
    """
    data = getattr(record, "data", record)
    v = data["verdict"]
    lines = headline(data, getattr(record, "path", None))
    first, load, (fix, check) = lines[0], lines[1:-2], lines[-2:]
    verdict = first[len("verdict: "):].split(";")[0]  # a job's straggler comes first
    said = first[len("verdict: "):][len(verdict):]  # the line after the verdict's name
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; img-src data:\">",
        f"<title>keras-gpufix report: {_e(verdict)}</title><style>{_CSS}</style></head><body>",
        f"<h1 id='headline'><span class='verdict {_e(verdict)}' id='verdict'>{_e(verdict)}"
        f"</span>{_e(said)}</h1>",
        *(f"<p id='load'><b>Load:</b> {_e(line[len('load:'):].strip())}</p>" for line in load),
        f"<p class='fix' id='top-fix'><b>Fix:</b> {_e(fix[len('fix:'):].strip())}</p>",
        f"<p id='check'><b>Check:</b> <code>{_e(check[len('check:'):].strip())}</code></p>",
    ]
    if data.get("ended_by"):
        parts.append(f"<p><b>Ended by:</b> {_e(data['ended_by'])}; this record covers what "
                     "was measured until then.</p>")
    because = [b for b in (v.get("because") or []) + [v.get("changed")] if b]
    if because:
        parts.append("<h2>What the verdict rests on</h2><ul class='because'>"
                     + "".join(f"<li>{_e(b)}</li>" for b in because) + "</ul>")
    parts += _job(data.get("job"))
    parts += _fixes(data["fixes"])
    parts += _timeline(data["series"])
    parts += _distribution(data)
    parts += _environment(data)
    parts.append("</body></html>")
    return "\n".join(parts)


def _job(job):
    """A multi-worker job: one row per worker, then one lane per worker on one scale."""
    if not job:
        return []
    s = job.get("straggler") or {}
    out = [f"<h2 id='job'>The job: {job['workers']} workers</h2>",
           f"<p id='job-message'>{_e(job['message'])}</p>",
           "<table id='workers'><tr><th>worker</th><th>input wait</th><th>own step</th>"
           "<th>wait at the all-reduce</th><th>between steps</th><th>CPU time</th>"
           "<th>CPU wait (threads)</th>"
           "<th>its CPU use</th><th>others' CPU share</th></tr>"]
    for w in job["per_worker"]:
        mark = " (chief)" if w.get("chief") else ""
        late = w["task"] == s.get("task")
        if late:
            mark += f" &#9664; straggler: {_e(s['cause'])}"
        out.append(f"<tr class='worker{' straggler' if late else ''}'>"
                   f"<td>{w['task']}{mark}</td><td>{_ms(w['input_wait_ms'])}</td>"
                   f"<td>{_ms(w['compute_ms'])}</td><td>{_ms(w['collective_wait_ms'])}</td>"
                   f"<td>{_ms(w['between_ms'])}</td><td>{_ms(w.get('cpu_ms'))}</td>"
                   f"<td>{_ms(w.get('cpu_wait_ms'))}</td>"
                   f"<td>{_pct(w.get('own_cpu_share'))}</td>"
                   f"<td>{_pct(w.get('others_share'))}</td></tr>")
    out.append("</table><p class='muted'>Per step. A worker's step holds its own work (its "
               "CPU time and the share of its threads' wait for a CPU on the step's path; "
               "without CPU figures, the job's shortest step) and its wait at the all-reduce "
               "for the others. CPU wait: its threads' time runnable but without a CPU, "
               "summed.</p>")
    return out + _job_lanes(job.get("series"), s.get("task"))


def _job_lanes(series, straggler):
    """One lane of stacked bars per worker (`<g class='lane'>`), on one scale."""
    if not series or not series.get("first_step"):
        return []
    lanes = series["workers"]
    n = len(series["first_step"])
    parts = ("input_wait", "compute", "collective_wait", "between")

    def heights(w, k):
        return [(p, (w[f"{p}_ms"][k] or 0.0)) for p in parts]

    # the steady steps' scale: a compile's or a stall's bar runs off the lane's top
    totals = sorted(sum(ms for _, ms in heights(w, k)) for w in lanes.values()
                    for k in range(n))
    top = max(1e-6, 1.3 * totals[int(0.9 * (len(totals) - 1))])
    bar, scale = _WIDTH / n, (_LANE - 20) / top
    svg = [f"<svg id='job-timeline' xmlns='http://www.w3.org/2000/svg' width='100%' "
           f"viewBox='0 0 {_WIDTH + 2 * _PAD} {_LANE * len(lanes) + 20}' role='img' "
           "aria-label='per-worker timeline'>"]
    for row, (task, w) in enumerate(sorted(lanes.items(), key=lambda t: int(t[0]))):
        y0 = _LANE * (row + 1)
        g = [f"<g class='lane' data-task='{_e(task)}'><text x='2' y='{y0 - _LANE / 2:.0f}' "
             f"font-size='11'>w{_e(task)}{' *' if str(straggler) == task else ''}</text>"]
        for k in range(n):
            x, y = _PAD + k * bar, y0
            label = ", ".join(f"{p.replace('_', ' ')} {ms:.1f} ms" for p, ms in heights(w, k))
            g.append(f"<g class='point'><title>worker {_e(task)}, steps from "
                     f"{series['first_step'][k]}: {_e(label)} (per step)</title>")
            for p, ms in heights(w, k):
                h = min(ms * scale, y - (y0 - _LANE + 20))
                if h > 0:
                    y -= h
                    g.append(f"<rect x='{x:.2f}' y='{y:.2f}' width='{max(bar - 0.5, 0.5):.2f}'"
                             f" height='{h:.2f}' fill='{JOB_COLOURS[p]}'/>")
            g.append("</g>")
        svg.append("".join(g) + "</g>")
    svg.append("</svg>")
    legend = "".join(f"<span style='background:{c}'></span>{p.replace('_', ' ')}"
                     for p, c in JOB_COLOURS.items())
    return ["<h3>The job's timeline</h3>",
            f"<p class='legend'>Per worker, per step, stacked on one scale ({top:.0f} ms "
            f"full height; a taller bar is cut):{legend}</p>", *svg,
            "<p class='muted'>The straggler (*) has the least wait at the all-reduce; the "
            "others wait there for it.</p>"]


def _fixes(fixes):
    if not fixes:
        return ["<h2>Fixes</h2><p>None ranked: this run measured no cause with a cost.</p>"]
    out = ["<h2>Fixes, ranked</h2><ol class='fixes'>"]
    for f in fixes:
        # a located input fix's text names its line and says each of its figures once
        stage = f.get("source") == "stage"
        where = "".join(f"<div class='where'>{_e(w)}</div>"
                        for w in (f.get("where") or ())[1 if stage else 0:])
        said = "" if stage else f"<div class='muted'>{_e(f.get('text'))}</div>"
        out.append(f"<li><b>[{_e(f['verdict'])}]</b> <span class='fix-text'>{_e(f['fix'])}"
                   f"</span>{said}{where}</li>")
    out.append("</ol>")
    return out


def _timeline(series):
    """One stacked bar per point (`<g class='step'>`), marks for compiles and stalls."""
    n = len(series["steps"])
    if not n:
        return ["<h2>Timeline</h2><p>No step was recorded.</p>"]
    wait = [w or 0.0 for w in series["input_wait_ms"]]
    cycles = [w + s + b for w, s, b in zip(wait, series["step_ms"], series["between_ms"])]
    judged = sorted(c for c, j in zip(cycles, series["judged"]) if j) or sorted(cycles)
    # the scale of the steady steps: a compile's or a stall's bar runs off the top, marked
    top = max(1e-6, 1.3 * judged[min(len(judged) - 1, int(0.98 * len(judged)))])
    bar = _WIDTH / n
    y0 = _HEIGHT + 10
    scale = _HEIGHT / top
    svg = [f"<svg id='timeline' xmlns='http://www.w3.org/2000/svg' width='100%' "
           f"viewBox='0 0 {_WIDTH + 2 * _PAD} {_HEIGHT + 50}' role='img' "
           "aria-label='per-step timeline'>"]
    for k, (first, steps) in enumerate(zip(series["first_step"], series["steps"])):
        x = _PAD + k * bar
        heights = [("input_wait", wait[k]), ("step", series["step_ms"][k]),
                   ("between", series["between_ms"][k])]
        label = (f"steps {first}-{first + steps - 1}: input wait "
                 f"{_ms(series['input_wait_ms'][k])}, step {_ms(series['step_ms'][k])}, "
                 f"between {_ms(series['between_ms'][k])} (per step)"
                 + (f"; {series['compiles'][k]} compiled" if series["compiles"][k] else "")
                 + ("; a stall" if series["stall"][k] else "")
                 + ("" if series["judged"][k] else "; not judged (warm-up or epoch start)"))
        g = [f"<g class='step'><title>{_e(label)}</title>"]
        if not series["judged"][k]:
            g.append(f"<rect x='{x:.2f}' y='10' width='{bar:.2f}' height='{_HEIGHT}' "
                     "fill='#eee'/>")
        y = y0
        for phase, ms in heights:
            h = min(ms * scale, y - 10)
            if h > 0:
                y -= h
                g.append(f"<rect x='{x:.2f}' y='{y:.2f}' width='{max(bar, 0.5):.2f}' "
                         f"height='{h:.2f}' fill='{PHASE_COLOURS[phase]}'/>")
        if series["compiles"][k]:
            g.append(f"<path class='compile' d='M{x + bar / 2:.2f} 2 l4 7 h-8 z' "
                     "fill='#6a1b9a'/>")
        if series["stall"][k]:
            g.append(f"<line class='stall' x1='{x + bar / 2:.2f}' y1='{y0 + 4}' "
                     f"x2='{x + bar / 2:.2f}' y2='{y0 + 12}' stroke='#000' stroke-width='2'/>")
        if series["epoch_first"][k] and k:
            g.append(f"<line x1='{x:.2f}' y1='10' x2='{x:.2f}' y2='{y0}' stroke='#999' "
                     "stroke-dasharray='3,3'/>")
        svg.append("".join(g) + "</g>")
    svg.append(f"<text x='{_PAD}' y='{_HEIGHT + 40}' font-size='12'>step "
               f"{series['first_step'][0]}</text><text x='{_PAD + _WIDTH}' y='{_HEIGHT + 40}' "
               f"font-size='12' text-anchor='end'>step {series['first_step'][-1] + series['steps'][-1] - 1}"
               f"</text><text x='2' y='20' font-size='11'>{top:.0f} ms</text>"
               f"<text x='2' y='{y0}' font-size='11'>0</text></svg>")
    legend = "".join(f"<span style='background:{c}'></span>{p.replace('_', ' ')}"
                     for p, c in PHASE_COLOURS.items())
    out = ["<h2>Timeline</h2>",
           f"<p class='legend'>Per step, stacked:{legend}<span style='background:#6a1b9a'></span>"
           "compiled (&#9650; above)<span style='background:#000'></span>stall (tick below)"
           "<span style='background:#eee'></span>not judged</p>", *svg,
           f"<p class='muted'>{sum(series['steps'])} steps, one bar per "
           f"{series['stride']} record(s) ({n} bars); a bar past {top:.0f} ms is cut at the "
           "top. Dashed lines: "
           "epoch starts. Hover a bar for its figures.</p>"]
    util = series["gpu_util"]
    if any(u is not None for u in util):
        points = " ".join(f"{_PAD + (k + 0.5) * bar:.2f},{10 + 80 * (1 - u):.2f}"
                          for k, u in enumerate(util) if u is not None)
        out.append(f"<h3>GPU utilisation (NVML)</h3><svg id='gpu-util' xmlns='http://www.w3.org/"
                   f"2000/svg' width='100%' viewBox='0 0 {_WIDTH + 2 * _PAD} 100'><polyline points='{points}' "
                   "fill='none' stroke='#2e7d32' stroke-width='1.5'/><text x='2' y='14' "
                   "font-size='11'>100%</text><text x='2' y='90' font-size='11'>0</text></svg>")
    else:
        out.append("<p class='muted'>GPU utilisation: not sampled (no NVIDIA GPU or no "
                   "nvidia-ml-py: <code>pip install keras-gpufix[nvml]</code>).</p>")
    return out


def _distribution(data):
    st, phases = data["step_time"], data["phases"]
    rows = [("steps judged", st.get("count")),
            ("their time", "-" if st.get("total_s") is None else f"{st['total_s']:.1f} s"),
            ("mean (wall per step)", _ms(st.get("mean_ms"))), ("median", _ms(st.get("p50_ms"))),
            ("p95", _ms(st.get("p95_ms"))), ("p99", _ms(st.get("p99_ms"))),
            ("max", _ms(st.get("max_ms"))),
            ("cv", "-" if st.get("cv") is None else f"{st['cv']:.2f}"),
            ("steps/s", "-" if st.get("steps_per_s") is None else f"{st['steps_per_s']:.1f}"),
            ("samples/s", "-" if st.get("samples_per_s") is None
             else f"{st['samples_per_s']:.1f}"),
            ("input wait", _pct(phases.get("input_wait")) if phases.get("input_wait") is not None
             else "not measured"),
            ("step", _pct(phases.get("step"))), ("between steps", _pct(phases.get("between"))),
            ("GPU utilisation", "not sampled" if data.get("gpu_util") is None
             else _pct(data["gpu_util"]))]
    out = ["<h2>Step time (steady steps)</h2><table>"
           + "".join(f"<tr><th>{_e(k)}</th><td>{_e(val)}</td></tr>" for k, val in rows)
           + "</table>"]
    if data["causes"]:
        # each cause's share; its gain is said once, by its ranked fix above
        out.append("<h2>Causes</h2><table><tr><th>cause</th><th>share of the run</th></tr>"
                   + "".join(f"<tr><td>{_e(c['verdict'])}</td><td>{_pct(c.get('share'))}</td>"
                             "</tr>" for c in data["causes"]) + "</table>")
    what_if = data.get("what_if")
    out.append("<h2>What-if</h2><p>" + (_e(what_if["text"]) if what_if else
                                        "Not measured in this run (keras-gpufix diagnose "
                                        "measures it).") + "</p>")
    return out


def _environment(data):
    env = data["environment"]
    rows = [(k, ", ".join(map(str, env[k])) if isinstance(env[k], list) else env[k])
            for k in sorted(env) if env[k] not in (None, "", [], {})
            and not isinstance(env[k], dict)]
    return ["<h2>Environment</h2><table>"
            + "".join(f"<tr><th>{_e(k)}</th><td>{_e(val)}</td></tr>" for k, val in rows)
            + "</table>",
            f"<p><b>Command:</b> <code>{_e(' '.join(data['command']))}</code></p>",
            f"<p class='muted'>Run record {_e(data['schema'])} version {data['version']}, "
            f"written {_e(data['written_at'])} by {_e(data['source'])}.</p>"]

