"""One file per actor (intake, encoder, prefix cache, generator), every message type, the compute
thread and the fault hooks. May import generation, inputs, models, cache and the bottom layer."""
