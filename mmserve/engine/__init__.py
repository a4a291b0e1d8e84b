"""The engine room: where a model step touches the device — the runner (`runner.ModelRunner`), its
static steps and graphs (`decode_graphs`, `mixed_step`, `vision_step`), the KV arena and its write
fence (`arena`, `write_fence`), the paged forward (`paged_forward`), the attention backends
(`attention/`), a step's inputs built from its plan (`step_inputs`) and the on-device sampling
(`step_sampling`). It may import `models`, `generation`,
`cache`, `config`, `errors` and `logs`; the actors and the runtime import it."""
