"""The engine's side of structured outputs: one llguidance matcher per constrained request,
advanced by every token the request accepts, and one token bitmask per step for all the
constrained rows of a batch (filled in parallel by llguidance's executor, off the GIL)."""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

# Compiled grammars kept for reuse: the n completions of a request, and clients that send
# the same schema again, start from a copy instead of compiling it once more.
COMPILED_CACHE_SIZE = 128

logger = logging.getLogger(__name__)

# How llguidance's errors for a grammar past its resource limits begin (ParserLimits: lexer
# states and fuel, Earley items), as opposed to a token the grammar does not allow.
_RESOURCE_LIMIT = re.compile(r"lexer error|limit|too many|fuel|too complex", re.IGNORECASE)


class StructuredOutputManager:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``tokenizer_json``: the tokenizer as ``tokenizers.Tokenizer.to_str()``;
        ``vocab_size``: the model's logits width (may exceed the tokenizer's);
        ``eos_token_ids``: what a finished grammar allows the model to end with."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        # What a request whose grammar gave up may still produce: the end of its output.
        self._eos_only = np.zeros(llg_numpy.allocate_token_bitmask(1, vocab_size).shape[1], dtype=np.uint32)
        for t in eos_token_ids:
            self._eos_only[t >> 5] |= np.uint32(1 << (t & 31))
        self._executor = llguidance.LLExecutor()
        self._matchers: dict[Hashable, llguidance.LLMatcher] = {}
        self._gave_up: set[Hashable] = set()  # keys whose matcher hit a resource limit (_give_up)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = (
            OrderedDict()
        )  # grammar text -> fresh matcher
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab_size)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for a grammar of ``StructuredOutputsParams``; a grammar compiled
        before (same text, so same hash) is copied, not compiled again. ``ValueError`` names
        what does not compile."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar)
            if compiled.is_error():
                raise ValueError(f"structured output grammar does not compile: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def add(self, key: Hashable, grammar: str) -> None:
        """Start a matcher for ``key`` (a request) from a grammar (see :meth:`compile`)."""
        self._matchers[key] = self.compile(grammar)

    def remove(self, key: Hashable) -> None:
        self._matchers.pop(key, None)
        self._gave_up.discard(key)

    def accept(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Advance ``key``'s matcher by tokens the request produced (see :meth:`_consume_failed`
        for when that fails)."""
        matcher = self._matchers[key]
        if not matcher.consume_tokens(list(tokens)):
            self._consume_failed(key, matcher)

    def accept_each(self, keys: Sequence[Hashable], tokens: Sequence[int]) -> None:
        """Advance each key's matcher by its one token (a step's tokens), as :meth:`accept`. One call per matcher: llguidance's parallel
        ``consume_token_par`` measured slower here (256 rows: ~3 ms against ~2 ms on 2 cores),
        a token costing a few µs, less than handing it to a thread pool."""
        matchers = self._matchers
        for key, token in zip(keys, tokens):
            if not matchers[key].consume_token(token):
                self._consume_failed(key, matchers[key])

    def _consume_failed(self, key: Hashable, matcher: llguidance.LLMatcher) -> None:
        """The grammar engine may give up on a grammar past its resource limits while
        advancing (:meth:`_give_up`): the request's next mask then ends it. Any other failure
        is a token the grammar forbids, which only a sampler that ignored the mask can produce:
        a bug, so it raises."""
        error = matcher.get_error()
        if key in self._gave_up:
            return
        if not _RESOURCE_LIMIT.search(error.split("\n", 1)[0]):
            raise RuntimeError(f"structured output of {key!r} took a token its grammar forbids: {error}")
        self._gave_up.add(key)
        logger.warning(
            "structured output of request %r: its grammar exceeds the grammar engine's limits (%s); "
            "ending the request",
            key,
            error.splitlines()[0],
        )

    def rollback(self, key: Hashable, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""
        if num_tokens and not self._matchers[key].rollback(num_tokens):
            raise RuntimeError(f"structured output of {key!r} cannot roll back {num_tokens} tokens")

    def is_finished(self, key: Hashable) -> bool:
        """The grammar allows nothing more (it then allows only EOS)."""
        return self._matchers[key].is_stopped()

    def fill_bitmask(self, keys: Sequence[Hashable]) -> np.ndarray:
        """One int32 bitmask row per key (bit ``t`` of a row: token ``t`` is allowed), the
        rows computed in parallel. The array is reused by the next call."""
        rows = len(keys)
        if self._bitmask.shape[0] < rows:
            self._bitmask = llg_numpy.allocate_token_bitmask(
                max(rows, 2 * self._bitmask.shape[0]), self.vocab_size
            )
        mask = self._bitmask[:rows]
        matchers = [self._matchers[k] for k in keys]
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                self._give_up(keys[i], matcher, mask[i])
        return mask

    def _give_up(self, key: Hashable, matcher: llguidance.LLMatcher, mask_row: np.ndarray) -> None:
        """A grammar that compiled may still exceed llguidance's resource limits when a mask
        is computed or a token consumed (a regex such as ``(a{1000}){1000}``: "too many
        expressions constructed"); its matcher is then in an error state for good. The request
        is ended, not the engine: its row allows only EOS."""
        mask_row.view(np.uint32)[:] = self._eos_only
        if key not in self._gave_up:
            self._gave_up.add(key)
            logger.warning(
                "structured output of request %r: its grammar exceeds the grammar engine's limits (%s); "
                "ending the request",
                key,
                matcher.get_error().splitlines()[0],
            )
