"""What every model family's adapter shares: the prompt types and the model steps that do not
depend on the family (embedding, the paged step over the KV arena, detokenizing).

A family adapter (`LlavaAdapter`, `Qwen2VLAdapter`) adds what differs: loading its processor,
tokenizing a chat with images, each image's pixel item and encoder forward, and — for M-RoPE
models — the 3-D positions of the prompt's tokens. `load_adapter` (mmserve.models.loading) picks
the family from the checkpoint's `config.json`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
import os
from pathlib import Path
from typing import Mapping, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models load from local directories only

import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from mmserve.cache.keys import check_hash_algorithm, image_identity
from mmserve.models.random_weights import checkpoint_sig

hf_logging.disable_progress_bar()

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's placeholder tokens sit in the prompt: positions [start, start+length)."""

    start: int
    length: int


@dataclass(frozen=True)
class PromptInputs:
    """A tokenized prompt and its per-image pixel items (item i belongs to spans[i]).

    `rope_positions` is set for M-RoPE models only: the [3, T] positions of the prompt's tokens
    (temporal, height, width; equal for text tokens) and `rope_delta`, the offset of every token
    after the prompt (its position is its index + rope_delta). Both follow from the token ids and
    the images' grids alone, so a prompt that shares a prefix with another shares its positions."""

    input_ids: tuple[int, ...]
    pixel_values: object | None  # indexable by image: a [N, C, H, W] tensor or a tuple of items
    spans: tuple[ImageSpan, ...]
    mm_keys: tuple[bytes | None, ...] = ()  # content key per image; None = uncacheable
    images: tuple = ()  # the decoded images, when pixel_values is left for the encoder to compute
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    bidirectional: tuple[tuple[int, int], ...] = ()  # runs [lo, hi) of tokens that see each other
    # both ways (Gemma 3's image soft tokens): never split across prefill chunks, masked per step

    def pixels(self, adapter: "Adapter", i: int):
        """Image i's pixel item (computed now if `tokenize` left it out)."""
        if self.pixel_values is not None:
            return self.pixel_values[i]
        return adapter.pixel_values([self.images[i]])[0]


@dataclass
class StepOutput:
    """Logits of the last position of each sequence, and the KV cache after the step."""

    logits: torch.Tensor
    cache: DynamicCache


def template_variables(source) -> frozenset[str] | None:
    """The variables a chat template (a string, or a dict of named ones) reads; None when it cannot
    be parsed here (then every requested keyword argument is passed)."""
    import jinja2
    import jinja2.meta

    texts = list(source.values()) if isinstance(source, dict) else [source] if source else []
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset().union(*(jinja2.meta.find_undeclared_variables(env.parse(t)) for t in texts))
    except Exception:  # a tag only transformers' own environment knows (e.g. {% generation %})
        return None


