"""Turning logits into answers: the token-budget scheduler, sampling parameters and host sampling,
penalties, grammars, stop strings, tool-call parsing (the on-device sampling step is the engine's:
`engine.step_sampling`). May import models, cache and the bottom layer; never inputs, engine,
actors or above."""
