"""The eager step made to run under `tf.function`: a patched copy, traced until it runs.

A scan of the step's source (`step_blockers`) finds what can be read in it;
what only a trace finds (a name AutoGraph needs before a loop over a tensor
count, a None accumulator whose structure changes in the `tf.while_loop`)
shows only when TensorFlow traces it. So before diagnose says "wrap the
step in tf.function", `make_runnable` builds a copy of the step's own
function in memory, changes each line the scan named, traces it, and while
the trace fails changes the line its error names, until the copy traces
or a change it cannot make is met (that line is then named with
TensorFlow's message):

| what                                  | the change                                   |
|---------------------------------------|----------------------------------------------|
| `float(t)`, `int(t)`, `t.numpy()`,    | `t`: the step returns the tensor, read after |
| `t.item()` (`host_read`)              | the call                                     |
| `self.n += 1`, a global set           | moved out of the compiled step into a plain  |
| (`python_state`, top-level statement) | wrapper of the same name that calls it       |
| `acc = None` before a loop over a     | zeros of the value set in the loop           |
| tensor, `acc = g if acc is None else  | (`tuple(tf.zeros_like(v) for v in SOURCES)`  |
| [...]` in it                          | for a tape's gradients), the loop's update   |
|                                       | kept a tuple                                 |
| a name first set in such a loop       | set before it to zeros of the value the      |
| ("must be defined before the loop"),  | eager step gave it (`tf.zeros(shape, dtype)`)|
| a dict's key (`'d['k']' must be ...`) |                                              |
| the zeros' variables first named in   | what that name is set to, where it reads     |
| the loop (`current = self.vars()`)    | only names bound before the loop; else the   |
|                                       | attribute holding the eager tape's variables |
| `tf.shape(x)[i]` where a loop's count | `(x.shape[i] or tf.shape(x)[i])`: a Python   |
| comes from it (`if n // k == 0: k=n`) | count keeps a Python loop (`static_shape`;   |
|                                       | undone if the loop stays a tensor loop)      |
| `if t: d[k] = d.get(k, 0) + v`, `t` a | `d[k] = tf.where(t, d.get(k, 0) + v,         |
| tensor, no else (`tensor_if`)         | d.get(k, 0))`: the key set on both paths     |

A function the step calls is changed too, in the same patch, for two blockers:
a Python `if` on a tensor in a function AutoGraph never reached (a loss's or
layer's `call`, which Keras calls: `@tf.autograph.to_graph` above it,
`autograph`), and `tf.constant` of a tensor (`tf.convert_to_tensor`,
`constant_of_tensor`). Their copies replace them on their class (or module)
while the copy is traced and checked, and are put back after.

The copy that runs is then checked: from the same variables, on the run's
own batch, the eager step and the patched one must give the same returned
values and the same variables after (`SAME_RTOL`/`SAME_ATOL`, else within a
seeded trainer's own spread between runs, `SPREAD_RTOL`/`SPREAD_ATOL`: the
result says which); every variable, and the Python state of the step's
arguments, is restored after each (the user's run is unchanged).
`jit_compile=True` is tried on it: the op XLA refuses (a `tf.print`'s
`StringFormat`) is named by the line that made it. `write_patch` writes the
changes, with the `tf.function` wrapper, as a unified diff `patch -p1` applies
from the folder diagnose ran in.

Any other blocker in a function the step calls is named, not changed.
"""

import ast
import collections
import contextlib
import difflib
import inspect
import linecache
import os
import re
import sys
import textwrap
import time
import traceback
import types
import weakref

from keras_gpufix.analysis.stages import on_disk_cache
from keras_gpufix.analysis.verdicts import INPUT_PATCH_NOTE, ON_DISK_NOTE

__all__ = ["make_runnable", "write_patch", "input_patch", "attach_patches", "xla_refusal",
           "saved_state", "SAME_RTOL", "SAME_ATOL"]

#: Tolerance of "the same result" (graph and eager kernels reorder float sums).
SAME_RTOL, SAME_ATOL = 1e-4, 1e-5
#: The looser tolerance a copy that `SAME_*` refuses is judged with: a seeded trainer's
#: own spread between runs (MyXTTSModel's first-step loss: 2.2997-2.3040, 0.19%); a deep
#: step's graph sums its many terms in another order than eager kernels do.
SPREAD_RTOL, SPREAD_ATOL = 2e-3, 1e-4
#: Traces tried at most before diagnose gives up changing the step.
MAX_TRACES = 12
_READ_METHODS = {"numpy", "item", "tolist"}
_READ_BUILTINS = {"float", "int", "bool"}
_LOOP_NAME = re.compile(r"'(\w+(?:\[[^\]]+\])?)' (?:must be defined|is not allowed to be "
                        r"None|has a None value|does not have the same nested structure)")


class CannotPatch(Exception):
    """A change the patcher cannot make: `where` (`file:line`), `code`, `message`."""

    def __init__(self, where, code, message):
        super().__init__(message)
        self.where, self.code, self.message = where, code, message


#: Python builtins that iterate a tensor, and their TensorFlow op.
_REDUCTIONS = {"max": "reduce_max", "min": "reduce_min", "sum": "reduce_sum"}


def _reduction(node):
    """(the tensor, the op) of `max(t)` / `min(t)` / `sum(t)`, or None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _REDUCTIONS and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], (ast.List, ast.Tuple, ast.GeneratorExp,
                                              ast.ListComp))):
        return node.args[0], _REDUCTIONS[node.func.id]
    return None


def _is_read(node):
    """The tensor a call reads into Python (`float(t)`, `t.numpy()`), or None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in _READ_METHODS and not node.args:
        return func.value
    if (isinstance(func, ast.Name) and func.id in _READ_BUILTINS and len(node.args) == 1
            and not node.keywords and not isinstance(node.args[0], ast.Constant)):
        return node.args[0]
    return None


