"""What the generator does with a step's results: KV bookkeeping, commits, and each sampled
token's way to the caller — text, logprobs, grammar state, stop and finish (`Answers`, a part the
generator holds).

`Answers` streams a sequence's tokens to its caller and decides when it ends; the ending itself
(its state, its blocks, its finish event) is the generator's: each method returns the `Ending` of
the sequence, or None while it goes on."""

from __future__ import annotations

import time

from mmserve.actors.faults import fault
from dataclasses import dataclass

from mmserve.actors.block_grants import BlockGrants
from mmserve.actors.messages import Commit, FinishEvent, PromptLogprob, TokenEvent, Usage
from mmserve.actors.prompt_scores import prompt_logprobs
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.actors.token_rows import Lexicon
from mmserve.cache.kv_event_records import BlockRouting, routing_group
from mmserve.errors import MMServeError
from mmserve.generation.scheduler import Planned
from mmserve.engine.step_sampling import Sampled
from mmserve.models.adapter import Adapter


@dataclass(frozen=True)
class Ending:
    """How a sequence ends: in `state`, with its `finish` event (finished), or failed by `error` at
    `stage`."""

    state: SeqState
    finish: FinishEvent | None = None
    error: Exception | None = None
    stage: str = ""


def _failed(error: Exception, stage: str) -> Ending:
    return Ending(SeqState.FAILED, error=error, stage=stage)


