"""Random-weights directories (mmserve.models.random_weights): `make-model --random-weights` writes
config, processor and a marker but no weights; loading draws the same weights every time, with the
silenced output rows zero; the model signature follows the marker; the llava-7b preset's shape."""

from __future__ import annotations

import json

import pytest
import torch

from mmserve.bench.model import build_bench_model
from mmserve.cli import main as cli
from mmserve.config import Config, ModelConfig
from mmserve.models.demo.build import PRESETS, build_config, build_processor, build_untrained
from mmserve.models.loading import load_adapter
from mmserve.cache.signature import WEIGHT_SUFFIXES
from mmserve.models.random_weights import (MARKER, checkpoint_sig, from_ranges, is_random_weights, load_model,
                                           read_marker, to_ranges)
from mmserve.runtime.runtime import Runtime


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rw") / "tiny-rw"
    assert cli(["make-model", "--preset", "tiny", "--out", str(out), "--random-weights", "--seed", "7"]) == 0
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_directory_holds_no_weights_and_a_marker(random_dir):
    names = {p.name for p in random_dir.iterdir()}
    assert not [n for n in names if n.endswith(WEIGHT_SUFFIXES)]
    assert {"config.json", "generation_config.json", "processor_config.json", "tokenizer.json", MARKER} <= names
    marker = read_marker(random_dir)
    assert marker["seed"] == 7 and marker["dtype"] == "float32" and marker["preset"] == "tiny"
    assert marker["vocab_size"] == json.loads((random_dir / "config.json").read_text())["text_config"]["vocab_size"]
    assert is_random_weights(random_dir)


def test_two_loads_are_bit_identical_and_silenced(random_dir):
    rng = torch.get_rng_state()
    a = load_adapter("m", random_dir)
    assert torch.equal(torch.get_rng_state(), rng)  # the loader forks the RNG: the caller's stream is untouched
    b = load_adapter("m", random_dir)
    wa, wb = _weights(a.model), _weights(b.model)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.model_sig == b.model_sig
    silent = from_ranges(read_marker(random_dir)["silent_token_ranges"])
    head = a.model.lm_head.weight
    zero = (head == 0).all(dim=1)
    assert silent and zero[silent].all() and int(zero.sum()) == len(silent)  # exactly those rows
    assert not any(t in silent for t in a.tokenizer.encode("red circle", add_special_tokens=False))
    assert all(t in silent for t in a.eos_token_ids)  # special: never picked by greedy decoding


def test_silenced_tokens_match_the_bench_builder(random_dir, tmp_path):
    """The marker silences exactly the rows the benchmark zeroes in a weights-file build."""
    full = build_bench_model("tiny", tmp_path / "full")
    head = load_model(full).lm_head.weight
    zeroed = torch.nonzero((head == 0).all(dim=1)).flatten().tolist()
    assert zeroed == from_ranges(read_marker(random_dir)["silent_token_ranges"])


def test_signature_follows_the_marker(random_dir, tmp_path, tiny_model_dir):
    other = build_untrained("tiny", tmp_path / "seed8", seed=8, random_weights=True)
    same = build_untrained("tiny", tmp_path / "seed7", seed=7, random_weights=True)
    sig = dict(dtype="float32", device_type="cpu")
    assert checkpoint_sig("m", random_dir, **sig) == checkpoint_sig("m", same, **sig)
    assert checkpoint_sig("m", random_dir, **sig) != checkpoint_sig("m", other, **sig)
    assert checkpoint_sig("m", random_dir, **sig) != checkpoint_sig("m", tiny_model_dir, **sig)
    assert checkpoint_sig("m", random_dir, **sig) != checkpoint_sig("m", random_dir, dtype="bfloat16", device_type="cpu")
    w7, w8 = load_model(random_dir).lm_head.weight, load_model(other).lm_head.weight
    assert not torch.equal(w7, w8)


def test_bfloat16_load_and_qwen(tmp_path):
    qwen = build_untrained("tiny-qwen", tmp_path / "q", seed=0, random_weights=True)
    a, b = load_adapter("q", qwen, dtype="bfloat16"), load_adapter("q", qwen, dtype="bfloat16")
    assert type(a).__name__ == "Qwen2VLAdapter" and a.model.dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_writer_refuses_weights_and_full_build_drops_the_marker(tmp_path):
    full = build_untrained("tiny", tmp_path / "d")
    with pytest.raises(FileExistsError):
        build_untrained("tiny", full, random_weights=True)
    assert cli(["make-model", "--preset", "tiny", "--out", str(full), "--random-weights"]) == 2
    rw = build_untrained("tiny", tmp_path / "r", random_weights=True)
    build_untrained("tiny", rw)  # a weights file saved over it: the marker goes
    assert not is_random_weights(rw) and (rw / "model.safetensors").exists()


def test_ranges_round_trip():
    ids = [0, 1, 2, 5, 9, 10]
    assert to_ranges(ids) == [[0, 3], [5, 6], [9, 11]]
    assert from_ranges(to_ranges(ids)) == ids and to_ranges([]) == []


async def test_greedy_generation_through_the_runtime(random_dir):
    config = Config(models=(ModelConfig("rw", str(random_dir), default=True),))
    messages = [{"role": "user", "content": "What color is the shape?"}]
    async with Runtime.open(config) as rt:
        first = await rt.chat_completion(messages, temperature=0, max_tokens=5, min_tokens=5)
        again = await rt.chat_completion(messages, temperature=0, max_tokens=5, min_tokens=5)
    assert first.usage.completion_tokens == 5 and first.text.strip()
    assert again.text == first.text


def test_llava_7b_preset_shape():
    """LLaVA-1.5-7B: Llama-2-7B text model, CLIP ViT-L/14 at 336 px; only the config is built."""
    p = PRESETS["llava-7b"]
    assert p.num_image_tokens == 576 and p.dtype == "bfloat16" and p.vocab_size == 32064
    tok = build_processor(p).tokenizer
    c = build_config(p, tok)
    t, v = c.text_config, c.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (4096, 32, 32, 32)
    assert (t.intermediate_size, t.max_position_embeddings, t.vocab_size) == (11008, 4096, 32064)
    assert t.vocab_size > len(tok)
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (1024, 24, 16, 4096)
    assert (v.image_size, v.patch_size, v.hidden_act) == (336, 14, "quick_gelu")
    assert c.projector_hidden_act == "gelu" and c.image_seq_length == 576 and c.vision_feature_layer == -2
    assert str(c.dtype).removeprefix("torch.") == "bfloat16"
    for name in ("demo", "demo-wide", "tiny", "bench"):  # the other presets: the tokenizer's vocabulary, float32
        other = PRESETS[name]
        assert other.vocab_size is None and other.dtype == "float32" and other.vision_feature_layer == -1
        assert build_config(other, tok).text_config.vocab_size == len(tok)


def test_llava_7b_random_directory_is_written_without_a_model(tmp_path):
    out = build_untrained("llava-7b", tmp_path / "7b", random_weights=True)
    marker = read_marker(out)
    assert marker["dtype"] == "bfloat16" and marker["vocab_size"] == 32064
    tok_len = len(build_processor("llava-7b").tokenizer)
    start, end = marker["silent_token_ranges"][-1]
    assert start <= tok_len and end == 32064  # the ids past the tokenizer: all silent
    assert sum(p.stat().st_size for p in out.iterdir()) < 1 << 20
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"] and config["image_seq_length"] == 576