class _Step:
    """The step's function as source lines, each with the file's line number it came
    from (None for a line the patch adds); changed in place."""

    def __init__(self, fn):
        lines, self.first = inspect.getsourcelines(fn)
        self.path = inspect.getsourcefile(fn)
        self.fn = fn
        self.rows = [[self.first + i, line if line.endswith("\n") else line + "\n"]
                     for i, line in enumerate(lines)]
        self.moved = []  # statements moved to the wrapper (dedented text)
        self.changes = []  # dicts kind, where, code, change
        self.tf_name = next((k for k, v in fn.__globals__.items()
                             if getattr(v, "__name__", None) == "tensorflow"),
                            '__import__("tensorflow")')
        self.indent = re.match(r"\s*", self.rows[0][1]).group(0)
        self.shapes_tried = False  # `static_shapes` was tried
        self.copy_name = f"{_COPY}{self.path}:{self.first}>"
        self.callees = []  # `_Step`s of the functions it calls that the patch changes
        self.owner = self.attr = None  # a callee's class (or module) and its name there
        self.autograph = False  # a callee AutoGraph does not reach: converted by the patch
        self.shape_trial = None  # (rows, changes) before it, until the next trace judges it

    # -- the source
    def text(self):
        return textwrap.dedent("".join(r[1] or "\n" for r in self.rows))

    def tree(self):
        node = ast.parse(self.text()).body[0]
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise CannotPatch(self.where(1), self.code(1), "the step is not a def")
        return node

    def where(self, index):
        """`file:line` of row `index` (1-based), the nearest line of the file."""
        for i in range(index - 1, -1, -1):
            if self.rows[i][0] is not None:
                return f"{self.path}:{self.rows[i][0]}"
        return f"{self.path}:{self.first}"

    def code(self, index):
        return self.rows[index - 1][1].strip() if 0 < index <= len(self.rows) else ""

    def index_of(self, line):
        """The row (1-based) of the file's `line`, or None."""
        return next((i + 1 for i, r in enumerate(self.rows) if r[0] == line), None)

    def _abs(self, row, col):
        """`col` of a dedented row as a column of the row as it is in the file."""
        text = self.rows[row - 1][1]
        dedented = self.text().splitlines(True)[row - 1]
        return col + len(text) - len(dedented)

    def replace(self, node, new_text):
        """Replaces `node`'s text (on one row) by `new_text`."""
        if node.lineno != node.end_lineno:
            return False
        row = node.lineno
        a, b = self._abs(row, node.col_offset), self._abs(row, node.end_col_offset)
        text = self.rows[row - 1][1]
        self.rows[row - 1][1] = text[:a] + new_text + text[b:]
        return True

    def segment(self, node):
        return ast.get_source_segment(self.text(), node)

    def statement_rows(self, stmt):
        return range(stmt.lineno, stmt.end_lineno + 1)

    # -- the changes
    def note(self, kind, index, change, code=None):
        self.changes.append({"kind": kind, "where": self.where(index),
                             "code": code if code is not None else self.code(index),
                             "change": change})

    def remove_reads(self, index):
        """Each Python read of a tensor on row `index`, made the tensor; False when none."""
        code, done = self.code(index), False
        for _ in range(20):
            node = next((n for n in ast.walk(self.tree()) if getattr(n, "lineno", None) == index
                         and _is_read(n) is not None), None)
            if node is None or not self.replace(node, self.segment(_is_read(node))):
                break
            done = True
        if done:
            self.note("host_read", index, f"`{self.code(index)}`: the tensor, read after the "
                                          "call", code)
        return done

    def reduce_in_tf(self, index):
        """`max(t)` / `min(t)` / `sum(t)` on row `index` (Python iterating a tensor) as the
        TensorFlow op; False when none."""
        code, done = self.code(index), False
        for _ in range(20):
            node = next((n for n in ast.walk(self.tree()) if getattr(n, "lineno", None) == index
                         and _reduction(n) is not None), None)
            if node is None:
                break
            tensor, op = _reduction(node)
            if not self.replace(node, f"{self.tf_name}.{op}({self.segment(tensor)})"):
                break
            done = True
        if done:
            self.note("host_read", index, f"`{self.code(index)}`: in TensorFlow ops", code)
        return done

    def move_state(self, index):
        """Moves the top-level statement on row `index` (Python state the step changes)
        into the wrapper that calls the compiled step."""
        fn = self.tree()
        stmt = next((s for s in fn.body if s.lineno <= index <= s.end_lineno), None)
        where, code = self.where(index), self.original(index)
        if stmt is None:
            raise CannotPatch(where, code, "it changes Python state inside a block of the step "
                                           "(an if, a loop): diagnose cannot move it out")
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs,
                                  fn.args.vararg, fn.args.kwarg) if a is not None}
        local = {t.id for s in fn.body if s is not stmt for n in ast.walk(s)
                 for t in getattr(n, "targets", [getattr(n, "target", None)])
                 if isinstance(t, ast.Name)} - params
        read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load)}
        if read & local:
            raise CannotPatch(where, code, "it sets Python state from values the step computes "
                                           f"({', '.join(sorted(read & local))}): diagnose "
                                           "cannot move it out")
        written = {ast.dump(t) for n in ast.walk(stmt)
                   for t in getattr(n, "targets", [getattr(n, "target", None)]) if t is not None}
        for other in fn.body:
            if other is stmt:
                continue
            if any(isinstance(n, (ast.Attribute, ast.Name)) and isinstance(n.ctx, ast.Load)
                   and ast.dump(type(n)(**{**n.__dict__, "ctx": ast.Store()})) in written
                   for n in ast.walk(other)):
                raise CannotPatch(where, code, "the step reads the state it changes: under "
                                               "tf.function it would read its value at the trace")
        text = textwrap.dedent("".join(self.rows[i - 1][1] for i in self.statement_rows(stmt)))
        self.moved.append(text)
        for i in self.statement_rows(stmt):
            self.rows[i - 1][1] = ""
        self.note("python_state", index, "moved after the compiled call (in the wrapper)",
                  code)

    def define_before_loop(self, name, index, eager_locals, message=""):
        """Sets `name` (a name, or a dict's key: `d['k']`) to a tensor before the loop on
        (or holding) row `index`: zeros of the gradients a `name = None ... name = g if
        name is None else ...` accumulator takes, else zeros of the eager step's last
        value of it (`eager_locals`: each local's last value). Zeros of gradients are
        made from variables known before the loop (`_sources_before`)."""
        fn = self.tree()
        name = ast.unparse(ast.parse(name, mode="eval"))  # d["k"] as the trace writes it
        value = _eager_value(name, eager_locals)
        loops = [n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))
                 and n.lineno <= index <= n.end_lineno
                 and name in {ast.unparse(t) for m in ast.walk(n)
                              for t in getattr(m, "targets", [getattr(m, "target", None)])
                              if isinstance(t, (ast.Name, ast.Subscript))}]
        where, code = self.where(index), self.original(index)
        if not loops:
            raise CannotPatch(where, code, f"no loop here sets '{name}'")
        loop = max(loops, key=lambda n: n.lineno)  # the innermost
        block = _block_of(fn, loop)
        before = [s for s in block if s.end_lineno < loop.lineno]
        none = next((s for s in reversed(before) if isinstance(s, ast.Assign)
                     and isinstance(s.value, ast.Constant) and s.value.value is None
                     and any(getattr(t, "id", None) == name for t in s.targets)), None)
        update = _none_update(loop, name)
        if none is not None and update is not None:
            stmt, first, then = update
            sources = _gradient_sources(fn, first)
            if sources is None:
                raise CannotPatch(self.where(stmt.lineno), self.original(stmt.lineno),
                                  f"'{name}' starts from None and takes its first value in the "
                                  "loop; diagnose finds its zeros only for a tape's gradients")
            sources = self._sources_before(fn, loop, sources, eager_locals, stmt.lineno)
            self._set_line(none, f"{name} = tuple({self.tf_name}.zeros_like(v) for v in "
                                 f"{sources})")
            self.note("none_before_loop", none.lineno,
                      f"`{self.code(none.lineno)}`: zeros of the gradients, a tuple",
                      code=f"{name} = None")
            old = self.code(stmt.lineno)
            self._set_line(stmt, f"{name} = {_as_tuple(self.segment(then))}")
            self.note("none_before_loop", stmt.lineno, f"`{self.code(stmt.lineno)}`: the "
                                                       "accumulator kept a tuple", code=old)
            return
        init = _zeros_of(value, self.tf_name)
        gradients = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(
            n.func, ast.Attribute) and n.func.attr == "gradient" and len(n.args) >= 2]
        if isinstance(value, (list, tuple)) and value and gradients:  # a gradient list grown
            sources = self._sources_before(fn, loop, ast.unparse(gradients[0].args[1]),
                                           eager_locals, index)
            zeros = f"{self.tf_name}.zeros_like(v) for v in {sources}"
            init = f"[{zeros}]" if isinstance(value, list) else f"tuple({zeros})"
        if init is None:
            raise CannotPatch(where, code, f"'{name}' has no tensor value in the eager step to "
                                           "start it from")
        indent = re.match(r"\s*", self.rows[loop.lineno - 1][1]).group(0)
        if none is not None:
            self._set_line(none, f"{name} = {init}")
            self.note("none_before_loop", none.lineno, f"`{name} = {init}`", code=f"{name} = None")
        else:
            self.rows.insert(loop.lineno - 1, [None, f"{indent}{name} = {init}\n"])
            self.note("none_before_loop", loop.lineno + 1,
                      f"`{name} = {init}` set before the loop"
                      + (f" (the trace: {message})" if message else ""),
                      code=self.code(loop.lineno + 1))

    def original(self, index):
        """The file's own text of row `index` (never a line the copy rewrote)."""
        number = int(self.where(index).rpartition(":")[2])
        return linecache.getline(self.path, number).strip() or self.code(index)

    def _sources_before(self, fn, loop, sources, eager_locals, index):
        """`sources` (the variables a tape's gradient is taken of, in `loop`) as an
        expression that is valid before the loop: itself where every name it reads is
        bound there; the value a name of it is set to in the loop where that reads only
        such names (`current = self.model.trainable_variables`); else the attribute of
        an argument or global that holds the very variables the eager step's tape took
        (`self.model.trainable_variables`). Raises `CannotPatch` where none is."""
        bound = _bound_before(fn, loop)
        expr = ast.parse(sources, mode="eval").body
        if _reads(expr) <= bound:
            return sources
        if isinstance(expr, ast.Name):
            sets = [n.value for n in ast.walk(loop) if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == expr.id for t in n.targets)]
            if len(sets) == 1 and _reads(sets[0]) <= bound:
                return ast.unparse(sets[0])
            held = (eager_locals or {}).get(expr.id)
            found = _holder_of(held, fn, eager_locals or {}, self.fn.__globals__)
            if found is not None:
                return found
        raise CannotPatch(self.where(index), self.original(index),
                          f"the gradient's variables ({sources}) are first known inside the "
                          "loop, and no value before it holds them")

    def static_shapes(self):
        """Each `tf.shape(x)[i]` of the step as `(x.shape[i] or tf.shape(x)[i])`: the
        number itself where the trace knows it (a `tf.function` traces each input shape
        it meets), so a count made from it (`range(n // k)`, `if n // k == 0: k = n`)
        stays a Python number and its loop a Python loop, as it runs eagerly; the tensor
        where the trace does not. Returns the rows changed."""
        changed = []
        nodes = [n for n in ast.walk(self.tree()) if _shape_item(n, self.tf_name)]
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset), reverse=True):
            held = self.segment(node.value.args[0])
            index = self.segment(node.slice)
            if self.replace(node, f"({held}.shape[{index}] or "
                                  f"{self.tf_name}.shape({held})[{index}])"):
                changed.append(node.lineno)
        for row in sorted(set(changed)):
            self.note("static_shape", row, f"`{self.code(row)}`: the shape's number where the "
                                           "trace knows it (a Python count, a Python loop)",
                      code=self.original(row))
        return changed

    def conditional_assignment(self, index):
        """`if TEST: T = VALUE` (no else) holding row `index`, TEST a tensor, made
        `T = tf.where(TEST, VALUE, OLD)`: TensorFlow picks the value, T is set on
        both paths (a dict's key an `if` adds inside a traced loop, that tf.cond would
        have set on one branch only). OLD: `d.get(k, default)` where VALUE reads it
        (an accumulator: `d[k] = d.get(k, 0.0) + v`), else T itself (a name). False
        where the `if` is not of that form."""
        fn = self.tree()
        node = max((n for n in ast.walk(fn) if isinstance(n, ast.If)
                    and n.lineno <= index <= n.end_lineno), key=lambda n: n.lineno,
                   default=None)
        if (node is None or node.orelse or len(node.body) != 1
                or not isinstance(node.body[0], ast.Assign)
                or len(node.body[0].targets) != 1):
            return False
        target, value = node.body[0].targets[0], node.body[0].value
        old = None
        if isinstance(target, ast.Subscript):
            held, key = ast.unparse(target.value), ast.unparse(target.slice)
            old = next((n for n in ast.walk(value) if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                        and ast.unparse(n.func.value) == held and n.args
                        and ast.unparse(n.args[0]) == key), None)
            old = old and self.segment(old)
        elif isinstance(target, ast.Name):
            old = target.id
        if old is None:
            return False
        code = self.code(node.lineno)
        self._set_line(node, f"{self.segment(target)} = {self.tf_name}.where("
                             f"{self.segment(node.test)}, {self.segment(value)}, {old})")
        self.note("tensor_if", node.lineno, f"`{self.code(node.lineno)}`: TensorFlow "
                                            "picks the value; the key is set on both paths",
                  code)
        return True

    def _set_line(self, stmt, text):
        """Statement `stmt` (its rows) made the one line `text`."""
        indent = re.match(r"\s*", self.rows[stmt.lineno - 1][1]).group(0)
        self.rows[stmt.lineno - 1][1] = f"{indent}{text}\n"
        for i in range(stmt.lineno + 1, stmt.end_lineno + 1):
            self.rows[i - 1][1] = ""

    # -- the function, in memory and in the file
    def function(self):
        """The changed function, compiled in memory (its decorators left out)."""
        fn = self.tree()
        rows = ["\n" if i < fn.lineno - 1 else r[1] or "\n" for i, r in enumerate(self.rows)]
        src = textwrap.dedent("".join(rows))
        free = self.fn.__code__.co_freevars
        offset = 0
        if free:
            src = (f"def __kg_outer__({', '.join(free)}):\n" + textwrap.indent(src, "    ")
                   + f"    return {fn.name}\n")
            offset = 1
        name = self.copy_name
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        namespace = {}
        exec(compile(src, name, "exec"), self.fn.__globals__, namespace)  # noqa: S102
        made = namespace[fn.name]
        if free:
            cells = [c.cell_contents for c in self.fn.__closure__]
            made = namespace["__kg_outer__"](*cells)
        if self.autograph:
            import tensorflow as tf

            made = tf.autograph.to_graph(made)
        made.__kg_offset__ = offset
        return made

    # -- the functions the step calls
    def callee(self, fn, owner, attr):
        """The `_Step` of `fn` (`owner.attr`, a function the step calls), made once."""
        found = next((c for c in self.callees if c.fn is fn or c.copy_name
                      == f"{_COPY}{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}>"),
                     None)
        if found is None:
            if "__class__" in fn.__code__.co_freevars:
                raise CannotPatch(f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}",
                                  fn.__name__, "it calls super(): diagnose cannot copy it")
            found = _Step(fn)
            found.owner, found.attr = owner, attr
            found.changes = self.changes  # one list: the step's and its callees' changes
            found.saved = vars(owner)[attr]  # put back by `uninstall`
            self.callees.append(found)
        return found

    def install(self):
        """Puts each changed callee's copy where the step finds it (its class or module)."""
        for c in self.callees:
            setattr(c.owner, c.attr, c.function())

    def uninstall(self):
        for c in self.callees:
            setattr(c.owner, c.attr, c.saved)

    def convert(self):
        """Makes a callee that AutoGraph does not reach (called through Keras: a loss's or
        layer's `call`) converted by the patch: `@tf.autograph.to_graph` above its def."""
        fn = self.tree()
        row = fn.lineno - 1
        self.rows.insert(row, [None, f"{self.indent}@{self.tf_name}.autograph.to_graph\n"])
        self.autograph = True
        self.note("autograph", row + 2, f"`@{self.tf_name}.autograph.to_graph` above it: "
                                        "AutoGraph makes its Python `if`s on tensors "
                                        "tf.cond (it is called through Keras, which AutoGraph "
                                        "does not convert)")

    def constant_of_tensor(self, index):
        """`tf.constant(t, ...)` on row `index` (a tensor: graph mode refuses it) as
        `tf.convert_to_tensor(t, ...)`; False when none."""
        node = next((n for n in ast.walk(self.tree()) if getattr(n, "lineno", None) == index
                     and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and n.func.attr == "constant" and getattr(n.func.value, "id", None)
                     == self.tf_name), None)
        if node is None:
            return False
        code = self.code(index)
        if not self.replace(node.func, f"{self.tf_name}.convert_to_tensor"):
            return False
        self.note("constant_of_tensor", index, f"`{self.code(index)}`: tf.constant takes no "
                                               "tensor in a graph; tf.convert_to_tensor does",
                  code)
        return True

    def text_as_file(self, jit=False):
        """The function as the patched file holds it: the step with its `tf.function`
        wrapper, a callee as changed."""
        return self.new_text(jit) if self.owner is None else "".join(r[1] for r in self.rows)

    def new_text(self, jit):
        """The function as the patched file holds it: `@tf.function` (with
        `jit_compile=True` where `jit`) above its def, in a wrapper of its name that
        runs the moved statements after it where there are any."""
        fn = self.tree()
        rows = [r[1] for r in self.rows]
        def_row = fn.lineno - 1
        deco = f"{self.indent}@{self.tf_name}.function" + ("(jit_compile=True)" if jit else "")
        if not self.moved:
            return "".join(rows[:def_row]) + deco + "\n" + "".join(rows[def_row:])
        compiled = f"_{fn.name}_compiled"
        rows[def_row] = rows[def_row].replace(f"def {fn.name}(", f"def {compiled}(", 1)
        args = fn.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        method = bool(positional) and "." in self.fn.__qualname__.rpartition("<locals>.")[2]
        call = positional[1:] if method else positional
        call = (call + ([f"*{args.vararg.arg}"] if args.vararg else [])
                + [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
                + ([f"**{args.kwarg.arg}"] if args.kwarg else []))
        target = f"{positional[0]}.{compiled}" if method else compiled
        body = "".join(textwrap.indent(m, self.indent + "    ") for m in self.moved)
        wrapper = (f"{self.indent}def {fn.name}({ast.unparse(args)}):\n"
                   f"{self.indent}    result = {target}({', '.join(call)})\n"
                   f"{body}{self.indent}    return result\n\n")
        return (wrapper + "".join(rows[:def_row]) + deco + "\n" + "".join(rows[def_row:]))


def _reads(node):
    """The names `node` reads (a comprehension's own names left out)."""
    own = {t.id for c in ast.walk(node) if isinstance(c, ast.comprehension)
           for t in ast.walk(c.target) if isinstance(t, ast.Name)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)} - own


