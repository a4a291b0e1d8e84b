"""Tiny LLaVA demo models: synthetic images, presets, builders and the trained checkpoints.

- :func:`render_image` draws a coloured circle/square/triangle on a plain background (64x64).
- :data:`PRESETS`: ``demo`` / ``demo-wide`` (trained, committed under ``checkpoints/``; text hidden
  128 vs 192), ``tiny`` (random weights, unit tests) and ``bench`` (random weights, CPU benchmark).
- :func:`build_untrained` saves a random-init checkpoint of a preset; :func:`checkpoint_dir` is
  where a trained one lives; :func:`train_demo_models` (``mmserve train-demo``) retrains them.
- ``python -m mmserve.models.demo.evaluate demo demo-wide`` prints held-out accuracy.
- :data:`QWEN_PRESETS` (:mod:`.qwen`): the Qwen2-VL family: ``demo-qwen`` (trained, committed),
  ``tiny-qwen`` / ``bench-qwen`` / ``qwen2-vl-7b`` (random weights); ``build_untrained`` and
  ``train_demo_models`` take their names too (``python -m mmserve.models.demo.qwen_evaluate``).

Every checkpoint is a plain ``LlavaForConditionalGeneration`` (CLIP vision tower, Llama text model)
with a ``LlavaProcessor`` (``CLIPImageProcessorPil``, byte-level BPE fast tokenizer) and this chat
format (see :mod:`.tokenizer`)::

    <s>system: Answer briefly.
    user: <image>What color is the shape?
    assistant: red</s>
    user: What shape is it?
    assistant:

The model answers `` circle</s>`` (strip the leading space).
"""

from .build import PRESETS, Preset, build_untrained, checkpoint_dir
from .qwen import QWEN_PRESETS, QwenPreset
from .render import (
    BACKGROUNDS,
    COLORS,
    Q_BACKGROUND,
    Q_COLOR,
    Q_FIRST,
    Q_SECOND,
    Q_SHAPE,
    SHAPES,
    render_image,
)


def train_demo_models(out_root=None, names=("demo", "demo-wide"), log=print):
    """Build and train the demo checkpoints (:mod:`.train`; Qwen2-VL names: :mod:`.qwen_train`)."""
    import pathlib

    from .qwen_train import train as train_qwen
    from .train import train_demo_models as _train

    llava = tuple(n for n in names if n not in QWEN_PRESETS)
    results = _train(out_root=out_root, names=llava, log=log) if llava else []
    for name in (n for n in names if n in QWEN_PRESETS):
        out = pathlib.Path(out_root) / name if out_root is not None else checkpoint_dir(name)
        results.append(train_qwen(name, out, log=log))
    return results


__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "PRESETS",
    "Preset",
    "QWEN_PRESETS",
    "QwenPreset",
    "Q_BACKGROUND",
    "Q_COLOR",
    "Q_FIRST",
    "Q_SECOND",
    "Q_SHAPE",
    "SHAPES",
    "build_untrained",
    "checkpoint_dir",
    "render_image",
    "train_demo_models",
]
