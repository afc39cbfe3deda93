"""llama.cpp's side of `bench decode`, through llama-cpp-python (the dev extra): an engine on one file as
ours is (run(tokens) -> the greedy next token, clear()), with the flash-attention setting asked for and the
one llama.cpp resolved, read from its log.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from .simd import parse_system_info

FLASH_ATTN_CHOICES = ("default", "on", "off")
_KEEP_ALIVE: list[Any] = []                             # log callbacks llama.cpp may still call


def _fa_name(llama_cpp: Any, v: Any) -> str:
    """llama.cpp's name of a flash-attention value: "auto", "enabled", "disabled" (a bool in older ones)."""
    if isinstance(v, bool):
        return "enabled" if v else "disabled"
    fn = getattr(llama_cpp, "llama_flash_attn_type_name", None)
    name = fn(int(v)) if fn is not None and isinstance(v, int) else None
    return name.decode() if isinstance(name, bytes) else str(v)


def _fa_request(llama_cpp: Any, setting: str) -> int | bool:
    """The flash-attention value to ask llama.cpp for: its llama_context_default_params() for "default"
    (an int llama_flash_attn_type, AUTO = -1, where the library has one; a bool in older ones)."""
    defaults = llama_cpp.llama_context_default_params()
    typed = hasattr(defaults, "flash_attn_type")
    if setting == "default":
        return int(defaults.flash_attn_type) if typed else bool(defaults.flash_attn)
    on = setting == "on"
    if not typed:
        return on
    return int(llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if on else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def parse_fa_log(text: str) -> str | None:
    """The flash-attention setting llama.cpp resolved, from its context-creation log ("resolve_fused_ops:
    Flash Attention enabled", "Flash Attention was auto, set to enabled", "flash_attn = disabled")."""
    found = None
    for line in text.splitlines():
        m = re.search(r"flash[ _]att(?:n|ention)\b(.*)$", line, re.IGNORECASE)
        words = re.findall(r"\b(enabled|disabled|auto|on|off|1|0)\b", m.group(1), re.IGNORECASE) if m else []
        if words:                                       # a line's last word: "was auto, set to enabled"
            v = words[-1].lower()
            v = {"on": "enabled", "1": "enabled", "off": "disabled", "0": "disabled"}.get(v, v)
            if v != "auto" or found is None:
                found = v                               # a resolved line wins over "= auto"
    return found


@contextlib.contextmanager
def _llamacpp_context(llama_cpp: Any, fa: int | bool) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """Create llama_cpp.Llama with flash attention `fa` and capture llama.cpp's log meanwhile. Llama()
    maps its bool flash_attn to ENABLED/DISABLED only, so AUTO (llama.cpp's default) is set on the
    context params as the context is created."""
    internals: Any = importlib.import_module("llama_cpp._internals")
    logs: list[str] = []
    kwargs: dict[str, Any] = {}

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        logs.append(text.decode("utf-8", "replace"))

    orig = internals.LlamaContext

    def context_with_fa(*args: Any, **kw: Any) -> Any:
        params = kw.get("params")
        if params is not None and hasattr(params, "flash_attn_type"):
            params.flash_attn_type = int(fa)
        return orig(*args, **kw)

    patched = not isinstance(fa, bool) and fa not in (0, 1)
    if not patched:
        kwargs["flash_attn"] = bool(fa)
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    if patched:
        internals.LlamaContext = context_with_fa
    try:
        yield kwargs, logs
    finally:
        internals.LlamaContext = orig
        restore = getattr(getattr(llama_cpp, "_logger", None), "llama_log_callback", None)
        if restore is not None:                         # llama-cpp-python's own logger again
            llama_cpp.llama_log_set(restore, ctypes.c_void_p(0))
        else:                                           # the library keeps calling ours: keep it alive
            _KEEP_ALIVE.append(capture)


class _LlamaCpp:
    """llama.cpp (llama-cpp-python) on one file, as _Ours: run(tokens) -> the greedy next token, clear().
    Flash attention as `flash_attn` says (FLASH_ATTN_CHOICES); info() names the build and the setting."""

    def __init__(self, path: str, n_ctx: int, threads: int, flash_attn: str = "default") -> None:
        import inspect
        self.lib = llama_cpp = importlib.import_module("llama_cpp")     # the dev extra: typed only where installed
        fa = _fa_request(llama_cpp, flash_attn)
        with _llamacpp_context(llama_cpp, fa) as (kwargs, logs):
            self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                       n_threads_batch=threads, verbose=False, **kwargs)
        requested = _fa_name(llama_cpp, fa)
        resolved = parse_fa_log("".join(logs)) or requested     # no log line: what was asked for
        py_param = inspect.signature(llama_cpp.Llama.__init__).parameters.get("flash_attn")
        py_default = None if py_param is None or py_param.default is None else _fa_name(llama_cpp, py_param.default)
        self.fa_info = {"setting": flash_attn, "requested": requested,
                        "resolved": None if resolved == "auto" else resolved,   # None: auto, not said what into
                        "library_default": _fa_name(llama_cpp, _fa_request(llama_cpp, "default")),
                        "llama_cpp_python_default": py_default}
        self.n_vocab = self.llm.n_vocab()

    def run(self, toks: list[int]) -> int:
        self.llm.eval(toks)
        # the context's own logits of the batch's last token, which eval() marks as an output: Llama.scores
        # is written only with logits_all=True (llama-cpp-python 0.3.x), so without it every row reads 0
        # and argmax gives token 0 at every step
        row = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def clear(self) -> None:
        self.llm.reset()

    def info(self) -> dict[str, Any]:
        return {"version": getattr(self.lib, "__version__", None),
                **parse_system_info(self.lib.llama_print_system_info()), "flash_attn": self.fa_info}
