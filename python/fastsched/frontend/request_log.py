"""``--enable-log-requests``: a log line when a request is admitted and one when it ends,
as vLLM's request logger writes them. ``--max-log-len`` cuts everything a client sent that
goes into them: the prompt, its token ids, the parameters (stop strings, an output
constraint's text), an error's message."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastsched.outputs import CompletionOutput, RequestMetrics
from fastsched.sampling_params import SamplingParams

logger = logging.getLogger("fastsched.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def _cut(self, items: str | Sequence[int] | None) -> str | list[int] | None:
        if items is None or isinstance(items, str):
            return items if items is None or self.max_log_len is None else items[: self.max_log_len]
        return list(items if self.max_log_len is None else items[: self.max_log_len])

    def received(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
    ) -> None:
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, priority: %d",
            request_id,
            self._cut(prompt),
            self._cut(str(params)),
            self._cut(token_ids),
            priority,
        )

    def finished(
        self, request_id: str, outputs: Sequence[CompletionOutput], metrics: RequestMetrics, error: str | None
    ) -> None:
        reasons = ",".join(str(o.finish_reason) for o in outputs)
        generated = sum(len(o.token_ids) for o in outputs)
        if error is not None:
            logger.info(
                "Failed request %s after %.3f s: %s", request_id, metrics.e2e or 0.0, self._cut(error)
            )
            return
        logger.info(
            "Finished request %s: finish_reason=%s, prompt_tokens=%d, generated_tokens=%d, "
            "ttft=%s, e2e=%.3f s",
            request_id,
            reasons,
            metrics.num_prompt_tokens,
            generated,
            "-" if metrics.ttft is None else f"{metrics.ttft:.3f} s",
            metrics.e2e or 0.0,
        )
