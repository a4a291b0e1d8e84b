"""The engine room: what turns a planned step into the runner's inputs, the forward and the
sampling (`step_inputs`). May import generation, models, attention, cache and the bottom layer;
never inputs, actors or above."""
