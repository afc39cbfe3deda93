"""The page in a real headless chromium (tests/serve/browser.py): it loads, asks for the API key, a chat
message streams its answer, Stop stops it; a 2-stage server's two lanes move while requests run, and a
stage killed under load shows as lost, then replaced and recovered. Screenshots are kept under the
test's tmp path (the path is printed)."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "aiohttp"):     # the serve extras; aiohttp comes with ray[default]
    pytest.importorskip(_mod)

import httpx  # noqa: E402

from ggml_dist.serve.guard import HTTPPolicy  # noqa: E402
from ggml_dist.serve.server import ServeOptions  # noqa: E402

from .browser import Browser, ensure_chromium  # noqa: E402
from .conftest import CHATML  # noqa: E402
from .test_page import Load  # noqa: E402

KEY = "browser-key"


@pytest.fixture(scope="module")
def chromium() -> str:
    return ensure_chromium()


@pytest.fixture
def browser(chromium, tmp_path):
    b = Browser(chromium, tmp_path / "profile")
    yield b
    b.close()


@pytest.fixture(scope="module")
def keyed(serve_model):
    """One process with an API key, the ChatML-like template; 32768 tokens a slot, so that an answer runs
    for tens of seconds (Stop must land in it: with 4096 a slot and 3000 tokens asked, a loaded CI machine
    once let the answer end by its length before the click arrived)."""
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    opts = ServeOptions(policy=HTTPPolicy.for_bind("127.0.0.1", KEY))
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=65536, chat_template=CHATML)
    with ServerThread(cfg, model_name="synthetic", opts=opts) as srv:
        yield srv


@pytest.fixture(scope="module")
def two_stages(local_ray, serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    cfg = engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=4096, chat_template=CHATML)
    with ServerThread(cfg, model_name="synthetic") as srv:
        srv.engine.runtime.set_recover_timeout(120)
        yield srv


def keep(browser: Browser, tmp_path, name: str) -> None:
    shot = browser.screenshot(tmp_path / name)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def settings(browser: Browser, **values: float) -> None:
    """The page's sampling fields, set as a user would leave them."""
    for k, v in values.items():
        browser.eval(f"document.getElementById('{k}').value = '{v}'")


def answer_of(srv, text: str, max_tokens: int) -> str:
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["message"]["content"]


# with --api-key the page shows nothing until it has the key; typed in, the view goes live (one lane);
# a message typed and sent with Enter gets the answer the API gives, with its token counts and speed;
# the template's rendering is shown on request
def test_page_asks_for_the_key_then_chats(keyed, browser, tmp_path):
    browser.goto(keyed.url + "/")
    browser.wait_for("!document.getElementById('key').hidden", what="the key prompt")
    assert browser.eval("document.querySelectorAll('.lane').length") == 0
    assert browser.eval("document.getElementById('model').textContent.trim()") == ""
    browser.type("#key-input", KEY)
    browser.click("#key-send")
    browser.wait_for("document.getElementById('status').dataset.state === 'live'", what="the live view")
    assert browser.eval("document.querySelectorAll('.lane').length") == 1
    assert browser.eval("document.getElementById('model').textContent") == "synthetic"
    settings(browser, temperature=0, max_tokens=40)
    browser.click("#show-template")
    browser.type("#prompt", "one two three")
    browser.press_enter()
    browser.wait_for("document.querySelector('.msg.assistant[data-done=\"true\"]')", what="the answer")
    text = browser.eval("document.querySelector('.msg.assistant .text').textContent")
    stats = browser.eval("document.querySelector('.msg.assistant .stats').textContent")
    assert text == answer_of(keyed, "one two three", 40) and text
    assert "+ 40 tokens" in stats and "tok/s" in stats and "finish: length" in stats, stats
    assert "<s>user\none two three</s>" in browser.eval("document.getElementById('template').textContent")
    keep(browser, tmp_path, "page-chat.png")
    assert browser.errors == []


