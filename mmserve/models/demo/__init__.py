"""Tiny LLaVA demo models: synthetic images, presets, builders and the trained checkpoints.

- :func:`render_image` draws a coloured circle/square/triangle on a plain background (64x64).
- :data:`PRESETS`: ``demo`` / ``demo-wide`` (trained, committed under ``checkpoints/``; text hidden
  128 vs 192), ``tiny`` (random weights, unit tests) and ``bench`` (random weights, CPU benchmark).
- :func:`build_untrained` saves a random-init checkpoint of a preset; :func:`checkpoint_dir` is
  where a trained one lives; :func:`train_demo_models` (``mmserve train-demo``) retrains them.
- ``python -m mmserve.models.demo.evaluate demo demo-wide`` prints held-out accuracy.

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
    """Build and train the demo checkpoints (see :mod:`mmserve.models.demo.train`)."""
    from .train import train_demo_models as _train

    return _train(out_root=out_root, names=names, log=log)


__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "PRESETS",
    "Preset",
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
