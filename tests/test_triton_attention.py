"""The paged Triton attention kernels (mmserve.engine.attention.triton_paged) against the SDPA reference
backend, over random block tables — scattered and consecutive ids, block sizes 1/16/32, lengths
1-700, GQA groups 1/4/7/8, fp32 and bf16 — and the backend interface around them.

Without a GPU the kernels run on CPU tensors through Triton's interpreter. It must be chosen before
triton is first imported — transformers' model classes import it, through torch._dynamo — so
tests/conftest.py sets TRITON_INTERPRET=1 before importing anything else (and this module does too,
for a run without that conftest). With a GPU (`torch.cuda.is_available()`) the same tests run the
compiled kernels on CUDA, unchanged.

The arena is filled with NaN before the step's keys are written, so a kernel that reads a slot no
sequence owns — past a sequence's length, a table's padding, another sequence's block — poisons
its output. The reference is SDPA in fp32 over the same (possibly bf16-rounded) inputs.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, if nothing imported it yet
import triton  # noqa: E402  (in the dev extra: these tests run, they never skip)

from mmserve.engine.attention import (AttentionBackendUnavailable, ModelFeatures, PagedMetadata, SdpaBackend,  # noqa: E402
                               UnsupportedAttentionFeature, select, write_kv)
from mmserve.engine.arena import KVArena, Segment  # noqa: E402
from mmserve.engine.attention import triton_paged  # noqa: E402
from mmserve.engine.paged_forward import KWARG, STEP_MASK, BackendStep, paged_attention_forward  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5),
       # bf16 output: 1 ulp is 2^-8 relative (2^-7 in the interpreter, which truncates fp32 -> bf16)
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_the_kernels_run_where_they_should():
    assert tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
    assert triton_paged.INTERPRETING is (not ON_GPU), \
        "without a GPU the kernels need TRITON_INTERPRET=1 set before triton is first imported (tests/conftest.py)"
    assert isinstance(select("triton", DEVICE), triton_paged.TritonBackend)


class Step:
    """A random step: an arena of `num_blocks` NaN-filled blocks, sequences given as (cached, new)
    token counts, their tables drawn scattered (shuffled free list) or consecutive (each table one
    run of ids), every key of every sequence written, and the step's queries."""

    def __init__(self, rng: random.Random, specs, block_size, kv_heads, group, head_dim, dtype, scattered,
                 max_blocks=None):
        used = [-(-(c + n) // block_size) for c, n in specs]
        num_blocks = sum(used) + len(specs) + 2
        ids = list(range(num_blocks))
        if scattered:
            rng.shuffle(ids)
        else:  # consecutive runs, the runs themselves in random order, a free block between them
            order, at, runs = list(range(len(specs))), 1, {}
            rng.shuffle(order)
            for i in order:
                runs[i] = ids[at:at + used[i]]
                at += used[i] + 1
        tables, at = [], 0
        for i, u in enumerate(used):
            tables.append(tuple(ids[at:at + u]) if scattered else tuple(runs[i]))
            at += u
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype)
        self.v = torch.full(shape, float("nan"), dtype=dtype)
        self.segments = [Segment(t, c, n) for t, (c, n) in zip(tables, specs)]
        everything = PagedMetadata.build([Segment(t, 0, c + n) for t, (c, n) in zip(tables, specs)], block_size)
        total = everything.num_tokens
        write_kv(self.k, self.v, torch.randn(total, kv_heads, head_dim, generator=g).to(dtype),
                 torch.randn(total, kv_heads, head_dim, generator=g).to(dtype), everything.slot_mapping)
        self.meta = PagedMetadata.build(self.segments, block_size, DEVICE, max_blocks=max_blocks)
        self.query = torch.randn(self.meta.num_tokens, kv_heads * group, head_dim, generator=g).to(dtype)
        self.k, self.v, self.query = self.k.to(DEVICE), self.v.to(DEVICE), self.query.to(DEVICE)

    def reference(self) -> torch.Tensor:
        f = torch.float32
        return SdpaBackend().forward(self.query.to(f), self.k.to(f), self.v.to(f), self.meta)


def _specs(rng: random.Random, decodes: int, prefills: int, longest: int = 700):
    """(cached, new) of `decodes` one-token sequences (contexts 1..longest) then `prefills` chunks
    (a chunk of 1..96 tokens after 0..longest - chunk cached ones, one of them from position 0)."""
    specs = [(rng.randint(0, longest - 1), 1) for _ in range(decodes)]
    for i in range(prefills):
        chunk = rng.randint(1, 96)
        specs.append((0 if i == 0 else rng.randint(0, longest - chunk), chunk))
    return specs


CASES = [(bs, group, dtype, scattered) for bs in (1, 16, 32) for group in (1, 4, 8)
         for dtype in (torch.float32, torch.bfloat16) for scattered in (True, False)]


@pytest.mark.parametrize("block_size,group,dtype,scattered", CASES,
                         ids=[f"bs{b}-g{g}-{str(d)[6:]}-{'scattered' if s else 'consecutive'}" for b, g, d, s in CASES])
def test_kernels_match_sdpa(block_size, group, dtype, scattered):
    """Both kernels in one step (decode sequences first, then prefill chunks) against the reference."""
    rng = random.Random(f"{block_size}-{group}-{dtype}-{scattered}")
    kv_heads = 1 if group == 8 else 2
    step = Step(rng, _specs(rng, decodes=3, prefills=2), block_size, kv_heads, group, 32, dtype, scattered)
    assert step.meta.num_decodes == 3
    out = select("triton", DEVICE).forward(step.query, step.k, step.v, step.meta)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), step.reference(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_shapes_group_7_head_dim_80_and_a_decode_after_a_chunk(dtype):
    """Qwen2-VL-7B groups 28 heads over 4 KV heads (7, not a power of two); head_dim 80 pads to 128.
    A one-token segment after a chunk goes through the prefill kernel (num_decodes counts only the
    leading run)."""
    rng = random.Random(7)
    specs = [(699, 1), (0, 40), (rng.randint(1, 600), 1), (350, 33)]
    step = Step(rng, specs, 16, 1, 7, 80, dtype, scattered=True)
    assert step.meta.num_decodes == 1
    out = select("triton", DEVICE).forward(step.query, step.k, step.v, step.meta, scale=0.11)
    f = torch.float32
    ref = SdpaBackend().forward(step.query.to(f), step.k.to(f), step.v.to(f), step.meta, scale=0.11)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_decode_splits_empty_splits_and_padded_rows():
    """Any number of KV splits gives the same answer (splits past a short sequence's end are empty);
    a row with no keys (seq_len 0: a padded slot of a captured batch) gives zeros, not NaN; the
    table tensor may be wider than any table (a static buffer)."""
    rng = random.Random(3)
    step = Step(rng, [(0, 1), (16, 1), (500, 1), (699, 1)], 16, 2, 4, 32, torch.float32, scattered=True,
                max_blocks=48)
    ref = step.reference()
    m, scale = step.meta, 1 / math.sqrt(32)
    for splits in (1, 3, 16):
        out = triton_paged.paged_decode(step.query, step.k, step.v, m.block_tables, m.seq_lens, scale,
                                        num_splits=splits)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
    lens = m.seq_lens.clone()
    lens[1] = 0
    out = triton_paged.paged_decode(step.query, step.k, step.v, m.block_tables, lens, scale)
    assert not out.isnan().any() and bool((out[1] == 0).all())
    torch.testing.assert_close(out[[0, 2, 3]], ref[[0, 2, 3]], **TOL[torch.float32])


def test_prefill_takes_a_static_bound_on_the_chunk_length():
    """`max_query_len` only bounds the grid: a cap above every chunk (a static one) changes nothing,
    and only the rows of the sequences asked for are written."""
    rng = random.Random(5)
    step = Step(rng, [(30, 1), (0, 17), (100, 64)], 32, 2, 4, 32, torch.float32, scattered=False)
    m, scale = step.meta, 1 / math.sqrt(32)
    out = torch.full_like(step.query, 7.0)
    triton_paged.paged_prefill(step.query, step.k, step.v, m.block_tables, m.seq_lens, m.cu_seqlens_q,
                               max_query_len=256, scale=scale, out=out, first_seq=1)
    assert bool((out[0] == 7.0).all())  # sequence 0 is not the kernel's to write
    torch.testing.assert_close(out[1:], step.reference()[1:], **TOL[torch.float32])


def test_prefill_through_a_tile_map_equals_its_own_grid():
    """A static step's launch: the programs are the map's (sequence, tile) pairs — the real tiles
    of every chunk (a chunk of one, a long one, one past a cached prefix), then slack entries past
    every chunk that do nothing — and the output equals the kernel's own grid over the same step,
    whatever order the map lists the tiles in."""
    rng = random.Random(6)
    step = Step(rng, [(30, 1), (0, 37), (100, 20), (5, 3)], 32, 2, 4, 32, torch.float32, scattered=True)
    m, scale = step.meta, 1 / math.sqrt(32)
    own = triton_paged.paged_prefill(step.query, step.k, step.v, m.block_tables, m.seq_lens, m.cu_seqlens_q,
                                     m.max_query_len, scale)
    tt = triton_paged.prefill_tile_tokens(4)  # the GQA group: 8 heads over 2 KV heads
    pairs = [(i, t) for i, n in enumerate(m.lengths) for t in range(-(-n // tt))]
    rng.shuffle(pairs)
    pairs += [(0, 1000)] * 5  # slack: past every chunk
    seqs, tiles = (torch.tensor(col, dtype=torch.int32, device=DEVICE) for col in zip(*pairs))
    out = torch.full_like(step.query, 7.0)
    triton_paged.paged_prefill(step.query, step.k, step.v, m.block_tables, m.seq_lens, m.cu_seqlens_q,
                               10_000, scale, out=out, tile_map=(seqs, tiles))
    torch.testing.assert_close(out, own, atol=0, rtol=0)
    torch.testing.assert_close(out, step.reference(), **TOL[torch.float32])


def test_the_decode_launch_reads_no_tensor_value():
    """The decode path's launch (tables, lengths and grid) takes nothing from a tensor's contents:
    no `.item()`, no `nonzero`, no copy to the host — what CUDA-graph capture requires. The grid
    comes from tensor shapes; a replay with other lengths in the same buffers is right."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostReads(TorchDispatchMode):
        banned = ("_local_scalar_dense", "nonzero", "item", "masked_select", "unique")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            assert name not in self.banned, f"the launch reads a tensor's value on the host: {func}"
            for a in (*args, *(kwargs or {}).values()):
                if isinstance(a, torch.device) and a.type == "cpu" and ON_GPU:
                    raise AssertionError(f"the launch copies to the host: {func}")
            return func(*args, **(kwargs or {}))

    rng = random.Random(11)
    step = Step(rng, [(40, 1), (200, 1)], 16, 2, 4, 32, torch.float32, scattered=True, max_blocks=16)
    backend = select("triton", DEVICE)
    lens = step.meta.seq_lens
    with NoHostReads():
        out = backend.forward(step.query, step.k, step.v, step.meta)
    torch.testing.assert_close(out, step.reference(), **TOL[torch.float32])
    lens.sub_(10)  # the same buffers, other lengths: what a graph replay sees
    shorter = PagedMetadata.build([Segment(s.block_table, s.start - 10, 1) for s in step.segments], 16, DEVICE)
    with NoHostReads():
        out = backend.forward(step.query, step.k, step.v, step.meta)
    f = torch.float32
    torch.testing.assert_close(out, SdpaBackend().forward(step.query.to(f), step.k.to(f), step.v.to(f), shorter),
                               **TOL[torch.float32])


def compile_for_h100() -> dict[str, int]:
    """Compiles the three kernels for sm_90 (bf16, GQA group 7, head_dim 80, block size 16; and the
    decode kernel in fp32, the "ieee" dot) with Triton's own compiler, down to a cubin through the
    wheel's ptxas — no GPU needed. Returns each kernel's shared memory. Run in a process where
    TRITON_INTERPRET is off (`test_the_kernels_compile_for_an_h100`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    assert not triton_paged.INTERPRETING
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    ptr, i32 = "*{}".format, "i32"
    strides = {f"stride_{x}": i32 for x in ("qt", "qh", "ot", "oh", "kb", "ks", "kh", "vb", "vs", "vh", "tb")}
    shared = {}
    for dtype, prec in (("bf16", None), ("fp32", "ieee")):
        common = dict(GROUP=7, HEAD_DIM=80, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64 if dtype == "bf16" else 32,
                      DOT_F32=False, PRECISION=prec)
        kernels = [(triton_paged._decode_split_kernel, dict(common, NUM_SPLITS=8, GROUP_PAD=16))]
        if dtype == "bf16":
            kernels += [(triton_paged._decode_reduce_kernel, dict(NUM_SPLITS=8, SPLITS_PAD=8, HEAD_DIM=80, D_PAD=128)),
                        (triton_paged._prefill_kernel, dict(common, BLOCK_Q=9, BLOCK_M=64, HAS_ENDS=True,
                                                             TILE_MAP=True))]
        for kernel, constexprs in kernels:
            types = {"q_ptr": ptr(dtype), "k_ptr": ptr(dtype), "v_ptr": ptr(dtype), "out_ptr": ptr(dtype),
                     "tables_ptr": ptr("i32"), "seq_lens_ptr": ptr("i32"), "cu_q_ptr": ptr("i32"),
                     "part_o_ptr": ptr("fp32"), "part_ml_ptr": ptr("fp32"), "scale_log2": "fp32",
                     "split_tokens": i32, "first_seq": i32, "window": i32, "q_ends_ptr": ptr("i32"),
                     "tile_seq_ptr": ptr("i32"), "tile_idx_ptr": ptr("i32"), **strides}
            signature = {a: "constexpr" if a in constexprs else types[a] for a in kernel.arg_names}
            options = backend.parse_options({"num_warps": 4, "num_stages": 3})
            compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                      options=options.__dict__)
            assert compiled.asm["cubin"], kernel.__name__
            if kernel is triton_paged._prefill_kernel:  # the tiles' dots run on the tensor cores
                assert "mma" in compiled.asm["ptx"]
            shared[f"{kernel.__name__}[{dtype}]"] = compiled.metadata.shared
    return shared


# slow (9 s): a GPU session's scripts/gpu-run.sh compiles and runs the kernels for real
@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="on a GPU every other test here compiles and runs the kernels")
def test_the_kernels_compile_for_an_h100(tmp_path):
    """The interpreter runs a kernel's Python, so it cannot see what only the compiler refuses
    (types, shapes tl.dot will not take, shared memory): compile for sm_90 here, in a process
    without TRITON_INTERPRET, as the GPU machine will."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, tests.test_triton_attention as t; "
            "print('SHARED', json.dumps(t.compile_for_h100()))")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.split("SHARED", 1)[1])
    assert len(shared) == 4 and max(shared.values()) <= 227 * 1024, shared  # an H100's shared memory per block


def test_sdpa_backend_is_todays_paged_attention_and_plain_attention():
    """The reference, called directly, computes what `engine.paged_forward.paged_attention_forward` (the
    CPU's serving path: the step's K/V written, then the backend) computes, and what dense causal attention over each sequence's own keys gives."""
    rng = random.Random(13)
    specs = [(37, 1), (5, 1), (0, 21), (50, 9)]
    step = Step(rng, specs, 4, 2, 4, 16, torch.float32, scattered=True)
    ours = SdpaBackend().forward(step.query, step.k, step.v, step.meta)
    arena = KVArena([step.k.cpu()], [step.v.cpu()])
    kflat, vflat = arena.flat(0)
    slots = step.meta.slot_mapping.cpu()
    new_k = kflat[slots].transpose(0, 1).unsqueeze(0)  # the step's K/V, rewritten in place by the call
    new_v = vflat[slots].transpose(0, 1).unsqueeze(0)
    module = type("Layer", (torch.nn.Module,), {})()
    module.layer_idx = 0
    today, _ = paged_attention_forward(module, step.query.cpu().transpose(0, 1).unsqueeze(0), new_k, new_v, STEP_MASK,
                                       scaling=1 / 4, **{KWARG: BackendStep(arena, SdpaBackend(), arena.metadata(step.segments))})
    torch.testing.assert_close(ours.cpu(), today[0], atol=1e-6, rtol=1e-6)
    offset = 0
    for seg in step.segments:  # dense: explicit softmax over keys [0, start + i] of query i
        pos = torch.arange(seg.end)
        table = torch.tensor(seg.block_table)
        idx = table[pos // 4] * 4 + pos % 4
        k = kflat[idx].repeat_interleave(4, dim=1)  # [end, heads, d]
        v = vflat[idx].repeat_interleave(4, dim=1)
        for i in range(seg.length):
            q = step.query[offset + i].cpu()  # [heads, d]
            w = torch.softmax(torch.einsum("hd,nhd->hn", q, k[: seg.start + i + 1]) / 4, dim=-1)
            dense = torch.einsum("hn,nhd->hd", w, v[: seg.start + i + 1])
            torch.testing.assert_close(ours[offset + i].cpu(), dense, atol=1e-5, rtol=1e-5)
        offset += seg.length


def test_metadata_from_segments():
    segs = [Segment((4, 5), 20, 1), Segment((9,), 0, 3), Segment((1, 2, 3), 33, 1)]
    m = PagedMetadata.build(segs, 16, max_blocks=4)
    assert m.num_decodes == 1 and m.max_query_len == 3 and m.num_tokens == 5
    assert m.block_tables.dtype == torch.int32 and m.block_tables.tolist() == [[4, 5, 0, 0], [9, 0, 0, 0],
                                                                               [1, 2, 3, 0]]
    assert m.seq_lens.tolist() == [21, 3, 34] and m.cu_seqlens_q.tolist() == [0, 1, 4, 5]
    assert m.slot_mapping.tolist() == [5 * 16 + 4, 144, 145, 146, 3 * 16 + 1]
    with pytest.raises(ValueError, match="too short"):
        PagedMetadata.build([Segment((1,), 16, 1)], 16)
    with pytest.raises(ValueError, match="max_blocks"):
        PagedMetadata.build(segs, 16, max_blocks=2)


def test_select_names_and_devices(monkeypatch):
    assert select("sdpa", "cpu").name == "sdpa"
    assert select("auto", "cpu").name == "sdpa"  # the interpreter is for tests, never picked by auto
    if ON_GPU:
        assert select("auto", "cuda").name == "triton"
    with pytest.raises(AttentionBackendUnavailable, match="unknown attention backend 'flash'.*auto, sdpa, triton"):
        select("flash", "cpu")
    # kernels built for the compiler (no TRITON_INTERPRET when triton_paged was imported) on the CPU:
    # refused with the reason and the way out, never a silent fall-back to sdpa
    monkeypatch.setattr(triton_paged, "INTERPRETING", False)
    with pytest.raises(AttentionBackendUnavailable) as e:
        select("triton", "cpu")
    assert "runs on CUDA" in str(e.value) and "TRITON_INTERPRET=1" in str(e.value) and '"sdpa"' in str(e.value)
    if not ON_GPU:  # the variable is set now (tests/conftest.py), so the message says it came too late
        assert "was not when triton was first imported" in str(e.value)


def test_check_refuses_a_feature_the_backend_lacks():
    from transformers import Gemma2Config, LlamaConfig

    triton_backend = select("triton", DEVICE)
    for backend in (SdpaBackend(), triton_backend):
        backend.check(ModelFeatures(gqa=True, mrope_positions=True, sliding_window=True, bidirectional_spans=True))
        with pytest.raises(UnsupportedAttentionFeature, match=f"'{backend.name}' attention backend does not "
                                                              "support softcap"):
            backend.check(ModelFeatures(gqa=True, sliding_window=True, softcap=True))
    llama = LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    assert ModelFeatures.from_config(llama).needed == ("gqa",)
    gemma2 = Gemma2Config(num_attention_heads=4, num_key_value_heads=4, hidden_size=64, head_dim=16)
    assert ModelFeatures.from_config(gemma2).needed == ("sliding_window", "softcap")
    with pytest.raises(UnsupportedAttentionFeature, match="does not support softcap"):
        triton_backend.check(ModelFeatures.from_config(gemma2))


def test_qwen2_vl_needs_only_what_both_backends_have():
    from transformers import Qwen2VLConfig

    features = ModelFeatures.from_config(Qwen2VLConfig(text_config=dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})))
    assert features.needed == ("gqa", "mrope_positions")  # Qwen2's sliding window is off by default
    SdpaBackend().check(features)
    select("triton", DEVICE).check(features)
