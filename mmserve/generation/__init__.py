"""Turning logits into answers: the token-budget scheduler, batched on-device sampling, stop strings.
May import models, cache and the bottom layer; never inputs, actors or above."""
