"""Intake actor: fetches remote images, decodes images, applies the chat template and processor, validates limits.

Each request is prepared in its own task (image decoding and the processor run in worker
threads, bounded by a limiter), so one large image never delays the others nor the event loop.
Bad input is answered here, with a typed error, before any model work.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AsyncExitStack
from typing import AsyncContextManager, Callable

import trio
from PIL import Image

from mmserve.actors.base import Actor
from mmserve.actors.messages import (
    EncodeJob, Lookup, PrefixFailed, PrefixState, Release, RequestHandle, Route, Submit)
from mmserve.cache.block_hash import prompt_block_hashes
from mmserve.actors.faults import fault
from mmserve.actors.prompt_scores import scores_prompt
from mmserve.errors import BadRequest, MMServeError, UnprocessableImage, clip, is_rejection, log_rejection

from mmserve.inputs.image_budget import check_image_size
from mmserve.models.adapter import Adapter, PromptInputs
from mmserve.cache.video_memo import VideoMemo
from mmserve.config import KVCacheConfig, LimitsConfig, VideoConfig
from mmserve.inputs.images import data_url_bytes, open_image, processor_rgb
from mmserve.inputs.remote_images import fetch_images, is_remote_url
from mmserve.inputs.request import ChatRequest, ImagePart, TextPart
from mmserve.inputs.text_bound import fewest_tokens
from mmserve.actors.prompt_limits import raw_prompt_ids, refuse_prompt_beyond_arena, refuse_prompt_tokens, truncated
from mmserve.inputs.tools import hf_tool_calls
from mmserve.inputs.video_parts import VideoPart
from mmserve.inputs.video_read import VideosRead, check_videos, read_videos


def hf_messages(request: ChatRequest) -> list[dict]:
    """The request's messages in the shape transformers' chat templates take. Tool messages and
    assistant messages with calls carry their text as a string (templates print it as is)."""
    out = []
    for m in request.messages:
        if m.role == "tool" or m.tool_calls:
            text = "".join(p.text for p in m.parts if isinstance(p, TextPart))
            msg = {"role": m.role, "content": (text or None) if m.tool_calls else text}
            if m.tool_calls:
                msg["tool_calls"] = hf_tool_calls(m.tool_calls)
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
            continue
        content = [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else
            {"type": "video"} if isinstance(p, VideoPart) else {"type": "image"}
            for p in m.parts
        ]
        out.append({"role": m.role, "content": content})
    return out


def hf_tools(adapter: Adapter, request: ChatRequest) -> list[dict] | None:
    """The tools the model is shown (none for tool_choice "none"); a BadRequest when its chat
    template would not show them."""
    tools = request.tools.rendered() if request.tools is not None else None
    if tools and not adapter.renders_tools:
        raise BadRequest(f"model {adapter.name!r} cannot be given tools: its chat template does not render them "
                         "(transformers' apply_chat_template(tools=...))", param="tools")
    return tools


def _image_parts(request: ChatRequest):
    """`(key, where, part)` for every image of the request, in prompt order."""
    for i, m in enumerate(request.messages):
        for j, part in enumerate(p for p in m.parts if isinstance(p, ImagePart)):
            yield (i, j), f"messages[{i}].content (image {j})", part


def _video_parts(request: ChatRequest):
    """`(key, where, part)` for every video of the request, in prompt order."""
    for i, m in enumerate(request.messages):
        for j, part in enumerate(p for p in m.parts if isinstance(p, VideoPart)):
            yield ("video", i, j), f"messages[{i}].content (video {j})", part


def _media_keys(request: ChatRequest) -> list:
    """The keys of the request's images and videos (`_image_parts`, `_video_parts`) in prompt order."""
    keys = []
    for i, m in enumerate(request.messages):
        counts = {ImagePart: 0, VideoPart: 0}
        for part in m.parts:
            if isinstance(part, (ImagePart, VideoPart)):
                j = counts[type(part)]
                counts[type(part)] += 1
                keys.append((i, j) if isinstance(part, ImagePart) else ("video", i, j))
    return keys


def remote_urls(request: ChatRequest) -> dict[tuple[int, int], tuple[str, str]]:
    """`{key: (url, where)}` of the request's remote `http(s)` images (a frame list's frames too)."""
    urls = {key: (part.url, where) for key, where, part in _image_parts(request)
            if part.url is not None and is_remote_url(part.url)}
    for key, where, part in _video_parts(request):
        urls.update({(key, k): (f, f"{where}.video[{k}]") for k, f in enumerate(part.frames)
                     if isinstance(f, str) and is_remote_url(f)})
    return urls