def _bound_before(fn, loop):
    """The names bound where `loop` starts: the step's parameters, what the statements
    before it set, and every name the step never sets (globals, builtins)."""
    args = fn.args
    params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                              args.kwarg) if a is not None}
    set_anywhere = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                    and isinstance(n.ctx, ast.Store)}
    before = {n.id for s in ast.walk(fn) if isinstance(s, ast.stmt) and s is not fn
              and s.end_lineno < loop.lineno for n in ast.walk(s)
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    return params | before | (reads - set_anywhere)


def _holder_of(held, fn, eager_locals, space):
    """`ARG.trainable_variables` or `ARG.ATTR.trainable_variables` (ARG a parameter of
    the step, or a global it reads) whose list is `held` (the same variables, in order),
    or None."""
    if not isinstance(held, (list, tuple)) or not held:
        return None
    want = [id(v) for v in held]
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    owners = [(n, eager_locals.get(n)) for n in names]
    owners += [(n, space[n]) for n in sorted(_reads(fn) - set(names)) if n in space]
    for name, obj in owners:
        if obj is None:
            continue
        candidates = [(name, obj)] + [(f"{name}.{k}", v) for k, v in
                                      list(getattr(obj, "__dict__", {}).items())]
        for text, value in candidates:
            try:
                found = getattr(value, "trainable_variables", None)
            except Exception:  # noqa: BLE001 - a property that raises
                continue
            if isinstance(found, (list, tuple)) and [id(v) for v in found] == want:
                return f"{text}.trainable_variables"
    return None


def _eager_value(name, eager_locals):
    """The eager step's last value of `name` (`d['k']`: the key's of the dict `d`)."""
    node = ast.parse(name, mode="eval").body
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        held = (eager_locals or {}).get(node.value.id)
        try:
            return held.get(ast.literal_eval(node.slice)) if isinstance(held, dict) else None
        except ValueError:
            return None
    return (eager_locals or {}).get(name)


def _shape_item(node, tf_name):
    """Whether `node` is `tf.shape(x)[i]` (`x` a name or attribute, `i` a number)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    return (isinstance(call.func, ast.Attribute) and call.func.attr == "shape"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == tf_name
            and len(call.args) == 1 and not call.keywords
            and all(isinstance(n, (ast.Name, ast.Attribute, ast.Load))
                    for n in ast.walk(call.args[0])))


def _block_of(fn, node):
    """The statement list holding `node`."""
    for parent in ast.walk(fn):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and node in block:
                return block
    return fn.body


def _none_update(loop, name):
    """(statement, value when None, value after) of `name = A if name is None else B`
    or `if name is None: name = A else: name = B` in `loop`, or None."""
    def is_none_test(test):
        return (isinstance(test, ast.Compare) and getattr(test.left, "id", None) == name
                and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0],
                                                                   ast.Constant)
                and test.comparators[0].value is None)

    for node in ast.walk(loop):
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                 for t in node.targets)
                and isinstance(node.value, ast.IfExp) and is_none_test(node.value.test)):
            return node, node.value.body, node.value.orelse
        if (isinstance(node, ast.If) and is_none_test(node.test) and len(node.body) == 1
                and len(node.orelse) == 1 and all(isinstance(s, ast.Assign)
                                                  for s in (*node.body, *node.orelse))):
            return node, node.body[0].value, node.orelse[0].value
    return None


def _gradient_sources(fn, value):
    """The sources (`model.trainable_variables`) of the tape gradient `value` is
    (`tape.gradient(loss, SOURCES)`, directly or by a name set to it), or None."""
    if isinstance(value, ast.Name):
        value = next((n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                      and any(getattr(t, "id", None) == value.id for t in n.targets)
                      and isinstance(n.value, ast.Call)), None)
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "gradient" and len(value.args) >= 2):
        return ast.unparse(value.args[1])
    return None


def _as_tuple(text):
    """`[a + g for ...]` as `tuple(a + g for ...)`; other values wrapped in tuple()."""
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.ListComp):
        return f"tuple({text.strip()[1:-1].strip()})"
    return f"tuple({text})"


def _zeros_of(value, tf_name):
    """`tf.zeros(shape, dtype)` source for a tensor `value` (0 / 0.0 for a number; a
    list or tuple of them for one of tensors)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (list, tuple)) and value:
        items = [_zeros_of(v, tf_name) for v in value]
        if None in items:
            return None
        return (f"[{', '.join(items)}]" if isinstance(value, list)
                else f"({', '.join(items)},)")
    if isinstance(value, (int, float)):
        return repr(type(value)(0))
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    return f"{tf_name}.zeros({list(shape)}, {tf_name}.{getattr(dtype, 'name', dtype)})"