def placeholder_spans(input_ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> tuple[ImageSpan, ...]:
    """One span per image, in order, from each image's own placeholder count: image k takes the
    next counts[k] placeholder positions, which must be contiguous (two images whose
    placeholders touch are still told apart by their counts)."""
    positions = [i for i, t in enumerate(input_ids) if t == image_token_id]
    if len(positions) != sum(counts):
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens; its images need {sum(counts)}")
    spans, at = [], 0
    for n in counts:
        chunk = positions[at:at + n]
        if not chunk or chunk[-1] - chunk[0] != n - 1:
            raise ValueError("an image's placeholder tokens are not contiguous")
        spans.append(ImageSpan(chunk[0], n))
        at += n
    return tuple(spans)


class Adapter(ABC):
    """One loaded model on a device. Subclasses set `tokenizer`, `model`, `image_processor` and
    `image_token_id` in `_load`, and implement the family's preprocessing and encoder steps."""

    mrope = False  # True: positions are 3-D (`PromptInputs.rope_positions`)

    def __init__(self, name: str, path: str | Path, device: str = "cpu", dtype: str = "float32", *,
                 hash_algorithm: str = "xxh3_128"):
        self.hash_algorithm = check_hash_algorithm(hash_algorithm)  # of block and multimodal keys
        self.name = name
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model {name!r}: checkpoint directory {self.path} does not exist")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self._load()
        self.model = self.model.to(self.device).eval()
        self.config = self.model.config
        self.text_config = self.config.get_text_config()
        self.eos_token_ids = frozenset(self._eos_ids())
        self.vocab_size = int(self.text_config.vocab_size)
        tc = self.text_config
        self.kv_layers = int(tc.num_hidden_layers)
        self.kv_heads = int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
        self.head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self._template_variables: frozenset[str] | None = None
        self.answer_lead = self._answer_lead()
        dtype_name = str(self.dtype).removeprefix("torch.")  # 'float32', 'float16', 'bfloat16'
        self.model_sig = checkpoint_sig(name, self.path, dtype=dtype_name, device_type=self.device.type)
        self.processor_digest = self._processor_digest()

    # -- what a family provides ------------------------------------------------------------

    @abstractmethod
    def _load(self) -> None:
        """Loads the tokenizer, image processor and model; sets `tokenizer`, `image_processor`,
        `model` (on the CPU, in `dtype`) and `image_token_id`."""

    @abstractmethod
    def _processor_digest(self) -> int:
        """The digest of the image processor's settings that every mm_hash folds in."""

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                      template: Mapping | None = None) -> str:
        """The chat-templated prompt text, ending with the generation prompt; `tools` (OpenAI's
        shape) are rendered by the template, as transformers' `apply_chat_template(tools=...)`.
        `template`: vLLM's template parameters (`template_args`)."""
        args = self.template_args(template)
        return self._render(messages, args.pop("add_generation_prompt", True), tools, **args)

    def template_args(self, template: Mapping | None) -> dict:
        """`add_generation_prompt` and `continue_final_message` from `template`, and those of its
        other keys (a request's `chat_template_kwargs`) that the chat template reads: vLLM drops
        the others, so a client may send e.g. `enable_thinking` to every model."""
        if not template:
            return {}
        if getattr(self, "_template_variables", None) is None:
            self._template_variables = template_variables(self._chat_template_source()) or frozenset({"*"})
        own, used = ("add_generation_prompt", "continue_final_message"), self._template_variables
        return {k: v for k, v in template.items() if k in own or k in used or "*" in used}

    def _chat_template_source(self):
        return getattr(getattr(self, "processor", None), "chat_template", None) or self.tokenizer.chat_template

    @abstractmethod
    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        """The templated prompt's tokens with each image's placeholders expanded to its count, and
        the images' spans; pixels are left for the encoder to make on a cache miss. `tools` and
        `template` as `render_prompt` takes them."""

    def tokenize_raw(self, input_ids: Sequence[int]) -> PromptInputs:
        """A text-only prompt given as token ids (`/v1/completions`: no chat template, no image)."""
        return PromptInputs(tuple(int(t) for t in input_ids), None, ())

    @abstractmethod
    def pixel_values(self, images: Sequence) -> list:
        """One pixel item per image, as `encode_images` takes them (worker thread)."""

    @abstractmethod
    def encode_images(self, items) -> list[torch.Tensor]:
        """The vision tower and projector over pixel items: one [num_image_tokens, hidden] each."""

    def fixed_tower(self):
        """The tower split for the static encoder path (`models.fixed_tower.FixedTower`), or None:
        a family whose views change shape with the image keeps its tower eager."""
        return None

    @property
    def encoder_width(self) -> int | None:
        """The width of an image's encoder-output rows (what the shared tier expects of a stored
        one): the language model's hidden size, unless the family's rows carry more (Qwen3-VL)."""
        return getattr(self.text_config, "hidden_size", None)

    def image_key(self, image) -> bytes | None:
        """The image's content key (mm_hash) under this model, or None when it has none."""
        return image_identity(self.model_sig, self.processor_digest, image, algorithm=self.hash_algorithm)

    def rope_positions(self, prompt: PromptInputs, ids_len: int, start: int, end: int) -> torch.Tensor | None:
        """[3, end-start] positions of tokens [start, end) of a sequence whose prompt is `prompt`
        (tokens past the prompt are its answer); None for 1-D positions (index = position)."""
        return None

    # -- shared -----------------------------------------------------------------------------

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]

    def _answer_lead(self) -> str:
        """Whitespace the chat template puts between the generation prompt and an assistant
        message's content (e.g. "assistant:" + " " + content). The model generates it as part of
        its answer; it is removed from responses so that a client sending the answer back in the
        history reproduces the very tokens that were generated."""
        user = [{"role": "user", "content": "q"}]
        try:
            prompt = self.render_prompt(user)
            full = self._render(user + [{"role": "assistant", "content": "ANSWER"}], generation_prompt=False)
        except Exception:  # a template that cannot render the probe: strip nothing
            return ""
        if not full.startswith(prompt):
            return ""
        rest = full[len(prompt):]
        lead = rest[: len(rest) - len(rest.lstrip())]
        return lead if rest[len(lead):].startswith("ANSWER") else ""

    def _expanded_prompt(self, messages: list[dict], counts: Sequence[int], tools: list[dict] | None = None,
                         template: Mapping | None = None):
        """(input_ids, spans) of the templated prompt with image k's single placeholder repeated
        counts[k] times, as the family's processor expands it. The image token is special, so it
        splits the text before the tokenizer's own rules run: one placeholder per image tokenizes
        like the expanded text, and repeating its id is far cheaper than tokenizing hundreds of
        placeholder strings."""
        compact = self.tokenizer([self.render_prompt(messages, tools, template)])["input_ids"][0]
        where = [i for i, t in enumerate(compact) if t == self.image_token_id]
        if len(where) != len(counts):
            raise ValueError(f"the prompt has {len(where)} image placeholders for {len(counts)} images")
        input_ids: list[int] = []
        start = 0
        for i, n in zip(where, counts):
            input_ids += compact[start:i] + [self.image_token_id] * n
            start = i + 1
        input_ids = tuple(int(t) for t in input_ids + compact[start:])
        return input_ids, placeholder_spans(input_ids, self.image_token_id, counts)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None,
                **template) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  tools=tools, **template)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model its tools (a template that ignores
        `tools=` would leave a tool request blind); probed once."""
        known = getattr(self, "_renders_tools", None)
        if known is None:
            user = [{"role": "user", "content": "q"}]
            probe = [{"type": "function", "function": {"name": "probe_tool_name", "parameters": {"type": "object"}}}]
            try:
                known = "probe_tool_name" in self._render(user, True, tools=probe)
            except Exception:  # a template that cannot render tools at all
                known = False
            self._renders_tools = known
        return known

    @torch.inference_mode()
    def embed(self, input_ids: Sequence[int], pieces: Sequence[tuple[int, torch.Tensor]] = ()) -> torch.Tensor:
        """Token embeddings [1, T, H] with each (position, rows) piece of image embeddings
        written over the placeholders starting at that position."""
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        for pos, rows in pieces:
            embeds[0, pos : pos + rows.shape[0]] = rows.to(embeds.dtype)
        return embeds

    @property
    def language_model(self) -> torch.nn.Module:
        """The decoder stack (no vision tower, no output head) a paged step runs."""
        return self.model.model.language_model

    def step_inputs(self, input_ids: Sequence[int], pieces: Sequence[tuple[int, torch.Tensor]] = ()) -> tuple[torch.Tensor, dict]:
        """What one step's language-model forward takes for these new tokens: `inputs_embeds`
        [1, T, H] (`embed`) and the family's extra keyword arguments for the language model (e.g.
        Qwen3-VL's DeepStack features at the image positions); `pieces` as `embed` takes them, rows
        of the encoder's outputs (an encoder output may carry more than the input embedding)."""
        return self.embed(input_ids, pieces), {}

    @torch.inference_mode()
    def prefill(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None = None, start: int = 0,
                positions: torch.Tensor | None = None, lm_kwargs: dict | None = None,
                spans: Sequence[tuple[int, int]] = ()) -> StepOutput:
        """The language model over [1, T, H] embeddings after `start` positions held in `cache` (a
        contiguous transformers cache; None: a new one): the model's own path, the reference the
        paged step is tested against and the benchmark's bare suffix prefill. `positions`: M-RoPE
        positions [3, T] (None: start .. start+T-1); `lm_kwargs`: the family's, from `step_inputs`;
        `spans`: the sequence's bidirectional runs [lo, hi) (`PromptInputs.bidirectional`), which
        `prefill_masks` turns into the family's attention masks when a new token is in one."""
        cache = cache if cache is not None else DynamicCache(config=self.text_config)
        t = inputs_embeds.shape[1]
        if positions is None:
            position_ids = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        else:
            position_ids = positions.to(self.device).unsqueeze(1)
        # a run that none of the new tokens is in adds nothing to their causal mask
        inside = any(lo < start + t and hi > start for lo, hi in spans)
        masks = self.prefill_masks(inputs_embeds, cache, position_ids, start, spans) if inside else {}
        out = self.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache, use_cache=True,
                                  **(lm_kwargs or {}), **masks)
        logits = self.model.lm_head(out.last_hidden_state[:, -1, :])
        return StepOutput(logits.float(), out.cache)

    def prefill_masks(self, inputs_embeds: torch.Tensor, cache, position_ids: torch.Tensor, start: int,
                      spans: Sequence[tuple[int, int]]) -> dict:
        """The language model's keyword arguments that make `prefill`'s tokens [start, start+T) see
        `spans` both ways (a family with bidirectional spans overrides it)."""
        raise NotImplementedError(f"{type(self).__name__} has no bidirectional attention spans")

    def generate_inputs(self, prompt: PromptInputs, items: Sequence = ()) -> dict:
        """The model's own `forward` / `generate` inputs for one prompt, from mmserve's tokens and
        pixel items (`pixel_values`; what the runtime encodes): input_ids and attention_mask [1, T]
        and the family's image tensors, as its transformers processor would give them (for a family
        whose processor cannot be built here: it needs torchvision)."""
        raise NotImplementedError(f"{type(self).__name__} builds no generate inputs (use its processor)")

    def _token_inputs(self, prompt: PromptInputs) -> dict:
        ids = torch.tensor([list(prompt.input_ids)], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def decode_special(self, token_ids: Sequence[int]) -> str:
        """`decode_text` keeping special tokens' text (vLLM's `skip_special_tokens: false`)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