class Answers:
    """Applying a step's result to its sequence. `grants`: where the blocks it filled are committed
    (the next step report); `reply`: the generator's inbox (a commit's failure comes back there)."""

    def __init__(self, adapter: Adapter, block_size: int, max_positions: int, grants: BlockGrants, reply,
                 lexicon: Lexicon, metrics, log):
        self.adapter, self.block_size, self.max_positions = adapter, block_size, max_positions
        self.grants, self.reply, self.lexicon = grants, reply, lexicon
        self.metrics, self.log = metrics, log

    def apply(self, p: Planned, result: Sampled | int | Exception) -> Ending | None:
        seq = p.seq
        if seq.state not in LIVE:
            return None
        if isinstance(result, Exception):
            return _failed(result, "generator (prefill)" if not p.decode else "generator (sampling)")
        seq.kv_len += p.tokens
        if not p.decode:
            if self.metrics is not None:
                self.metrics.prefilled(self.adapter.name, p.tokens)
            self.log.info("generator.prefill", request_id=seq.request_id, tokens=p.tokens,
                          start=seq.kv_len - p.tokens, cached_tokens=seq.hit_tokens, done=seq.kv_len == seq.target_len)
        try:
            self._commit_full_blocks(seq)
        except Exception as e:
            return _failed(e, "generator (hashing)")
        if result == -1:
            return None
        if seq.state is SeqState.PREFILLING:
            seq.move(SeqState.DECODING)
        if seq.params.max_tokens == 0:  # /v1/completions scoring its prompt: nothing is generated
            return self._finish(seq, "length")
        return self.accept(seq, result)

    def _commit_full_blocks(self, seq: Sequence) -> None:
        """The blocks this step filled, keyed and committed in the next step report (bookkeeping:
        requests waiting for them go on; a failed commit fails this request alone)."""
        if seq.chain is None:
            return
        full = min(seq.kv_len // self.block_size, seq.table_len)
        if full <= seq.committed:
            return
        fault("generator.hash", seq.label)
        seq.hashes = seq.chain.extend(seq.hashes, seq.ids[:full * self.block_size])
        new = tuple((i, seq.hashes[i]) for i in range(seq.committed, min(full, len(seq.hashes))))
        seq.committed = full
        if new:  # with what the blocks hold (token ids, images, group): the manager announces them —
            # from block 0 on the first commit after a cached prefix (restored ones were never announced)
            first = 0 if new[0][0] == len(seq.job.prefix.blocks) else new[0][0]
            lo, hi = first * self.block_size, (new[-1][0] + 1) * self.block_size
            routing = BlockRouting(seq.hashes[first - 1] if first else None, lo, tuple(seq.ids[lo:hi]), seq.chain.items,
                                   routing_group(seq.chain.root, seq.handle.request.cache_salt),
                                   tuple(seq.hashes[first:new[-1][0] + 1]))
            self.grants.note(Commit(seq.kv_owner, new, self.reply, seq.label, routing))  # in the next step report

    def accept(self, seq: Sequence, sampled: Sampled) -> Ending | None:
        """Takes a sampled token; the sequence ends when it is a stop (or completes its grammar),
        or its last."""
        token, now = sampled.token_id, time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
        elif self.metrics is not None:
            self.metrics.token_gap(self.adapter.name, now - seq.last_token_at)
        seq.last_token_at = now
        if seq.matcher is not None and not seq.matcher.consume_token(token):  # its mask allowed it: a bug
            return _failed(MMServeError(f"the grammar refused token {token}: {seq.matcher.get_error()}"),
                           "generator (grammar)")
        if token in self.adapter.eos_token_ids:
            return self._finish(seq, "stop", sampled)
        seq.ids.append(token)
        try:
            fault("generator.detokenize", seq.label)
            text = seq.assembler.add(token, sampled)
        except Exception as e:
            return _failed(e, "generator (detokenizing)")
        # the first token is always announced (its text may be held back, e.g. a leading space):
        # callers see the first token when it exists, and a client gone by then is noticed
        logprobs = self._settled_logprobs(seq)
        event = TokenEvent(text, token, seq.choice, logprobs, prompt_tokens=seq.prompt_len,
                           completion_tokens=len(seq.tokens))
        if (text or logprobs or len(seq.tokens) == 1) and not seq.handle.emit(event):
            return Ending(SeqState.ABORTED)
        if (seq.assembler.stopped or token in seq.params.stop_token_ids
                or (seq.matcher is not None and seq.matcher.is_stopped())):
            return self._finish(seq, "stop")
        if len(seq.tokens) >= seq.params.max_tokens or len(seq.ids) >= self.max_positions:
            return self._finish(seq, "length")
        return None

    def _settled_logprobs(self, seq: Sequence) -> tuple:
        """The logprobs entries of the tokens whose text is now final, each token's `token` its text
        as the answer shows it (`TextAssembler.settled`): joined, they are the answer."""
        settled = seq.assembler.settled()
        if not seq.params.logprobs:
            return ()
        return tuple(self.lexicon.pieces.logprob(sampled, text) for text, sampled in settled)

    def _finish(self, seq: Sequence, reason: str, eos: Sampled | None = None) -> Ending:
        """Ends `seq` with `reason`: the caller gets the rest of the text and the finish. A
        `/v1/completions` answer ended by `eos` lists that token last in its logprobs, with no text
        (as vLLM does, and as lm-eval's log-likelihood reading expects: one entry per token drawn)."""
        handle = seq.handle
        try:
            tail = seq.assembler.finish()
        except Exception as e:
            return _failed(e, "generator (finishing)")
        logprobs = self._settled_logprobs(seq)
        if eos is not None and seq.params.logprobs and handle.request.prompt is not None:
            logprobs += (self.lexicon.pieces.logprob(eos, ""),)
        if tail or logprobs:
            handle.emit(TokenEvent(tail, -1, seq.choice, logprobs, prompt_tokens=seq.prompt_len,
                                   completion_tokens=len(seq.tokens) + (eos is not None)))
        # an EOS the model drew is a token of its answer (as OpenAI and vLLM count it), though no text
        usage = Usage(seq.prompt_len, len(seq.tokens) + (eos is not None), seq.hit_tokens)
        ttft, total = (seq.first_token_at or time.monotonic()) - handle.created, time.monotonic() - handle.created
        if self.metrics is not None:
            self.metrics.request_finished(self.adapter.name, reason, usage.prompt_tokens,
                                          usage.completion_tokens, ttft, total)
        self.log.info(
            "generator.finished", request_id=handle.request_id, choice=seq.choice, finish_reason=reason,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens, images=len(seq.job.prompt.spans),
            ttft_s=round(ttft, 6), total_s=round(total, 6))
        return Ending(SeqState.FINISHED, FinishEvent(reason, usage, seq.job.encoder_hits, seq.choice))

    def echo(self, seq: Sequence) -> None:
        """With `echo`, every choice's text starts with the prompt's (its text as sent, or its ids
        decoded), and with the prompt's logprobs asked for, every choice gets them: once per
        request (a sequence prefilled again after a preemption sends nothing)."""
        raw = seq.handle.request.prompt
        if not (raw.echo or raw.logprobs is not None) or seq.echoed or seq.choice:
            return
        seq.echoed = True
        text = "" if not raw.echo else raw.text if raw.text is not None else \
            self.adapter.decode_special(seq.job.prompt.input_ids)
        scores: tuple[PromptLogprob, ...] = prompt_logprobs(seq, self.lexicon.pieces) if raw.logprobs is not None else ()
        for c in range(seq.handle.choices):
            seq.handle.emit(TokenEvent(text, -1, c, prompt=scores))


class HeldFinishes:
    """With a shared tier, the finishes of answers whose Release asked the manager to say when the
    blocks they committed are there (`FinishFlushed`): the generator emits each then — or, should
    that word never come (the manager restarted), `FLUSH_SLACK_S` after `finish_flush_ms`."""

    FLUSH_SLACK_S = 1.0

    def __init__(self, flush_s: float, log):
        self.flush_s, self.log = flush_s, log
        self.held: dict[str, tuple] = {}  # kv owner -> (handle, FinishEvent, emitted at the latest)

    def hold(self, owner: str, handle, finish: FinishEvent) -> None:
        self.held[owner] = (handle, finish, time.monotonic() + self.flush_s + self.FLUSH_SLACK_S)

    def flushed(self, owner: str) -> None:
        pending = self.held.pop(owner, None)
        if pending is not None:
            pending[0].emit(pending[1])

    def emit_due(self, due: float) -> None:
        """Emits the finishes due by `due` without the manager's word (all of them: `inf`)."""
        for owner, (handle, event, by) in list(self.held.items()):
            if by <= due:
                del self.held[owner]
                if due != float("inf"):
                    self.log.warning("generator.finish_unflushed", request_id=owner)
                handle.emit(event)