def _frames(exc):
    """(file, line) of each frame the error names: AutoGraph's "in user code:" frames
    in its message, then its traceback's."""
    text = str(exc)
    out = [(m.group(1), int(m.group(2)))
           for m in re.finditer(r'File "([^"]+)", line (\d+)', text)]
    out += [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    return out


def _message(exc):
    """TensorFlow's message: its error's line (AutoGraph puts it after the frames) and the
    first sentence of a note after it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    at = next((i for i, line in enumerate(lines)
               if re.match(r"\w+(Error|Exception): ", line)), None)
    if at is None:
        text = lines[-1] if lines else ""
        return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"
    note = next((line for line in lines[at + 1:] if line.startswith("Note:")), "")
    return _first_sentence(lines[at]) + (f" ({_first_sentence(note)})" if note else "")


def _first_sentence(text):
    """`text` up to its first sentence's end (TensorFlow's advice after it left out)."""
    return re.sub(r"(?<=[a-z`'\)])\. [A-Z].*", ".", text)


#: The file name of a copy compiled in memory (the step's path and ">" after it).
_COPY = "<keras_gpufix patched "


def _fix_error(step, made, exc, library, eager_locals, args=()):
    """Makes the change the trace's error names (raises `CannotPatch` where it cannot)."""
    offset = made.__kg_offset__
    frames = _frames(exc)
    message = _message(exc)
    # any copy's name but its callees': AutoGraph caches a conversion by its code object,
    # equal for the same source whatever its file, so a copy made before of the same step
    # can be named
    callees = {c.copy_name for c in step.callees}
    mine = [line - offset for f, line in frames if f.startswith(_COPY) and f not in callees]
    others = [(f, line) for f, line in frames  # "<...>": a copy's, or no file's
              if f in callees or (not f.startswith(library) and not f.startswith("<")
                                  and "__autograph_generated" not in f and os.path.exists(f))]
    if not mine:
        where = f"{others[-1][0]}:{others[-1][1]}" if others else step.where(1)
        code = linecache.getline(*others[-1]).strip() if others else ""
        raise CannotPatch(where, code, message)
    # the deepest line of the copy the message names (AutoGraph's frames come first)
    text_frames = [line - offset for f, line in
                   ((m.group(1), int(m.group(2)))
                    for m in re.finditer(r'File "([^"]+)", line (\d+)', str(exc)))
                   if f.startswith(_COPY) and f not in callees]
    index = (text_frames or mine)[-1]
    at = next((i for i, (f, line) in enumerate(frames)
               if f.startswith(_COPY) and f not in callees and line == index + offset), None)
    deeper = [] if at is None else [(f, line) for f, line in others
                                    if (f, line) in frames[at + 1:]]
    loop_name = _LOOP_NAME.search(message)
    trial, step.shape_trial = step.shape_trial, None
    if loop_name and trial is not None:  # the shapes' numbers left the loop a tensor loop
        step.rows, step.changes[:] = trial
    elif loop_name and not step.shapes_tried:  # a Python count keeps a Python loop
        step.shapes_tried = True
        saved = ([list(r) for r in step.rows], list(step.changes))
        if step.static_shapes():
            step.shape_trial = saved
            return
    if loop_name:
        step.define_before_loop(loop_name.group(1), index, eager_locals, message)
        return
    if deeper and _fix_callee(step, deeper, message, args):
        return
    if deeper:
        f, line = deeper[-1]
        if f in callees:
            callee = next(c for c in step.callees if c.copy_name == f)
            f, line = callee.path, int(callee.where(line - callee.function().__kg_offset__)
                                       .rpartition(":")[2])
        raise CannotPatch(f"{f}:{line}", linecache.getline(f, line).strip(),
                          f"{message} (in a function the step calls: diagnose changes only the "
                          "step's own lines)")
    if (("Undefined" in message or "else branch" in message)
            and step.conditional_assignment(index)):
        return
    if ("numpy" in message or "item" in message or "__float__" in message or "float()" in message
            or "int()" in message or "OperatorNotAllowed" in message or "bool" in message):
        if step.remove_reads(index) or step.reduce_in_tf(index):
            return
    raise CannotPatch(step.where(index), step.original(index), message)


