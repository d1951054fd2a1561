"""Speculative decoding: drafters propose up to ``k`` tokens per request, the target verifies
them in one forward pass over ``1 + k`` positions and keeps what the rejection-sampling rule
accepts (docs/scheduler.md, "Speculative decoding in the engine").

- ``ngram``: prompt lookup (:class:`NgramProposer`); ``draft_model``: a small model of the
  same vocabulary (:class:`DraftModelProposer`);
- ``rejection``: the acceptance rule, for greedy and random rows;
- ``verification``: the layout of a verification step in the runner;
- ``metrics``: vLLM's ``spec_decode_*`` counters.
"""

from fastsched.spec_decode.draft_model import DraftModelProposer
from fastsched.spec_decode.metrics import SpecDecodingCounters
from fastsched.spec_decode.ngram import NgramProposer
from fastsched.spec_decode.proposer import Proposer, build_proposer, draft_rows
from fastsched.spec_decode.rejection import Verified, rejection_sample
from fastsched.spec_decode.verification import SpecStep, verification_logprobs

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "SpecDecodingCounters",
    "SpecStep",
    "Verified",
    "build_proposer",
    "draft_rows",
    "rejection_sample",
    "verification_logprobs",
]
