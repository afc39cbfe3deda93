"""Constrained decoding: a grammar as a token mask at sampling time, through llguidance.

llguidance (guidance-ai; the library llama.cpp's `LLAMA_LLGUIDANCE` build uses) compiles JSON schemas,
Lark/GBNF grammars and regexes, and gives per step the set of tokens that keep the output inside the
grammar (a bitmask over the vocabulary, computed in native code: tens of microseconds for a 49K vocab).
Chosen over xgrammar and outlines-core because it is maintained, needs no torch, reads llama.cpp's
GBNF, and works from the token byte strings we already hold.

    grammar_of(response_format=..., grammar=...) -> llguidance grammar text | None (APIError on bad input)
    Checker(model_path).check(text)   -> None, or why the grammar is refused (compiled in a child process)
    prepare(lltok, text)              compile once, off the engine thread; Constraint then copies it
    Constraint(tokenizer_of(tok), grammar): allowed() -> bool mask over the vocabulary; accept(token)

A request's grammar passes three gates before a sequence samples with it, each bounded:
    1. limits     the text's size, a GBNF's rules, alternatives, nesting and rule-chain depth, a JSON
                  schema's depth with its $refs followed and its $ref cycles that produce nothing: a 400
                  that names the limit (grammar_limits.py; docs/api.md's request-field table). Linear time.
    2. GBNF       converted to Lark in linear time (gbnf.py: llguidance's converter is quadratic in the
                  rules: 3,000 rules took 10.7 s; ours 30 ms).
    3. checker    the grammar is compiled, and its first two tokens masked and consumed, in a child
                  process with a 5 s limit and an address-space limit, on a thread whose stack is half
                  the engine thread's: a grammar that overflows llguidance's stack (a $defs chain 1,000
                  deep did), that runs too long or allocates too much kills the child, not the server,
                  and the request gets a 400. The child is started again for the next grammar.
The app runs 1 and 2 in a worker thread and waits for 3 there, so the event loop never compiles.

A sequence with a constraint is sampled on the driver (model/sampling.Sampler.sample's `allowed`):
every token outside the mask gets -inf before the sampler chain, as llama.cpp applies its grammar
sampler. The grammar's end allows only end-of-generation; the engine then finishes the request.
llguidance runs with verbose_errors off, so an error names the problem in one line and does not carry
the parser's state (the 20,000-alternative grammar's error was 300 KB with it on).
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..model.tokenizer import Tokenizer, TokenType, _spm_tokenize
from .gbnf import GBNFError, _gbnf_to_lark, _is_lark, _TooComplex
from .grammar_limits import LIMITS, GrammarLimits, _refuse, check_schema
from .protocol import APIError

try:
    import llguidance
    import llguidance.numpy as llg_np
    _HAVE_LLGUIDANCE = True
except ImportError:                     # pragma: no cover - a dependency of the serve extra
    _HAVE_LLGUIDANCE = False            # every use of llguidance is behind _need()

_LOCK = threading.Lock()
_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()


def _short(err: str, n: int = 200) -> str:
    """llguidance's message, its first line and at most n characters (no parser state, no grammar)."""
    line = err.strip().splitlines()[0] if err.strip() else "unknown error"
    if line == "NoExtensionBias":
        line = "the grammar can produce no output (a $ref or rule that only refers to itself?)"
    return line if len(line) <= n else line[:n] + "..."


def available() -> bool:
    return _HAVE_LLGUIDANCE


def _need() -> None:
    if not _HAVE_LLGUIDANCE:
        raise APIError(400, "structured output needs the llguidance package (pip install llguidance)",
                       param="response_format", code="unsupported_parameter")


def _parser_limits() -> Any:
    # verbose_errors off: llguidance's errors otherwise carry the parser's state and the grammar
    return llguidance.LLParserLimits(verbose_errors=False, max_lexer_states=50_000, max_grammar_size=200_000)


# -- a request's grammar -----------------------------------------------------------------------------

def grammar_of(response_format: Any = None, grammar: Any = None, json_schema: Any = None,
               limits: GrammarLimits = LIMITS) -> str | None:
    """The llguidance grammar of a request: OpenAI's response_format (json_object, json_schema) or
    llama-server's `grammar` (GBNF) / `json_schema`; None for plain text. Bad input, or input past the
    limits: APIError (400). Linear in the input; the compile is the checker's (Checker.check)."""
    given = [(n, v) for n, v in (("response_format", response_format), ("grammar", grammar),
                                 ("json_schema", json_schema)) if v is not None]
    if not given or (given[0][0] == "response_format" and len(given) == 1 and response_format == {"type": "text"}):
        return None
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(n for n, _ in given)}", param=given[1][0])
    name, v = given[0]
    _need()
    try:
        if name == "grammar":
            if not isinstance(v, str):
                raise APIError(400, "'grammar' must be a GBNF grammar string", param=name)
            return grammar_text(v, name, limits)
        if name == "json_schema":
            return schema_grammar(v, name, limits)
        return _response_format(v, limits)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's compile errors (ValueError, RuntimeError): a 400
        raise APIError(400, f"invalid {name}: {_short(str(e))}", param=name) from None


