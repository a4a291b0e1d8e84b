"""Prefix-cache block hashes: pinned layouts, multimodal extra keys (DESIGN.md F2), validation."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.cache import block_hash as B
from mmserve.cache.block_hash import ExtraKey, MMPlaceholder, block_extra_keys, block_hashes, hash_block, root_hash
from mmserve.cache.keys import HASH_ALGORITHMS

IMG = 9  # the one placeholder token id every image shares
A = bytes(range(16))
A_AGAIN = bytes(range(16))
C = bytes(range(16, 32))
ROOT = root_hash(7, None)
ROOTS = {alg: root_hash(7, None, algorithm=alg) for alg in HASH_ALGORITHMS}
ALGS = pytest.mark.parametrize("alg", HASH_ALGORITHMS)


def hashes_of(alg, tokens, items, block_size=4):
    return block_hashes(ROOTS[alg], tokens, items, block_size, algorithm=alg)


# -- pinned layouts ----------------------------------------------------------------------------


def test_layout_version_and_seed_are_pinned():
    assert B.BLOCK_HASH_LAYOUT_VERSION == 1
    assert B.SEED_BLOCK_HASH == 0x4D4D534552560004


def test_root_layout_and_hash_are_pinned():
    layout = B.root_layout(0x0102030405060708, "s")
    assert layout == struct.pack("<HQBI", 1, 0x0102030405060708, 1, 1) + b"s"
    assert layout.hex() == "01000807060504030201010100000073"
    assert root_hash(0x0102030405060708, "s").hex() == "1f16de26a485c0ce682564c0d6e99d1c"
    assert root_hash(0x0102030405060708, None).hex() == "1af20d4413c0e76bef7d96e6e0803112"
    assert ROOT.hex() == "6513f3817db934d6c8b392e7b1c5e19e"


def test_block_layout_and_hash_are_pinned():
    extra = (ExtraKey(A, offset=2, start_in_block=0, length=5),)
    layout = B.block_layout(ROOT, [1, 2, 3, 4], extra)
    expected = ROOT + struct.pack("<5I", 4, 1, 2, 3, 4) + struct.pack("<I", 1) + A + struct.pack("<3I", 2, 0, 5)
    assert layout == expected
    assert hash_block(ROOT, [1, 2, 3, 4], extra).hex() == "dbc3673b7ab2e65fec325d94b7617488"
    hashes = block_hashes(ROOT, [1, 2, IMG, IMG, IMG, IMG, IMG, 3, 4], [MMPlaceholder(A, 2, 5)], 4)
    assert [h.hex() for h in hashes] == ["bf4b3e9998b7f53c982dcdcd1881da68", "481eea13a2211e0e5e1a35995d9fad6a"]
    assert hashes[1] == hash_block(hashes[0], [IMG] * 3 + [3], extra)


def _sha256_key(*parts: bytes) -> bytes:
    """The documented sha256 construction, written out independently of the module."""
    return hashlib.sha256(struct.pack("<Q", B.SEED_BLOCK_HASH) + b"".join(parts)).digest()[:16]


def test_sha256_root_and_block_hashes_are_pinned():
    root = root_hash(0x0102030405060708, "s", algorithm="sha256")
    assert root.hex() == "105df244e5fdf6e681797a9cb196402b"
    assert root == _sha256_key(B.root_layout(0x0102030405060708, "s"))
    sha_root = ROOTS["sha256"]
    assert sha_root.hex() == "6397074b61dded52208bab85fed41407"
    extra = (ExtraKey(A, offset=2, start_in_block=0, length=5),)
    block = hash_block(sha_root, [1, 2, 3, 4], extra, algorithm="sha256")
    assert block.hex() == "563011d8ce6ea5c40adc2f248594e40a"
    assert block == _sha256_key(B.block_layout(sha_root, [1, 2, 3, 4], extra))
    hashes = hashes_of("sha256", [1, 2, IMG, IMG, IMG, IMG, IMG, 3, 4], [MMPlaceholder(A, 2, 5)])
    assert [h.hex() for h in hashes] == ["e431db00154cf20c6f3b02c5c8081675", "a2ec4820a7ad569f349526c08ecc0678"]
    assert hashes[1] == hash_block(hashes[0], [IMG] * 3 + [3], extra, algorithm="sha256")


def test_the_default_is_xxh3_and_sha256_never_agrees_with_it():
    assert ROOTS["xxh3_128"] == ROOT
    assert root_hash(7, None, algorithm="xxh3_128") == root_hash(7, None)
    assert ROOTS["sha256"] != ROOTS["xxh3_128"]
    tokens, items = [1, 2, IMG, IMG, IMG, IMG, IMG, 3], [MMPlaceholder(A, 2, 5)]
    assert block_hashes(ROOT, tokens, items, 4, algorithm="xxh3_128") == block_hashes(ROOT, tokens, items, 4)
    # even over the same root and layout, the two algorithms give different blocks
    xxh3 = block_hashes(ROOT, tokens, items, 4)
    sha = block_hashes(ROOT, tokens, items, 4, algorithm="sha256")
    assert all(a != b for a, b in zip(xxh3, sha)) and len(sha) == 2
    assert hash_block(ROOT, tokens[:4], (), algorithm="sha256") != hash_block(ROOT, tokens[:4], ())


def test_an_unknown_algorithm_is_rejected_naming_the_allowed_ones():
    for bad in ("md5", "SHA256", "xxh3_64", "", None):
        with pytest.raises(ValueError, match="xxh3_128.*sha256"):
            root_hash(7, None, algorithm=bad)
        with pytest.raises(ValueError, match="xxh3_128.*sha256"):
            hash_block(ROOT, [1, 2], (), algorithm=bad)
        with pytest.raises(ValueError, match="xxh3_128.*sha256"):
            block_hashes(ROOT, [1], [], 4, algorithm=bad)  # even with no full block to hash


# -- roots and chaining --------------------------------------------------------------------------


@ALGS
def test_root_separates_models_and_salts(alg):
    roots = {root_hash(m, salt, algorithm=alg) for m, salt in [(1, None), (2, None), (1, ""), (1, "a"), (1, "b")]}
    assert len(roots) == 5
    assert all(len(r) == 16 for r in roots)
    assert root_hash(1, "a", algorithm=alg) == root_hash(1, "a", algorithm=alg)
    tokens = list(range(8))
    one = block_hashes(root_hash(1, None, algorithm=alg), tokens, [], 4, algorithm=alg)
    two = block_hashes(root_hash(2, None, algorithm=alg), tokens, [], 4, algorithm=alg)
    assert one != two


def test_only_full_blocks_are_hashed():
    assert block_hashes(ROOT, [1, 2, 3], [], 4) == []
    assert len(block_hashes(ROOT, list(range(11)), [], 4)) == 2
    assert block_hashes(ROOT, list(range(12)), [], 4)[:2] == block_hashes(ROOT, list(range(11)), [], 4)


def test_text_only_blocks_have_an_empty_extra_key():
    tokens = list(range(8))
    hashes = block_hashes(ROOT, tokens, [], 4)
    assert hashes[0] == hash_block(ROOT, tokens[:4], ())
    assert hashes[1] == hash_block(hashes[0], tokens[4:], ())


# -- multimodal extra keys (F2) ---------------------------------------------------------------


def _prompt(n_before=3, n_img=6, n_after=7):
    """Text, one image's placeholder run, text; block size 4 puts the image across 3 blocks."""
    tokens = list(range(100, 100 + n_before)) + [IMG] * n_img + list(range(200, 200 + n_after))
    return tokens, n_before, n_img


