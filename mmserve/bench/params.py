"""Parameter sets of the benchmark: `full`, `quick` (< 3 min on 2 cores), `test` (tiny, seconds) and
`gpu` (a LLaVA-1.5-7B-shaped model on one CUDA GPU in bfloat16, a few minutes on an H100)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

ALL_SCENARIOS = ("decode", "concurrency", "multiturn", "same_image", "three_images", "peer", "replicas", "scaleout", "structured",
                 "engine_overhead", "absolute")
# run only when named (--scenarios video): they need a family the default preset is not (video: bench-qwen),
# or measure what a default run does not use (deterministic: the mode's cost, a few minutes)
OPT_IN_SCENARIOS = ("video", "deterministic")
KNOWN_SCENARIOS = ALL_SCENARIOS + OPT_IN_SCENARIOS


@dataclass(frozen=True)
class BenchParams:
    name: str
    preset: str = "bench"  # random-weight preset built when no --model-dir is given (bench-qwen: Qwen2-VL)
    scenarios: tuple[str, ...] = ALL_SCENARIOS
    torch_threads: int = 2
    http: str = "subprocess"  # "subprocess": `mmserve serve` in its own process; "inprocess": same trio run
    # where every side runs: mmserve's [runtime] device / dtype, and the baselines' model and inputs
    device: str = "cpu"
    dtype: str = "float32"
    random_weights: bool = False  # build the preset as a random-weights directory (always: llava-7b, qwen2-vl-7b)
    kv_budget_mib: int = 0  # mmserve's KV arena; 0: CPU_KV_BUDGET_MIB on the CPU, CUDA_KV_BUDGET_MIB on CUDA
    deterministic: bool = False  # mmserve's [runtime] deterministic (bench --deterministic): the mode's cost
    # 1. single-stream decode
    decode_tokens: int = 64
    decode_repeats: int = 3
    # 2. concurrency sweep
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    batched_levels: tuple[int, ...] = ()  # levels whose requests HF also runs as one batched call (the top one always)
    sweep_tokens: int = 128  # a typical chat answer; with short answers the prompt prefill dominates
    health_interval_s: float = 0.02
    host_share_steps: int = 32  # the window (steps, all requests decoding) of the top level's host share
    kv_sample_interval_s: float = 0.005  # KV arena usage of the embedded run at the top level (also sampled per delta)
    # what requests leave behind (`bench.retention`): RSS growth per 1,000 requests once both caches are full
    retention_requests: int = 1000  # measured, after the fill
    retention_samples: int = 10  # RSS readings over them (the growth is their least-squares slope)
    retention_settle: int = 200  # requests after the fill before the first reading (see `bench.retention`)
    retention_concurrency: int = 8
    retention_tokens: int = 4  # answer tokens: short, the requests are many
    retention_encoder_entries: int = 32  # the encoder cache's cap in this run: full after as many fresh images
    retention_kv_budget_bytes: int = 0  # this run's KV arena; 0: the run's own
    retention_fill_max: int = 400  # requests at most to fill the caches (the row says whether they were full)
    # 3. multi-turn image chat
    turns: int = 6
    turn_tokens: int = 24
    conversations: int = 8  # single TTFT samples vary by ±30% on a shared machine: medians need several
    ref_repeats: int = 3
    # 4./5. same image new question; three images in a row
    answer_tokens: int = 16
    image_repeats: int = 2
    # 6. peer: its concurrency levels (empty: scenario 2's)
    peer_levels: tuple[int, ...] = ()
    # 9. engine overhead: streams decoding through the real runtime, the model's forward a stand-in
    # of fixed duration (4 ms: an H200's 7B decode step at 32)
    engine_streams: int = 32
    engine_tokens: int = 128  # per stream; the window is the steps while all of them decode (~110: one
    # late step of a shared machine moves a short window's figure by 0.1)
    engine_prompt_tokens: int = 300  # text prompts (no image to encode) about as long as an image request's
    engine_stand_in_ms: float = 4.0
    # 10. absolute figures: the device's copy bandwidth, prefill time per token count
    copy_mib: int = 256  # the copied buffer (each byte read once and written once)
    prefill_tokens: tuple[int, ...] = (16, 64, 256, 640)
    prefill_repeats: int = 5
    # 13. deterministic mode's cost (opt-in): rounds of single-stream decode and these levels, off and on
    det_rounds: int = 5
    det_levels: tuple[int, ...] = (8, 16)

    def to_json(self) -> dict:
        return asdict(self)

    def kv_budget_bytes(self) -> int:
        """mmserve's `[kv_cache] budget_bytes`: fixed, never the config's "auto" (which follows the
        memory free at the time: the figures of two runs would not compare)."""
        return (self.kv_budget_mib or (CUDA_KV_BUDGET_MIB if self.device.startswith("cuda") else CPU_KV_BUDGET_MIB)) << 20


CUDA_KV_BUDGET_MIB = 8192
CPU_KV_BUDGET_MIB = 256  # the config's default until "auto" (every recorded CPU run used it)
"""The KV arena on a GPU unless given: the default 256 MiB holds 512 tokens of a 7B model in
bfloat16 (0.5 MiB a token), less than one request with an image; 8 GiB holds 16 such requests."""


FULL = BenchParams("full")
QUICK = replace(FULL, name="quick", decode_tokens=16, decode_repeats=3, levels=(1, 4, 8, 16), sweep_tokens=64,
                turns=4, turn_tokens=16, conversations=2, ref_repeats=2, answer_tokens=8, image_repeats=2,
                peer_levels=(1, 8), host_share_steps=16, engine_tokens=128, copy_mib=64, prefill_tokens=(16, 64, 256),
                prefill_repeats=3, retention_requests=200, det_rounds=4)
GPU = replace(FULL, name="gpu", preset="llava-7b", device="cuda", dtype="bfloat16", torch_threads=4,
              scenarios=("decode", "concurrency", "multiturn", "same_image", "three_images", "absolute",
                         "engine_overhead"),
              decode_tokens=128, levels=(1, 8, 32), batched_levels=(8, 32), sweep_tokens=128,
              kv_budget_mib=16384, turns=4, turn_tokens=32, conversations=4, image_repeats=3, copy_mib=2048,
              engine_prompt_tokens=600, retention_requests=200, retention_settle=50,
              retention_fill_max=100, retention_kv_budget_bytes=4096 * 1024 * 1024)
"""The GPU issue's figures: single-stream decode, 8 and 32 concurrent against HF's batched
`generate` of the same requests, TTFT at 32, prefix hits, the absolute figures (tok/s against the
measured bandwidth limit, prefill time per token count) and the host's overhead with a stand-in
forward on the GPU machine's own CPU; a 16 GiB KV arena holds 32 requests of
one image (~600 tokens, 0.5 MiB a token in bfloat16). The retention run's 4 GiB arena holds its 8
requests in flight (~2.4 GiB) and evicts after a few more (256 MiB held less than one: the H200
run of 2026-11-28 refused its first request)."""
TEST = replace(QUICK, name="test", preset="tiny", http="inprocess", decode_tokens=4, decode_repeats=1,
               levels=(1, 2), sweep_tokens=4, peer_levels=(), turns=3, turn_tokens=4, ref_repeats=1, answer_tokens=4,
               host_share_steps=2, engine_streams=4, engine_tokens=10, engine_prompt_tokens=40, copy_mib=8,
               prefill_tokens=(8, 16), prefill_repeats=1, retention_requests=16, retention_samples=4,
               retention_settle=4, retention_concurrency=2, retention_encoder_entries=4,
               retention_kv_budget_bytes=256 * 1024, retention_fill_max=16, det_rounds=2,
               det_levels=(2,))

PARAMS = {p.name: p for p in (FULL, QUICK, TEST, GPU)}
