"""Byte-level BPE tokenizer and chat template for the demo models.

The BPE is trained (deterministically) on the task's own text, so the vocabulary is tiny (~360)
while any UTF-8 text still round-trips through the byte-level alphabet.

Chat format (one line per message; the template writes the BOS, tokenization adds nothing)::

    <s>system: Answer briefly.
    user: <image>What color is the shape?
    assistant: red</s>
    user: What shape is it?
    assistant:

The model then generates `` circle</s>`` (leading space: strip it).

:func:`build_qwen_tokenizer` is the same BPE for the Qwen2-VL demo models, with Qwen's vision
special tokens instead of ``<image>``; its template writes each image as
``<|vision_start|><|image_pad|><|vision_end|>`` (one pad: the caller expands it per image).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from . import render

BOS, EOS, PAD, IMAGE = "<s>", "</s>", "<pad>", "<image>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IMAGE)
VOCAB_SIZE = 360

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
QWEN_SPECIAL_TOKENS = (BOS, EOS, PAD, VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
QWEN_IMAGE = VISION_START + IMAGE_PAD + VISION_END
QWEN_VIDEO = VISION_START + VIDEO_PAD + VISION_END

_TOOLS_PREAMBLE = ("# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>")
_TOOLS_POSTAMBLE = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and "
                    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
                    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>')
CHAT_TEMPLATE = (
    "{%- macro content(message) -%}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{{- '<image>' -}}"
    "{%- elif part['type'] in ('text', 'input_text') -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- '<s>' -}}"
    # tools (hermes style, as Qwen2.5's template): a system line listing them, then the messages
    "{%- if tools -%}"
    "{{- 'system: ' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- content(messages[0]) + '\\n\\n' -}}{%- endif -%}"
    "{{- '" + _TOOLS_PREAMBLE + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '" + _TOOLS_POSTAMBLE + "\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- message['role'] + ': ' -}}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<tool_response>\\n' + content(message) + '\\n</tool_response>' -}}"
    "{%- else -%}"
    "{{- content(message) -}}"
    "{%- endif -%}"
    # an assistant's calls, each as the model writes one: compact JSON in <tool_call> markup
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\":' + (fn['name'] | tojson) + ',\"arguments\":' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson(separators=(',', ':')) -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}"
)
# LLaVA-OneVision's video token; its demo template writes it for a video part
VIDEO = "<video>"
ONEVISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- elif part['type'] in ('text', 'input_text') -%}",
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '" + VIDEO + "' -}}"
    "{%- elif part['type'] in ('text', 'input_text') -%}")
# a video part renders as Qwen's own templates render it (the image and text parts as before)
QWEN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{{- '<image>' -}}", "{{- '" + QWEN_IMAGE + "' -}}").replace(
    "{%- elif part['type'] in ('text', 'input_text') -%}",
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '" + QWEN_VIDEO + "' -}}"
    "{%- elif part['type'] in ('text', 'input_text') -%}")


def _corpus() -> list[str]:
    from .data import SYSTEM_PROMPTS  # local import: data imports nothing from here

    questions = [
        render.Q_COLOR,
        render.Q_BACKGROUND,
        render.Q_SHAPE,
        render.Q_FIRST,
        render.Q_SECOND,
    ]
    answers = [f" {w}" for w in (*render.COLORS, *render.BACKGROUNDS, *render.SHAPES)]
    lines: list[str] = []
    for _ in range(20):  # weight the task text well above the system prompts
        lines += [f"user: {q}" for q in questions]
        lines += [f"assistant:{a}" for a in answers]
    lines += [f"system: {p}" for p in SYSTEM_PROMPTS]
    lines += ["Describe the image.", "Hello! How are you? Thank you, please tell me more."]
    return lines


def build_backend(special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Train the byte-level BPE (deterministic for a given corpus).

    The vocabulary grows with the special tokens, so every variant learns the same merges.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) + len(special_tokens),
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def demo_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE,
                   **extra_special_tokens: str) -> PreTrainedTokenizerFast:
    """The demo BPE trained with `special_tokens` as a fast tokenizer: BOS, EOS, PAD, the family's
    `extra_special_tokens` (``image_token=...``), left padding, `chat_template`."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_backend(special_tokens),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=extra_special_tokens,
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = chat_template
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    return demo_tokenizer(image_token=IMAGE)


def build_onevision_tokenizer() -> PreTrainedTokenizerFast:
    """The demo BPE with `<image>` and `<video>` (LLaVA-OneVision's two placeholders)."""
    return demo_tokenizer(SPECIAL_TOKENS + (VIDEO,), ONEVISION_CHAT_TEMPLATE, image_token=IMAGE, video_token=VIDEO)


def build_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The demo BPE with Qwen2-VL's vision tokens (``tokenizer.image_token`` is ``<|image_pad|>``)."""
    return demo_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE, image_token=IMAGE_PAD,
                          vision_start_token=VISION_START, vision_end_token=VISION_END, video_token=VIDEO_PAD)


def generation_config(tokenizer) -> GenerationConfig:
    """The demo models' generation config: greedy, 16 new tokens, the tokenizer's special ids."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=16,
    )