# the answer streams: a long one shows its text while it is still coming, and Stop ends it there (the
# answer says it was stopped, shorter than asked; the server's slot is freed)
def test_page_stop_ends_the_answer(keyed, browser):
    browser.goto(keyed.url + "/")
    browser.wait_for("!document.getElementById('key').hidden", what="the key prompt")
    browser.type("#key-input", KEY)
    browser.press_enter()
    browser.wait_for("document.getElementById('status').dataset.state === 'live'", what="the live view")
    settings(browser, temperature=0, max_tokens=30000)
    browser.type("#prompt", "Tell me a long story")
    browser.click("#send")
    browser.wait_for("(document.querySelector('.msg.assistant .text') || {}).textContent", what="the first text")
    browser.click("#stop")
    browser.wait_for("document.querySelector('.msg.assistant[data-done=\"true\"]')", what="the stopped answer")
    assert browser.eval("document.querySelector('.msg.assistant').dataset.finish") == "stopped"
    assert browser.eval("document.querySelector('.msg.assistant .text').textContent").count(" ") < 30000
    eng = keyed.engine
    _until(lambda: eng.n_running() == 0, "the slot to be freed")
    assert eng.metrics.generated_tokens > 0 and browser.errors == []


def _until(cond, what: str, timeout: float = 60) -> bool:
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return True


_WATCH = """window.__busy = {}; new MutationObserver((ms) => ms.forEach((m) => {
    const el = m.target, v = parseFloat(el.dataset.busy);
    if (!isNaN(v)) window.__busy[el.dataset.lane] = Math.max(window.__busy[el.dataset.lane] || 0, v);
  })).observe(document.getElementById('lanes'), {subtree: true, attributes: true, attributeFilter: ['data-busy']})"""


# a 2-stage server: two lanes with their layers; while requests run both lanes' busy shares rise above
# zero, and back at zero once they are done
def test_page_shows_two_lanes_moving(two_stages, browser, tmp_path):
    browser.goto(two_stages.url + "/")
    browser.wait_for("document.querySelectorAll('.lane').length === 2", what="two lanes")
    layers = browser.eval("[...document.querySelectorAll('.lane .layers')].map((e) => e.textContent)")
    assert layers == ["layers 0–0", "layers 1–1"]
    browser.eval(_WATCH)
    with Load(two_stages.url, clients=3, n=48):
        browser.wait_for("window.__busy[0] > 0 && window.__busy[1] > 0", what="both lanes busy")
        keep(browser, tmp_path, "page-two-stages.png")
    browser.wait_for("[...document.querySelectorAll('.lane')].every((e) => e.dataset.busy === '0')",
                     what="both lanes idle again")
    assert browser.errors == []


# a stage killed while requests run: its lane shows lost (or replaced, when the new process answered
# before the page looked), the events say lost, then recovered; the lane is ok again
def test_page_shows_a_killed_stage_lost_then_recovered(two_stages, browser, tmp_path):
    browser.goto(two_stages.url + "/")
    browser.wait_for("document.querySelectorAll('.lane').length === 2", what="two lanes")
    eng = two_stages.engine
    n0, r0 = eng.metrics.generated_tokens, eng.ctx.recovery.n_recoveries
    with Load(two_stages.url, clients=3, n=48):
        _until(lambda: eng.metrics.generated_tokens > n0 + 10, "generation under way")
        eng.runtime.kill_stage(1)
        browser.wait_for("document.querySelector('#events li[data-kind=\"lost\"][data-lane=\"1\"]')",
                         what="stage 1 shown lost")
        browser.wait_for("document.querySelector('#events li[data-kind=\"recovered\"]')", what="the recovery")
        _until(lambda: eng.ctx.recovery.n_recoveries > r0, "the engine's recovery")
    browser.wait_for("document.querySelector('.lane[data-lane=\"1\"]').dataset.state === 'ok'", what="lane 1 ok")
    kinds = browser.eval("[...document.querySelectorAll('#events li')].map((e) => e.dataset.kind)")
    assert kinds.index("lost") < kinds.index("recovered"), kinds
    keep(browser, tmp_path, "page-recovered.png")
    assert browser.errors == []
