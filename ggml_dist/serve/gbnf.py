"""GBNF converted to Lark in linear time (serve/grammar.py's second gate): llguidance's own converter is
quadratic in the rules (3,000 rules took 10.7 s; this one 30 ms), and its output is the same Lark (less
the comments), so llguidance reads the same grammar. A grammar past the limits is _TooComplex (a 400 that
names the limit), a text that is not GBNF a GBNFError.
"""
from __future__ import annotations

import collections
import re
from collections.abc import Iterable

from .grammar_limits import LIMITS, GrammarLimits, _height

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