def _function_at(path, line, args):
    """(owner, name, function) of the plain function defined in `path` whose code holds
    `line`: a method of the class of an argument of the step or of one of its attributes
    (a trainer's loss), or a function or method of the module loaded from `path`; the
    innermost; None where none is (a closure, a decorated function)."""
    path = os.path.abspath(path)
    owners = [m for m in list(sys.modules.values())
              if os.path.abspath(getattr(m, "__file__", None) or "?") == path]
    owners += [v for m in owners[:] for v in vars(m).values() if isinstance(v, type)]
    for arg in args:
        for obj in (arg, *list(getattr(arg, "__dict__", {}).values())):
            owners += list(type(obj).__mro__)
    found = []
    for owner in owners:
        for name, value in list(vars(owner).items()):
            code = getattr(value, "__code__", None)
            if not inspect.isfunction(value) or os.path.abspath(code.co_filename) != path:
                continue
            lines = [n for _, _, n in code.co_lines() if n is not None]
            if code.co_firstlineno <= line <= max(lines, default=0):
                found.append((code.co_firstlineno, owner, name, value))
    if not found:
        return None
    _, owner, name, value = max(found, key=lambda f: f[0])
    return owner, name, value


def _fix_callee(step, deeper, message, args):
    """Makes the change the trace's error names in a function the step calls (`deeper`:
    the error's user frames below the step, `(file, line)`, outermost first): a Python
    `if` on a tensor where AutoGraph does not reach (the callee entered from Keras, whose
    calls it does not convert: the outermost such function `convert`ed), `tf.constant`
    of a tensor at the deepest (`constant_of_tensor`). False where it makes none."""
    copies = {c.copy_name: c for c in step.callees}

    def callee_at(f, line):
        if f in copies:
            return copies[f], line - copies[f].function().__kg_offset__
        found = _function_at(f, line, args)
        if found is None:
            return None, None
        callee = step.callee(found[2], found[0], found[1])
        return callee, callee.index_of(line)

    if "as a Python `bool`" in message:  # raised where AutoGraph did not convert
        callee, _ = callee_at(*deeper[0])
        if callee is None or callee.autograph:
            return False
        callee.convert()
    elif "but got Tensor" in message or "SymbolicTensor" in message:
        callee, index = callee_at(*deeper[-1])
        if callee is None or index is None or not callee.constant_of_tensor(index):
            return False
    else:
        return False
    step.install()
    return True


