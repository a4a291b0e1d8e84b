"""Tiny LLaVA demo models: synthetic images, presets, builders and the trained checkpoints."""

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
