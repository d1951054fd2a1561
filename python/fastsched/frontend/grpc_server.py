"""The frontend's gRPC server: ``proto/fastsched/v1/generate.proto`` over one AsyncLLM.

It only translates. Requests become ``SamplingParams`` (whose ``__post_init__`` is the
one place that judges values; AsyncLLM judges the prompt), the per-completion deltas
that AsyncLLM's stream carries become ``GenerateResponse`` messages, and exceptions
become status codes (docs/design.md §8):

- ``ValueError`` → INVALID_ARGUMENT with the message (prompt + max_tokens >
  max_model_len included); trailing metadata ``invalid-param`` names the field the
  message is about.
- ``AdmissionError`` (A1–A3) → UNAVAILABLE, the reason as details and as trailing
  metadata ``rejection-reason`` (A5). Any other failure while the engine is unhealthy
  (e.g. it died mid-request) is reported the same way, as ``engine_faulted``.
- The client cancelling the call ends the ``async with`` around the request's stream,
  which aborts the request (its blocks are freed at once), however the call ends.
- ``GetRequestStatus`` of an id the frontend does not know → NOT_FOUND; an engine that
  does not answer in time (``TimeoutError``) → DEADLINE_EXCEEDED. AsyncLLM's status dict
  becomes ``RequestStatusResponse`` field for field.
- More than ``max_concurrent_streams`` calls at once: the extra ones get
  RESOURCE_EXHAUSTED from grpc itself, before any work (the gateway tries another
  frontend, then answers 503).
- With an API key, every call but ``Health`` (left open for probes, as the gateway's
  ``/health``) and the admin methods must carry metadata ``authorization: Bearer <key>``; else
  UNAUTHENTICATED. Admin methods (pause, resume, reload, LoRA load/unload, request status;
  ``fastsched.admin``) are UNIMPLEMENTED unless enabled, take the admin key instead, and a path
  outside ``--allowed-local-paths`` is PERMISSION_DENIED.

Every request passes the request gate once (``fastsched.request_gate``): a long text
prompt or session chunk is tokenized, and an output constraint compiled, in a worker
thread after an O(1) check of its size, so no request holds the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import fields
from typing import Any

import grpc
from google.protobuf import json_format

from fastsched.admin import ADMIN_RPCS, LORA_RPCS, AdminSettings, PathNotAllowedError
from fastsched.frontend.admission import ENGINE_FAULTED, AdmissionError
from fastsched.frontend.async_llm import CompletionDelta, StreamOutput
from fastsched.frontend.lora_registry import LoRAInUseError, LoRANotFoundError, LoRARegistry
from fastsched.frontend.session import Session, SessionOutput
from fastsched.frontend.stats import LatencyHistograms, stats_to_proto
from fastsched.limits import RequestLimits
from fastsched.lora.request import LoRARequest
from fastsched.outputs import RequestOutput
from fastsched.proto_gen import import_stubs
from fastsched.request_gate import ValidRequest
from fastsched.rpc import (
    INVALID_PARAM_KEY,
    MESSAGE_SIZE_OPTIONS,
    REJECTION_REASON_KEY,
    bearer_matches,
    error_metadata,
    metadata_authorization,
)
from fastsched.sampling_params import SamplingParams

pb, pb_grpc = import_stubs()

logger = logging.getLogger("fastsched.grpc")


# Field names an error message may be about, for `invalid-param` (OpenAI's `param`).
_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams)) | {
    "prompt",
    "priority",
    "request_id",
    "model",
}
_WORD = re.compile(r"[A-Za-z_]+")
_OPTIONAL_PARAMS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
    "skip_reading_prefix_cache",
)


def sampling_params_from_proto(msg: Any, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """An unset optional field takes the model's default (``defaults``, from its generation
    config) if it has one, else SamplingParams'; invalid values raise ValueError."""
    kwargs: dict[str, Any] = dict(defaults or {})
    kwargs.update({name: getattr(msg, name) for name in _OPTIONAL_PARAMS if msg.HasField(name)})
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(**kwargs)


