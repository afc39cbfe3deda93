"""serve/grammar.py's gates: the limits (a 400 naming them), the linear GBNF-to-Lark conversion (the same Lark
as llguidance's converter), and the checker process that a grammar may crash or hang instead of the server."""
from __future__ import annotations

import gc
import time

import pytest

llguidance = pytest.importorskip("llguidance")

from llguidance.gbnf_to_lark import gbnf_to_lark as llguidance_gbnf_to_lark  # noqa: E402

from ggml_dist.serve import grammar as G  # noqa: E402
from ggml_dist.serve.protocol import APIError  # noqa: E402

JSON_GBNF = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''
GRAMMARS = [
    JSON_GBNF,
    'root ::= "\\u0041" [a-z/\\]] . x{2,3} (y | "z")* \nx ::= "q"\ny ::= x | "w" y\n',
    ('root ::= (expr "=" ws term "\\n")+\nexpr ::= term ([-+*/] term)*\nterm ::= ident | num | "(" ws expr ")" ws\n'
     'ident ::= [a-z] [a-z0-9_]* ws\nnum ::= [0-9]+ ws\nws ::= [ \\t\\n]*\n'),
    'root ::= camelCase my-rule\ncamelCase ::= "a"+ | "b"?\nmy-rule ::= ( "x" |\n "y" ) { 1 , }\n',
    'root ::= a |\n  b\na ::= "1"\nb ::= "2" root\n',
]


def _lines(lark: str) -> list[str]:
    return [ln for ln in lark.splitlines() if ln.strip() and not ln.startswith("//")]


# the linear converter writes the Lark llguidance's own converter writes (comments and blank lines aside)
@pytest.mark.parametrize("gbnf", GRAMMARS)
def test_gbnf_to_lark_matches_llguidance(gbnf):
    assert _lines(G._gbnf_to_lark(gbnf)) == _lines(llguidance_gbnf_to_lark(gbnf))


# malformed GBNF is an error either way, ours a GBNFError with the line
@pytest.mark.parametrize("gbnf", ['root ::= (', 'root ::= "\\q"', 'x ::= "a"', 'root ::= y', 'root ::= "a"\n| "b"'])
def test_gbnf_errors(gbnf):
    with pytest.raises(Exception):  # noqa: B017 - llguidance raises plain Exception for some of them
        llguidance_gbnf_to_lark(gbnf)
    with pytest.raises(G.GBNFError):
        G._gbnf_to_lark(gbnf)


# linear: llguidance's converter took 2.4 s for 1,500 chained rules and 10.7 s for 3,000 (its terminal
# fixpoint sweeps every rule per step); ours takes milliseconds and doubles with the rules. Timed in this
# process's CPU time, which other processes' load does not stretch (wall time failed on a busy 2-core box)
def test_gbnf_conversion_is_linear():
    unlimited = G.GrammarLimits(max_bytes=1 << 30, max_rules=1 << 30, max_rule_depth=1 << 30)

    def chain(n: int) -> str:
        return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n} ::= "x"\n'

    def timed(n: int) -> float:
        text = chain(n)
        gc.collect()
        gc.disable()            # a collection of the older generations inside one run is not the conversion's
        try:
            t0 = time.process_time()
            G._gbnf_to_lark(text, unlimited)
            return time.process_time() - t0
        finally:
            gc.enable()
    timed(500)
    t3, t12 = min(timed(3000) for _ in range(3)), min(timed(12000) for _ in range(3))
    assert t3 < 0.5, f"3,000 rules took {t3:.2f} s"
    assert t12 < 8 * t3 + 0.05, f"3,000 rules {t3:.3f} s, 12,000 rules {t12:.3f} s: not linear"


def _refused(**kw) -> APIError:
    with pytest.raises(APIError) as e:
        G.grammar_of(**kw)
    assert e.value.status == 400 and len(e.value.message) < 600, e.value.message
    return e.value


# each limit refuses with a 400 that names it (docs/api.md's request-field table states them)
def test_limits_refuse_with_400():
    chain = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(150)) + 'r150 ::= "x"\n'
    assert "chain more than 100 deep" in _refused(grammar=chain).message
    many = "root ::= " + " | ".join(f"r{i}" for i in range(900)) + "\n"
    many += "".join(f'r{i} ::= "x"\n' for i in range(1001))
    assert "more than 1000 rules" in _refused(grammar=many).message
    alts = "root ::= " + " | ".join(f'"w{i}"' for i in range(1001)) + "\n"
    assert "more than 1000 alternatives" in _refused(grammar=alts).message
    nest = "root ::= " + "(" * 40 + '"x"' + ")" * 40 + "\n"
    assert "nest more than 32" in _refused(grammar=nest).message
    big = "root ::= " + " | ".join(f'"w{i}"' for i in range(20000)) + "\n"
    e = _refused(grammar=big)
    assert "bytes" in e.message and "limits:" in e.message and e.code == "grammar_too_complex"
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)}
    defs["d1000"] = {"type": "string"}
    assert "levels deep" in _refused(json_schema={"$defs": defs, "$ref": "#/$defs/d0"}).message
    for schema in ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a", "title": "t"}},
                                   "$ref": "#/$defs/a"}):
        assert "cycle" in _refused(json_schema=schema).message
    # a recursive schema with a value between its recursions is fine: a tree
    kids = {"type": "array", "items": {"$ref": "#/$defs/n"}}
    tree = {"$defs": {"n": {"type": "object", "properties": {"kids": kids}}}, "$ref": "#/$defs/n"}
    assert G.grammar_of(json_schema=tree)


@pytest.fixture(scope="module")
def checker(serve_model):
    c = G.Checker(serve_model)
    yield c
    c.close()


# the checker compiles a grammar and masks two tokens in a child process: what crashes llguidance there (a
# 3,000-rule Lark chain overflows its stack) is a verdict, and the next grammar gets a new child
def test_checker_survives_a_crash(checker):
    assert checker.check(G.grammar_of(grammar='root ::= "yes" | "no"')) is None
    lark = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "x"\n'
    verdict = checker.check(G.grammar_of(grammar=lark))
    assert verdict is not None and "crashed" in verdict, verdict
    n = checker.n_started
    assert checker.check(G.grammar_of(json_schema={"type": "object"})) is None
    assert checker.n_started == n + 1
    assert checker.check(G.grammar_of(grammar=lark)) == verdict and checker.n_started == n + 1   # remembered


# a grammar that fails in its first tokens (llguidance's parser limit of 2,000 items a row) is refused by the
# checker, with llguidance's one-line message, not its state (that message was 300 KB)
def test_checker_refuses_what_fails_at_once(checker):
    def alts(c: str) -> str:
        return " | ".join(f'"{c}{i}" z' for i in range(900))
    g = (f'root ::= big\nbig ::= r1 | r2 | r3\nr1 ::= {alts("p")}\nr2 ::= {alts("q")}\nr3 ::= {alts("s")}\n'
         'z ::= "z" z | "y"\n')
    verdict = checker.check(G.grammar_of(grammar=g))
    assert verdict is not None and "2000" in verdict and len(verdict) < 300, verdict


# past the time limit the child is killed, the verdict says so, and the next check starts another
def test_checker_time_limit(serve_model):
    c = G.Checker(serve_model, G.GrammarLimits(check_timeout_s=1e-4))
    try:
        alts = "root ::= " + " | ".join(f'"w{i}" "{i}"' for i in range(999)) + "\n"
        verdict = c.check(G.grammar_of(grammar=alts))
        assert verdict is not None and "took more than" in verdict, verdict
        assert c._proc is None                      # killed; the next check starts one
    finally:
        c.close()
