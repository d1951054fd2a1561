"""``fastsched.LLM``: offline generation with an in-process EngineCore (no IPC)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.entrypoints.vllm_compat import pop_vllm_engine_kwargs
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.inputs import PromptType, child_request_ids, engine_requests
from fastsched.lora.request import LoRARequest
from fastsched.model_loader import load_tokenizer
from fastsched.outputs import CompletionOutput, RequestOutput
from fastsched.request_gate import RequestGate
from fastsched.sampling_params import SamplingParams

PromptDict = Mapping[str, Any]  # vLLM's TextPrompt / TokensPrompt
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Loads a model and generates for batches of prompts, continuously batched.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``LLM(model=path, **engine_args)``
    any supported HF directory or GGUF file, with the engine arguments of
    :class:`fastsched.config.EngineConfig` (``max_num_seqs``, ``max_num_batched_tokens``,
    ``num_gpu_blocks``, ``dtype``, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        # vLLM's enforce_eager, trust_remote_code and kv_cache_dtype: accepted as vLLM's flags are.
        self.config = EngineConfig.from_kwargs(model=model, **pop_vllm_engine_kwargs(engine_args))
        self.tokenizer = load_tokenizer(self.config.tokenizer or model)
        self.engine = EngineCore(self.config)
        # Offline requests pass the same gate as a server's (fastsched.request_gate); the limits
        # on what a remote client controls are the server's defaults here too.
        self.gate = RequestGate(self.tokenizer, self.engine.max_model_len, self.engine.vocab_size)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | PromptDict | Sequence[PromptType | PromptDict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text, or a list of token ids); outputs in input order.

        A prompt may also be given as vLLM's dicts: ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``, either with an optional ``"cache_salt"`` (requests with
        different salts never share prefix-cache blocks). Any other key is a ``ValueError``.

        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); needs ``LLM(..., enable_lora=True)``. ``RuntimeError`` while paused: nothing new would ever be scheduled."""
        if self.is_paused():
            raise RuntimeError(f"the engine is paused ({self.engine.pause_state}); call resume() first")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:  # the model's generation config, as vLLM's LLM does
            sampling_params = SamplingParams(**self.engine.sampling_defaults)
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(lora_list)} lora_request for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        processor = OutputProcessor(self.tokenizer, stream=False)
        results: list[RequestOutput] = []
        added: list[str] = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, lora_list):
                results.append(self._add(prompt, params, lora, processor, added))
        except BaseException:
            self.engine.abort_requests(added)
            self._drain()  # no step has run yet, so this one only reports the aborts
            raise
        try:
            self._run(processor, len(results), use_tqdm)
        except BaseException:
            self.engine.abort_requests(added)  # their blocks are freed at once (S18)
            raise
        return results

    def shutdown(self) -> None:
        """Stops the engine's threads and its tensor-parallel workers (they would otherwise
        live until this process exits); the LLM is not used after this."""
        self.engine.shutdown()

    def pause(self, mode: str = "all") -> None:
        """S13, between ``generate`` calls, e.g. to load new weights (RL): nothing is scheduled
        until :meth:`resume`. ``mode``: ``"all"`` or ``"new"`` (the same here: offline, every
        request runs inside one ``generate`` call). ``ValueError`` for another mode."""
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def is_paused(self) -> bool:
        return self.engine.pause_state != "unpaused"

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (or ``chat_template``, a Jinja template, as vLLM's
        ``LLM.chat`` takes it: a base model has none) to each conversation: with the assistant
        prompt, or (``continue_final_message``) leaving the last message open for the model
        to go on."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                list(conv),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add(
        self,
        prompt: PromptType | PromptDict,
        params: SamplingParams,
        lora: LoRARequest | None,
        processor: OutputProcessor,
        added: list[str],
    ) -> RequestOutput:
        request_id = str(next(self._ids))
        prompt, cache_salt = _split_prompt(prompt)
        valid = self.gate.request(request_id, prompt, params, cache_salt=cache_salt)
        text, token_ids = valid.prompt, valid.prompt_token_ids
        parent = RequestOutput(
            request_id, text, token_ids, [CompletionOutput(index=i) for i in range(params.n)]
        )
        child_ids = child_request_ids(request_id, params.n)
        for i, request in enumerate(engine_requests(child_ids, token_ids, params)):
            # Text is only looked at by stop strings before the end, and logprobs come per
            # token: anything else is reported once, when it finishes (no per-step cost).
            request.final_only = not request.params.stop and request.params.logprobs is None
            request.lora_request = lora
            request.cache_salt = valid.cache_salt
            self.engine.add_request(request)
            added.append(request.request_id)
            processor.add_request(request.request_id, parent, i, request.params)
        return parent

    def _run(self, processor: OutputProcessor, num_requests: int, use_tqdm: bool) -> None:
        # Without use_tqdm the bar is off; with it, TQDM_DISABLE still may turn it off (the
        # CLI sets it when stderr is no terminal: a redirected log gets no \r fragments).
        bar = tqdm(
            total=num_requests,
            desc="Processed prompts",
            unit="req",
            **({} if use_tqdm else {"disable": True}),
        )
        speed = _TokenSpeed()
        done: set[int] = set()
        with bar:
            while processor.num_unfinished():
                changed, to_abort = processor.process(self.engine.step())
                if to_abort:
                    self.engine.abort_requests(to_abort)
                finished = [p for p in changed if p.finished and id(p) not in done]
                for parent in finished:
                    done.add(id(parent))
                    speed.add(parent)
                if finished:
                    bar.set_postfix_str(speed.describe(bar.format_dict["elapsed"]), refresh=False)
                    bar.update(len(finished))
        self._drain()

    def _drain(self) -> None:
        """Steps until the engine has reported every finish and abort (S17, S18).

        The scheduler reports a finished or aborted request one ``schedule()`` after its
        last output, and only then does the engine drop its record and the runner its
        row; without this step they would linger until the next call.
        """
        while self.engine.has_unfinished_requests():
            self.engine.step()


class _TokenSpeed:
    """Input and output tokens of the finished requests, as vLLM's progress bar shows them."""

    def __init__(self) -> None:
        self.input_tokens = self.output_tokens = 0

    def add(self, output: RequestOutput) -> None:
        self.input_tokens += len(output.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in output.outputs)

    def describe(self, elapsed: float) -> str:
        elapsed = max(elapsed, 1e-9)
        return (
            f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
            f"output: {self.output_tokens / elapsed:.2f} toks/s"
        )


def _as_prompt_list(
    prompts: PromptType | PromptDict | Sequence[PromptType | PromptDict],
) -> list[PromptType | PromptDict]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _split_prompt(prompt: PromptType | PromptDict) -> tuple[PromptType, str | None]:
    """A prompt and its ``cache_salt`` from vLLM's dict form (a plain prompt has none)."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = sorted(set(prompt) - {*_PROMPT_KEYS, "cache_salt"})
    if unknown:
        raise ValueError(
            f"prompt key {unknown[0]!r} is not supported; a prompt dict has 'prompt' or "
            "'prompt_token_ids', and optionally 'cache_salt'"
        )
    given = [key for key in _PROMPT_KEYS if key in prompt]
    if len(given) != 1:
        raise ValueError(
            f"a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids', got {given or 'neither'}"
        )
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt must be a string, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and (isinstance(value, str) or not isinstance(value, Sequence)):
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(value).__name__}")
    return value, prompt.get("cache_salt")