def _structured_outputs_from_proto(msg: Any) -> dict[str, Any]:
    """The constraint as ``StructuredOutputsParams`` fields; an empty one raises ValueError there."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return {}
    return {kind: list(msg.choice.values) if kind == "choice" else getattr(msg, kind)}


def param_named_in(message: str) -> str:
    """The first request field a ValueError message mentions ('' if none)."""
    return next((w for w in _WORD.findall(message) if w in _PARAM_NAMES), "")


def model_info_dict(info: Any) -> dict[str, Any]:
    """AsyncLLM's ``model_info()`` (a mapping, or ``protocol.ModelInfo``) as
    ``{"model", "max_model_len", "vocab_size"}``."""
    if isinstance(info, Mapping):
        return {
            "model": info["model"],
            "max_model_len": info["max_model_len"],
            "vocab_size": info["vocab_size"],
        }
    name = getattr(info, "model_name", None) or getattr(info, "model", None) or ""
    return {"model": name, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}


def _token_logprob(token_id: int, lp: Any) -> Any:
    msg = pb.TokenLogprob(token_id=token_id, logprob=lp.logprob, rank=lp.rank)
    if lp.decoded_token is not None:
        msg.decoded_token = lp.decoded_token
    return msg


def _position_logprobs(token_id: int, position: Mapping[int, Any] | None, num_top: int) -> Any:
    """One position's logprobs: ``token_id``'s (unset when the position has none) and the top ``num_top``."""
    entry = pb.PositionLogprobs()
    if position is None:
        return entry
    if token_id in position:
        entry.sampled.CopyFrom(_token_logprob(token_id, position[token_id]))
    top = sorted((lp.rank, tid) for tid, lp in position.items() if lp.rank <= num_top)
    entry.top.extend(_token_logprob(tid, position[tid]) for _, tid in top)
    return entry


class _ResponseStream:
    """Turns the deltas of AsyncLLM's stream into ``GenerateResponse`` messages, and times
    them for the latency histograms (TTFT, inter-token latency, e2e as this frontend sees them),
    per engine (``engine``: the index of the engine serving the request, None if not known)."""

    def __init__(
        self,
        request_id: str,
        num_top_logprobs: int | None,
        latencies: LatencyHistograms,
        engine: int | None = None,
        embed: bool = False,
    ) -> None:
        self.request_id = request_id
        self.embed = embed  # an embedding request: its final message carries the embedding, no tokens
        self.num_top_logprobs = num_top_logprobs
        self.latencies = latencies.engine(engine)
        self.start = time.monotonic()
        self.first_token_seen = False
        self.last_token_time: dict[int, float] = {}
        self.usage_sent = False
        self.prompt_logprobs_sent = False
        self.last: RequestOutput | None = None

    def response(self, output: StreamOutput) -> Any | None:
        """The message for one step of the stream; None if nothing a client sees changed."""
        now = time.monotonic()
        self.last = output
        response = pb.GenerateResponse(request_id=self.request_id)
        for delta in () if self.embed else output.deltas:
            if delta.token_ids:
                self._observe_tokens(delta.index, len(delta.token_ids), now)
            response.completions.append(self._completion_delta(delta))
        if output.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            response.prompt_token_ids.extend(output.prompt_token_ids)
            response.prompt_logprobs.extend(
                _position_logprobs(t, p, len(p or ()))
                for t, p in zip(output.prompt_token_ids, output.prompt_logprobs)
            )
        if output.finished:
            if output.embedding is not None:
                response.embedding.extend(output.embedding)
            response.usage.CopyFrom(self.usage())
            self.usage_sent = True
            self._observe_end(output, now)
        return response if response.completions or output.finished else None

    def _completion_delta(self, d: CompletionDelta) -> Any:
        delta = pb.CompletionDelta(index=d.index, token_ids=d.token_ids, text=d.text)
        if d.logprobs is not None and self.num_top_logprobs is not None:
            delta.logprobs.extend(
                _position_logprobs(token_id, position, self.num_top_logprobs)
                for token_id, position in zip(d.token_ids, d.logprobs)
            )
        if d.finish_reason is not None:
            delta.finish_reason = d.finish_reason
            if isinstance(d.stop_reason, str):
                delta.stop_str = d.stop_reason
            elif isinstance(d.stop_reason, int):
                delta.stop_token_id = d.stop_reason
        return delta

    def _observe_tokens(self, index: int, num_new: int, now: float) -> None:
        previous = self.last_token_time.get(index)
        self.last_token_time[index] = now
        if previous is None:  # gaps inside a completion's first snapshot cannot be measured
            if not self.first_token_seen:
                self.first_token_seen = True
                self.latencies["time_to_first_token_seconds"].observe(now - self.start)
            return
        # Steps coalesced into one snapshot: spread the gap over its tokens.
        self.latencies["inter_token_latency_seconds"].observe((now - previous) / num_new, num_new)

    def _observe_end(self, output: RequestOutput, now: float) -> None:
        if any(c.finish_reason == "abort" for c in output.outputs):
            return
        self.latencies["e2e_request_latency_seconds"].observe(now - self.start)

    def usage(self) -> Any:
        out = self.last
        if out is None:
            return pb.Usage()
        return pb.Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=0 if self.embed else sum(len(c.token_ids) for c in out.outputs),
            cached_tokens=out.num_cached_tokens or 0,
        )


class FrontendServicer(pb_grpc.FrontendServicer):
    """Serves one AsyncLLM (see the module docstring for the error mapping)."""

    def __init__(
        self, async_llm: Any, limits: RequestLimits | None = None, admin: AdminSettings | None = None
    ) -> None:
        self.async_llm = async_llm
        self.limits = limits or RequestLimits()
        self.admin = admin or AdminSettings()
        self.latencies = LatencyHistograms()

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        async with self._admission(context, request_id):
            valid = await self._validate(request_id, request, streaming=False)
            stream = self.async_llm.submit(valid)
        responses = _ResponseStream(
            request_id,
            valid.params.logprobs,
            self.latencies,
            getattr(stream, "engine_index", None),
            embed=valid.pooling,
        )
        try:
            # Leaving this block before the request finished (the client cancelled, the
            # stream broke) aborts it in the engine: no path can forget the abort.
            async with stream:
                async for output in stream:
                    if (response := responses.response(output)) is not None:
                        yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await self._abort_failed(context, request_id, e)
        if not responses.usage_sent:  # ended without a finished snapshot
            yield pb.GenerateResponse(request_id=request_id, usage=responses.usage())

    @contextlib.asynccontextmanager
    async def _admission(self, context: grpc.aio.ServicerContext, request_id: str) -> AsyncIterator[None]:
        """Around parsing and admitting a request (Generate, GenerateSession): AsyncLLM checks
        and admits when called, so a rejection or a bad prompt ends the call here, before any
        response, and leaves no request behind (A5)."""
        try:
            yield
        except AdmissionError as e:
            await self._abort_unavailable(context, e.reason)
        except ValueError as e:
            await self._abort_invalid(context, e)
        except Exception as e:
            await self._abort_failed(context, request_id, e)

    async def _abort_failed(
        self, context: grpc.aio.ServicerContext, request_id: str, error: Exception
    ) -> None:
        """End the call for a request that failed: UNAVAILABLE ``engine_faulted`` while the
        engine is unhealthy (it died mid-request), INVALID_ARGUMENT for a ``ValueError``
        (e.g. the engine refused the prompt: docs/design.md §4, ignored), else INTERNAL."""
        if not self.async_llm.is_healthy():
            logger.warning(
                "request %r failed, the engine is not healthy: %s", request_id, error
            )  # %r: as sent, escaped
            await self._abort_unavailable(context, ENGINE_FAULTED)
        if isinstance(error, ValueError):
            await self._abort_invalid(context, error)
        logger.error("request %r failed", request_id, exc_info=error)
        await context.abort(grpc.StatusCode.INTERNAL, f"request {request_id} failed: {error}")

    async def _validate(self, request_id: str, request: Any, streaming: bool) -> ValidRequest:
        """A ``GenerateRequest`` (or a session's ``open``) through the request gate
        (``fastsched.request_gate``): checked once, compiled and tokenized off the event loop."""
        prompt, build_params, lora = self._parse(request)
        constraint = None
        if request.sampling_params.HasField("structured_outputs"):
            so = request.sampling_params.structured_outputs
            kind = so.WhichOneof("kind")
            if kind is not None and kind != "json_object":
                constraint = (kind, list(so.choice.values) if kind == "choice" else getattr(so, kind))
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        return await self.async_llm.gate.request_async(
            request_id,
            prompt,
            build_params,
            constraint,
            request.priority,
            lora,
            streaming,
            cache_salt,
            request.embed,
        )

    def _parse(
        self, request: Any
    ) -> tuple[str | list[int], Callable[[], SamplingParams], LoRARequest | None]:
        """The prompt, a builder of the sampling parameters (it may compile a grammar: the gate
        runs it off the event loop) and the adapter a request names."""
        lora = None
        if request.model:
            served = model_info_dict(self.async_llm.model_info())["model"]
            loras = self.async_llm.loras
            lora = None if loras is None else loras.get(request.model)
            if request.model != served and lora is None:
                raise _NotFound(
                    f"The model `{request.model}` does not exist; this frontend serves `{served}`."
                )
        info = self.async_llm.model_info()
        defaults = info.get("sampling_defaults") if isinstance(info, Mapping) else info.sampling_defaults
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("prompt is required: set `text` or `token_ids`")
        return (
            (request.text if kind == "text" else list(request.token_ids.ids)),
            lambda: sampling_params_from_proto(request.sampling_params, defaults),
            lora,
        )

    @staticmethod
    async def _abort_invalid(context: grpc.aio.ServicerContext, error: ValueError) -> None:
        error_code: str | None
        if isinstance(error, _NotFound):
            code, param, error_code = grpc.StatusCode.NOT_FOUND, "model", "model_not_found"
        else:
            code = grpc.StatusCode.INVALID_ARGUMENT
            param = getattr(error, "field", None) or param_named_in(
                str(error)
            )  # a LimitError knows its field
            error_code = getattr(error, "code", None)  # e.g. context_length_exceeded
        context.set_trailing_metadata(error_metadata(param=param, code=error_code))
        await context.abort(code, str(error))

    @staticmethod
    async def _abort_unavailable(context: grpc.aio.ServicerContext, reason: str) -> None:
        context.set_trailing_metadata(((REJECTION_REASON_KEY, reason),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, reason)

    async def GenerateSession(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """S15 (see the proto): the first message opens the session, a task feeds it the
        following ones while this call streams its outputs. Refused input ends the call
        INVALID_ARGUMENT; the request stream ending without ``close`` closes the session."""
        try:
            async with asyncio.timeout(getattr(self.async_llm, "session_open_timeout", None)):
                first = await anext(aiter(request_iterator), None)
        except TimeoutError:
            context.set_trailing_metadata(error_metadata(param="open", code="session_open_timeout"))
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "no `open` message within the session open timeout (--session-open-timeout)",
            )
        if first is None or first.WhichOneof("kind") != "open":
            context.set_trailing_metadata(((INVALID_PARAM_KEY, "open"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session's first message must be `open`")
        request_id = first.open.request_id or f"session-{uuid.uuid4().hex}"
        async with self._admission(context, request_id):
            session = self.async_llm.open_session(
                await self._validate(request_id, first.open, streaming=True)
            )
        feeder = asyncio.create_task(feed_session(session, request_iterator))
        try:
            async with session:
                async for out in session:
                    yield session_response(out, session)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await self._abort_failed(context, request_id, e)
        finally:
            feeder.cancel()

    async def _check_admin(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """Admin methods (``fastsched.admin``): UNIMPLEMENTED unless enabled, UNAUTHENTICATED
        without the admin key when there is one (the API key never grants them)."""
        if not self.admin.enabled(rpc):
            flag = "--enable-runtime-lora-updating" if rpc in LORA_RPCS else "--enable-admin-api"
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc} is off: start the server with {flag}")
        key = self.admin.admin_api_key
        authorization = metadata_authorization(context.invocation_metadata() or ())
        if key is not None and not bearer_matches(authorization, key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED_ADMIN)

    async def _check_path(self, context: grpc.aio.ServicerContext, path: str, field: str) -> None:
        try:
            self.admin.check_local_path(path, field)
        except PathNotAllowedError as e:
            context.set_trailing_metadata(error_metadata(param=field, code=e.code))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    async def Pause(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "Pause")
        try:
            await self.async_llm.pause(request.mode or "all")
        except ValueError as e:
            context.set_trailing_metadata(((INVALID_PARAM_KEY, "mode"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        return self._pause_response()

    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "Resume")
        try:
            await self.async_llm.resume()
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        return self._pause_response()

    async def ReloadWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "ReloadWeights")
        if not request.model:
            context.set_trailing_metadata(((INVALID_PARAM_KEY, "model"),))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "model (the checkpoint to load) is required"
            )
        await self._check_path(context, request.model, "model")
        try:
            await self.async_llm.reload_weights(request.model)
        except ValueError as e:
            context.set_trailing_metadata(((INVALID_PARAM_KEY, "model"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except RuntimeError as e:  # not paused with mode all
            context.set_trailing_metadata(error_metadata(code="not_paused"))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.ReloadWeightsResponse()

    async def ResetPrefixCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "ResetPrefixCache")
        try:
            await self.async_llm.reset_prefix_cache()
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        return pb.ResetPrefixCacheResponse()

    async def IsPaused(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "IsPaused")
        return self._pause_response()

    def _pause_response(self) -> Any:
        return pb.PauseResponse(paused=self.async_llm.is_paused(), engines=self.async_llm.pause_states())

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.HealthResponse(status=pb.SERVING if self.async_llm.is_healthy() else pb.NOT_SERVING)

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ModelInfoResponse(**model_info_dict(self.async_llm.model_info()))

    async def ListLoRAAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        loras = self.async_llm.loras
        adapters = [] if loras is None else loras.adapters()
        return pb.ListLoRAAdaptersResponse(
            adapters=[pb.LoRAAdapter(name=a.name, path=a.path) for a in adapters]
        )

    async def LoadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "LoadLoRAAdapter")
        await self._check_path(context, request.lora_path, "lora_path")
        try:
            await asyncio.to_thread(self._loras().load, request.lora_name, request.lora_path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "UnloadLoRAAdapter")
        try:
            self._loras().unload(request.lora_name)
        except LoRANotFoundError as e:
            context.set_trailing_metadata(error_metadata(param="lora_name", code="lora_not_found"))
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except LoRAInUseError as e:
            context.set_trailing_metadata(error_metadata(param="lora_name", code="lora_in_use"))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.UnloadLoRAAdapterResponse()

    def _loras(self) -> LoRARegistry:
        loras = self.async_llm.loras
        if loras is None:
            raise ValueError("LoRA is not enabled on this server (start it with --enable-lora)")
        return loras

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return stats_to_proto(self.async_llm.stats(), self.latencies)

    async def GetRequestStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_admin(context, "GetRequestStatus")
        try:
            self.limits.check_request_id(request.request_id)
        except ValueError as e:
            await self._abort_invalid(context, e)
        try:
            status = await self.async_llm.request_status(request.request_id)
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        if status is None:
            context.set_trailing_metadata(error_metadata(param="request_id", code="request_not_found"))
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"this frontend does not know request {request.request_id!r}"
            )
        return json_format.ParseDict(status, pb.RequestStatusResponse())


async def feed_session(session: Session, request_iterator: Any) -> None:
    """Hands a session the chunks and the close of its request stream; a refused chunk fails
    the session (its stream raises the ``ValueError``)."""
    try:
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "chunk":
                chunk = msg.chunk
                which = chunk.WhichOneof("input")
                if which is None:
                    raise ValueError("a chunk needs its input: set `text` or `token_ids`")
                prompt = chunk.text if which == "text" else list(chunk.token_ids.ids)
                await session.send(prompt, chunk.max_tokens, last=chunk.last)
            elif kind == "close":
                await session.close()
            else:
                raise ValueError(
                    f"a session takes `open` once, then `chunk` or `close`; got {kind or 'nothing'}"
                )
        await session.close()  # no more input can come
    except ValueError as e:
        session.fail(e)


def session_response(out: SessionOutput, session: Session) -> Any:
    response = pb.SessionResponse(
        request_id=out.request_id,
        segment=out.segment,
        token_ids=out.token_ids,
        text=out.text,
        segment_ended=out.segment_ended,
        finish_reason=out.finish_reason or "",
    )
    if out.finished:
        response.usage.CopyFrom(
            pb.Usage(prompt_tokens=session.num_input_tokens, completion_tokens=session.num_output_tokens)
        )
    return response


class _NotFound(ValueError):
    """The request names a model this frontend does not serve."""


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Lets through calls that carry ``authorization: Bearer <key>`` (and ``Health``,
    without); answers every other one UNAUTHENTICATED before its handler runs."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
            yield  # an async generator, as a server-streaming handler must be

        async def deny_bidi(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
            yield

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny_bidi)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        method = handler_call_details.method
        rpc = method.rsplit("/", 1)[-1]
        # Health is open for probes; admin methods take the admin key instead (FrontendServicer._check_admin).
        if (
            rpc == "Health"
            or rpc in ADMIN_RPCS
            or rpc in LORA_RPCS
            or self._authorized(handler_call_details.invocation_metadata or ())
        ):
            return await continuation(handler_call_details)
        if method.endswith("/GenerateSession"):
            return self._deny_bidi
        return self._deny_stream if method.endswith("/Generate") else self._deny_unary

    def _authorized(self, metadata: Any) -> bool:
        return bearer_matches(metadata_authorization(metadata), self._key)


_UNAUTHENTICATED = "Invalid or missing API key: send metadata `authorization: Bearer <key>`."
_UNAUTHENTICATED_ADMIN = (
    "Invalid or missing admin API key (--admin-api-key): send metadata `authorization: Bearer <key>`."
)


async def serve_frontend(
    async_llm: Any,
    host: str = "127.0.0.1",
    port: int = 50051,
    *,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    admin: AdminSettings | None = None,
) -> grpc.aio.Server:
    """Starts a grpc.aio server for ``async_llm`` on ``host:port`` and returns it (stop it
    with ``await server.stop(grace)``). Fails if the port is taken: SO_REUSEPORT is off so
    two frontends can never silently share one port. ``api_key``: required of every call
    but Health and the admin methods; ``limits.max_concurrent_streams``: the most calls served at
    once; ``admin``: which admin methods are on and their key (``fastsched.admin``; default: none)."""
    limits = limits or RequestLimits()
    admin = admin or AdminSettings()
    admin.check_keys(api_key)
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), *MESSAGE_SIZE_OPTIONS],
        interceptors=[_ApiKeyInterceptor(api_key)] if api_key is not None else None,
        maximum_concurrent_rpcs=limits.max_concurrent_streams,
    )
    pb_grpc.add_FrontendServicer_to_server(FrontendServicer(async_llm, limits, admin), server)
    try:
        server.add_insecure_port(_address(host, port))
    except RuntimeError as e:
        raise OSError(f"the gRPC frontend cannot listen on {_address(host, port)}: {e}") from e
    await server.start()
    return server
