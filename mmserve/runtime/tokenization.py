"""vLLM's tokenizer routes on a model's own tokenizer and chat template: what `/tokenize`,
`/detokenize` and `/tokenizer_info` answer (vLLM's shapes), so a client such as lm-eval needs
no copy of the tokenizer. A chat is tokenized exactly as a chat request's prompt is (the same
template, tools and template parameters), its images expanded to the placeholder tokens the
model sees; the count is not limited by the server's prompt limits (`max_model_len` is there to
compare with)."""

from __future__ import annotations

from mmserve.actors.intake import decode_images, hf_messages, hf_tools, remote_urls
from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest, clip
from mmserve.inputs.video_parts import VideoPart
from mmserve.inputs.image_budget import check_image_size
from mmserve.inputs.tokenize import DetokenizeRequest, TokenizeRequest
from mmserve.models.adapter import Adapter


def max_model_len(adapter: Adapter) -> int | None:
    return int(getattr(adapter.text_config, "max_position_embeddings", 0) or 0) or None


def token_ids(adapter: Adapter, request: TokenizeRequest, limits: LimitsConfig) -> list[int]:
    """The request's tokens (runs in a worker thread: images are decoded and preprocessed)."""
    if request.chat is None:
        return list(adapter.tokenizer(request.text, add_special_tokens=request.add_special_tokens)["input_ids"])
    chat = request.chat
    if remote_urls(chat):
        raise BadRequest("/tokenize takes images as data: URLs only (it fetches nothing)", param="messages")
    if any(isinstance(p, VideoPart) for m in chat.messages for p in m.parts):
        raise BadRequest("/tokenize does not take video parts (it decodes no video)", param="messages")
    images = decode_images(chat, limits)
    for img in images:
        check_image_size(adapter.image_processor, img.width, img.height, limits, "messages")
    prompt = adapter.tokenize(hf_messages(chat), images, hf_tools(adapter, chat), chat.template.render_args() or None)
    return list(prompt.input_ids)


def tokenize(adapter: Adapter, request: TokenizeRequest, limits: LimitsConfig) -> dict:
    ids = token_ids(adapter, request, limits)
    strs = adapter.tokenizer.convert_ids_to_tokens(ids) if request.token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len(adapter), "tokens": ids, "token_strs": strs}


def detokenize(adapter: Adapter, request: DetokenizeRequest) -> dict:
    bad = next((t for t in request.tokens if t >= adapter.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"'tokens' holds token id {bad}; model {clip(adapter.name)} has {adapter.vocab_size} tokens",
                         param="tokens")
    return {"prompt": adapter.tokenizer.decode(list(request.tokens))}


def tokenizer_info(adapter: Adapter) -> dict:
    """The tokenizer's configuration as vLLM's `/tokenizer_info` gives it: its class, special
    tokens and chat template (lm-eval renders chats with it) and the model's context."""
    tok = adapter.tokenizer
    return {"tokenizer_class": type(tok).__name__, "model": adapter.name,
            "eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
            "unk_token": tok.unk_token, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
            "chat_template": getattr(getattr(adapter, "processor", None), "chat_template", None) or tok.chat_template,
            "model_max_length": max_model_len(adapter),
            "vocab_size": adapter.vocab_size, "add_bos_token": getattr(tok, "add_bos_token", None)}