def remote_video_urls(request: ChatRequest) -> dict:
    """`{key: (url, where)}` of the request's remote video files (fetched under [video] max_bytes)."""
    return {key: (part.url, where) for key, where, part in _video_parts(request)
            if part.url is not None and is_remote_url(part.url)}


def decode_images(request: ChatRequest, limits: LimitsConfig, fetched: dict | None = None,
                  label: str | None = None, videos: dict | None = None) -> list:
    """Every image of the request, decoded to RGB, and its videos (`videos`, by key, read by
    `read_videos`), in prompt order (runs in a worker thread).

    Remote images come as bytes already fetched (`fetched`, by `remote_urls` key) and take the
    same validation as inline ones. `label` is the client's request id (for fault hooks only).
    """
    if request.num_images:
        fault("image.decode", label)
    images = {}
    for key, where, part in _image_parts(request):
        if part.image is not None:
            images[key] = _embedded_image(part.image, where)
        elif fetched is not None and key in fetched:
            images[key] = open_image(fetched[key], limits, where)
        else:
            images[key] = open_image(data_url_bytes(part.url, limits, where), limits, where)
    if videos is None:
        return list(images.values())
    return [images[key] if key in images else videos[key] for key in _media_keys(request)]


def _embedded_image(image, where: str):
    if not isinstance(image, Image.Image):
        raise UnprocessableImage(f"{where}: expected a PIL image, got {type(image).__name__}", param=where)
    try:
        return processor_rgb(image)  # read as a decoded file is (mmserve.inputs.images)
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise UnprocessableImage(f"{where}: image could not be read as RGB ({e})", param=where) from None


def prepare(adapter: Adapter, request: ChatRequest, images: list, limits: LimitsConfig,
            label: str | None = None, arena_tokens: int | None = None) -> PromptInputs:
    fault("intake.prepare", label)
    still = [img for img in images if isinstance(img, Image.Image)]
    for (_, where, _), img in zip(_image_parts(request), still):  # before the processor pays for it
        check_image_size(adapter.image_processor, img.width, img.height, limits, where)
    param = "messages" if request.prompt is None else "prompt"
    max_pos = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 0)
    if request.options.truncate_prompt_tokens is None:  # before the tokenizer pays for a text too long
        refuse_prompt_tokens(adapter, fewest_tokens(request, adapter.tokenizer), limits, max_pos, param,
                             at_least=True)
    if request.prompt is not None:  # /v1/completions: the raw prompt, no chat template
        prompt = adapter.tokenize_raw(raw_prompt_ids(adapter, request.prompt))
    else:
        prompt = adapter.tokenize(hf_messages(request), images, hf_tools(adapter, request),
                                  request.template.render_args() or None)
        keys = tuple(adapter.image_key(img) for img in (prompt.images or images))  # a video may be several items
        prompt = dataclasses.replace(prompt, mm_keys=keys)
    if request.options.truncate_prompt_tokens is not None:
        prompt = truncated(adapter, prompt, request.options.truncate_prompt_tokens, limits, max_pos)
    refuse_prompt_tokens(adapter, len(prompt.input_ids), limits, max_pos, param)
    refuse_prompt_beyond_arena(len(prompt.input_ids), arena_tokens, param)
    return prompt


def _decode_and_prepare(adapter: Adapter, request: ChatRequest, limits: LimitsConfig, fetched, label,
                        block_size: int | None, arena_tokens: int | None = None,
                        video: VideoConfig = VideoConfig(), known: dict | None = None, read: VideosRead | None = None):
    """Every step in one worker-thread hop: (prompt, its full-block hashes, decode seconds,
    preprocess seconds). No block hashes without a prefix cache (`block_size` None). Videos are
    read against `known` (the intake's memo, a snapshot) into `read`."""
    t0 = time.monotonic()
    parts = list(_video_parts(request))
    if parts:
        check_videos(adapter, parts, request.video, video)
        got = read_videos(adapter, parts, request.video, video, limits, fetched, known or {}, request.cache_salt)
        read.items, read.learnt, read.hits = got.items, got.learnt, got.hits
    images = decode_images(request, limits, fetched, label, read.items if parts else None)
    t1 = time.monotonic()
    prompt = prepare(adapter, request, images, limits, label, arena_tokens)
    hashes = () if block_size is None else tuple(prompt_block_hashes(
        adapter.model_sig, request.cache_salt, prompt.input_ids, prompt.spans, prompt.mm_keys, block_size,
        algorithm=adapter.hash_algorithm))
    return prompt, hashes, t1 - t0, time.monotonic() - t1


