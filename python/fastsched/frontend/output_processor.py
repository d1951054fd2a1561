"""Turns the engine's token deltas into text: incremental detokenization, stop
strings, logprobs with decoded tokens, and the ``n`` completions of a request.

This is frontend work (docs/design.md §1): ``fastsched.LLM`` runs it in-process, the gRPC
frontend runs it beside its AsyncLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastsched.engine.protocol import EngineCoreOutput
from fastsched.frontend.stop import StopChecker
from fastsched.model_loader.tokenizer import Tokenizer
from fastsched.outputs import CompletionOutput, Logprob, RequestOutput
from fastsched.sampling_params import SamplingParams


@dataclass
class _Completion:
    """State of one engine request (one of a parent's ``n`` completions)."""

    parent: RequestOutput
    output: CompletionOutput
    params: SamplingParams
    stop: StopChecker
    # Incremental detokenization: output tokens [prefix_offset, read_offset) are the
    # context decoded again each step; text up to read_offset is already released.
    prefix_offset: int = 0
    read_offset: int = 0
    new_text: str = ""  # text released by the last step (for streaming)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, *, stream: bool = True) -> None:
        """``stream=False`` (offline generation) detokenizes a completion without stop
        strings once, when it finishes, instead of step by step."""
        self.tokenizer = tokenizer
        self.stream = stream
        self._completions: dict[str, _Completion] = {}

    def add_request(
        self, engine_request_id: str, parent: RequestOutput, index: int, params: SamplingParams
    ) -> None:
        output = parent.outputs[index]
        if params.logprobs is not None:
            output.logprobs = []
        stop = StopChecker(params.stop or [], params.include_stop_str_in_output)
        self._completions[engine_request_id] = _Completion(parent, output, params, stop)

    def num_unfinished(self) -> int:
        return len(self._completions)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step; returns the parents that changed and the engine requests
        a stop string ended (the caller aborts them in the engine)."""
        changed: dict[int, RequestOutput] = {}
        to_abort: list[str] = []
        for out in outputs:
            c = self._completions.get(out.request_id)
            if c is None:
                continue  # ended by a stop string; the engine's last words are dropped
            o = c.output
            # Several tokens in one step (speculative decoding) may hold a stop string's end.
            one_by_one = bool(c.params.stop) and len(out.new_token_ids) > 1
            if not one_by_one:
                o.token_ids.extend(out.new_token_ids)
            if out.num_cached_tokens is not None and c.parent.num_cached_tokens is None:
                c.parent.num_cached_tokens = out.num_cached_tokens
            if out.pooled is not None:
                c.parent.embedding = out.pooled.tolist()
            if out.prompt_logprobs is not None and c.parent.prompt_logprobs is None:
                # Every one of the n completions computes them; the first to arrive is kept.
                c.parent.prompt_logprobs = self._prompt_logprobs(out.prompt_logprobs)
            if out.new_logprobs and o.logprobs is not None:
                for entry in out.new_logprobs:
                    o.logprobs.append(
                        {
                            t: Logprob(lp, rank, self.tokenizer.decode([t], False))
                            for t, (lp, rank) in entry.items()
                        }
                    )
            if one_by_one:
                c.new_text = self._detokenize_each(c, out)
            elif self.stream or c.params.stop:
                c.new_text = self._detokenize(c, out.finish_reason is not None)
            elif out.finish_reason is not None:
                c.new_text = self.tokenizer.decode(
                    o.token_ids, skip_special_tokens=c.params.skip_special_tokens
                )
            if c.stop.stopped:
                o.finish_reason, o.stop_reason = "stop", c.stop.matched_stop
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                c.new_text += c.stop.flush()
                o.finish_reason = out.finish_reason
                o.stop_reason = out.error if out.finish_reason == "ignored" else out.stop_reason
            o.text += c.new_text
            if o.finish_reason is not None:
                del self._completions[out.request_id]
            changed[id(c.parent)] = c.parent
        return list(changed.values()), to_abort

    def _prompt_logprobs(
        self,
        entries: list[dict[int, tuple[float, int]] | None],
    ) -> list[dict[int, Logprob] | None]:
        """The engine's prompt logprobs with decoded tokens (each distinct id decoded once)."""
        decoded: dict[int, str] = {}

        def text(t: int) -> str:
            if t not in decoded:
                decoded[t] = self.tokenizer.decode([t], False)
            return decoded[t]

        return [
            None if e is None else {t: Logprob(lp, rank, text(t)) for t, (lp, rank) in e.items()}
            for e in entries
        ]

    def _detokenize_each(self, c: _Completion, out: EngineCoreOutput) -> str:
        """Appends a step's tokens one at a time, as if each came in a step of its own, so that
        the output ends with the token that completed a stop string and no token after it
        reaches the client."""
        text = ""
        last = len(out.new_token_ids) - 1
        for i, token in enumerate(out.new_token_ids):
            c.output.token_ids.append(token)
            text += self._detokenize(c, i == last and out.finish_reason is not None)
            if c.stop.stopped:
                break
        return text

    def _detokenize(self, c: _Completion, finished: bool) -> str:
        """The newly releasable text, holding back a trailing partial UTF-8 character
        until its bytes are complete.

        Only a window is decoded (vLLM's incremental detokenization): the tokens since
        the last release plus the ones before it as context, whose text is subtracted.
        Decoding the whole output each step made a request's detokenization quadratic in
        its length. The window starts where the released text ended on a whole
        character, so the pieces add up to the decode of all the tokens.
        """
        ids = c.output.token_ids
        skip = c.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(ids[c.prefix_offset : c.read_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(ids[c.prefix_offset :], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not finished):
            delta = ""
        else:
            delta = new_text[len(prefix_text) :]
            c.prefix_offset, c.read_offset = c.read_offset, len(ids)
        check = len(ids) >= c.params.min_tokens
        return c.stop.append(delta, check=check)
