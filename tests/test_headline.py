"""The headline's words fit the script and its figures (issue 57, items 3 and 5): a
cause below its threshold named with its gain, never a fix at 1.00x, a TF-op map
cached (not moved into TF ops), a cache that pays from the next run kept in a file,
a gain its reruns could not settle said so, the load on a line of its own; and a
pipeline the run's own what-if finds fast is never input_bound. Plain dicts: no
TensorFlow."""

from keras_gpufix.analysis import headline, weigh


def _record(verdict, fixes, share=None, contention=None):
    return {"verdict": {"verdict": verdict, "cost_share": share},
            "causes": [{"verdict": f["verdict"], "share": f.get("share")} for f in fixes],
            "fixes": [dict({"rank": i + 1, "where": ["train.py:305: `map`"], "share": 0.13,
                            "source": "stage"}, **f) for i, f in enumerate(fixes)],
            "contention": contention}


def test_a_cause_below_its_threshold_is_named_as_the_largest_with_its_line_and_gain():
    fix = {"verdict": "input_bound", "share": 0.13, "expected_speedup": 1.22,
           "stage_op": "map", "stage_kind": "python"}
    quiet = headline(_record("healthy", [fix]))
    loaded = headline(_record("input_bound", [fix], share=0.23))
    assert quiet[1] == ("fix:     none needed to call it healthy; the largest cause, "
                        "input_bound (13% of the run): take the Python work out of `map` at "
                        "train.py:305 (into TF ops), or cache its output: the whole run 1.22x "
                        "faster")
    # the same cause, line and gain whichever label the run got
    assert loaded[1] == "fix:     " + quiet[1].split(": ", 2)[2]


def test_a_fix_that_gains_nothing_is_never_the_headline():
    nothing = {"verdict": "input_bound", "expected_speedup": 1.0015, "stage_op": "map",
               "stage_kind": "cache"}
    stall = {"verdict": "periodic_stall", "expected_speedup": 1.31, "source": "skipped-run",
             "where": ["train.py:88: plot(step)"]}
    lines = headline(_record("input_bound", [nothing, stall], share=0.3))
    assert "1.00x" not in "".join(lines)
    assert lines[1].startswith("fix:     move the work that runs every ? steps at train.py:88")
    assert lines[1].endswith("1.31x the steps/s with that work removed, measured")
    alone = headline(_record("input_bound", [nothing], share=0.3))
    assert alone[1] == "fix:     nothing to fix: the fix of input_bound measured no gain (1.00x)"


def test_the_fix_words_are_true_of_the_users_input_stage():
    # a map of TF ops: cached, not moved into TF ops, nor given prefetch
    tf_map = {"verdict": "input_bound", "expected_speedup": 1.25, "stage_op": "map",
              "stage_kind": "cache"}
    fix = headline(_record("input_bound", [tf_map], share=0.3))[1]
    assert fix == ("fix:     cache the output of `map` at train.py:305 (`.cache()` right after "
                   "it): the whole run 1.25x faster")
    # a one-epoch run: the cache pays only from the next run; kept in a file, said so
    once = dict(tf_map, expected_speedup=1.0, later_speedup=1.35)
    fix = headline(_record("input_bound", [once], share=0.3))[1]
    assert fix == ("fix:     cache the output of `map` at train.py:305 in a file "
                   "(`.cache(\"FILE\")` right after it): every later run 1.35x faster (this "
                   "run 1.00x: it fills the file)")
    serial = dict(tf_map, stage_kind="parallel")
    assert "run `map` at train.py:305 in parallel (num_parallel_calls=tf.data.AUTOTUNE)" in (
        headline(_record("input_bound", [serial], share=0.3))[1])
    generic = headline(_record("input_bound", [dict(tf_map, stage_op=None)], share=0.3))[1]
    assert "prefetch" not in generic


def test_a_gain_its_reruns_could_not_settle_says_not_known_yet():
    fix = {"verdict": "eager_step", "expected_speedup": 1.03, "source": "patched-run",
           "speedup_range": [0.9, 1.18], "known": False, "settle_steps": 420}
    line = headline(_record("eager_step", [fix], share=0.2))[1]
    assert line.endswith(": not known yet (1.03x, 0.90x-1.18x measured beside the script as "
                         "it is); runs of about 420 steady steps would settle it")


