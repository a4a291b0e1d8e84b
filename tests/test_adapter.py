"""The adapter's separate steps reproduce the model's own forward and `generate`."""

import pytest
import torch

from mmserve.models.demo import Q_COLOR, Q_FIRST, render_image
from tests.kv_reference import stack_kv
from mmserve.models.llava import LlavaAdapter


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return LlavaAdapter("tiny", tiny_model_dir)


def messages(n_images=1, question=Q_COLOR):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}]


def images(n):
    return [render_image(c, s, seed=i) for i, (c, s) in enumerate([("red", "circle"), ("blue", "square")][:n])]


def full_prefill(adapter, prompt):
    embeds = adapter.encode_images(prompt.pixel_values)
    pieces = [(span.start, e) for span, e in zip(prompt.spans, embeds)]
    return adapter.embed(prompt.input_ids, pieces)


def reference_logits(adapter, prompt):
    with torch.inference_mode():
        out = adapter.model(input_ids=torch.tensor([prompt.input_ids]), pixel_values=prompt.pixel_values)
    return out.logits[0]


@pytest.mark.parametrize("n_images", [1, 2])
def test_preprocess_spans_cover_every_placeholder(adapter, n_images):
    prompt = adapter.preprocess(messages(n_images, Q_FIRST), images(n_images))
    assert len(prompt.spans) == n_images == prompt.pixel_values.shape[0]
    covered = {p for s in prompt.spans for p in range(s.start, s.start + s.length)}
    assert covered == {i for i, t in enumerate(prompt.input_ids) if t == adapter.image_token_id}


@pytest.mark.parametrize("n_images", [1, 2])
def test_prefill_matches_model_forward(adapter, n_images):
    prompt = adapter.preprocess(messages(n_images), images(n_images))
    out = adapter.prefill(full_prefill(adapter, prompt))
    ref = reference_logits(adapter, prompt)[-1]
    assert (out.logits[0] - ref).abs().max() <= 1e-4


def test_chunked_prefill_with_past_kv_matches(adapter):
    prompt = adapter.preprocess(messages(2), images(2))
    embeds = full_prefill(adapter, prompt)
    ref = reference_logits(adapter, prompt)[-1]
    for split in (1, prompt.spans[0].start + 3, len(prompt.input_ids) - 1):
        first = adapter.prefill(embeds[:, :split])
        second = adapter.prefill(embeds[:, split:], first.cache, start=split)
        assert (second.logits[0] - ref).abs().max() <= 1e-4, split


def greedy_loop(adapter, prompt, n):
    out = adapter.prefill(full_prefill(adapter, prompt))
    tokens, pos = [], len(prompt.input_ids)
    for _ in range(n):
        tok = int(out.logits[0].argmax())
        tokens.append(tok)
        if tok in adapter.eos_token_ids:
            break
        out = adapter.decode([tok], out.cache, [pos])
        pos += 1
    return tokens


def test_decode_steps_match_generate_greedy(adapter):
    prompt = adapter.preprocess(messages(1), images(1))
    with torch.inference_mode():
        gen = adapter.model.generate(input_ids=torch.tensor([prompt.input_ids]), pixel_values=prompt.pixel_values,
                                     max_new_tokens=12, do_sample=False)
    expected = gen[0, len(prompt.input_ids):].tolist()
    assert greedy_loop(adapter, prompt, 12) == expected


def test_batched_decode_with_left_padding_matches_unbatched(adapter):
    """Several steps in one left-padded buffered batch cache, regrowing its buffers on the way,
    give each sequence the logits of its own unbatched decode."""
    a = adapter.preprocess(messages(1), images(1))
    b = adapter.preprocess(messages(2, Q_FIRST), images(2))
    steps = 24
    single = []
    for p in (a, b):
        out, pos, rows = adapter.prefill(full_prefill(adapter, p)), len(p.input_ids), []
        for _ in range(steps):
            tok = int(out.logits[0].argmax())
            out = adapter.decode([tok], out.cache, [pos])
            rows.append((tok, out.logits[0]))
            pos += 1
        single.append(rows)
    outs = [adapter.prefill(full_prefill(adapter, p)) for p in (a, b)]
    kvs = [tuple((layer.keys, layer.values) for layer in o.cache.layers) for o in outs]
    cache, mask = stack_kv(kvs)
    assert cache.layers[0].capacity < mask.shape[1] + steps  # forces a regrowth mid-way
    positions = [len(a.input_ids), len(b.input_ids)]
    for step in range(steps):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        tokens = [single[r][step][0] for r in range(2)]
        batched = adapter.decode(tokens, cache, positions, attention_mask=mask).logits
        positions = [p + 1 for p in positions]
        for r in range(2):
            assert (batched[r] - single[r][step][1]).abs().max() <= 1e-4, (step, r)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_tokenize_without_pixels_matches_the_processor(adapter, n_images):
    """The intake's pixel-free tokenization gives the processor's tokens and spans, and the
    pixels the encoder computes later are the processor's own."""
    msgs, imgs = messages(n_images, Q_FIRST), images(n_images)
    if n_images == 0:
        msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    full = adapter.preprocess(msgs, imgs)
    lazy = adapter.tokenize(msgs, imgs)
    assert lazy.input_ids == full.input_ids and lazy.spans == full.spans
    assert lazy.pixel_values is None
    for i in range(n_images):
        assert torch.equal(lazy.pixels(adapter, i), full.pixel_values[i])


def test_placeholder_counts_are_asked_of_the_processor_once_per_image_size(adapter, monkeypatch):
    asked = []
    count = adapter.processor._get_num_multimodal_tokens

    def counting(image_sizes, **kw):
        asked.append(tuple(image_sizes))
        return count(image_sizes=image_sizes, **kw)

    monkeypatch.setattr(adapter.processor, "_get_num_multimodal_tokens", counting)
    monkeypatch.setattr(adapter, "_token_counts", {})
    msgs = messages(2, Q_FIRST)
    small, large = images(2)[0].resize((64, 48)), images(2)[1].resize((300, 200))
    for _ in range(3):
        assert adapter.tokenize(msgs, [small, large]).input_ids == adapter.preprocess(msgs, [small, large]).input_ids
    assert asked == [((48, 64),), ((200, 300),)]


def test_tokenize_refuses_a_placeholder_count_that_does_not_match(adapter):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look: <image> and"}, {"type": "image"}]}]
    with pytest.raises(ValueError):
        adapter.tokenize(msgs, images(1))
