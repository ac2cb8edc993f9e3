"""The static scan: known input-pipeline and compile traps in a script's source.

The scan follows the user's own modules that the script imports (files
under the script's folder or the working directory, never site-packages or
the standard library), and reports each finding with its file and line.

A finding is on the training path (`training_path`) only in code that
runs: the script's module-level code, its imports' module-level code (not
their `__main__` block) and the functions these refer to, transitively.
And a `.numpy()` in a loop counts only
inside a training loop (a loop whose own body trains: `fit`,
`train_on_batch`, a gradient, `apply_gradients`, or a call of a function
that does; not the epoch loop around it) or inside a function that such
a loop or a training function calls. Visualisation, decoding and
inference code outside the training step is listed but never ranked as a
fix.
"""

import ast
import os
import sys

from keras_gpufix.analysis import TRAPS, fix_for

__all__ = ["scan_script"]

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


def _defaults(func):
    """A function's parameters that have a default: name -> default node."""
    args = func.args
    positional = args.posonlyargs + args.args
    out = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]],
                   args.defaults))
    out.update((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
    return out


_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _own_body_nodes(func, loops=True):
    """Nodes of a function's (or a loop's) body, without nested functions (and loops)."""
    stack = list(func.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and (
                loops or not isinstance(node, _LOOPS)):
            stack.extend(ast.iter_child_nodes(node))


# Calls that train: a loop whose body makes one is a training loop.
_TRAIN_CALLS = {"fit", "train_on_batch", "gradient", "apply_gradients", "minimize",
                "train_step", "train_function"}
# Calls that make a function a training step (run once per step).
_STEP_CALLS = {"gradient", "apply_gradients", "minimize"}
_MAX_FILES = 50  # the user's own modules followed at most


def _refs(node, skip=None):
    """What `node`'s own body refers to (not nested function bodies), less the `skip` node.

    A set of `("name", id)` (a bare name: this module's, or one it imports
    with `from ... import`) and `("attr", name)` (`x.name`: any module's).
    """
    out, nested = set(), not isinstance(node, ast.Module)
    if skip is not None:
        node = ast.Module(body=[n for n in node.body if n is not skip], type_ignores=[])
    for n in _own_body_nodes(node):
        if isinstance(n, ast.Name):
            out.add(("name", n.id))
        elif isinstance(n, ast.Attribute):
            out.add(("attr", n.attr))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and nested:
            out.add(("name", n.name))  # a nested def runs when its parent does
        elif isinstance(n, ast.ImportFrom):
            out.update(("imported", a.asname or a.name, a.name) for a in n.names)
    return out


def _is_main_guard(node):
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


class _Scanner(ast.NodeVisitor):
    def __init__(self, tree):
        self.findings = []
        self.loops = []  # the enclosing loops, innermost last
        self.functions = []  # the enclosing function names, innermost last
        self.function_nodes = []  # the enclosing function definitions, innermost last
        self.calls = {}  # function name -> names it calls (its own body)
        self.refs = {}  # function name -> names its own body refers to (calls, callbacks, defs)
        self.in_main = False  # inside `if __name__ == "__main__":`
        self.loop_calls = []  # (loop node, names its body calls, those outside inner loops)
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
        self.last_batch = None  # the finding `no_prefetch` would be, at the last batch call
        self.has_prefetch = any(_attr(c) in ("prefetch", "prefetch_to_device") for c in calls)
        self.uses_tf_data = any(_attr(c) in ("from_tensor_slices", "from_tensors", "from_generator",
                                             "TFRecordDataset", "TextLineDataset", "list_files",
                                             "range", "zip") and isinstance(c.func, ast.Attribute)
                                for c in calls)

    def _is_generator(self, node):
        return isinstance(node, ast.GeneratorExp) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in self.generators)

    def _finding(self, trap, node, detail=""):
        return {"trap": trap, "line": node.lineno, "detail": detail, "loops": list(self.loops),
                "function": self.functions[-1] if self.functions else None,
                "in_main": self.in_main}

    def add(self, trap, node, detail=""):
        self.findings.append(self._finding(trap, node, detail))

    def _loop(self, node):
        self.loops.append(node)
        if isinstance(node, _LOOPS):  # (loop, calls in its body, calls not in inner loops)
            self.loop_calls.append((node, {_attr(n) for n in _own_body_nodes(node)
                                           if isinstance(n, ast.Call)},
                                    {_attr(n) for n in _own_body_nodes(node, loops=False)
                                     if isinstance(n, ast.Call)}))
        self.generic_visit(node)
        self.loops.pop()

    visit_For = visit_AsyncFor = visit_While = visit_ListComp = _loop
    visit_SetComp = visit_DictComp = visit_GeneratorExp = _loop

    def _function(self, node):
        self.calls.setdefault(node.name, set()).update(
            _attr(n) for n in _own_body_nodes(node) if isinstance(n, ast.Call))
        self.refs.setdefault(node.name, set()).update(_refs(node))
        saved, self.loops = self.loops, []  # a loop around a def does not run its body
        self.functions.append(node.name)
        self.function_nodes.append(node)
        self.generic_visit(node)
        self.function_nodes.pop()
        self.functions.pop()
        self.loops = saved

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_If(self, node):
        main = not self.functions and _is_main_guard(node)
        self.in_main |= main
        self.generic_visit(node)
        self.in_main &= not main

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
        if name in ("batch", "padded_batch") and isinstance(node.func, ast.Attribute):
            self.last_batch = self._finding("no_prefetch", node, "no .prefetch( in the script")
        if name == "map" and isinstance(node.func, ast.Attribute):
            fn = node.args[0] if node.args else kwargs.get("map_func")
            line = self._map_uses_py(fn) if fn is not None else None
            if line is not None:
                self.add("py_function_in_map", node, f"the py_function call is at line {line}")
        if name == "from_generator":
            self.add("python_generator", node, "Dataset.from_generator")
        if "run_eagerly" in kwargs and _const(kwargs["run_eagerly"], True):
            self.add("run_eagerly", node)
        elif "run_eagerly" in kwargs and self._true_parameter(kwargs["run_eagerly"]):
            # `def compile(self, ..., run_eagerly=True): super().compile(...,
            # run_eagerly=run_eagerly)`: the line that hands it to Keras
            self.add("run_eagerly", node, f"`{kwargs['run_eagerly'].id}` defaults to True in "
                     f"`{self.functions[-1]}` (line {self.function_nodes[-1].lineno})")
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

    def _true_parameter(self, value):
        """`value` is a parameter of the enclosing function whose default is True."""
        return (isinstance(value, ast.Name) and bool(self.function_nodes)
                and _const(_defaults(self.function_nodes[-1]).get(value.id), True))

    def visit_Assign(self, node):
        if _const(node.value, True) and any(
                isinstance(t, ast.Attribute) and t.attr == "run_eagerly" for t in node.targets):
            self.add("run_eagerly", node)
        self.generic_visit(node)


def _module_file(name, level, here, roots):
    """The file of module `name` (`from ..name import` when `level` > 0), if the user's."""
    bases = [here] if level else roots
    if level:
        for _ in range(level - 1):
            bases = [os.path.dirname(bases[0])]
    parts = name.split(".") if name else []
    for base in bases:
        path = os.path.join(base, *parts)
        for candidate in (path + ".py", os.path.join(path, "__init__.py")):
            if parts and os.path.isfile(candidate):
                return os.path.abspath(candidate)
    return None


def _imports(tree, path, roots):
    """Files of the user's own modules that `tree` imports."""
    here = os.path.dirname(os.path.abspath(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [(base, node.level)] + [
                (f"{base}.{a.name}" if base else a.name, node.level) for a in node.names]
        else:
            continue
        for name, level in names:
            found = _module_file(name, level, here, roots)
            if found and found not in out:
                out.append(found)
    return out


def _library_dirs():
    """Folders of installed packages, the standard library and this package: never the user's."""
    import sysconfig

    import keras_gpufix

    paths = sysconfig.get_paths()
    dirs = [paths[k] for k in ("stdlib", "purelib", "platlib") if k in paths]
    dirs += [sys.prefix, sys.base_prefix, os.path.dirname(keras_gpufix.__file__)]
    return tuple(os.path.abspath(d) + os.sep for d in dirs)


def _shown(path):
    """`path` relative to the working directory when it lies under it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def _parse(path):
    """(tree or None, source lines, syntax-error finding or None)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        return ast.parse(source, filename=path), source.splitlines(), None
    except SyntaxError as exc:
        return None, [], {"trap": "syntax_error", "file": _shown(path), "line": exc.lineno,
                          "code": "",
                          "detail": str(exc.msg), "why": "the script does not parse", "fix": "",
                          "verdict": None, "training_path": False}


def _closure(start, graph):
    """Every node reachable from `start` through `graph` (node -> nodes)."""
    out, todo = set(), list(start)
    while todo:
        node = todo.pop()
        if node not in out:
            out.add(node)
            todo.extend(graph.get(node, ()))
    return out


def _on_path(parsed):
    """(functions that run, functions run once per step, ids of the training loops).

    `parsed` is [(tree, scanner, is the entry script)]; a function is
    `(file index, name)`. What runs: the entry's module-level code, the
    imports' module-level code (not their `__main__` block) and every
    function they refer to, transitively.
    """
    defined = {}  # name -> the functions of that name
    for i, (_, scanner, _) in enumerate(parsed):
        for name in scanner.calls:
            defined.setdefault(name, set()).add((i, name))

    def resolve(i, refs):
        imported = {r[1]: r[2] for r in refs if r[0] == "imported"}
        out = set()
        for kind, name, *_ in refs:
            if kind == "attr":
                out |= defined.get(name, set())
            elif kind == "name" and name in imported:
                out |= defined.get(imported[name], set())
            elif kind == "name" and (i, name) in defined.get(name, ()):
                out.add((i, name))
        return out

    graph, calls, top = {}, {}, set()
    for i, (tree, scanner, entry) in enumerate(parsed):
        module = _refs(tree)
        for name, refs in scanner.refs.items():
            graph[(i, name)] = resolve(i, refs | {r for r in module if r[0] == "imported"})
            calls[(i, name)] = scanner.calls[name]
        guard = None if entry else next(
            (n for n in tree.body if isinstance(n, ast.If) and _is_main_guard(n)), None)
        top |= resolve(i, _refs(tree, skip=guard) | {r for r in module if r[0] == "imported"})
    runs = _closure(top, graph)
    trains = set(_TRAIN_CALLS)
    while True:  # names of functions that train, directly or through others
        more = {name for (_, name), names in calls.items() if names & trains} - trains
        if not more:
            break
        trains |= more
    # a training loop trains in its own body (an epoch loop around it does not)
    loops = {id(loop) for _, scanner, _ in parsed for loop, _, direct in scanner.loop_calls
             if direct & trains}
    steps = {key for key, names in calls.items()
             if names & _STEP_CALLS or key[1] == "train_step"}
    for i, (_, scanner, _) in enumerate(parsed):
        steps |= {f for loop, names, _ in scanner.loop_calls if id(loop) in loops
                  for f in resolve(i, {("attr", n) for n in names})}
    return runs, _closure(steps, graph), loops


def scan_script(path):
    """Finds known input-pipeline and compile traps in a script and its own modules.

    Args:
        path: the script.

    Returns:
        A list of findings, the script's first, each file's sorted by line,
        each a dict with `trap` (a key of `analysis.TRAPS`), `file` (relative to the
        working directory when under it), `line`, `code`
        (the source line), `detail`, `why` (with what to change on the
        line), `verdict` (the measured cause it would produce, None for a
        hint that produces none), `fix` (the verdict's, from the one
        verdict table; None without a verdict) and `training_path` (False for code that
        training does not run: such a finding is never ranked as a fix).
        A file that is not valid Python gives one finding with trap
        `syntax_error`.
    """
    path = os.path.abspath(os.fspath(path))
    roots = [os.path.dirname(path), os.getcwd()]
    library = _library_dirs()
    files, parsed, out = [path], [], []
    while files and len(parsed) < _MAX_FILES:
        current = files.pop(0)
        tree, lines, error = _parse(current)
        if error:
            out.append(error)
            continue
        scanner = _Scanner(tree)
        scanner.visit(tree)
        parsed.append((current, lines, tree, scanner))
        for found in _imports(tree, current, roots):
            known = found in files or any(found == p for p, _, _, _ in parsed)
            if not known and not found.startswith(library):
                files.append(found)
    runs, per_step, training_loops = _on_path(
        [(tree, scanner, current == path) for current, _, tree, scanner in parsed])
    prefetch = any(scanner.has_prefetch for _, _, _, scanner in parsed)
    for index, (current, lines, _, scanner) in enumerate(parsed):
        if scanner.uses_tf_data and scanner.last_batch and not prefetch:
            scanner.findings.append(scanner.last_batch)
        seen = set()
        for f in sorted(scanner.findings, key=lambda f: (f["line"], f["trap"])):
            if (f["trap"], f["line"]) in seen:
                continue
            seen.add((f["trap"], f["line"]))
            verdict, why = TRAPS[f["trap"]]
            where = f"{_shown(current)}:{f['line']}"
            fix = None if verdict is None else fix_for(verdict, where=where)
            code = lines[f["line"] - 1].strip() if 0 < f["line"] <= len(lines) else ""
            if f["function"] is None:  # module level: an import's __main__ block never runs
                on_path = current == path or not f["in_main"]
            else:
                on_path = (index, f["function"]) in runs
            if f["trap"] == "numpy_in_loop":  # costs per step only inside the step or its loop
                on_path = on_path and ((index, f["function"]) in per_step or any(
                    id(loop) in training_loops for loop in f["loops"]))
            out.append({"trap": f["trap"], "file": _shown(current), "line": f["line"], "code": code,
                        "detail": f["detail"], "why": why, "fix": fix, "verdict": verdict,
                        "training_path": on_path})
    return out
