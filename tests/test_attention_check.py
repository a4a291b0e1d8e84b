"""A checkpoint whose language model needs an attention feature the serving path lacks (logit
soft-capping; sliding windows and bidirectional image spans are implemented since issue 31) is
refused at load with a message naming it — never served with that feature silently ignored
(issue 29's rule)."""

from __future__ import annotations

import json
import shutil

import pytest

from mmserve import Runtime
from mmserve.config import Config, ModelConfig
from mmserve.engine.attention import check_attention
from mmserve.engine.attention.backend import UnsupportedAttentionFeature
from mmserve.errors import MMServeError


def with_text_config(src, dst, **changes):
    """A copy of checkpoint `src` whose text config has `changes` (a LLaVA over a windowed model)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_soft_capping_model_is_refused_naming_the_feature(tiny_model_dir, tmp_path):
    windowed = with_text_config(tiny_model_dir, tmp_path / "windowed", attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedAttentionFeature, match="softcap") as refused:
        check_attention("windowed", windowed)
    assert "'windowed'" in str(refused.value) and "sdpa" in str(refused.value)


def test_a_sliding_window_model_is_served(tiny_model_dir, tmp_path):
    """Sliding windows are implemented (issue 31): a LLaVA over a windowed Mistral passes."""
    check_attention("w", with_text_config(tiny_model_dir, tmp_path / "w", model_type="mistral", sliding_window=64))


async def test_the_runtime_refuses_it_and_serves_the_others(tiny_model_dir, tmp_path):
    windowed = with_text_config(tiny_model_dir, tmp_path / "windowed", attn_logit_softcapping=50.0)
    config = Config(models=(ModelConfig("tiny", str(tiny_model_dir), default=True),
                            ModelConfig("windowed", str(windowed), load="on_demand")))
    async with Runtime.open(config) as rt:
        with pytest.raises(MMServeError, match="softcap") as refused:
            await rt.chat_completion([{"role": "user", "content": "hi"}], model="windowed", max_tokens=2)
        assert refused.value.status == 503 and not rt.health("windowed").serving
        done = await rt.chat_completion([{"role": "user", "content": "hi"}], model="tiny", max_tokens=2)
        assert done.usage.completion_tokens >= 1 and rt.health("tiny").serving


def test_mmserve_serve_refuses_it_in_one_line(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    windowed = with_text_config(tiny_model_dir, tmp_path / "windowed", attn_logit_softcapping=50.0)
    proc = subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", "--model", str(windowed), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "softcap" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["demo", "demo-wide", "demo-qwen"])
def test_the_served_families_pass(name):
    from mmserve.models.demo import checkpoint_dir

    check_attention(name, checkpoint_dir(name))
