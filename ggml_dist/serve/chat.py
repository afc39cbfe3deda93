"""A chat request's prompt, rendered in one place: for /v1/chat/completions (and /v1/responses over it),
for llama-server's /chat/completions/input_tokens (the tokens it would take) and /apply-template.

    render_chat(st, body, req, hint)  the chat template (the server's --chat-template, else the GGUF's),
        the request's tools (rendered by the template, or as a system note where the template renders none:
        serve/tools.py's generic format), and the rendering with the generation prompt, without it
        (add_generation_prompt false), or cut inside the last assistant message, which the answer then
        continues (vLLM's continue_final_message). Off the event loop.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .protocol import ChatRequest
from .state import AppState, invalid
from .tools import check_tools, generic_messages, style_of


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    tools: list[Any] | None = None      # the request's tools, where it has some and tool_choice is not none
    forced: str | None = None           # the tool a call is forced to (tool_choice)
    style: str | None = None            # the template's tool-call syntax (serve/tools.py), with tools


async def render_chat(st: AppState, body: dict[str, Any], req: ChatRequest, hint: str = "") -> ChatPrompt:
    """req's prompt; body: the request as sent, for the rendering's own fields (add_generation_prompt,
    continue_final_message); hint: what the refusal of a model without a template suggests besides
    --chat-template."""
    tok = st.tokenizer()
    template = st.engine.cfg.chat_template or tok.chat_template
    if not template:
        raise invalid(f"the model has no chat template{' (tokenizer.chat_template)' if hint else ''}; start the "
                      f"server with --chat-template{hint}", "messages")
    messages = [m.for_template() for m in req.messages]
    tools, forced, style = None, None, None
    if req.tools is not None and req.tool_choice != "none":
        style = style_of(template)
        tools, forced = check_tools(req.tools, req.tool_choice)
    extra: dict[str, Any] = {"tools": tools} if tools is not None else {}
    if tools is not None and style == "generic":     # the template renders no tools: a system note
        messages, extra = generic_messages(messages, tools), {}
    cont, gen = body.get("continue_final_message", False), body.get("add_generation_prompt", True)
    if not isinstance(cont, bool) or not isinstance(gen, bool):
        raise invalid("'add_generation_prompt' and 'continue_final_message' must be booleans",
                      "continue_final_message")
    if cont and gen and "add_generation_prompt" in body:
        raise invalid("continue_final_message continues the last message: add_generation_prompt must be "
                      "false with it", "continue_final_message")
    if cont and (messages[-1]["role"] != "assistant" or not messages[-1].get("content")):
        raise invalid("continue_final_message needs a last assistant message with content", "messages")
    try:
        text = await asyncio.to_thread(tok.apply_chat_template, messages, add_generation_prompt=gen and not cont,
                                       template=template, **extra)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception (roles out of order): a 400
        raise invalid(f"the chat template rejected the messages: {e}", "messages") from None
    if cont:                    # the rendering, cut where the last message's content ends
        last = messages[-1]["content"]
        at = text.rfind(last)
        if at < 0:
            raise invalid("the chat template does not render the last message's content as given, so it "
                          "cannot be continued", "continue_final_message")
        text = text[:at + len(last)]
    return ChatPrompt(text, tools, forced, style)