#: How deep `_variables` looks into the objects the step reaches (a trainer's model's
#: optimizer is three attributes in; a layer's, model's or optimizer's `variables`
#: count from 0 again).
_REACH = 4


def _names(code):
    """The global names a code object and the code objects nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def _variables(fn, args, kwargs):
    """The tf.Variables the step reaches (its weights, optimizer slots, accumulators):
    those of its arguments, its closure and the module globals it uses, and of the
    functions and objects those name, `_REACH` levels deep. Never every live variable
    of the process: another model's, or one of a strategy or graph gone by, cannot be
    read or put back here."""
    import tensorflow as tf

    proxies = (weakref.ProxyType, weakref.CallableProxyType)  # a dead one raises on isinstance
    out, seen = [], set()
    queue = collections.deque([(fn, 0)] + [(a, 1) for a in (*args, *(kwargs or {}).values())])
    while queue:  # breadth first: each object seen first at its least depth
        obj, depth = queue.popleft()
        if id(obj) in seen or isinstance(obj, proxies) or depth > _REACH:
            continue
        seen.add(id(obj))
        if isinstance(obj, tf.Variable):
            out.append(obj)
        elif inspect.isfunction(obj) or inspect.ismethod(obj):
            function = getattr(obj, "__func__", obj)
            space = function.__globals__
            queue.append((getattr(obj, "__self__", None), depth + 1))
            queue.extend((space[n], depth + 1) for n in _names(function.__code__) & set(space))
            for cell in function.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    queue.append((cell.cell_contents, depth + 1))
        elif isinstance(obj, (list, tuple, set)):
            queue.extend((item, depth + 1) for item in obj)
        elif isinstance(obj, dict):
            queue.extend((item, depth + 1) for item in obj.values())
        elif not isinstance(obj, (type, types.ModuleType, str, bytes, int, float)) \
                and obj is not None:
            variables = getattr(obj, "variables", None)  # a Keras layer, optimizer, metric
            if isinstance(variables, (list, tuple)):  # a Keras variable holds its tf.Variable
                queue.extend((v, 0) for v in variables)
            attributes = list(getattr(obj, "__dict__", {}).values())
            queue.extend((item, depth + 1) for item in attributes)
    return out


class _State:
    """The variables' values and the arguments' Python state, to put back."""

    def __init__(self, variables, args, kwargs, fn):
        self.values = []
        for v in variables:
            try:
                self.values.append((v, v.numpy()))
            except Exception:  # noqa: BLE001 - a variable not readable here (uninitialized)
                continue
        # plain Python values of the arguments' attributes (a trainer's step count, its
        # lists and dicts copied); a layer's or model's state is its variables
        objects = [a for a in (*args, *kwargs.values()) if hasattr(a, "__dict__")
                   and not hasattr(a, "numpy") and not hasattr(a, "trainable_variables")]
        self.objects = [(o, {k: (v.copy() if type(v) in (list, dict) else v)
                             for k, v in vars(o).items()
                             if type(v) in (int, float, bool, str, list, dict, type(None))})
                        for o in objects]
        names = set(fn.__code__.co_names) & set(fn.__globals__)
        self.globals = fn.__globals__, {k: fn.__globals__[k] for k in names
                                        if isinstance(fn.__globals__[k], (int, float, str))}

    def restore(self):
        for variable, value in self.values:
            variable.assign(value)
        for o, saved in self.objects:
            o.__dict__.update(saved)
        space, saved = self.globals
        space.update(saved)


def saved_state(args, kwargs, fn):
    """The values of the variables `fn` reaches and the Python state of `fn`'s arguments (and the
    numbers of its module it names), saved: `.restore()` puts them back."""
    return _State(_variables(fn, args, kwargs), args, kwargs or {}, fn)


def _leaves(result):
    import numpy as np
    import tensorflow as tf

    out = []
    for leaf in tf.nest.flatten(result):
        try:
            out.append(np.asarray(leaf, dtype=np.float64))
        except (TypeError, ValueError):
            continue
    return out


def _eager_run(fn, args, kwargs):
    """(returned value, each local's last value) of one eager call of `fn`."""
    import sys

    seen = {}
    code = fn.__code__

    def profile(frame, event, arg):
        if event == "return" and frame.f_code is code:
            seen.update(frame.f_locals)

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return result, seen


def _same(eager, patched, before, after, rtol=SAME_RTOL, atol=SAME_ATOL):
    """Why the patched step's result differs from the eager one's, or None."""
    import numpy as np

    a, b = _leaves(eager), _leaves(patched)
    if len(a) != len(b):
        return f"it returns {len(b)} values where the eager step returns {len(a)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            return f"its returned value {i} differs ({x.ravel()[:3]} eager, {y.ravel()[:3]})"
    changed = 0
    for (v, x), y in zip(before, after):
        if x.shape != y.shape or not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            changed += 1
            if changed == 1:
                first = v.name
    if changed:
        return f"{changed} variable(s) end different (the first: {first})"
    return None


def _ops(graph, seen=None):
    """Every op of `graph` and of the functions it calls (a while loop's body)."""
    seen = seen if seen is not None else set()
    for op in graph.get_operations():
        yield op
    for function in list(getattr(graph, "_functions", {}).values()):
        inner = getattr(function, "graph", None)
        if inner is not None and id(inner) not in seen:
            seen.add(id(inner))
            yield from _ops(inner, seen)


def _op_where(graph, op_type, library, step, made):
    """`file:line` of the user's code that made the first `op_type` op (a copy's line
    as the file's line; code AutoGraph generated left out: its user's line is the
    deepest one left)."""
    copy, offset = (step.copy_name, made.__kg_offset__) if made is not None else (None, 0)
    callees = {c.copy_name: c for c in step.callees} if step is not None else {}
    for op in _ops(graph):
        if op.type != op_type:
            continue
        frames = [f for f in op.traceback if not f.filename.startswith(library)
                  and "__autograph_generated" not in f.filename]
        if not frames:
            return None
        f = frames[-1]
        if f.filename in callees:
            callee = callees[f.filename]
            return callee.where(f.lineno - callee.function().__kg_offset__)
        return (step.where(f.lineno - offset) if copy and f.filename.startswith(copy)
                else f"{f.filename}:{f.lineno}")
    return None


def make_runnable(fn, args, kwargs=None, library=(), static=()):
    """The user's eager step changed until `tf.function` runs it, checked to compute
    what the eager step computes, and tried with `jit_compile=True`.

    Args:
        fn: the step's Python function (a method's function, `self` in `args`).
        args, kwargs: the arguments of its last call in the run (its batch).
        library: path prefixes of library code (never named as the user's line).
        static: `step_blockers`'s static blockers (`python_state`, `host_read`), changed
            first.

    Returns:
        A dict `runs` (whether the patched copy traced and ran), `changes` (each
        `kind`, `where`, `code`, `change`), `traces` (how many), and where it runs:
        `same` (True, or the reason it differs: `differs`), `tolerance` (`rtol`, `atol`,
        `why`: the tolerance it was the same within), `function` (the copy in
        `tf.function`) and `xla_function`, `xla_error`, `xla_op`, `xla_where`
        (None where XLA ran it), `first_call_s` (each way's trace, compile and first
        call, by `tf.function` / `tf.function(jit_compile=True)`), `step` (for
        `write_patch`); where it does not:
        `blocker` (`where`, `code`, `message`: the line it could not change, with
        TensorFlow's message) and `unchecked` (what was not checked).
    """
    import tensorflow as tf

    kwargs = kwargs or {}
    if not library:
        from keras_gpufix.diagnose.loop_patch import _library_prefixes

        library = _library_prefixes()
    library = tuple(library)
    out = {"runs": False, "changes": [], "traces": 0, "copied": False}
    try:
        step = _Step(fn)
        step.tree()
    except (OSError, TypeError, SyntaxError, CannotPatch) as exc:
        out["blocker"] = {"where": f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}",
                          "code": "", "message": f"its source cannot be read as a def ({exc})"}
        out["unchecked"] = "the step was not changed nor traced"
        return out
    out["changes"], out["copied"] = step.changes, True
    state = saved_state(args, kwargs, fn)
    first_call_s = {}
    try:
        try:
            eager, eager_locals = _eager_run(fn, args, kwargs)
            eager_after = [v.numpy() for v, _ in state.values]
        finally:
            state.restore()
        for blocker in sorted(static, key=lambda b: -int(b["where"].rpartition(":")[2])):
            index = step.index_of(int(blocker["where"].rpartition(":")[2]))
            if index is None:
                continue
            if blocker["kind"] == "python_state":
                step.move_state(index)
            elif blocker["kind"] == "host_read":
                step.remove_reads(index)
        for _ in range(MAX_TRACES):
            made = step.function()
            function = tf.function(made)
            out["traces"] += 1
            t0 = time.perf_counter()
            try:
                concrete = function.get_concrete_function(*args, **kwargs)
                first_call_s["tf.function"] = time.perf_counter() - t0
                break
            except Exception as exc:  # the next change the trace names
                _fix_error(step, made, exc, library, eager_locals, (*args, *kwargs.values()))
        else:
            raise CannotPatch(step.where(1), step.original(1),
                              f"still failing after {MAX_TRACES} traces")
        try:
            t0 = time.perf_counter()
            patched = function(*args, **kwargs)
            first_call_s["tf.function"] += time.perf_counter() - t0
            patched_after = [v.numpy() for v, _ in state.values]
        except Exception as exc:
            raise CannotPatch(step.where(1), step.original(1), _message(exc)) from exc
        finally:
            state.restore()
    except CannotPatch as exc:
        out["blocker"] = {"where": exc.where, "code": exc.code, "message": exc.message}
        out["unchecked"] = ("the changes after it (and whether the step then computes the same "
                            "result, and its speed) were not checked")
        return out
    except Exception as exc:  # noqa: BLE001 - the eager step itself, or a change gone wrong
        out["blocker"] = {"where": step.where(1), "code": step.code(1),
                          "message": f"diagnose could not run or change it: "
                                     f"{type(exc).__name__}: {_first_sentence(str(exc))}"}
        out["unchecked"] = "the step's changes, result and speed were not checked"
        return out
    finally:
        state.restore()
        step.uninstall()
    before = [(v, x) for (v, _), x in zip(state.values, eager_after)]
    for rtol, atol, why in ((SAME_RTOL, SAME_ATOL, "float sums in another order"),
                            (SPREAD_RTOL, SPREAD_ATOL, "a seeded trainer's spread between runs")):
        differs = _same(eager, patched, before, patched_after, rtol, atol)
        if differs is None:
            out["tolerance"] = {"rtol": rtol, "atol": atol, "why": why}
            break
    out.update(runs=True, same=differs is None, differs=differs, function=function,
               step=step, xla_function=None, xla_error=None, xla_op=None, xla_where=None,
               first_call_s=first_call_s)
    xla = tf.function(made, jit_compile=True)
    try:
        step.install()
        t0 = time.perf_counter()
        xla(*args, **kwargs)
        first_call_s["tf.function(jit_compile=True)"] = time.perf_counter() - t0
        out["xla_function"] = xla
    except Exception as exc:  # an op XLA cannot compile
        out.update(xla_refusal(exc, concrete.graph, library, step, made))
    finally:
        state.restore()
        step.uninstall()
    return out


