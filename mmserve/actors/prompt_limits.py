"""A prompt's limits, checked where intake prepares it (`actors.intake.prepare`): the server's and
the model's token limits, the KV arena's size, vLLM's `truncate_prompt_tokens`, and what a
completions prompt's token ids may hold. Each refusal is a 400 naming the limit."""

from __future__ import annotations

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest
from mmserve.inputs.request import RawPrompt
from mmserve.models.adapter import Adapter, PromptInputs


def refuse_prompt_beyond_arena(prompt_tokens: int, arena_tokens: int | None, param: str) -> None:
    """A prompt whose KV the model's whole arena cannot hold is refused here, before any of its
    images is encoded (the generator would refuse it after the vision tower ran, seconds to
    minutes on a CPU). Its prefill needs the prompt's tokens and the first answer token's slot."""
    needed = prompt_tokens + 1
    if arena_tokens is not None and needed > arena_tokens:
        raise BadRequest(
            f"the prompt needs {needed} tokens of KV cache; this model's KV arena holds {arena_tokens} "
            "tokens: raise [kv_cache] budget_bytes (or its memory_fraction, when budget_bytes is \"auto\")",
            param=param, code="context_length_exceeded")


def refuse_prompt_tokens(adapter: Adapter, tokens: int, limits: LimitsConfig, max_pos: int, param: str,
                         at_least: bool = False) -> None:
    """A prompt of `tokens` tokens (`at_least`: of that many or more, known from its text's size
    before it is tokenized, `inputs.text_bound`) above the server's limit or the model's context."""
    count = f"at least {tokens} tokens (from its text's size)" if at_least else f"{tokens} tokens"
    if tokens > limits.max_prompt_tokens:
        raise BadRequest(f"the prompt is {count}, above this server's limit of {limits.max_prompt_tokens}",
                         param=param, code="context_length_exceeded")
    if max_pos and tokens >= max_pos:
        raise BadRequest(f"the prompt is {count}; model {adapter.name!r} has a context of {max_pos}",
                         param=param, code="context_length_exceeded")


def truncated(adapter: Adapter, prompt: PromptInputs, keep: int, limits: LimitsConfig, max_pos: int) -> PromptInputs:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as this server
    and the model take, leaving room for one answer token). A prompt with images is refused rather
    than cut: its images' tokens would be cut through or moved away from their pixels."""
    if keep == -1:
        keep = min(limits.max_prompt_tokens, max_pos - 1 if max_pos else limits.max_prompt_tokens)
    if len(prompt.input_ids) <= keep:
        return prompt
    if prompt.spans:
        raise BadRequest(f"'truncate_prompt_tokens' would cut this prompt ({len(prompt.input_ids)} tokens) to "
                         f"{keep}, and it holds images, which mmserve does not cut; send a shorter conversation",
                         param="truncate_prompt_tokens")
    return adapter.tokenize_raw(prompt.input_ids[-keep:])


def raw_prompt_ids(adapter: Adapter, raw: RawPrompt) -> tuple[int, ...]:
    """A completions prompt's token ids: its text tokenized as it is (the tokenizer's special
    tokens added when `add_special_tokens`, as vLLM does), or its ids, checked against the model."""
    if raw.token_ids is not None:
        ids = raw.token_ids
    else:
        ids = tuple(adapter.tokenizer(raw.text, add_special_tokens=raw.add_special_tokens)["input_ids"])
    if not ids:
        raise BadRequest("the prompt is empty: it makes no tokens", param="prompt")
    bad = next((t for t in ids if t >= adapter.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"the prompt holds token id {bad}; model {adapter.name!r} has {adapter.vocab_size} "
                         "tokens", param="prompt")
    if adapter.image_token_id in ids:
        raise BadRequest("the prompt holds the image placeholder token: /v1/completions is text-only "
                         "(send images to /v1/chat/completions)", param="prompt")
    return ids