@ALGS
def test_same_tokens_with_different_images_never_share_a_block(alg):
    tokens, start, length = _prompt()
    with_a = hashes_of(alg, tokens, [MMPlaceholder(A, start, length)])
    with_c = hashes_of(alg, tokens, [MMPlaceholder(C, start, length)])
    assert with_a[0] != with_c[0]  # block 0 holds the image's first placeholder
    assert all(a != c for a, c in zip(with_a, with_c))
    assert len(with_a) == 4


@ALGS
def test_identical_images_share_every_block(alg):
    tokens, start, length = _prompt()
    first = hashes_of(alg, tokens, [MMPlaceholder(A, start, length)])
    again = hashes_of(alg, list(tokens), [MMPlaceholder(A_AGAIN, start, length)])
    assert first == again


@ALGS
def test_text_blocks_depend_on_images_only_through_the_chain(alg):
    tokens = list(range(100, 108)) + [IMG] * 4 + list(range(200, 208))
    with_a = hashes_of(alg, tokens, [MMPlaceholder(A, 8, 4)])
    with_c = hashes_of(alg, tokens, [MMPlaceholder(C, 8, 4)])
    assert with_a[:2] == with_c[:2]  # text before the image: untouched
    assert with_a[2] != with_c[2]
    for hashes in (with_a, with_c):  # text after: an empty extra key, chained from the image block
        assert hashes[3] == hash_block(hashes[2], tokens[12:16], (), algorithm=alg)
        assert hashes[4] == hash_block(hashes[3], tokens[16:20], (), algorithm=alg)


