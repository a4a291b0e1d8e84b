"""The video key layouts (`keys.video_content_digest`, `video_header`, `mm_hash_video`,
`video_source_key`), version 1, pinned byte for byte; and every setting that changes a video's
tokens changes its key — the frames sampled, the source's rate, the resize, the grid, the
processor settings, the model, the request's settings — while the tenant's salt separates the
source keys (the encoder key salts the mm_hash as it does an image's)."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.cache.keys import (MODALITY_VIDEO, VIDEO_LAYOUT_VERSION, encoder_cache_key, mm_hash_video,
                                video_content_digest, video_header, video_source_key)
from mmserve.cache.video_memo import VideoIdentity, VideoMemo

FRAMES = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
SIG, DIGEST = 0x1122334455667788, 0x99AABBCCDDEEFF00
FIELDS = dict(settings={"fps": 2.0, "kind": "file"}, indices=(0, 3), source_fps=8.0, total_frames=16, size=(6, 4),
              resized=(32, 32), grid=(1, 4, 4))


def test_layout_v1_is_pinned():
    assert (VIDEO_LAYOUT_VERSION, MODALITY_VIDEO) == (1, 3)
    content = video_content_digest(FRAMES)
    assert content.hex() == "5234d7d45a4a35a527abac565f4fe3aa"
    assert video_header(SIG, DIGEST, content, **FIELDS).hex() == (
        "0100" "03" "8877665544332211" "00ffeeddccbbaa99" "5234d7d45a4a35a527abac565f4fe3aa"
        "19000000" + b'{"fps":2.0,"kind":"file"}'.hex() + "0000000000002040" "10000000" "06000000" "04000000"
        "20000000" "20000000" "01000000" "04000000" "04000000" "02000000" "00000000" "03000000")
    assert mm_hash_video(SIG, DIGEST, content, **FIELDS).hex() == "d9f07548e90462475858b45b470adbf9"
    assert video_source_key(1, 2, "tenant", {"fps": 2.0}, b"file-bytes").hex() == "c0ec050f85380d927d0275c9f50b6e50"
    assert video_source_key(1, 2, None, {"fps": 2.0}, b"file-bytes", algorithm="sha256").hex() == (
        "26603857d4195bb5870658510956aa73")


@pytest.mark.parametrize("change", [
    {"indices": (0, 2)}, {"source_fps": 4.0}, {"total_frames": 17}, {"resized": (32, 64)}, {"grid": (2, 4, 4)},
    {"settings": {"fps": 1.0, "kind": "file"}}, {"settings": {"fps": 2.0, "kind": "frames"}}, {"size": (6, 5)},
])
def test_every_setting_that_changes_tokens_changes_the_key(change):
    content = video_content_digest(FRAMES)
    assert mm_hash_video(SIG, DIGEST, content, **{**FIELDS, **change}) != mm_hash_video(SIG, DIGEST, content, **FIELDS)


def test_content_model_and_processor_are_in_the_key_and_the_salt_in_the_source_key():
    content = video_content_digest(FRAMES)
    other = FRAMES.copy()
    other[1, 2, 3, 0] ^= 1  # one channel of one pixel of one frame
    base = mm_hash_video(SIG, DIGEST, content, **FIELDS)
    assert mm_hash_video(SIG, DIGEST, video_content_digest(other), **FIELDS) != base
    assert mm_hash_video(SIG + 1, DIGEST, content, **FIELDS) != base
    assert mm_hash_video(SIG, DIGEST + 1, content, **FIELDS) != base
    assert encoder_cache_key(base, "a") != encoder_cache_key(base, None) != encoder_cache_key(base, "b")
    keys = {video_source_key(1, 2, salt, {"fps": 2.0}, b"x") for salt in (None, "", "a", "b")}
    assert len(keys) == 4
    assert video_source_key(1, 2, None, {"fps": 2.0}, b"x") != video_source_key(1, 2, None, {"fps": 1.0}, b"x")
    assert video_source_key(1, 2, None, {}, b"x") != video_source_key(1, 2, None, {}, b"y")
    assert video_content_digest(FRAMES, "sha256") != content


def test_the_memo_is_lru_over_its_entry_count():
    memo = VideoMemo(2)
    ident = VideoIdentity(None, (0,), b"\0" * 16)
    assert memo.put(b"a", ident) == [] and memo.put(b"b", ident) == []
    assert memo.get(b"a") is ident  # refreshed: b is now the oldest
    assert memo.put(b"c", ident) == [b"b"]
    assert set(memo.snapshot()) == {b"a", b"c"}
    assert VideoMemo(0).put(b"a", ident) == [] and len(VideoMemo(0)) == 0