def grammar_text(text: str, param: str = "grammar", limits: GrammarLimits = LIMITS) -> str:
    """A GBNF or Lark grammar as llguidance grammar text, within the limits."""
    n = len(text.encode("utf-8", errors="replace"))
    if n > limits.max_bytes:
        raise _refuse(param, f"the grammar has {n} bytes", limits)
    if _is_lark(text):
        return str(llguidance.LLMatcher.grammar_from_lark(text))
    try:
        lark = _gbnf_to_lark(text, limits)
    except _TooComplex as e:
        raise _refuse(param, str(e), limits) from None
    except GBNFError as e:
        raise APIError(400, f"invalid {param}: {e}", param=param) from None
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def _response_format(v: Any, limits: GrammarLimits) -> str:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise APIError(400, "'response_format' must be an object with a 'type'", param="response_format")
    kind = v["type"]
    if kind == "json_object":       # llama-server's extension: a `schema` beside it is honoured
        schema = v.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format.schema' must be a JSON schema object", param="response_format")
        return schema_grammar(schema, "response_format", limits)
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(400, "'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format")
        return schema_grammar(js.get("schema", {}), "response_format", limits)
    raise APIError(400, f"response_format type '{kind}' is not supported (text, json_object, json_schema)",
                   param="response_format")


def schema_grammar(schema: Any, param: str, limits: GrammarLimits = LIMITS) -> str:
    """JSON in the compact form (no whitespace between tokens, as OpenAI's structured outputs): with
    whitespace allowed, a model can fill its whole budget with newlines inside an object."""
    check_schema(schema, param, limits)
    return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults={"whitespace_flexible": False}))


# -- the model's llguidance tokenizer ----------------------------------------------------------------

class _Wrapped:
    """What llguidance.LLTokenizer reads of a tokenizer: every token's bytes (control tokens marked
    with a 0xFF prefix, as llguidance's llama.cpp bridge does), EOS and BOS, and an encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tokens = []
        special = []
        for i in range(tok.n_vocab):
            b = tok.token_to_piece(i, special=True)
            if tok.token_types[i] == TokenType.CONTROL or (
                    tok.token_types[i] == TokenType.USER_DEFINED and b.startswith(b"<") and b.endswith(b">")):
                b = b"\xff" + b
                special.append(i)
            self.tokens.append(b)
        self.special_token_ids = special
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else 0
        self.bos_token_id = tok.bos_id
        self._tok = tok

    def __call__(self, s: str | bytes) -> list[int]:
        """The tokens of a piece of output text (llguidance re-tokenizes forced bytes): without the
        space SentencePiece puts before a prompt, which would not be in the output."""
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        if self._tok.model == "gpt2" or not self._tok.add_space_prefix:
            return self._tok.encode(text, add_special=False, parse_special=False)
        return _spm_tokenize(text.replace(" ", "\u2581"), self._tok)


def tokenizer_of(tok: Tokenizer) -> Any:
    """The model's llguidance tokenizer, built once (a pass over the vocabulary, ~1 s for 50K tokens)."""
    _need()
    with _LOCK:
        lt = _TOKENIZERS.get(tok)
        if lt is None:
            w = _Wrapped(tok)
            eog = sorted(i for i in range(tok.n_vocab) if tok.is_eog(i)) or [w.eos_token_id]
            lt = _TOKENIZERS[tok] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), eos_token=eog)
        return lt


# -- compiled grammars, ready for the engine ---------------------------------------------------------

_PREPARED_MAX = 64                       # grammars kept compiled (a matcher in its start state each)
_PREPARED: collections.OrderedDict[tuple[int, str], tuple[Any, Any]] = collections.OrderedDict()
_PREPARED_LOCK = threading.Lock()


def prepare(lltok: Any, grammar: str) -> None:
    """Compile grammar for lltok now (llguidance drops the GIL while it does), so that the engine
    thread's Constraint only copies the start state: a worker thread of the app compiles, the engine
    does not stall its other sequences for it. Kept for the next request with the same grammar."""
    _template(lltok, grammar)


def _template(lltok: Any, grammar: str) -> Any:
    key = (id(lltok), grammar)
    with _PREPARED_LOCK:
        hit = _PREPARED.get(key)
        if hit is not None and hit[0] is lltok:
            _PREPARED.move_to_end(key)
            return hit[1]
    m = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_parser_limits())
    with _PREPARED_LOCK:
        _PREPARED[key] = (lltok, m)
        while len(_PREPARED) > _PREPARED_MAX:
            _PREPARED.popitem(last=False)
    return m


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, lltok: Any, grammar: str, n_vocab: int) -> None:
        template = _template(lltok, grammar)
        with _PREPARED_LOCK:                # a template is shared: copied by one thread at a time
            self.matcher = template.deep_copy()
        self.n_vocab = n_vocab
        self._mask = llg_np.allocate_token_bitmask(1, lltok.vocab_size)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {_short(self.matcher.get_error())}")

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens that keep the output inside the grammar."""
        llg_np.fill_next_token_bitmask(self.matcher, self._mask)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {_short(self.matcher.get_error())}")
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:self.n_vocab]
        return bits.astype(bool)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"grammar: token {token} was not allowed: {_short(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the output must end)."""
        return bool(self.matcher.is_stopped())


