"""Turning logits into answers: sampling, stop strings and the decode batch (next: the scheduler).
May import models, cache and the bottom layer; never inputs, actors or above."""
