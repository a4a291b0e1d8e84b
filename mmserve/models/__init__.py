"""Model adapters (one per family), what a fixed-shape tower offers the engine, the batch-invariant
ops of deterministic mode, and the demo-model builder (the KV arena and the paged step they run
over are the engine's: `mmserve.engine`). May import cache and the bottom layer."""