def xla_refusal(exc, graph, library, step=None, made=None):
    """`xla_error` (the error's first line), `xla_op` (the op XLA has no kernel for) and
    `xla_where` (the user's line that made it, a copy's line as the file's) of
    `jit_compile=True`'s error `exc` on the step traced as `graph`."""
    text = str(exc)
    op = (re.search(r"No registered '(\w+)' OpKernel", text)
          or re.search(r"XLA_\w+_JIT: (\w+)", text))
    return {"xla_error": f"{type(exc).__name__}: " + next(
        (line for line in text.splitlines() if line.strip()), ""),
        "xla_op": op and op.group(1),
        "xla_where": op and _op_where(graph, op.group(1), library, step, made)}


def write_patch(step, folder, jit=False, cwd=None):
    """Writes the step's changes, with its `tf.function` wrapper, and those of the
    functions it calls that the copy changed, as a unified diff `patch -p1` applies
    from `cwd` (the folder diagnose ran in); returns its path, or None when a changed
    file is not under `cwd`."""
    cwd = os.path.abspath(cwd or os.getcwd())
    by_file = {}
    for made in (step, *step.callees):
        by_file.setdefault(os.path.abspath(made.path), []).append(made)
    diff = []
    for path, made in sorted(by_file.items()):
        relative = os.path.relpath(path, cwd)
        if relative.startswith(os.pardir):
            return None
        with open(path, encoding="utf-8") as f:
            old = f.read().splitlines(True)
        new = list(old)
        for one in sorted(made, key=lambda m: -m.first):  # the last first: lines stay put
            start = one.first - 1
            new[start:start + len([r for r in one.rows if r[0] is not None])] = (
                one.text_as_file(jit).splitlines(True))
        diff += difflib.unified_diff(old, new, f"a/{relative}", f"b/{relative}")
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "step.patch")
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(diff)
    return out


