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
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from . import render

BOS, EOS, PAD, IMAGE = "<s>", "</s>", "<pad>", "<image>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IMAGE)
VOCAB_SIZE = 360

CHAT_TEMPLATE = (
    "{{- '<s>' -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] + ': ' -}}"
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
    "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}"
)


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


def build_backend() -> Tokenizer:
    """Train the byte-level BPE (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_backend(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
