"""The bounded Jinja sandbox that renders chat templates (the limits that
:mod:`.template`'s docstring lists; a limit raises :class:`RenderLimit`).

It imports Jinja2 (which comes with llama-cpp-python), so :mod:`.template` imports
this module only when a template is compiled.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["BoundedSandbox", "RenderLimit", "build_env", "SIZE_LIMIT", "SIZE_PER_INPUT", "TIME_LIMIT", "MAX_RANGE"]

SIZE_LIMIT = 1_000_000  # characters of a string (or items of a list) a template may build ...
SIZE_PER_INPUT = 4  # ... plus this many times the characters of the messages
TIME_LIMIT = 2.0  # seconds of rendering
MAX_RANGE = 100_000  # items of one range()
MAX_POW_BITS = 64_000  # an integer product or power may have this many bits


class RenderLimit(Exception):
    """A rendering limit was hit (turned into a MarsError by ChatTemplate)."""


def _size(x: Any) -> int:
    if isinstance(x, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(x)
    return 0


def _deep_size(x: Any, budget: int) -> int:
    """About how many characters str(x) has; stops counting past ``budget``
    (so a list holding one large list a thousand times costs little to judge)."""
    total, stack = 0, [x]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 * len(v) + 2
            if total <= budget:
                stack.extend(v)
        elif isinstance(v, dict):
            total += 4 * len(v) + 2
            if total <= budget:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        else:
            total += 8
        if total > budget:
            break
    return total


_PCT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FMT_NUM = re.compile(r"\d+")


def _replaced_size(s: str, old: str, new: str, count: int = -1) -> int:
    n = (len(s) + 1) if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


class IgnoreGenerationTags(Extension):
    """Pass-through for Hugging Face's ``{% generation %}`` tag."""

    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)

class BoundedRange:
    """range() whose iteration checks the render's time limit."""

    def __init__(self, env, r: range):
        self._env, self._r = env, r

    def __iter__(self):
        tick = self._env._tick
        for n, v in enumerate(self._r):
            if not n & 1023:
                tick()
            yield v

    def __len__(self):
        return len(self._r)

    def __getitem__(self, i):
        return self._r[i]

    def __contains__(self, v):
        return v in self._r

    def __reversed__(self):
        return iter(BoundedRange(self._env, self._r[::-1]))

    def __repr__(self):
        return repr(self._r)

class BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` goes through environment.concat (bounded), not str_join;
    every ``{% for %}`` iterates through a generator that checks the time
    limit (so even an empty loop body cannot spin unbounded)."""

    def visit_Template(self, node, frame=None):
        for loop in node.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, "_mars_bounded_iter", [], [], None, None,
                                            lineno=loop.lineno)
        return super().visit_Template(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = BoundedCodeGenerator

    def __init__(self, **kw):
        super().__init__(finalize=self._finalize, **kw)
        self.limit = SIZE_LIMIT
        self.deadline = math.inf
        self.globals["range"] = self._range
        lipsum = self.globals.get("lipsum")
        if lipsum is not None:
            self.globals["lipsum"] = lambda n=5, html=True, min=20, max=100: lipsum(
                n if n <= 100 else 100, html, min, max if max <= 1000 else 1000)
        for name in list(self.filters):
            self.filters[name] = self._wrap_filter(name, self.filters[name])

    # -- limits
    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"rendering took longer than {TIME_LIMIT:g} s")

    def _refuse(self, what: str, n: int) -> None:
        if n > self.limit:
            raise RenderLimit(f"{what} would build {n:,} characters or items (the limit is {self.limit:,})")

    def _check(self, value: Any, what: str = "a value") -> Any:
        self._refuse(what, _size(value))
        return value

    def _check_args(self, what: str, args, kwargs=None) -> None:
        """Arguments that would print as more than the limit (nested lists)."""
        budget = self.limit
        n = _deep_size(args, budget) + (_deep_size(kwargs, budget) if kwargs else 0)
        self._refuse(what, n)

    def _finalize(self, value):
        if not isinstance(value, (str, int, float)) and value is not None:
            self._refuse("printing a value", _deep_size(value, self.limit))
        return value

    def concat(self, parts):
        self._tick()
        self._check_args("'~'", parts)
        out = "".join(map(str, parts))
        return self._check(out, "'~'")

    def _bounded_iter(self, iterable):
        self._tick()
        tick = self._tick
        for n, v in enumerate(iterable):
            if not n & 1023:
                tick()
            yield v

    def _range(self, *args):
        self._tick()
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise RenderLimit(f"range() of {len(r):,} items (the limit is {MAX_RANGE:,})")
        return BoundedRange(self, r)

    def _check_pct(self, fmt: str) -> None:
        for m in _PCT_SPEC.finditer(fmt):
            for g in m.groups():
                if g == "*":
                    raise RenderLimit("a '%*' width is not allowed in a chat template")
                if g is not None:
                    self._refuse("a '%' format width", int(g))

    def _check_format_spec(self, fmt: str) -> None:
        for spec in re.findall(r"\{[^{}]*?:([^{}]*)\}", fmt):
            for num in _FMT_NUM.findall(spec):
                self._refuse("a format width", int(num))
        if re.search(r"\{[^{}]*:[^{}]*\{", fmt):
            raise RenderLimit("nested format widths are not allowed in a chat template")

    # -- operators
    def call_binop(self, context, operator, left, right):
        self._tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    self._refuse("'*'", len(seq) * max(n, 0))
            if isinstance(left, int) and isinstance(right, int):
                bits = left.bit_length() + right.bit_length()
                if bits > MAX_POW_BITS:
                    raise RenderLimit(f"'*' would build a {bits:,}-bit number")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                bits = right * math.log2(abs(left))
                if bits > MAX_POW_BITS:
                    raise RenderLimit(f"'**' would build a {int(bits):,}-bit number")
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                self._refuse("'+'", len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            self._check_pct(left)
            self._check_args("'%'", right)
            return self._check(super().call_binop(context, operator, left, right), "'%'")
        return super().call_binop(context, operator, left, right)

    # -- calls and attributes
    def _precheck_str_method(self, obj, args, kwargs) -> None:
        s, name = obj.__self__, obj.__name__
        if name in ("center", "ljust", "rjust", "zfill"):
            width = args[0] if args else kwargs.get("width", 0)
            if isinstance(width, int):
                self._refuse(f"str.{name}()", width)
        elif name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int):
                self._refuse("str.expandtabs()", len(s) + s.count("\t") * max(size, 0))
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            self._refuse("str.replace()", _replaced_size(s, args[0], args[1], args[2] if len(args) > 2 else -1))
        elif name == "join" and args:
            items = args[0]
            if isinstance(items, (list, tuple)):
                self._refuse("str.join()", _deep_size(items, self.limit) + len(s) * max(len(items) - 1, 0))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        __self._tick()
        __self._check_args("a call", args, kwargs)
        if isinstance(getattr(__obj, "__self__", None), str) and hasattr(__obj, "__name__"):
            __self._precheck_str_method(__obj, args, kwargs)
        return __self._check(super().call(__context, __obj, *args, **kwargs), "a call")

    def wrap_str_format(self, value):
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        self._check_format_spec(value.__self__)

        def bounded(*args, **kwargs):
            self._tick()
            self._check_args("str.format()", args, kwargs)
            return self._check(fmt(*args, **kwargs), "str.format()")

        return bounded

    # -- filters
    def _wrap_filter(self, name, fn):
        pre = {
            "center": lambda v, width=80, *a, **k: self._refuse("center", width if isinstance(width, int) else 0),
            "indent": lambda v, width=4, *a, **k: self._refuse(
                "indent", (len(width) if isinstance(width, str) else width if isinstance(width, int) else 0)
                * (v.count("\n") + 1) + len(v)) if isinstance(v, str) else None,
            "replace": lambda v, old="", new="", count=None, *a, **k: self._refuse(
                "replace", _replaced_size(str(v), str(old), str(new), -1 if count is None else count)
            ) if isinstance(v, str) else None,
            "join": lambda v, d="", *a, **k: self._refuse(
                "join", _deep_size(v, self.limit) + _size(d) * len(v)) if isinstance(v, (list, tuple)) else None,
            "format": lambda v, *a, **k: self._check_pct(v) if isinstance(v, str) else None,
            "slice": lambda v, slices=1, *a, **k: self._refuse("slice", slices if isinstance(slices, int) else 0),
        }.get(name)
        ctx_first = getattr(fn, "jinja_pass_arg", None) is not None

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self._tick()
            self._check_args(f"the {name!r} filter", args[1:] if ctx_first else args, kwargs)
            if pre is not None:
                pre(*(args[1:] if ctx_first else args), **kwargs)
            return self._check(fn(*args, **kwargs), f"the {name!r} filter")

        return wrapper


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if isinstance(indent, int) and indent > 64:
        raise RenderLimit(f"tojson(indent={indent}) is not allowed in a chat template")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def build_env() -> BoundedSandbox:
    """A fresh sandbox: Hugging Face's semantics (trim_blocks, lstrip_blocks, loop controls,
    ``{% generation %}``, a ``tojson`` that keeps non-ASCII text), every limit in place."""
    env = BoundedSandbox(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[IgnoreGenerationTags, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = env._wrap_filter("tojson", tojson)
    env.filters["_mars_bounded_iter"] = env._bounded_iter
    return env