def test_the_load_is_a_line_of_its_own():
    busy = {"others_share": 0.62, "waited_share": 0.1, "load": 6.5, "cpus": 2,
            "contended": True}
    lines = headline(_record("healthy", [], contention=busy))
    assert len(lines) == 4 and "other processes" not in lines[0]
    assert lines[1].startswith("load:    other processes used 62% of the CPU during the run "
                               "(load 6.5 on 2 CPUs)")
    assert lines[2] == "fix:     nothing to fix"


def test_a_pipeline_its_own_what_if_finds_fast_is_never_input_bound():
    run = {"verdict": "input_bound", "fix": "x", "phase": "input_wait", "cost_share": 0.37,
           "because": [], "changed": None, "input_wait": 0.37}
    fast = {"input_batches_per_s": 51.7, "step_batches_per_s": 0.6,
            "speedup_if_input_free": 1.02, "speedup_range": [0.97, 1.08], "known": True}
    out = weigh(run, what_if=fast)
    assert out["verdict"] == "healthy" and out["covers"] == "input_bound"
    assert ("the input drained alone supplies 51.7 batches/s, 86x the step's demand of 0.60"
            in out["because"][-1])
    slow = dict(fast, input_batches_per_s=1.2)  # 2x the demand: it may be the input
    assert weigh(run, what_if=slow)["verdict"] == "input_bound"


def test_stalls_with_no_period_at_a_located_line_name_it():
    fix = {"verdict": "irregular_stall", "expected_speedup": 1.4, "source": "skipped-run",
           "where": ["train.py:88: plot(step)"]}
    line = headline(_record("irregular_stall", [fix], share=0.25))[1]
    assert line == ("fix:     move the work at train.py:88 off the step path, or run it less "
                    "often (the long cycles' stack samples find it there): 1.40x the steps/s "
                    "with that work removed, measured")


def test_a_refused_step_patch_names_why_in_the_fix_line():
    from keras_gpufix.analysis import patch_refusal

    compiled = {"changes": [{"kind": "host_read"}], "patch": None, "stopped": {
        "where": "myxtts/training/trainer.py:1527", "code": "if aux_reg_value != 0.0:",
        "message": "'total_losses['aux_head_reg']' must be defined before the loop\nmore"}}
    refused = patch_refusal(compiled)
    assert refused == ("its copy stopped at myxtts/training/trainer.py:1527: "
                       "'total_losses['aux_head_reg']' must be defined before the loop")
    assert patch_refusal(dict(compiled, patch="logs/step.patch")) is None
    assert patch_refusal({"changes": None}) is None  # no copy made: nothing refused
    fix = {"verdict": "eager_step", "expected_speedup": 3.2, "source": "compiled-step",
           "where": ["myxtts/training/trainer.py:1276: the step's def"], "refused": refused * 3}
    line = headline(_record("eager_step", [fix], share=0.7))[1]
    assert line.startswith("fix:     compile the step at myxtts/training/trainer.py:1276 ")
    assert "; no patch: its copy stopped at myxtts/training/trainer.py:1527: " in line
    assert len(line) <= 200 and line.endswith("...")


def test_the_step_patch_line_gives_its_gain_and_the_fixes_run_together():
    fix = {"verdict": "eager_step", "expected_speedup": 4.47, "run_speedup": 3.9,
           "source": "patched-run", "patch": "L1/step.patch",
           "where": ["myxtts/training/trainer.py:1276: the step's def"]}
    record = dict(_record("eager_step", [fix], share=0.76),
                  together={"fixes": 2, "speedup": 44.98, "known": True})
    line = headline(record)[1]
    assert line == ("fix:     compile the step at myxtts/training/trainer.py:1276: `patch -p1 < "
                    "L1/step.patch`: 4.47x the steps/s, measured with the patch applied (the "
                    "whole loop 3.90x); both fixes together: 44.98x")
    # not known, or no more than the step's own: not said
    for together in ({"fixes": 2, "speedup": 44.98, "known": False},
                     {"fixes": 2, "speedup": 4.0, "known": True}, None):
        assert "together" not in headline(dict(record, together=together))[1]
    # the loop's gain where it differs from the steps', and the line within 200
    for loop in (4.47, 4.30):  # the same, or within 5%: one figure for one thing
        record["fixes"][0]["run_speedup"] = loop
        assert "whole loop" not in headline(record)[1]
    record["fixes"][0]["patch"] = "/a/long/folder/" * 4 + "step.patch"  # 71 characters
    line = headline(record)[1]
    assert "together" not in line and len(line) <= 200
