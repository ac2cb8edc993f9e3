"""The static scan: known input-pipeline and compile traps in a script's source."""

import ast
import os

__all__ = ["TRAPS", "scan_script"]

# Static traps: id -> (related verdict, why, fix).
TRAPS = {
    "py_function_in_map": (
        "input_bound",
        "`tf.py_function`/`tf.numpy_function` inside `Dataset.map` runs Python per "
        "element under the GIL: the map cannot run in parallel",
        "compute features with TF ops (kg.data.log_mel) or once into a feature cache "
        "(kg.data.SpeechDatasetBuilder(cache_dir=...))",
    ),
    "python_generator": (
        "input_bound",
        "a Python generator feeds the model: every batch is produced by Python, one at a "
        "time, with no parallelism or prefetch",
        "build a tf.data pipeline (kg.data.SpeechDatasetBuilder, or "
        "Dataset.from_tensor_slices + map(num_parallel_calls=AUTOTUNE) + prefetch)",
    ),
    "no_prefetch": (
        "input_bound",
        "the tf.data pipeline has no `prefetch`: the next batch is prepared only after "
        "the step that needs it asked for it",
        "end the pipeline with `.prefetch(tf.data.AUTOTUNE)`",
    ),
    "run_eagerly": (
        "eager_step",
        "`run_eagerly=True` runs every op from Python: no graph, no XLA",
        "remove run_eagerly=True (use it only to debug)",
    ),
    "jit_compile_false": (
        "healthy",
        "`jit_compile=False` turns XLA off: no op fusion",
        "kg.compile_model(model, ..., jit_compile=True) (with bucketed shapes)",
    ),
    "numpy_in_loop": (
        "dispatch_bound",
        "`.numpy()` inside a loop copies to the host and waits for the device at every "
        "iteration",
        "keep values as tensors inside the loop; convert once after it",
    ),
}

_PY_FUNCS = {"py_function", "numpy_function", "py_func", "eager_py_func"}

def _attr(node):
    """The called name of a Call (`tf.data.Dataset.map` -> "map")."""
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _const(node, value):
    return isinstance(node, ast.Constant) and node.value is value


def _own_body_nodes(func):
    """Nodes of a function, without those of nested functions."""
    stack = list(func.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


class _Scanner(ast.NodeVisitor):
    def __init__(self, tree):
        self.findings = []
        self.loops = 0
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        self.py_defs = {f.name: next(c.lineno for c in _calls(f) if _attr(c) in _PY_FUNCS)
                        for f in funcs if any(_attr(c) in _PY_FUNCS for c in _calls(f))}
        self.generators = {f.name for f in funcs
                           if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_body_nodes(f))}
        self.gen_vars = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and self._is_generator(node.value):
                self.gen_vars.update(t.id for t in node.targets if isinstance(t, ast.Name))
        calls = _calls(tree)
        self.batch_calls = [c for c in calls if _attr(c) in ("batch", "padded_batch")
                            and isinstance(c.func, ast.Attribute)]
        self.has_prefetch = any(_attr(c) in ("prefetch", "prefetch_to_device") for c in calls)
        self.uses_tf_data = any(_attr(c) in ("from_tensor_slices", "from_tensors", "from_generator",
                                             "TFRecordDataset", "TextLineDataset", "list_files",
                                             "range", "zip") and isinstance(c.func, ast.Attribute)
                                for c in calls)

    def _is_generator(self, node):
        return isinstance(node, ast.GeneratorExp) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in self.generators)

    def add(self, trap, node, detail=""):
        self.findings.append({"trap": trap, "line": node.lineno, "detail": detail})

    def _loop(self, node):
        self.loops += 1
        self.generic_visit(node)
        self.loops -= 1

    visit_For = visit_AsyncFor = visit_While = visit_ListComp = _loop
    visit_SetComp = visit_DictComp = visit_GeneratorExp = _loop

    def _map_uses_py(self, fn):
        if isinstance(fn, ast.Lambda):
            lines = [c.lineno for c in _calls(fn) if _attr(c) in _PY_FUNCS]
            if lines:
                return lines[0]
            names = [c.func.id for c in _calls(fn) if isinstance(c.func, ast.Name)]
            return next((self.py_defs[n] for n in names if n in self.py_defs), None)
        if isinstance(fn, ast.Name):
            return self.py_defs.get(fn.id)
        if isinstance(fn, ast.Attribute):
            return self.py_defs.get(fn.attr)
        if isinstance(fn, ast.Call):  # functools.partial(f, ...)
            return next((self._map_uses_py(a) for a in fn.args if self._map_uses_py(a)), None)
        return None

    def visit_Call(self, node):
        name = _attr(node)
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if name == "map" and isinstance(node.func, ast.Attribute):
            fn = node.args[0] if node.args else kwargs.get("map_func")
            line = self._map_uses_py(fn) if fn is not None else None
            if line is not None:
                self.add("py_function_in_map", node, f"the py_function call is at line {line}")
        if name == "from_generator":
            self.add("python_generator", node, "Dataset.from_generator")
        if "run_eagerly" in kwargs and _const(kwargs["run_eagerly"], True):
            self.add("run_eagerly", node)
        if name == "run_functions_eagerly" and node.args and _const(node.args[0], True):
            self.add("run_eagerly", node, "tf.config.run_functions_eagerly(True)")
        if "jit_compile" in kwargs and _const(kwargs["jit_compile"], False):
            self.add("jit_compile_false", node)
        if name == "numpy" and not node.args and self.loops:
            self.add("numpy_in_loop", node)
        if name == "fit" and isinstance(node.func, ast.Attribute):
            x = node.args[0] if node.args else kwargs.get("x")
            if x is not None and (self._is_generator(x) or (
                    isinstance(x, ast.Name) and x.id in self.gen_vars)):
                self.add("python_generator", node, "a Python generator passed to fit")
        self.generic_visit(node)

    def visit_Assign(self, node):
        if _const(node.value, True) and any(
                isinstance(t, ast.Attribute) and t.attr == "run_eagerly" for t in node.targets):
            self.add("run_eagerly", node)
        self.generic_visit(node)


def scan_script(path):
    """Finds known input-pipeline and compile traps in a Python file.

    Args:
        path: the script.

    Returns:
        A list of findings sorted by line, each a dict with `trap` (a key
        of `TRAPS`), `file`, `line`, `code` (the source line), `detail`,
        `why`, `fix` and `verdict` (the measured cause it would produce).
        A file that is not valid Python gives one finding with trap
        `syntax_error`.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    lines = source.splitlines()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return [{"trap": "syntax_error", "file": path, "line": exc.lineno, "code": "",
                 "detail": str(exc.msg), "why": "the script does not parse", "fix": "",
                 "verdict": None}]
    scanner = _Scanner(tree)
    scanner.visit(tree)
    if scanner.uses_tf_data and scanner.batch_calls and not scanner.has_prefetch:
        scanner.add("no_prefetch", scanner.batch_calls[-1], "no .prefetch( in the script")
    out, seen = [], set()
    for f in sorted(scanner.findings, key=lambda f: (f["line"], f["trap"])):
        if (f["trap"], f["line"]) in seen:
            continue
        seen.add((f["trap"], f["line"]))
        verdict, why, fix = TRAPS[f["trap"]]
        code = lines[f["line"] - 1].strip() if 0 < f["line"] <= len(lines) else ""
        out.append({**f, "file": path, "code": code, "why": why, "fix": fix,
                    "verdict": verdict})
    return out

