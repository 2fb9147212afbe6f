"""A request's prompt as token ids: the chat template and the tokenizer, in one place.

The gateway renders every request this way before it runs it, and the ingress request
router (routing/router/ingress.py) renders a body the same way to hash its prompt and
choose the replica that holds it: the two must agree token for token, or the router
would look up blocks the replica never writes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from engine.config import EngineConfig
from engine.tokenizer import load_tokenizer
from routing.openai.config import GatewayConfig
from routing.openai.errors import invalid_request
from routing.openai.protocol import ChatCompletionRequest, CompletionRequest
from routing.openai.tools import tool_format


class Prompts:
    """The served model's tokenizer, the chat template (`gateway.chat_template`, else the
    checkpoint's) and the tool-call format it implies."""

    def __init__(self, engine: EngineConfig, gateway: GatewayConfig):
        self.tokenizer = load_tokenizer(engine.model)
        _ = self.tokenizer.hf  # chat templates render through transformers: load it now, not on a request
        self.chat_template = Path(gateway.chat_template).read_text() if gateway.chat_template else None
        self.tool_format = tool_format(self.chat_template or self.tokenizer.chat_template, gateway.tool_format)

    async def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The rendered conversation's ids (tokenized off the event loop); a 400 if the
        template cannot render it."""
        req.use_tool_format(self.tool_format)
        try:
            text = self.tokenizer.apply_chat_template(req.template_messages(), req.add_generation_prompt,
                                                      req.template_tools(), self.chat_template)
        except Exception as e:
            raise invalid_request(f"messages could not be rendered with the chat template: {e}", "messages") from e
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def completion_ids(self, req: CompletionRequest) -> list[int]:
        """The prompt's ids: a string tokenized (off the event loop), or ids checked
        against the vocabulary; a 400 if empty or out of range."""
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt)
        else:
            ids = list(cast(list[int], req.prompt))  # CompletionRequest leaves text or ids
            if ids and max(ids) >= self.tokenizer.vocab_size:
                raise invalid_request(f"token ids must be < {self.tokenizer.vocab_size}", "prompt")
        if not ids:
            raise invalid_request("prompt must not be empty", "prompt")
        return ids