def _tf_name(tree):
    """The name the module imports TensorFlow as (`tf` when it does not)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tensorflow":
                    return alias.asname or "tensorflow"
    return "tf"


def _map_call(tree, line):
    """The `.map(...)` call (or, where none, any dataset call) made at `line`: the one
    whose `.map` is on that line, else the one starting there."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute)]
    for test in (lambda n: n.func.attr == "map" and n.func.end_lineno == line,
                 lambda n: n.func.attr == "map" and n.lineno == line,
                 lambda n: n.func.end_lineno == line):
        found = [n for n in calls if test(n)]
        if found:
            return min(found, key=lambda n: (n.end_lineno, n.end_col_offset))
    return None


def _repeats(call):
    """The `.repeat(...)` calls in the chain `call` is made on (its receiver, its
    receiver's, ...), nearest first."""
    out, node = [], call.func.value
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "repeat":
            out.append(node)
        node = node.func.value
    return out


def _cache_edits(call, lines, filename=None):
    """The edits that cache `call`'s output: `.cache()` after it (`.cache(filename)`:
    on disk, where a cache pays only from the script's next run); where the call is
    made on `.repeat(...)` (on one line), that repeat moved after the cache (a cache
    after a repeat never fills: it never serves and holds every element it saw);
    none where a repeat is further up the chain (moving it past the calls between
    could change the data)."""
    cache = f".cache({filename!r})" if filename else ".cache()"
    repeats = _repeats(call)
    if not repeats:
        return [(call.end_lineno, call.end_col_offset, call.end_col_offset, cache)]
    repeat = repeats[0]
    start = repeat.func.value
    if len(repeats) > 1 or repeat is not call.func.value or (
            start.end_lineno != repeat.end_lineno):
        return []
    text = lines[repeat.end_lineno - 1][start.end_col_offset:repeat.end_col_offset]
    return [(repeat.end_lineno, start.end_col_offset, repeat.end_col_offset, ""),
            (call.end_lineno, call.end_col_offset, call.end_col_offset, cache + text)]


def _input_edits(tree, lines, stage, prefetch_lines, tf_name, filename=None):
    """(line, start column, end column, text) edits of one file: `.cache()` after the
    slow stage's call (`_cache_edits`; on disk at `filename` where given), or
    `num_parallel_calls=AUTOTUNE` on it; `.prefetch(AUTOTUNE)` at the end of each
    statement a scan named for no prefetch."""
    edits = []
    autotune = f"{tf_name}.data.AUTOTUNE"
    if stage is not None:
        kind, line = stage
        call = _map_call(tree, line)
        if call is not None and kind in ("python", "cache", "source"):
            edits += _cache_edits(call, lines, filename)
        elif call is not None and kind == "parallel":
            keyword = next((k for k in call.keywords if k.arg == "num_parallel_calls"), None)
            if keyword is not None:
                edits.append((keyword.value.lineno, keyword.value.col_offset,
                              keyword.value.end_col_offset, autotune))
            elif lines[call.end_lineno - 1][call.end_col_offset - 1] == ")":
                edits.append((call.end_lineno, call.end_col_offset - 1, call.end_col_offset - 1,
                              f", num_parallel_calls={autotune}"))
    for line in prefetch_lines:
        stmt = next((s for s in ast.walk(tree) if isinstance(s, (ast.Assign, ast.Expr))
                     and s.lineno <= line <= s.end_lineno), None)
        value = getattr(stmt, "value", None)
        if isinstance(value, ast.Call):
            edits.append((value.end_lineno, value.end_col_offset, value.end_col_offset,
                          f".prefetch({autotune})"))
    return edits


def input_patch(fixes, scan, folder, cwd=None):
    """Writes the `input_bound` fix that is an edit at a named line as `input.patch`
    in `folder` (a unified diff `patch -p1` applies from `cwd`): `.cache()` after the
    measured slow stage (Python work, a slow map even in parallel, a slow source; the
    `.repeat()` it is made on moved after the cache, none where a repeat is further up;
    on disk, `.cache("<script>_<line>.tfcache")` in the folder the script runs in, where
    a cache in memory gains nothing in the script's run and a cache on disk gains in
    each later run: `analysis.on_disk_cache`), `num_parallel_calls=tf.data.AUTOTUNE`
    on a map run one element at a time, and `.prefetch(tf.data.AUTOTUNE)` where the
    scan found none. Sets the fix's `patch` (its path) and returns it; None where no
    edit applies (a fix only the user can choose, such as how often to plot, names its
    line and has no patch)."""
    fix = next((f for f in fixes if f.get("verdict") == "input_bound"), None)
    if fix is None:
        return None
    cwd = os.path.abspath(cwd or os.getcwd())
    predicted = fix.get("predicted") or {}
    on_disk = on_disk_cache(predicted.get("speedup") if predicted.get("whole_run") else None,
                            predicted.get("speedup_later_runs"))
    by_file = {}
    stage = fix.get("stage") or {}
    if stage.get("where") and stage.get("kind"):
        path, _, line = stage["where"].rpartition(":")
        if line.isdigit():
            by_file.setdefault(os.path.abspath(path), [None, []])[0] = (stage["kind"], int(line))
    for finding in scan or ():
        if finding.get("trap") == "no_prefetch" and finding.get("ran") is not False:
            by_file.setdefault(os.path.abspath(finding["file"]), [None, []])[1].append(
                finding["line"])
    diffs = []
    for path, (stage_at, prefetch_lines) in sorted(by_file.items()):
        relative = os.path.relpath(path, cwd)
        if relative.startswith(os.pardir):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        old = text.splitlines(True)
        new = list(old)
        filename = (f"{os.path.splitext(os.path.basename(path))[0]}_{stage_at[1]}.tfcache"
                    if on_disk and stage_at else None)
        for line, start, end, insert in sorted(_input_edits(
                tree, old, stage_at, prefetch_lines, _tf_name(tree), filename), reverse=True):
            row = new[line - 1]
            new[line - 1] = row[:start] + insert + row[end:]
        if new != old:
            diffs += difflib.unified_diff(old, new, f"a/{relative}", f"b/{relative}")
    if not diffs:
        return None
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "input.patch")
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(diffs)
    edits = [line[1:].strip() for line in diffs if line.startswith("+") and not
             line.startswith("+++")]
    fix["patch"] = out
    fix["fix"] += INPUT_PATCH_NOTE.format(patch=out, edits="; ".join(f"`{e}`" for e in edits))
    if on_disk:
        fix["fix"] += ON_DISK_NOTE
    return out


def attach_patches(fixes, fits, scan, folder, cwd=None):
    """Names each ranked fix's patch in it (`patch`): the eager step's (`compile_step`
    wrote it; the step's `def` then comes first in the fix's `where`: the line the
    patch compiles, which the headline names) and the input's (`input_patch`, written
    here)."""
    eager = next((f for f in fixes if f.get("verdict") == "eager_step"), None)
    compiled = next((f["compiled_step"] for f in fits
                     if (f.get("compiled_step") or {}).get("patch")), None)
    if eager is not None and compiled:
        eager["patch"] = compiled["patch"]
        at = re.search(r"\((\S+:\d+)\)$", compiled.get("function") or "")
        if at:
            eager["where"] = [f"{at.group(1)}: the step's def, which the patch compiles"] + [
                w for w in eager.get("where") or () if not w.startswith(at.group(1) + ":")]
    if folder is not None:
        input_patch(fixes, scan, folder, cwd)
