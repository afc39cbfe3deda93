"""A request's grammar, bounded before anything compiles it (serve/grammar.py's first gate): the limits
(GrammarLimits, stated in docs/api.md's request-field table) and the JSON schema's checks against them
(its size, its depth with $refs followed, a $ref cycle that produces nothing). Linear time.
"""
from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from .protocol import APIError

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