def test_offset_into_the_item_tells_its_blocks_apart():
    tokens = [IMG] * 8
    assert block_extra_keys([MMPlaceholder(A, 0, 8)], 4, 8) == (ExtraKey(A, 4, 0, 8),)
    assert block_extra_keys([MMPlaceholder(A, 2, 8)], 4, 8) == (ExtraKey(A, 2, 0, 8),)
    assert block_extra_keys([MMPlaceholder(A, 6, 2)], 4, 8) == (ExtraKey(A, 0, 2, 2),)
    h = block_hashes(ROOT, tokens, [MMPlaceholder(A, 0, 8)], 4)
    assert hash_block(h[0], tokens[4:], (ExtraKey(A, 4, 0, 8),)) == h[1]
    assert hash_block(h[0], tokens[4:], (ExtraKey(A, 0, 0, 8),)) != h[1]


@ALGS
def test_swapped_images_inside_one_block_differ(alg):
    # (mm_hash, offset) sorted by hash would be {(A, 0), (C, 0)} both ways: position order counts.
    tokens = [IMG] * 8
    a_then_c = hashes_of(alg, tokens, [MMPlaceholder(A, 0, 4), MMPlaceholder(C, 4, 4)], 8)
    c_then_a = hashes_of(alg, tokens, [MMPlaceholder(C, 0, 4), MMPlaceholder(A, 4, 4)], 8)
    assert a_then_c != c_then_a


@ALGS
def test_item_start_within_the_block_counts(alg):
    tokens = [1] + [IMG] * 6 + [1]
    early = hashes_of(alg, tokens, [MMPlaceholder(A, 1, 5)], 8)
    late = hashes_of(alg, tokens, [MMPlaceholder(A, 2, 5)], 8)
    assert early != late


@ALGS
def test_a_later_turn_with_the_same_image_extends_the_earlier_hashes(alg):
    turn1, start, length = _prompt(n_after=3)
    turn2 = turn1 + [300, 301, 302, 303, 304, 305, 306, 307]
    items = [MMPlaceholder(A, start, length)]
    h1 = hashes_of(alg, turn1, items)
    h2 = hashes_of(alg, turn2, items + [MMPlaceholder(C, len(turn2) - 4, 4)])
    assert h2[: len(h1)] == h1
    assert len(h2) == len(h1) + 2


@ALGS
def test_item_order_in_the_argument_does_not_matter(alg):
    tokens = [IMG] * 4 + [1, 2] + [IMG] * 4 + [3, 4]
    items = [MMPlaceholder(A, 0, 4), MMPlaceholder(C, 6, 4)]
    assert hashes_of(alg, tokens, items) == hashes_of(alg, tokens, items[::-1])