# -- the checker process -----------------------------------------------------------------------------

_START_TIMEOUT_S = 120.0                 # the child's imports and the vocabulary pass
_RESULTS_MAX = 512                       # grammars whose verdict is remembered (by sha256)


class Checker:
    """A child process that compiles each grammar before this process does (the module docstring's
    gate 3). check() blocks: call it from a worker thread. One grammar at a time; a child that died
    or ran past the time limit is replaced at the next check."""

    def __init__(self, model_path: str, limits: GrammarLimits = LIMITS) -> None:
        self.model_path = model_path
        self.limits = limits
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._results: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ggml-dist-grammar-check")
        self.n_started = 0                # child processes started (a crash or timeout starts another)

    def submit(self, grammar: str) -> concurrent.futures.Future[str | None]:
        """check() on the checker's own thread: the waits do not hold the event loop's worker threads."""
        return self._pool.submit(self.check, grammar)

    def check(self, grammar: str) -> str | None:
        """None if the grammar compiles and masks within the limits, else why not (one short line)."""
        key = hashlib.sha256(grammar.encode("utf-8", errors="surrogatepass")).hexdigest()
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
            verdict = self._check(grammar)       # a crash too: the same grammar would crash it again
            self._results[key] = verdict
            while len(self._results) > _RESULTS_MAX:
                self._results.popitem(last=False)
            return verdict

    def _check(self, grammar: str) -> str | None:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._conn is not None and self._proc is not None
        try:
            self._conn.send(grammar)
            if not self._conn.poll(self.limits.check_timeout_s):
                self._kill()
                return (f"compiling the grammar took more than {self.limits.check_timeout_s:g} s "
                        f"(limits: {self.limits.describe()})")
            verdict: str | None = self._conn.recv()
            return verdict
        except (EOFError, OSError):
            code = self._proc.wait()
            self._kill()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"ggml-dist serve: the grammar checker died ({how}) on a request's grammar; refused it, "
                  f"starting another", file=sys.stderr)
            return (f"the grammar crashed the grammar compiler ({how}): it is too deep or too large "
                    f"(limits: {self.limits.describe()})")

    def _start(self) -> None:
        self._kill()
        parent, child = socket.socketpair()
        budget = str(self.limits.check_memory_bytes)
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno()), self.model_path, budget],
                                      pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        self.n_started += 1
        if not self._conn.poll(_START_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"the grammar checker did not start within {_START_TIMEOUT_S:g} s")
        ready = self._conn.recv()
        if ready != "ready":
            self._kill()
            raise RuntimeError(f"the grammar checker did not start: {ready}")

    def _kill(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._kill()


def _probe(lltok: Any, grammar: str, n_vocab: int) -> str | None:
    """What the engine will do with the grammar, the first two tokens of it: compile, mask, consume an
    allowed token, mask again. None if all went through, else llguidance's error."""
    m = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_parser_limits())
    mask = llg_np.allocate_token_bitmask(1, lltok.vocab_size)
    for _ in range(2):
        if m.is_error():
            break
        if m.is_stopped():
            return None
        llg_np.fill_next_token_bitmask(m, mask)
        if m.is_error():
            break
        ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab])
        if not len(ids):
            return "the grammar allows no token"
        m.consume_token(int(ids[0]))
    return _short(m.get_error()) if m.is_error() else None


def _checker_main(fd: int, model_path: str, budget: int) -> None:
    """The checker process: the model's tokenizer, then one grammar at a time from the front, each
    probed on a thread with half the engine thread's stack, under an address-space limit."""
    conn = Connection(fd)
    try:
        from ..model.gguf import load_gguf
        tok = Tokenizer.from_gguf(load_gguf(model_path))
        lltok = tokenizer_of(tok)
    except Exception as e:  # noqa: BLE001 - told to the front, which refuses the grammar
        conn.send(f"{type(e).__name__}: {e}")
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    engine_stack = soft if soft != resource.RLIM_INFINITY else 8 << 20
    threading.stack_size(max(1 << 20, min(engine_stack // 2, 64 << 20)))
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + budget + (256 << 20), resource.RLIM_INFINITY))

    def serve() -> None:
        while True:
            try:
                grammar = conn.recv()
            except (EOFError, OSError):         # the front is gone
                return
            try:
                verdict = _probe(lltok, grammar, tok.n_vocab)
            except MemoryError:
                verdict = "the grammar needs more memory than the checker may use"
            except Exception as e:  # noqa: BLE001 - llguidance's errors are the verdict
                verdict = _short(str(e))
            conn.send(verdict)
    t = threading.Thread(target=serve, name="ggml-dist-grammar-check")
    t.start()
    conn.send("ready")
    t.join()


if __name__ == "__main__":              # the checker process, started by Checker._start
    from ggml_dist.serve.grammar import _checker_main as main
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
