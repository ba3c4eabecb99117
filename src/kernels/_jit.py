"""Lazy ``@triton.jit``: the op modules define their kernels at import without importing triton.

``import triode.kernels`` must work where triton is missing (the torch references are the CPU path),
and triton chooses between its compiler and its interpreter from ``TRITON_INTERPRET`` when a
function is decorated -- its own standard library (``tl.zeros``, ``tl.sum``, ...) included,
which is decorated when ``triton`` is first imported. So the mode is fixed, per process, by the
first ``import triton``. The op modules decorate their kernels with :func:`lazy_jit`, which
keeps the plain function and hands it to ``triton.jit`` on first launch; triton is imported
only then. The kernels' source stays in their files (triton reads it with ``inspect``), their
``tl.constexpr`` annotations are strings (``from __future__ import annotations``; triton
accepts ``"tl.constexpr"``), and ``triton`` / ``tl`` are put into the module's globals when the
first kernel of the module is jitted.

Importing ``torch._dynamo`` (transformers does) imports triton, so in a test process triton is
often already imported in compile mode when a test asks for the interpreter. Then, for the
duration of each interpreted launch, the standard library's jitted functions are swapped for
interpreted twins (what importing triton under ``TRITON_INTERPRET=1`` would have made), and put
back afterwards.

A lazily jitted kernel cannot be called from another kernel: each kernel is self-contained.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on", "y"})


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for triton's interpreter (kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def triton_mode() -> str | None:
    """'interpret' or 'compile': the mode triton was imported in; None if not imported yet."""
    language = sys.modules.get("triton.language")
    if language is None:
        return None
    return "interpret" if type(language.zeros).__name__ == "InterpretedFunction" else "compile"


def import_triton(interpret: bool | None = None) -> Any:
    """Import triton in the mode ``TRITON_INTERPRET`` asks for (``interpret`` overrides it, for
    this import only). Compiled kernels need triton imported in compile mode; interpreted ones
    run either way (see :func:`_interpretable_stdlib`)."""
    wanted = interpreting() if interpret is None else interpret
    if triton_mode() is None:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if wanted else "0"
        try:
            import triton
            import triton.language
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    import triton

    if not wanted and triton_mode() == "interpret":
        raise RuntimeError(
            "triton was imported with TRITON_INTERPRET=1, so its standard library only runs in "
            "the interpreter and kernels cannot be compiled in this process; unset "
            "TRITON_INTERPRET before anything imports triton"
        )
    return triton


_stdlib_twins: list[tuple[Any, str, Any, Any]] | None = None


@contextlib.contextmanager
def _interpretable_stdlib() -> Iterator[None]:
    """Swap triton.language's jitted functions (tl.sum, tl.zeros, ...) for interpreted twins
    while an interpreted kernel runs in a process that imported triton in compile mode."""
    global _stdlib_twins
    if _stdlib_twins is None:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        twins: dict[int, Any] = {}
        found = []
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    twin = twins.setdefault(id(value), InterpretedFunction(value.fn))
                    found.append((module, attr, value, twin))
        _stdlib_twins = found
    for module, attr, _, twin in _stdlib_twins:
        setattr(module, attr, twin)
    try:
        yield
    finally:
        for module, attr, original, _ in _stdlib_twins:
            setattr(module, attr, original)


class LazyKernel:
    """A kernel that becomes ``triton.jit(fn)`` on first use: ``kernel[grid](*args)``."""

    def __init__(self, fn: Callable[..., Any], jit_kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._jitted: Any = None
        self._interpret: bool | None = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def jitted(self) -> Any:
        interpret = interpreting()
        if self._jitted is None or self._interpret != interpret:
            triton = import_triton(interpret)
            module_globals = self.fn.__globals__
            module_globals.setdefault("triton", triton)
            module_globals.setdefault("tl", triton.language)
            self._jitted = triton.jit(self.fn, **self.jit_kwargs)
            self._interpret = interpret
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        launch = self.jitted()[grid]
        if not self._interpret or triton_mode() == "interpret":
            return launch

        def interpreted_launch(*args: Any, **kwargs: Any) -> Any:
            with _interpretable_stdlib():
                return launch(*args, **kwargs)

        return interpreted_launch

    def __repr__(self) -> str:
        return f"LazyKernel({self.fn.__module__}.{self.fn.__qualname__})"


def lazy_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """``@lazy_jit`` or ``@lazy_jit(do_not_specialize=[...])``, like ``@triton.jit``."""
    if fn is None:
        return lambda f: LazyKernel(f, jit_kwargs)
    return LazyKernel(fn, jit_kwargs)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), without importing triton."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