class Intake(Actor):
    name = "intake"
    ABORT_POLL_S = 0.02  # how soon a remote-image fetch notices that its caller left

    def __init__(self, limits: LimitsConfig, route: Callable[[RequestHandle], AsyncContextManager[Route]],
                 kv: KVCacheConfig = KVCacheConfig(), lookup_timeout_s: float = 2.0, video: VideoConfig = VideoConfig(),
                 on_reject: Callable[[str], None] | None = None):
        super().__init__()
        self.limits = limits
        self.video = video
        self.video_memo = VideoMemo(video.identity_memo_entries)  # a video file's decoded identity (video_read)
        # remote video files are fetched under the remote-image rules, with [video] max_bytes
        self.video_fetch_limits = dataclasses.replace(limits, remote_image_max_bytes=video.max_bytes)
        self.block_size = kv.block_size if kv.prefix_caching else None
        # a lookup may wait for another request's commit; past this the request computes alone
        self.lookup_wait_s = kv.inflight_wait_s + lookup_timeout_s
        self.route = route
        self.limiter = trio.CapacityLimiter(limits.decode_concurrency)
        self.fetch_limiter = trio.CapacityLimiter(limits.remote_image_policy.fetch_concurrency)
        self.awaiting_load = 0  # requests in flight that wait for their model to load
        self.on_reject = on_reject  # counts a refused request by its reason

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            async for msg in self.inbox:
                self.progressed()
                self.in_flight[msg.handle.request_id] = msg.handle
                nursery.start_soon(self._prepare, msg)
                # the task holds it now; bound here, the loop variable would keep the last request
                # (its images' data URLs, its output channel) alive until the next one arrives
                del msg

    async def _fetch(self, handle: RequestHandle, urls: dict, log, limits: LimitsConfig | None = None) -> dict | None:
        """Fetches the request's remote images; None when the caller left (the fetch is cancelled).

        Nothing cancels this task when the caller goes away (it only sets `handle.aborted`), so a
        watcher polls the handle and cancels the fetch; it also reports progress to the
        supervisor, the fetch being bounded by its own `timeout_s`.
        """
        result, error = None, None
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                while handle.active:
                    self.progressed()
                    await trio.sleep(self.ABORT_POLL_S)
                nursery.cancel_scope.cancel()

            async def fetch() -> None:
                nonlocal result, error
                try:
                    result = await fetch_images(urls, limits or self.limits, log, self.fetch_limiter)
                except MMServeError as e:  # raised below as itself, not wrapped in an ExceptionGroup
                    error = e
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(fetch)
        if not handle.active:
            return None
        if error is not None:
            raise error
        return result

    async def _prepare(self, msg: Submit) -> None:
        """Prepares one request; whatever it raises fails that request alone, never the actor."""
        handle = msg.handle
        log = self.log.bind(request_id=handle.request_id, client_request_id=handle.client_request_id,
                            model=handle.model)
        try:
            await self._prepare_one(handle, log)
        except MMServeError as e:
            self._refuse(handle, log, e)
        except ValueError as e:  # the processor's own complaints about the input (e.g. placeholder counts)
            self._refuse(handle, log, BadRequest(f"the request could not be prepared: {clip(str(e))}"))
        except Exception as e:
            self.fail_request(handle, e, "intake")
        # not in a `finally`: a request caught in a crash stays in in_flight, for the supervisor to fail
        self.in_flight.pop(handle.request_id, None)
        self.progressed()

    def _refuse(self, handle: RequestHandle, log, error: MMServeError) -> None:
        """Answers a request its input got refused (one `request.rejected` line, counted by
        `on_reject`); a typed 500 or 504 raised here is a failure of the request instead."""
        if not is_rejection(error):
            return self.fail_request(handle, error, "intake")
        if log_rejection(log, error) and self.on_reject is not None:
            self.on_reject(error.reason)
        handle.fail(error)

    async def _prepare_one(self, handle: RequestHandle, log) -> None:
        if not handle.active:
            return
        # routed: the model stays loaded while the request lives
        async with AsyncExitStack() as stack:
            self.awaiting_load += 1  # a load runs on its own clock (load_timeout_s): not a stall
            try:
                route = await stack.enter_async_context(self.route(handle))
            finally:
                self.awaiting_load -= 1
            self.progressed()
            await self._prepare_routed(handle, log, route)

    def has_work(self) -> bool:
        """Work that can stall: a request waiting for its model to load is not intake's work."""
        pending = len(self.in_flight) - self.awaiting_load
        return pending > 0 or self.inbox.statistics().current_buffer_used > 0

    async def _prepare_routed(self, handle: RequestHandle, log, route: Route) -> None:
        request, adapter = handle.request, route.adapter
        t_fetch = time.monotonic()
        fetched = None
        for urls, limits in ((remote_urls(request), None), (remote_video_urls(request), self.video_fetch_limits)):
            if urls:
                got = await self._fetch(handle, urls, log, limits)
                if got is None:
                    log.info("intake.aborted")
                    return
                fetched = {**(fetched or {}), **got}
        t0 = time.monotonic()
        read = VideosRead()
        known = self.video_memo.snapshot() if any(True for _ in _video_parts(request)) else None
        prompt, hashes, decode_s, preprocess_s = await trio.to_thread.run_sync(
            _decode_and_prepare, adapter, request, self.limits, fetched, handle.client_request_id,
            self.block_size if route.prefix_cache is not None else None, route.arena_tokens, self.video, known, read,
            limiter=self.limiter, abandon_on_cancel=True)  # a hung decode never holds a shutdown
        self._remember_videos(read, log)
        log.info("intake.prepared", prompt_tokens=len(prompt.input_ids), images=len(prompt.spans),
                 image_tokens=[span.length for span in prompt.spans],
                 queued_s=round(t_fetch - handle.created, 6), fetch_s=round(t0 - t_fetch, 6),
                 decode_s=round(decode_s, 6), preprocess_s=round(preprocess_s, 6),
                 hop_s=round(time.monotonic() - t0 - decode_s - preprocess_s, 6))
        prefix = await self._look_up(handle, route.prefix_cache, hashes, len(prompt.input_ids))
        if prefix is None:
            return
        if handle.active:
            route.encoder.send_nowait(EncodeJob(handle, prompt, prefix))
        elif prefix.registered:
            route.prefix_cache.send_nowait(Release(handle.request_id))

    def _remember_videos(self, read: VideosRead, log) -> None:
        """What the read learnt goes into the memo (its hits refreshed), here on the intake's task."""
        for source in read.hits:
            self.video_memo.touch(source)
        for source, identity in read.learnt.items():
            self.video_memo.put(source, identity)
        if read.items:
            log.info("video.read", videos=len(read.items), decoded=len(read.learnt), memo_hits=len(read.hits),
                     frames=[len(item.indices) for item in read.items.values()])

    async def _look_up(self, handle: RequestHandle, prefix_cache, hashes: tuple[bytes, ...],
                       prompt_len: int) -> PrefixState | None:
        """The prompt's cached prefix, pinned for the request — asked before any image is encoded,
        so an image the hit covers is never encoded. Capped so one prompt token is prefilled.
        None when the lookup failed (the request is failed here). A request scoring its prompt
        looks up nothing: a cached block has no logits (`actors.prompt_scores`)."""
        wanted = hashes[: (prompt_len - 1) // self.block_size] if self.block_size else ()
        if prefix_cache is None or not wanted or scores_prompt(handle.request):
            return PrefixState(hashes)
        reply, answers = trio.open_memory_channel(1)
        prefix_cache.send_nowait(Lookup(handle.request_id, wanted, reply, handle.client_request_id))
        settled = False  # the lookup is answered: its Release is sent below, or at the request's end
        try:
            # closed on the way out: an answer that comes too late finds no one, and the manager
            # releases what it pinned for it at once
            with answers, trio.move_on_after(self.lookup_wait_s):
                answer = await answers.receive()
                settled = True
                if isinstance(answer, PrefixFailed):
                    self.fail_request(handle, answer.error, answer.stage)
                    prefix_cache.send_nowait(Release(handle.request_id))  # every lookup is settled by one
                    return None
                return PrefixState(hashes, answer.blocks, len(answer.blocks) * self.block_size, True, answer.epoch)
            # blocks granted after this are the request's still: its Release (at its end) frees them
            settled = True
            self.log.warning("intake.lookup_timeout", request_id=handle.request_id, waited_s=self.lookup_wait_s)
            return PrefixState(hashes, registered=True)
        finally:
            if not settled:  # cancelled while waiting (intake restarting): no one else will
                prefix_cache.send_nowait(Release(handle.request_id))
