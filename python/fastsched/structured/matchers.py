"""The engine's side of structured outputs: one llguidance matcher per constrained request,
advanced by every token the request accepts, and one token bitmask per step for all the
constrained rows of a batch (filled in parallel by llguidance's executor, off the GIL)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

# Compiled grammars kept for reuse: the n completions of a request, and clients that send
# the same schema again, start from a copy instead of compiling it once more.
COMPILED_CACHE_SIZE = 128


class StructuredOutputManager:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``tokenizer_json``: the tokenizer as ``tokenizers.Tokenizer.to_str()``;
        ``vocab_size``: the model's logits width (may exceed the tokenizer's);
        ``eos_token_ids``: what a finished grammar allows the model to end with."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self._executor = llguidance.LLExecutor()
        self._matchers: dict[Hashable, llguidance.LLMatcher] = {}
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar text -> fresh matcher
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

    def accept(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Advance ``key``'s matcher by tokens the request produced. A token the grammar
        forbids can only come from a sampler that ignored the mask: that is a bug, so it raises."""
        matcher = self._matchers[key]
        if not matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"structured output of {key!r} took a token its grammar forbids: "
                               f"{matcher.get_error()}")

    def accept_each(self, keys: Sequence[Hashable], tokens: Sequence[int]) -> None:
        """Advance each key's matcher by its one token (a step's tokens); a forbidden token
        raises, as in :meth:`accept`. One call per matcher: llguidance's parallel
        ``consume_token_par`` measured slower here (256 rows: ~3 ms against ~2 ms on 2 cores),
        a token costing a few µs, less than handing it to a thread pool."""
        matchers = self._matchers
        for key, token in zip(keys, tokens):
            if not matchers[key].consume_token(token):
                raise RuntimeError(f"structured output of {key!r} took a token its grammar forbids: "
                                   f"{matchers[key].get_error()}")

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
            self._bitmask = llg_numpy.allocate_token_bitmask(max(rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        mask = self._bitmask[:rows]
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(self._matchers[k], i) for i, k in enumerate(keys)],
                                              mask)
        return mask

