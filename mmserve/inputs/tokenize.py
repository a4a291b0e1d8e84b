"""Parsing vLLM's tokenizer routes' bodies (`POST /tokenize`, `POST /detokenize`): a prompt to
tokenize as it is, or chat messages to render through the model's chat template (validated as a
chat request is: the same messages, images, tools and template parameters), or token ids to
decode. Everything wrong is a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest, clip
from mmserve.inputs.extensions import flag
from mmserve.inputs.request import ChatRequest, check_json_shape, parse_chat_request

# what a chat-form /tokenize body may hold besides its messages (vLLM's TokenizeChatRequest)
_CHAT_KEYS = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
              "chat_template_kwargs", "tools", "tool_choice"}
_PROMPT_KEYS = {"model", "prompt", "add_special_tokens"}


@dataclass(frozen=True)
class TokenizeRequest:
    """A prompt (`text`, its tokenizer's special tokens added when `add_special_tokens`) or a
    chat (`chat`: rendered by the template, its images expanded to the tokens the model sees)."""

    model: str
    text: str | None = None
    add_special_tokens: bool = True
    chat: ChatRequest | None = None
    token_strs: bool = False  # vLLM's return_token_strs: each token's own string too


def _model(body: dict, default_model: str) -> str:
    model = body.get("model")
    if model is None:
        return default_model
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a string", param="model")
    return model


def _object(body: Any, limits: LimitsConfig) -> dict:
    check_json_shape(body, limits.max_json_depth)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse_tokenize(body: Any, limits: LimitsConfig, default_model: str) -> TokenizeRequest:
    body = _object(body, limits)
    token_strs = flag(body, "return_token_strs", False)
    rest = {k: v for k, v in body.items() if k != "return_token_strs"}
    model = _model(rest, default_model)
    if "messages" in rest:
        unknown = sorted(set(rest) - _CHAT_KEYS)
        if unknown:
            raise BadRequest(f"unrecognized argument(s) for a chat /tokenize: {clip(', '.join(unknown))}",
                             param=unknown[0][:64])
        chat = parse_chat_request(dict(rest, model=model), limits, default_model)
        return TokenizeRequest(model, chat=chat, token_strs=token_strs)
    unknown = sorted(set(rest) - _PROMPT_KEYS)
    if unknown:
        raise BadRequest(f"unrecognized argument(s) for /tokenize: {clip(', '.join(unknown))} (send 'prompt', or "
                         "'messages' to render through the chat template)", param=unknown[0][:64])
    text = rest.get("prompt")
    if not isinstance(text, str):
        raise BadRequest("'prompt' must be a string (or send 'messages')", param="prompt")
    return TokenizeRequest(model, text=text, add_special_tokens=flag(rest, "add_special_tokens", True),
                           token_strs=token_strs)


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str
    tokens: tuple[int, ...]


def parse_detokenize(body: Any, limits: LimitsConfig, default_model: str) -> DetokenizeRequest:
    body = _object(body, limits)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise BadRequest(f"unrecognized argument(s) for /detokenize: {clip(', '.join(unknown))}",
                         param=unknown[0][:64])
    tokens = body.get("tokens")
    if (not isinstance(tokens, list) or len(tokens) > limits.max_prompt_tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens)):
        raise BadRequest(f"'tokens' must be a list of at most {limits.max_prompt_tokens} token ids (integers >= 0)",
                         param="tokens")
    return DetokenizeRequest(_model(body, default_model), tuple(tokens))
