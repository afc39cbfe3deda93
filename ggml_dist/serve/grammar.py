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
                  that names the limit (LIMITS below; docs/api.md's request-field table). Linear time.
    2. GBNF       converted to Lark here, in linear time (llguidance's converter is quadratic in the
                  rules: 3,000 rules took 10.7 s; ours 30 ms, _gbnf_to_lark).
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
import re
import resource
import socket
import subprocess
import sys
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..model.tokenizer import Tokenizer, TokenType, _spm_tokenize
from .protocol import APIError

try:
    import llguidance
    import llguidance.numpy as llg_np
    _HAVE_LLGUIDANCE = True
except ImportError:                     # pragma: no cover - a dependency of the serve extra
    _HAVE_LLGUIDANCE = False            # every use of llguidance is behind _need()

_LOCK = threading.Lock()
_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()


# -- limits ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GrammarLimits:
    """What a request's grammar may be (docs/api.md's request-field table states them). Far above what real
    schemas and grammars use (llama.cpp's grammars/ are under 4 KB and 60 rules; a pydantic model's
    schema nests a few levels), far below what breaks llguidance (a rule chain of 3,000 or a $ref
    chain of 1,000 overflowed its stack at 8 MiB; a rule of 2,001 alternatives fails its parser)."""
    max_bytes: int = 64 * 1024          # the GBNF/Lark text, or the JSON schema serialized
    max_rules: int = 1000               # GBNF rules
    max_alternatives: int = 1000        # alternatives of one rule or group (llguidance's row limit: 2,000)
    max_nesting: int = 32               # GBNF parentheses inside each other
    max_rule_depth: int = 100           # GBNF: the longest chain of rule references (recursion cut)
    max_schema_depth: int = 128         # JSON schema: nested objects/arrays, each $ref followed counting one
    check_timeout_s: float = 5.0        # compiling and masking two tokens, in the checker process
    check_memory_bytes: int = 1 << 30   # address space the checker may add to what it holds at start

    def describe(self) -> str:
        return (f"at most {self.max_bytes // 1024} KiB; GBNF: {self.max_rules} rules, {self.max_alternatives} "
                f"alternatives per rule or group, {self.max_nesting} nested groups, rule chains "
                f"{self.max_rule_depth} deep; JSON schema: {self.max_schema_depth} levels deep with $refs "
                f"followed; compiled within {self.check_timeout_s:g} s")


LIMITS = GrammarLimits()


def _refuse(param: str, what: str, limits: GrammarLimits = LIMITS) -> APIError:
    return APIError(400, f"invalid {param}: {what} (limits: {limits.describe()})", param=param,
                    code="grammar_too_complex")


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


# -- JSON schema limits ------------------------------------------------------------------------------

# keywords that say nothing about the value: a schema of only these and a $ref is the $ref's target
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$id", "$schema", "$comment", "$anchor", "title",
                          "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})


def check_schema(schema: Any, param: str, limits: GrammarLimits = LIMITS) -> None:
    """A 400 for a JSON schema past the limits: its size serialized, its depth (nested objects and arrays,
    a $ref followed counting one more level, recursion cut where it comes back), and a $ref cycle that
    reaches no value (`{"$ref": "#"}`: llguidance accepts it and fails at the first token). Linear."""
    if not isinstance(schema, dict):
        raise APIError(400, "a JSON schema must be an object", param=param)
    n = len(json.dumps(schema))
    if n > limits.max_bytes:
        raise _refuse(param, f"the schema has {n} bytes", limits)

    def children(node: Any) -> Iterable[Any]:
        items = node.values() if isinstance(node, dict) else node
        for c in items:
            if isinstance(c, (dict, list)):
                yield c
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = _resolve_ref(schema, node["$ref"])
            if isinstance(target, (dict, list)):
                yield target
    depth = _height(schema, children, id, limits.max_schema_depth)
    if depth > limits.max_schema_depth:
        raise _refuse(param, f"the schema is more than {limits.max_schema_depth} levels deep with its $refs "
                      f"followed", limits)
    cycle = _ref_cycle(schema)
    if cycle:
        raise APIError(400, f"invalid {param}: a $ref cycle that reaches no value ({' -> '.join(cycle)})",
                       param=param, code="invalid_value")


def _resolve_ref(root: Any, ref: str) -> Any:
    """A local $ref ("#", "#/$defs/a", JSON pointer escapes) in root; None if it is not local or missing."""
    if not ref.startswith("#"):
        return None
    node = root
    pointer = urllib.parse.unquote(ref[1:])
    if not pointer:
        return node
    if not pointer.startswith("/"):
        return None                     # an anchor ("#foo"): llguidance's to resolve
    for raw in pointer[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _ref_cycle(root: dict[str, Any]) -> list[str]:
    """The first chain of $ref-only schemas (a $ref beside annotations alone) that comes back to itself."""
    known_ok: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(c for c in node if isinstance(c, (dict, list)))
            continue
        stack.extend(c for c in node.values() if isinstance(c, (dict, list)))
        chain: list[str] = []
        seen: set[int] = set()
        cur: Any = node
        while (isinstance(cur, dict) and isinstance(cur.get("$ref"), str) and cur.keys() <= _ANNOTATIONS
               and id(cur) not in known_ok):
            if id(cur) in seen:
                return [*chain, cur["$ref"]]
            seen.add(id(cur))
            chain.append(cur["$ref"])
            cur = _resolve_ref(root, cur["$ref"])
        known_ok |= seen
    return []


def _height(root: Any, children: Callable[[Any], Iterable[Any]], key: Callable[[Any], Hashable],
            cap: int) -> int:
    """The longest path down from root (nodes counted), an edge back to a node on the path cut (it is
    recursion, not depth); stops once the path is longer than cap. Each node's height once: linear."""
    done: dict[Hashable, int] = {}
    on_path: set[Hashable] = {key(root)}
    stack: list[list[Any]] = [[root, iter(children(root)), 0]]
    while stack:
        if len(stack) > cap:
            return len(stack)
        top = stack[-1]
        for c in top[1]:
            k = key(c)
            if k in done:
                top[2] = max(top[2], done[k])
            elif k not in on_path:
                on_path.add(k)
                stack.append([c, iter(children(c)), 0])
                break
        else:
            stack.pop()
            k = key(top[0])
            on_path.discard(k)
            done[k] = top[2] + 1
            if stack:
                stack[-1][2] = max(stack[-1][2], done[k])
    return done[key(root)]


# -- GBNF to Lark, linear ----------------------------------------------------------------------------
# llguidance's gbnf_to_lark, re-done in linear time: its terminal-rule fixpoint sweeps every rule until
# nothing changes, which is quadratic in a chain of rules, and its parser allocates a position object per
# character. The output is the same Lark (less the comments), so llguidance reads the same grammar.

class GBNFError(ValueError):
    """The text is not GBNF."""


class _TooComplex(ValueError):
    """The grammar is GBNF, past a limit."""


_TOKEN = re.compile(r"""
    (?P<ws>[ \t]+)
  | (?P<nl>\r\n?|\n)
  | (?P<comment>\#[^\r\n]*)
  | (?P<define>::=)
  | (?P<name>[\w-]+)
  | (?P<lit>"(?:[^"\\]|\\[\s\S])*")
  | (?P<cls>\[(?:[^\]\\]|\\[\s\S])*\])
  | (?P<rep>\{[ \t\r\n]*[0-9]+[ \t\r\n]*(?:,[ \t\r\n]*[0-9]*[ \t\r\n]*)?\})
  | (?P<op>[()|*+?.])
""", re.X)
_ESCAPE = re.compile(r"""\\(?:(?P<simple>["\\\[\]nrt])|x(?P<x>[0-9a-fA-F]{2})|u(?P<u>[0-9a-fA-F]{4})
                         |U(?P<U>[0-9a-fA-F]{8})|(?P<bad>[\s\S]?))""", re.X)

# nodes: ("lit", text) ("rx", text) ("ref", name) ("rep", node, min, max|None) ("seq", [nodes]) ("alt", [nodes])
_Node = tuple


def _is_lark(text: str) -> bool:
    """llguidance's test for Lark syntax (its any_to_lark passes such text through)."""
    return re.search(r"(?m)^\s*(%llguidance\b|start\s*:)", text) is not None


def _escapes(body: str, where: str, in_class: bool) -> str:
    """A literal's or class's characters as llguidance's converter writes them: escapes checked and
    kept, \\uXXXX shortened as it does, and in a class an unescaped '/' or '[' escaped."""
    out: list[str] = []
    i = 0
    while i < len(body):
        j = body.find("\\", i)
        plain = body[i:] if j < 0 else body[i:j]
        out.append(plain.replace("/", "\\/").replace("[", "\\[") if in_class else plain)
        if j < 0:
            break
        m = _ESCAPE.match(body, j)
        assert m is not None, "the escape pattern matches any backslash"
        if m.group("simple") is not None:
            out.append("\\" + m.group("simple"))
        elif m.group("x") is not None:
            out.append("\\x" + m.group("x"))
        elif m.group("u") is not None:
            out.append("\\u" + m.group("u").lstrip("0"))
        elif m.group("U") is not None:
            out.append("\\U" + m.group("U").lstrip("0"))
        else:
            raise GBNFError(f"invalid escape sequence \\{m.group('bad')} in {where}")
        i = m.end()
    return "".join(out)


class _GBNFParser:
    """Recursive descent over a token list (llama.cpp's grammar-parser rules: a rule ends at a newline
    outside parentheses, '|' may be followed by newlines); recursion only into groups (max_nesting)."""

    def __init__(self, text: str, limits: GrammarLimits) -> None:
        self.limits = limits
        self.toks: list[tuple[str, str, int]] = []        # (kind, text, line)
        pos, line = 0, 1
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise GBNFError(f"unexpected {text[pos]!r} at line {line}")
            kind = m.lastgroup
            assert kind is not None
            if kind not in ("ws", "comment"):
                self.toks.append((kind, m.group(), line))
            line += m.group().count("\n") + (m.group() == "\r")
            pos = m.end()
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str, int]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "", self.toks[-1][2] if self.toks else 1)

    def skip_nl(self) -> None:
        while self.peek()[0] == "nl":
            self.i += 1

    def rules(self) -> dict[str, _Node]:
        out: dict[str, _Node] = {}
        self.skip_nl()
        while self.peek()[0] != "eof":
            kind, name, line = self.peek()
            if kind != "name":
                raise GBNFError(f"expected a rule name at line {line}, got {name!r}")
            self.i += 1
            if self.peek()[0] != "define":
                raise GBNFError(f"expected ::= after '{name}' at line {line}")
            self.i += 1
            self.skip_nl()
            out[name] = self.alternatives(nested=False)
            if self.peek()[0] not in ("nl", "eof"):
                raise GBNFError(f"expected the end of rule '{name}' at line {self.peek()[2]}, got "
                                f"{self.peek()[1]!r}")
            if len(out) > self.limits.max_rules:
                raise _TooComplex(f"the grammar has more than {self.limits.max_rules} rules")
            self.skip_nl()
        return out

    def alternatives(self, nested: bool) -> _Node:
        alts = [self.sequence(nested)]
        while True:
            if nested:
                self.skip_nl()
            if self.peek()[1] != "|" or self.peek()[0] != "op":
                break
            self.i += 1
            self.skip_nl()
            alts.append(self.sequence(nested))
            if len(alts) > self.limits.max_alternatives:
                raise _TooComplex(f"a rule or group has more than {self.limits.max_alternatives} alternatives")
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self, nested: bool) -> _Node:
        nodes: list[_Node] = []
        while True:
            if nested:
                self.skip_nl()
            kind, text, line = self.peek()
            if kind == "lit":
                nodes.append(("lit", _escapes(text[1:-1], f"a string at line {line}", False)))
            elif kind == "cls":
                nodes.append(("rx", "[" + _escapes(text[1:-1], f"a character class at line {line}", True) + "]"))
            elif kind == "name":
                nodes.append(("ref", text))
            elif kind == "op" and text == ".":
                nodes.append(("rx", "."))
            elif kind == "op" and text == "(":
                self.i += 1
                self.depth += 1
                if self.depth > self.limits.max_nesting:
                    raise _TooComplex(f"groups nest more than {self.limits.max_nesting} deep")
                self.skip_nl()
                group = self.alternatives(nested=True)
                self.skip_nl()
                if self.peek()[1] != ")":
                    raise GBNFError(f"expected ')' at line {self.peek()[2]}")
                self.depth -= 1
                nodes.append(group)
            else:
                break
            self.i += 1
            self.repetition(nodes, nested)
        return nodes[0] if len(nodes) == 1 else ("seq", nodes)

    def repetition(self, nodes: list[_Node], nested: bool) -> None:
        if nested:
            self.skip_nl()
        kind, text, _ = self.peek()
        if kind == "op" and text in "*+?":
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[text]
        elif kind == "rep":
            parts = text[1:-1].split(",")
            lo = int(parts[0])
            hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1].strip() else None)
        else:
            return
        self.i += 1
        nodes[-1] = ("rep", nodes[-1], lo, hi)


