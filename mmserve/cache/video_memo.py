"""The intake's memo of decoded video identities: `video_source_key` (a file's bytes, the model's
sampling settings, the tenant's cache_salt) -> what decoding it gave (its metadata, the sampled
frame indices and their content digest), LRU over a fixed number of entries.

Pure and synchronous. A hit lets a second question about a video be tokenized and keyed without
decoding the file; its frames are decoded again only if the encoder cache no longer holds its
output. The key is salted: one tenant never learns from a skipped decode that another sent a file.
Lookups run in worker threads against a `snapshot` (a plain dict); the owner applies what they
found and learnt with `touch` and `put`, on its own task.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class VideoIdentity:
    """What decoding a file under some settings gave: all the tokens of a video depend on."""

    meta: object  # models.video_item.VideoMeta
    indices: tuple[int, ...]
    content: bytes


class VideoMemo:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, VideoIdentity] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict[bytes, VideoIdentity]:
        return dict(self._entries)

    def get(self, key: bytes) -> VideoIdentity | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def put(self, key: bytes, identity: VideoIdentity) -> list[bytes]:
        """Stores (or refreshes) an entry; returns the keys evicted, least recently used first."""
        if self.max_entries <= 0:
            return []
        self._entries[key] = identity
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.max_entries:
            evicted.append(self._entries.popitem(last=False)[0])
        return evicted