@settings(max_examples=60, deadline=None)
@given(
    n_tokens=st.integers(1, 40),
    block_size=st.integers(1, 8),
    spans=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), max_size=4),
    changed=st.integers(0, 3),
)
def test_changing_one_image_changes_exactly_the_blocks_from_its_first(n_tokens, block_size, spans, changed):
    items, pos = [], 0
    for i, (gap, length) in enumerate(spans):  # non-overlapping runs, laid out left to right
        pos += gap
        if pos + length > n_tokens:
            break
        items.append(MMPlaceholder(bytes([i]) * 16, pos, length))
        pos += length
    tokens = [IMG] * n_tokens
    for alg in HASH_ALGORITHMS:  # cheap: every example runs under both algorithms
        base = hashes_of(alg, tokens, items, block_size)
        assert len(base) == n_tokens // block_size
        assert hashes_of(alg, list(tokens), list(items), block_size) == base  # equal inputs, equal keys
        if changed >= len(items):
            continue
        other = list(items)
        other[changed] = MMPlaceholder(b"\xff" * 16, items[changed].start, items[changed].length)
        hashes = hashes_of(alg, tokens, other, block_size)
        first = items[changed].start // block_size
        assert hashes[:first] == base[:first]
        assert all(a != b for a, b in zip(hashes[first:], base[first:]))


# -- validation ----------------------------------------------------------------------------------


def test_placeholder_fields_are_validated():
    with pytest.raises(ValueError):
        MMPlaceholder(b"short", 0, 1)
    with pytest.raises(ValueError):
        MMPlaceholder(A, -1, 1)
    with pytest.raises(ValueError):
        MMPlaceholder(A, 0, 0)


@pytest.mark.parametrize(
    "items",
    [
        [MMPlaceholder(A, 6, 3)],  # runs past the 8 tokens
        [MMPlaceholder(A, 0, 4), MMPlaceholder(C, 3, 2)],  # overlap
        [MMPlaceholder(C, 3, 2), MMPlaceholder(A, 0, 4)],  # overlap, unsorted
        [MMPlaceholder(A, 2, 2), MMPlaceholder(A, 2, 2)],  # the same run twice
    ],
)
def test_placeholders_out_of_range_or_overlapping_are_rejected(items):
    with pytest.raises(ValueError):
        block_hashes(ROOT, [IMG] * 8, items, 4)


def test_placeholders_in_the_trailing_partial_block_are_still_validated():
    block_hashes(ROOT, [IMG] * 6, [MMPlaceholder(A, 4, 2)], 4)  # fine: in range
    with pytest.raises(ValueError):
        block_hashes(ROOT, [IMG] * 6, [MMPlaceholder(A, 4, 3)], 4)


@pytest.mark.parametrize(
    "tokens", [[1, -1, 2, 3], [1, 2**32, 2, 3], [1.0, 2.0, 3.0, 4.0], [True] * 4, [[1, 2], [3, 4]]]
)
def test_bad_token_ids_are_rejected(tokens):
    with pytest.raises(ValueError):
        block_hashes(ROOT, tokens, [], 2)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        block_hashes(ROOT, [1, 2], [], 0)
    with pytest.raises(ValueError):
        hash_block(b"short", [1], ())
    with pytest.raises(TypeError):
        block_hashes(ROOT, [1, 2], [(A, 0, 1)], 2)
    with pytest.raises(ValueError):
        root_hash(-1, None)


@ALGS
def test_token_id_sequences_of_any_int_type_agree(alg):
    import numpy as np

    tokens = [5, 6, 2**32 - 1, 0]
    expected = hashes_of(alg, tokens, [], 2)
    assert hashes_of(alg, tuple(tokens), [], 2) == expected
    assert hashes_of(alg, np.array(tokens, dtype=np.int64), [], 2) == expected
    assert hashes_of(alg, np.array(tokens, dtype=np.uint32), [], 2) == expected


@given(st.lists(st.integers(0, 500), min_size=0, max_size=80), st.integers(1, 9), st.integers(0, 80),
       st.booleans())
def test_a_chain_extended_block_by_block_equals_hashing_all_at_once(tokens, block, cut, uncacheable):
    from types import SimpleNamespace

    from mmserve.cache.block_hash import BlockChain, prompt_block_hashes

    spans = [SimpleNamespace(start=2, length=5), SimpleNamespace(start=12, length=3)]
    keys = [bytes(range(16)), None if uncacheable else bytes(range(1, 17))]
    whole = prompt_block_hashes(7, "salt", tokens, spans, keys, block)
    chain = BlockChain.of(7, "salt", len(tokens), spans, keys, block)
    assert chain.extend(chain.extend((), tokens[:cut]), tokens) == whole
    if uncacheable:
        assert len(whole) <= 12 // block