def _refs(node: _Node) -> Iterable[str]:
    """The rule names a body refers to, each occurrence (a stack: no recursion)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n[0] == "ref":
            yield n[1]
        elif n[0] == "rep":
            stack.append(n[1])
        elif n[0] in ("seq", "alt"):
            stack.extend(n[1])


def _gbnf_to_lark(text: str, limits: GrammarLimits = LIMITS) -> str:
    """llguidance's gbnf_to_lark in linear time: parse; root becomes start; a rule whose every reference
    is to a terminal rule is terminal (a worklist over who refers to whom, instead of sweeping every rule
    until nothing changes); names snake_case, terminals upper case; then print."""
    rules = _GBNFParser(text, limits).rules()
    refs = {name: list(_refs(body)) for name, body in rules.items()}
    for name, targets in refs.items():
        for t in targets:
            if t not in rules:
                raise GBNFError(f"rule '{t}' (used by '{name}') is not defined")
    if "root" not in rules:
        raise GBNFError("no 'root' rule")
    depth = _height("root", lambda r: refs[r], lambda r: r, limits.max_rule_depth)
    if depth > limits.max_rule_depth:
        raise _TooComplex(f"rule references chain more than {limits.max_rule_depth} deep")
    # 1. terminals: the least fixpoint, by counting each rule's references to rules not yet terminal
    pending = {name: len(targets) for name, targets in refs.items()}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for name, targets in refs.items():
        for t in targets:
            users[t].append(name)
    terminal: set[str] = set()
    work = [name for name, n in pending.items() if n == 0 and name != "root"]
    while work:
        r = work.pop()
        terminal.add(r)
        for u in users[r]:
            pending[u] -= 1
            if pending[u] == 0 and u != "root":
                work.append(u)
    # 2. names, as llguidance renames (a clash is an error there too)
    names: dict[str, str] = {}
    taken = set(rules)
    for r in rules:
        if r == "root":
            new = "start"
        else:
            new = re.sub(r"([a-z])([A-Z])", r"\1_\2", r.replace("-", "_")).lower()
            new = new.upper() if r in terminal else new
        if new != r:
            if new in taken:
                raise GBNFError(f"rule '{r}' becomes '{new}' in Lark, which another rule is called")
            taken.discard(r)
            taken.add(new)
        names[r] = new
    # 3. print, in the rules' order, laid out as llguidance lays them out
    out = ["%llguidance {}\n\n"]
    prev_nl = True
    for r, body in rules.items():
        s = f"{names[r]}: " + ("\n     | ".join(_lark(a, names) for a in body[1]) if body[0] == "alt"
                               else _lark(body, names))
        if not prev_nl and "\n" in s:
            out.append("\n")
        out.append(s + "\n")
        prev_nl = "\n" in s
        if prev_nl:
            out.append("\n")
    return "".join(out)


def _lark(node: _Node, names: dict[str, str]) -> str:
    """One node as Lark (recursion only as deep as the groups nest: max_nesting)."""
    kind = node[0]
    if kind == "lit":
        return f'"{node[1]}"'
    if kind == "rx":
        return f"/{node[1]}/"
    if kind == "ref":
        return names[node[1]]
    if kind == "seq":
        return " ".join(_lark(n, names) for n in node[1]) if node[1] else '""'
    if kind == "alt":
        return "(" + " | ".join(_lark(n, names) for n in node[1]) + ")"
    inner, lo, hi = node[1], node[2], node[3]
    s = _lark(inner, names)
    if inner[0] in ("seq", "alt"):
        s = f"({s})"
    if (lo, hi) == (0, None):
        return s + "*"
    if (lo, hi) == (1, None):
        return s + "+"
    if (lo, hi) == (0, 1):
        return s + "?"
    return f"{s}{{{lo},{'' if hi is None else hi}}}"


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
