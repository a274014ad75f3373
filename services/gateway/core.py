"""What both front ends share, so HTTP and gRPC accept, refuse and serve exactly alike: the
backend, the tokenizer, settings, metrics and the checks (``Gateway``); a client's prompt and
options to a validated, tokenized ``GenerationRequest`` (``build_request``); the choices of one
request (``start_choices``); and the request's span (``RequestTrace``).

Requests with several choices (``n`` > 1, ``best_of``): the prompt is prefilled once.

Choice ``i`` is its own engine request (id ``<id>-<i>``, seed ``seed + i``, as vLLM's rule), so
it equals the same request sent with ``n`` = 1 and that seed, on every path. Choice 0 starts
first; once its first token is out its prompt's full blocks are in its worker's prefix cache
(and, disaggregated, in the router's index, which then sends the others to the same prefill
worker), so the other choices start together and reuse them: each computes only the prompt's
last partial block (fewer than ``block_size`` tokens) and, disaggregated, decode workers pull
only that block. ``tandem_prefix_cache_hits`` shows it.

Each choice counts as a request in the gateway's metrics and in ``max_in_flight``. A choice
that fails fails the whole request: the others are aborted (their blocks freed).

The gateway's span of one request is the root of its trace (or a child of the client's
``traceparent``), with parse and tokenize phases; the backend's router, prefill and decode
spans hang under it. It ends when the generation does (finished, aborted or failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import secrets
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2 import TemplateError
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from tandem.services import tracing
from tandem.services.engine.grammar import Grammars
from tandem.services.engine.tokenizer import TEMPLATE_VARIABLES, Tokenizer
from tandem.services.gateway.backend import GenerationBackend, HealthReporting, MultiWorkerStats
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.errors import GatewayError, bad_request, model_not_found
from tandem.services.gateway.metrics import (
    ERROR,
    REJECTED,
    SLOW_CLIENT,
    GatewayMetrics,
    RequestTimer,
    failure_reason,
)
from tandem.services.gateway.pipeline import Delta, Usage, generate_deltas
from tandem.services.gateway.reasoning import parser_enabled
from tandem.services.gateway.tenants import FairSlots, Tenants
from tandem.services.gateway.tool_parsers import pick as pick_tool_parser
from tandem.services.gateway.tools import Function, auto_constraint
from tandem.services.protocol.outputs import EngineStats
from tandem.services.protocol.request import (
    DEFAULT_TENANT,
    UNKNOWN_TENANT,
    GenerationRequest,
    SamplingParams,
    StructuredOutput,
)

log = logging.getLogger(__name__)

# A refusal is logged at most once per this many seconds per (endpoint, tenant, status); the
# next line says how many were not (each is counted in tandem_request_failures_total). A tenant
# sending hundreds of refused requests a second must not make the gateway spend its event loop
# writing logs, slowing every other tenant's streams.
REFUSAL_LOG_INTERVAL_S = 10.0


class LogSampler:
    """At most one log line per key per ``interval_s``: ``allow`` returns how many lines of
    that key were left out since the last one written, or None to leave this one out."""

    def __init__(self, interval_s: float, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[object, tuple[float, int]] = {}  # key -> (written at, left out since)

    def allow(self, key: object) -> int | None:
        now = self.clock()
        written, left_out = self._last.get(key, (-math.inf, 0))
        if now - written < self.interval_s:
            self._last[key] = (written, left_out + 1)
            return None
        if key not in self._last and len(self._last) >= self.max_keys:
            self._last.clear()  # bounded: many distinct keys only cost an early line each
        self._last[key] = (now, 0)
        return left_out


TOKENIZER_THREADS = 2  # per gateway: tokenizing releases the GIL, templates do not
MAX_LOGGED_MESSAGE = 300  # characters of a refusal's message in its log line


class Gateway:
    """One served model behind one backend. Build one per process and hand it to the front ends:
    ``create_http_app(gateway)`` and ``GenerationServicer(gateway)``.
    """

    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer,
                 config: GatewayConfig | None = None, tenants: Tenants | None = None) -> None:
        """``tenants``: API keys, cache salts and rate limits (none: no authentication)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.grammars = Grammars(tokenizer)  # checks structured-output constraints
        self.config = config or GatewayConfig()
        self.tenants = tenants or Tenants()
        self._tenants = self.tenants if self.tenants.in_use else None  # None: nothing to do
        self._slots = (None if self.config.max_in_flight is None else FairSlots(
            self.config.max_in_flight, self.tenants.weights, self.config.retry_after_s,
            self.config.tenant_max_in_flight, len(self.tenants.tenant_names)))
        self.model_names = self.config.served_model_names or (backend.model_id,)
        # Chat replies' <think> text apart, as reasoning_content (gateway/reasoning.py).
        self.reasoning = parser_enabled(self.config.reasoning_parser, tokenizer)
        # How replies under tool_choice auto write their calls (gateway/tool_parsers.py), and
        # the ids of its tags that are tokens of their own: the reply's text keeps them.
        self.tool_parser = pick_tool_parser(self.config.tool_call_parser,
                                            tokenizer.chat_template_sources)
        self.tool_tag_ids = self.tool_parser.token_ids(tokenizer.backend.token_to_id)
        self.model_name = self.model_names[0]
        # Seeds for sampled requests that bring none: drawn from the server's seed (the same
        # requests in the same order get the same ones), else random (inputs.build_request).
        self._seeds = None if self.config.seed is None else random.Random(self.config.seed)
        self.created = int(time.time())
        # Tokenizing and chat templates run here, off the event loop (a long prompt would stall
        # every stream the loop serves), after check_prompt_size refused what cannot fit.
        self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS,
                                              thread_name_prefix="tandem-tokenize")
        self._max_token_chars = tokenizer.max_token_chars
        self.metrics = GatewayMetrics(self.model_name, self._worker_stats,
                                      tenants=self.tenants.tenant_names,
                                      authenticates=bool(self.tenants.keys))
        self.refusal_log = LogSampler(REFUSAL_LOG_INTERVAL_S)
        self.in_flight = 0  # admitted requests that have not ended
        # Awaited before /metrics renders: brings workers' stats up to date when they are
        # polled lazily (an idle cluster); None where stats are always current.
        self.refresh_stats: Callable[[], Awaitable[None]] | None = None
        self.metrics.in_flight_limit.labels(self.model_name).set(self.config.max_in_flight or 0)

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    def check_buffered(self, request: GenerationRequest, choices: int) -> None:
        """400 for a non-streaming request whose response could hold more token entries than
        ``max_buffered_tokens`` (it is built whole in memory): naming the fields."""
        p = request.params
        entries = choices * p.max_tokens * (1 + (p.logprobs or 0))
        if p.prompt_logprobs is not None:
            entries += request.num_prompt_tokens * (1 + p.prompt_logprobs)
        limit = self.config.max_buffered_tokens
        if entries > limit:
            prompt = " + the prompt's logprobs" if p.prompt_logprobs is not None else ""
            raise bad_request(
                f"a response of n {choices} x max_tokens {p.max_tokens} x (1 + logprobs "
                f"{p.logprobs or 0}){prompt} = {entries} tokens is more than the {limit} a "
                f"non-streaming response may hold: stream it, or ask for fewer",
                param="max_tokens")

    async def tokenize(self, param: str, chars: int, work: Callable[[], list[int]]
                       ) -> list[int]:
        """``work``'s token ids (a prompt's tokenizing or a chat's rendering), computed in the
        gateway's tokenizer threads; first, at once, a 400 naming ``param`` when its ``chars``
        characters could not fit the context."""
        check_prompt_size(chars, self.max_model_len, self._max_token_chars, param)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work)

    def health_problem(self) -> str | None:
        """None while requests can be served; else why not (/health answers 503)."""
        if isinstance(self.backend, HealthReporting):
            return self.backend.health_problem()
        return None

    def check_model(self, model: str | None) -> None:
        """An empty or missing model name means the served one."""
        if model and model not in self.model_names:
            raise model_not_found(model)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's tenant; 401 unless ``authorization`` (the header's value, ``Bearer
        <key>``) holds a known key (without keys configured: the default tenant)."""
        if self._tenants is None:
            return DEFAULT_TENANT
        if self._tenants.reload_keys() and self._slots is not None:
            self._slots.weights = dict(self._tenants.weights)
            self._slots.tenants = len(self._tenants.tenant_names)
        return self._tenants.authenticate(authorization)

    def caller(self, authorization: str | None) -> str:
        """A generation request's tenant, refused (401; 429 when the tenant could not be
        admitted now) before its body is parsed or tokenized: a tenant flooding with requests
        it is refused costs the gateway next to nothing."""
        tenant = self.authenticate(authorization)
        if self._slots is not None:
            self._slots.check(tenant)
        return tenant

    @contextlib.contextmanager
    def refusals(self, operation: str, authorization: str | None,
                 gone: tuple[type[Exception], ...] = ()) -> Iterator[None]:
        """Around a front end's work on a request before ``start`` (which counts every request
        it is given): a request refused here is counted once in ``tandem_request_failures``
        and, if the refusal is a ``GatewayError``, logged once (the front end logs others).
        ``operation``: the endpoint, for the log; ``authorization``: the request's header;
        ``gone``: the front end's "the client left" exceptions (not failures: not counted)."""
        try:
            yield
        except GatewayError as exc:
            self.refused(operation, exc, authorization)
            raise
        except gone:
            raise
        except Exception:
            self.metrics.fail(self._tenant_label(authorization), ERROR)
            raise

    def refused(self, operation: str, error: GatewayError, authorization: str | None) -> None:
        """Count and log a request refused before ``start``, under its tenant
        (``UNKNOWN_TENANT`` when its API key is missing or wrong)."""
        tenant = self._tenant_label(authorization)
        self.metrics.fail(tenant, failure_reason(error))
        more = self.refusal_log.allow((operation, tenant, error.status))
        if more is not None:
            log.info("%s refused for tenant %s: %d %.*r%s", operation, tenant, error.status,
                     MAX_LOGGED_MESSAGE, error.message,
                     f" (and {more} more like it in the last {REFUSAL_LOG_INTERVAL_S:.0f} s)"
                     if more else "")

    def _tenant_label(self, authorization: str | None) -> str:
        try:
            return self.authenticate(authorization)
        except GatewayError:
            return UNKNOWN_TENANT

    async def check_structured_output(self, stated: tuple[str, StructuredOutput] | None
                                      ) -> None:
        """400 naming the field when the constraint it ``stated`` (field, constraint) cannot be
        compiled (in a thread: the first one builds the grammar tokenizer, ~0.5 s, and a large
        grammar takes long)."""
        if stated is None:
            return
        param, constraint = stated
        problem = await asyncio.to_thread(self.grammars.problem, constraint)
        if problem is not None:
            raise bad_request(f"{param}: {problem}", param=param)

    async def auto_tool_constraint(self, functions: list[Function], parallel: bool
                                   ) -> StructuredOutput | None:
        """Under ``tool_choice`` auto, the grammar that holds the reply's calls to the tools'
        schemas (``tools.auto_constraint``); None where the parser has none, where its tag is
        a token of its own (the grammar spells it out, and would forbid that token), or where
        the tools' schemas do not compile (the calls are then parsed unconstrained)."""
        constraint = None if self.tool_tag_ids else auto_constraint(functions, self.tool_parser,
                                                                     parallel)
        if constraint is None or await asyncio.to_thread(self.grammars.problem, constraint):
            return None
        return constraint

    def build_request(self, request_id: str, prompt_token_ids: list[int],
                      options: SamplingOptions, cache_salt: str | None = None,
                      arrival_time: float | None = None, prompt_param: str = "prompt",
                      tenant: str = DEFAULT_TENANT, session: str | None = None
                      ) -> GenerationRequest:
        """``cache_salt``: the client's; the request's own is derived from it and ``tenant``.
        ``session``: the client's session name, if it gave one."""
        unset = {k: v for k, v in self.config.sampling_defaults.items()
                 if getattr(options, k) is None}
        if unset:  # the model's own defaults (generation_config.json)
            options = dataclasses.replace(options, **unset)
        if self._seeds is not None and options.seed is None and options.temperature != 0:
            options = dataclasses.replace(options, seed=self._seeds.getrandbits(63))
        request = build_request(request_id, prompt_token_ids, options, self.max_model_len,
                                (cache_salt or None) if self._tenants is None
                                else self._tenants.cache_salt(tenant, cache_salt),
                                self.config.default_max_tokens, arrival_time, prompt_param,
                                self.config.request_timeout_s, self.tokenizer.vocab_size, tenant)
        return request if session is None else dataclasses.replace(request, session=session)

    async def start(self, request: GenerationRequest, trace: RequestTrace | None = None,
                    keep: frozenset[int] = frozenset()) -> Generation:
        """Submit the request and wait for its first step (rejections raise ``GatewayError``).
        ``trace`` (the request's span) ends with the generation. ``keep``: special tokens whose
        text the reply keeps (a tool-call parser's tags, ``tool_parsers``)."""
        timer = self.metrics.start_request(request.arrival_time, request.tenant)
        tenants = self._tenants
        try:  # the tenant's rate limits (at most its prompt and max_tokens), then a slot
            charged = 0 if tenants is None else tenants.admit(
                request.tenant, request.num_prompt_tokens + request.params.max_tokens)
            if self._slots is not None:  # shed before any work or any 200
                try:
                    await self._slots.acquire(request.tenant, request.remaining_s())
                except BaseException:
                    if charged:
                        self.tenants.settle(request.tenant, charged, 0)
                    raise
        except GatewayError:
            timer.fail(REJECTED)
            raise
        self._admitted(1, request.tenant)
        deltas = generate_deltas(self.backend, self.tokenizer, request, timer,
                                 self.config.retry_after_s, keep)
        if trace is not None:
            trace.request(request)
        try:
            # The backend starts its work, and its spans, in this first step.
            with trace.active() if trace is not None else contextlib.nullcontext():
                first = await anext(deltas)
        except BaseException:
            try:
                await deltas.aclose()
            finally:
                self._admitted(-1, request.tenant)
                if charged:
                    self.tenants.settle(request.tenant, charged, 0)  # refused: it cost nothing
            raise
        if trace is not None:
            trace.first_token()

        def ended() -> None:
            self._admitted(-1, request.tenant)
            if charged:
                self.tenants.settle(request.tenant, charged,
                                    request.num_prompt_tokens + generation.generated)

        generation = Generation(request, first, deltas, trace, ended, timer)
        return generation

    def busy(self) -> bool:
        """Whether some admitted request has not ended."""
        return self.in_flight > 0

    def set_admission_limit(self, limit: int) -> None:
        """The in-flight bound from now on (``max_in_flight``'s default follows the healthy
        decode workers: serving/gateway.py)."""
        if self._slots is not None and limit != self._slots.limit:
            log.info("admission limit %d (was %d)", limit, self._slots.limit)
            self._slots.resize(limit)
            self.metrics.in_flight_limit.labels(self.model_name).set(limit)

    def _admitted(self, change: int, tenant: str) -> None:
        """``change`` requests of ``tenant`` admitted (1) or ended (-1: its slot freed)."""
        if change < 0 and self._slots is not None:
            self._slots.release(tenant)
        self.in_flight += change
        self.metrics.in_flight.labels(self.model_name).set(self.in_flight)

    def _worker_stats(self) -> Mapping[str, EngineStats]:
        if isinstance(self.backend, MultiWorkerStats):
            return self.backend.worker_stats()
        return {self.config.worker_name: self.backend.stats}


@dataclass
class Generation:
    """A started request: its first delta and the rest. Close it to abort an unfinished one."""

    request: GenerationRequest
    first: Delta
    rest: AsyncGenerator[Delta, None]
    trace: RequestTrace | None = None
    on_end: Callable[[], None] | None = None  # called once, when it is closed
    timer: RequestTimer | None = None  # its metrics
    generated: int = 0  # tokens handed out so far

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            delta = self.first
            self._note(delta)
            yield delta
            if delta.finish_reason is None:
                async for delta in self.rest:
                    self._note(delta)
                    yield delta
        except Exception as exc:
            if self.trace is not None:
                self.trace.fail(exc)
            raise

    def _note(self, delta: Delta) -> None:
        self.generated += len(delta.token_ids)
        if self.trace is not None and delta.finish_reason is not None:
            self.trace.finish(delta)

    async def aclose(self) -> None:
        try:
            await self.rest.aclose()
        finally:
            if self.trace is not None:
                self.trace.end()
            on_end, self.on_end = self.on_end, None
            if on_end is not None:
                on_end()

    async def cut_slow_client(self, read_timeout_s: float) -> None:
        """The client read nothing for ``read_timeout_s``: count and log it, abort the request
        (the front end then drops the connection)."""
        log.warning("request %s: the client read nothing for %g s; its stream is cut",
                    self.request.request_id, read_timeout_s)
        if self.timer is not None:
            self.timer.fail(SLOW_CLIENT)
        await self.aclose()

    async def collect(self) -> Delta:
        """Run to the end and merge every delta into one."""
        merged = Delta()
        try:
            async for delta in self:
                merged.text += delta.text
                merged.token_ids += delta.token_ids
                merged.logprobs += delta.logprobs
                merged.text_offsets += delta.text_offsets
                merged.finish_reason = delta.finish_reason
                merged.stop_string = delta.stop_string
                merged.usage = delta.usage
                merged.prompt_logprobs = merged.prompt_logprobs or delta.prompt_logprobs
        finally:
            await self.aclose()
        return merged


# Choices (n > 1, best_of) ------------------------------------------------------------------

T = TypeVar("T")
_SEED_SPACE = 2**64  # seeds are 64-bit (core.py); seed + i wraps within them
_MAX_SEED = 2**64 - 1


def choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice ``index`` of ``request`` (choice 0 is ``request`` itself, and alone computes the
    prompt's logprobs if asked: the same for every choice)."""
    if index == 0:
        return request
    seed = request.params.seed
    if seed is not None:
        seed += index
        if seed > _MAX_SEED:
            seed -= _SEED_SPACE
    params = dataclasses.replace(request.params, seed=seed, prompt_logprobs=None)
    return dataclasses.replace(request, request_id=f"{request.request_id}-{index}",
                               params=params)


async def start_choices(gateway: Gateway, request: GenerationRequest, n: int = 1,
                        trace: RequestTrace | None = None,
                        keep: frozenset[int] = frozenset()) -> Choices:
    """Start ``n`` choices of ``request``: choice 0 first, then the others at once. If any is
    refused (or this is cancelled), those started are closed and the refusal raised. ``keep``:
    special tokens whose text the replies keep (``Gateway.start``)."""
    first = await gateway.start(request, trace, keep)
    if n == 1:
        return Choices([first])
    others = await _all_or_none(
        [gateway.start(choice_request(request, i), keep=keep) for i in range(1, n)],
        first.aclose)
    return Choices([first, *others])


async def _all_or_none(work: Sequence[Awaitable[T]], on_failure: Callable[[], Awaitable[None]]
                       ) -> list[T]:
    """Every result of ``work`` (run at once), or, at the first failure (or a cancellation),
    the rest cancelled, ``on_failure`` awaited and the failure raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:
            raise failed
        return [t.result() for t in tasks]
    except BaseException:
        await _cancel(tasks)
        await on_failure()
        raise


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait for them to end; a generation one of them already started is
    closed."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if (not task.cancelled() and task.exception() is None
                and isinstance(task.result(), Generation)):
            await task.result().aclose()


@dataclass
class Choices:
    """A started request's choices (one or more ``Generation``s). Close it to abort those
    unfinished."""

    generations: list[Generation]

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        """Each choice's deltas as they come, with its index. A choice's failure is raised; the
        other choices are closed when the stream is."""
        streams = [aiter(g) for g in self.generations]
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    index = pending.pop(task)
                    try:
                        delta = task.result()
                    except StopAsyncIteration:
                        continue
                    yield index, delta
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
        finally:
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
            for stream in streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            await self.aclose()

    async def collect(self) -> list[Delta]:
        """Every choice run to its end, each merged into one delta (``Generation.collect``);
        the first failure ends them all."""
        return await _all_or_none([g.collect() for g in self.generations], self.aclose)

    async def aclose(self) -> None:
        """Close every choice (aborting those unfinished), even if one close fails."""
        results = await asyncio.gather(*(g.aclose() for g in self.generations),
                                       return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    async def cut_slow_client(self, read_timeout_s: float) -> None:
        """The client stopped reading: counted and logged once (on choice 0), every choice
        aborted."""
        await self.generations[0].cut_slow_client(read_timeout_s)
        await self.aclose()


def total_usage(usages: Sequence[Usage | None]) -> Usage | None:
    """The usage of a request with several choices: its prompt once (as choice 0 saw it) and
    every choice's completion tokens."""
    if not usages or usages[0] is None:
        return None
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages if u is not None)
    return Usage(first.prompt_tokens, completion, first.cached_tokens)


def cumulative_logprob(delta: Delta) -> float:
    """The sum of the log-probabilities of a choice's tokens (what ``best_of`` ranks by)."""
    return sum(lp.logprob for lp in delta.logprobs)


class RequestTrace:
    def __init__(self, entry: str, operation: str, carrier: Mapping[str, Any] | None) -> None:
        """``entry``: http or grpc; ``carrier``: the request's headers or metadata."""
        self.span = tracing.start_span("gateway.request", tracing.extract(carrier),
                                       SpanKind.SERVER)
        self.recording = self.span.is_recording()
        self._ended = False
        self._finished = False
        if self.recording:
            self.span.set_attributes({"tandem.entry": entry, "tandem.operation": operation})

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """A child span around a block of the gateway's own work (not across a ``yield``)."""
        if not self.recording:
            yield INVALID_SPAN
            return
        # What went wrong is recorded once, on the request span (see fail).
        with tracing.tracer().start_as_current_span(
                name, context=trace.set_span_in_context(self.span), record_exception=False,
                set_status_on_exception=False) as span:
            yield span

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The request span as the current one: the backend parents its spans on it."""
        if not self.recording:
            yield
            return
        with trace.use_span(self.span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            yield

    @contextlib.contextmanager
    def guard(self, aborts: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """End the span if the block raises (on success the generation ends it); ``aborts``
        are the exceptions that mean the client went away."""
        try:
            yield
        except BaseException as exc:
            self.fail(exc, aborted=isinstance(exc, aborts))
            raise

    def request(self, request: GenerationRequest) -> None:
        if self.recording:
            self.span.set_attributes({
                "tandem.request_id": request.request_id,
                "tandem.prompt_tokens": len(request.prompt_token_ids),
                "tandem.max_tokens": request.params.max_tokens})

    def client_request_id(self, request_id: str) -> None:
        """The id the client sent (gRPC), echoed back to it; the server's own id keys the
        request (``tandem.request_id``)."""
        if self.recording and request_id:
            self.span.set_attribute("tandem.client_request_id", request_id)

    def first_token(self) -> None:
        if self.recording:
            self.span.add_event("first_token")

    def finish(self, delta: Delta) -> None:
        self._finished = True
        if self.recording and delta.usage is not None:
            self.span.set_attributes({
                "tandem.finish_reason": delta.finish_reason or "",
                "tandem.completion_tokens": delta.usage.completion_tokens,
                "tandem.cached_tokens": delta.usage.cached_tokens})

    def fail(self, exc: BaseException, aborted: bool = False) -> None:
        """End the span: client errors and disconnects are outcomes, not failures of ours."""
        if self._ended:
            return
        if isinstance(exc, GatewayError) and exc.status < 500:
            self._finished = True  # rejected, not aborted
            if self.recording:
                self.span.set_attributes({"tandem.error.status": exc.status,
                                          "tandem.error.message": exc.message})
            self.end()
        elif aborted or isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.end()
        else:
            self._ended = True
            tracing.end_with_error(self.span, exc)

    def end(self) -> None:
        """End the span (once); a request that had not finished was aborted."""
        if self._ended:
            return
        self._ended = True
        if self.recording and not self._finished:
            self.span.set_attribute("tandem.finish_reason", "abort")
        self.span.end()


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_CHOICES = 16  # n and best_of: each choice is a request of its own (core.start_choices)
_INT64 = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling as a client states it; None means the default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus the top n
    prompt_logprobs: int | None = None  # the prompt's, likewise (completions echo + logprobs)
    speculative: bool = True  # speculative decoding, where the server runs it
    num_speculative_tokens: int | None = None  # cap on draft tokens per step
    timeout_s: float | None = None  # the client's deadline for the whole request, if any
    # Logits controls (engine/logits_controls.py); None or empty: off.
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    structured_output: StructuredOutput | None = None  # checked by the gateway (Grammars)


# The chat roles both front ends accept; "developer" is OpenAI's newer name for "system".
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def template_message(role: str, content: str, reasoning: str | None = None
                     ) -> dict[str, str]:
    """A message as the chat template reads it (templates know "system", not "developer");
    an assistant turn's reasoning as ``reasoning_content`` (what templates that show it read)."""
    message = {"role": "system" if role == "developer" else role, "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def text_chars(value: Any) -> int:
    """The characters of every string in ``value`` (a prompt, or chat messages and their
    parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0


def check_prompt_size(chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """400 before any tokenizing for a text too long to fit the context whatever its tokens
    (each stands for at most ``max_token_chars`` characters)."""
    limit = max_model_len * max_token_chars
    if chars > limit:
        raise bad_request(
            f"{param} has {chars} characters: more than the {max_model_len} tokens of this "
            f"model's context could hold (at most {max_token_chars} characters a token, "
            f"{limit} in all)", param=param, code="context_length_exceeded")


def tokenize_prompt(tokenizer: Tokenizer, prompt: str, add_special_tokens: bool = True
                    ) -> list[int]:
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    return tokenizer.encode(prompt, add_special_tokens)


def tokenize_chat(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                  tools: Sequence[dict[str, Any]] | None = None,
                  template_kwargs: dict[str, Any] | None = None,
                  add_special_tokens: bool = False) -> list[int]:
    if not messages:
        raise bad_request("messages is empty: send at least one message", param="messages")
    clash = sorted(set(template_kwargs or ()) & set(TEMPLATE_VARIABLES))
    if clash:
        raise bad_request(f"chat_template_kwargs cannot set {clash[0]!r}: the server does",
                          param="chat_template_kwargs")
    try:
        return tokenizer.encode_chat(messages, tools, template_kwargs, add_special_tokens)
    except (ValueError, TemplateError) as exc:  # no template, or the template rejected them
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str = "prompt"
                    ) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise bad_request("the prompt has no tokens", param=param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                          param=param)
    return ids


def build_request(request_id: str, prompt_token_ids: list[int], options: SamplingOptions,
                  max_model_len: int, cache_salt: str | None = None,
                  default_max_tokens: int | None = None, arrival_time: float | None = None,
                  prompt_param: str = "prompt", max_timeout_s: float | None = None,
                  vocab_size: int | None = None, tenant: str = DEFAULT_TENANT
                  ) -> GenerationRequest:
    """Check the request against the context length (and the token ids it names against
    ``vocab_size``) and turn options into SamplingParams. Its deadline is the client's
    ``timeout_s`` or ``max_timeout_s`` (the server's limit), whichever is sooner."""
    num_prompt = len(prompt_token_ids)
    room = max_model_len - num_prompt
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt} tokens (prompt + at least 1 generated token must fit).",
            param=prompt_param, code="context_length_exceeded")
    max_tokens = options.max_tokens
    if max_tokens is not None and max_tokens >= 1 and num_prompt + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens) if default_max_tokens else room
    _check_stop(options.stop)
    _check_ranges(options)
    _check_token_controls(options, vocab_size)
    if options.seed is not None and not _INT64[0] <= options.seed <= _INT64[1]:
        raise bad_request(f"seed must fit in 64 bits, got {options.seed}", param="seed")
    top_k = options.top_k if options.top_k is not None else 0
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    seed = options.seed
    if seed is None and options.temperature != 0:
        # Chosen here, once: prefill, decode and any worker a stream migrates to draw the
        # request's tokens from it (engine/sampler.py).
        seed = secrets.randbits(63)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if options.temperature is None else options.temperature,
            top_k=top_k,
            top_p=1.0 if options.top_p is None else options.top_p,
            seed=seed,
            ignore_eos=options.ignore_eos,
            logprobs=options.logprobs,
            prompt_logprobs=options.prompt_logprobs,
            speculative=options.speculative,
            num_speculative_tokens=options.num_speculative_tokens,
            stop_token_ids=options.stop_token_ids,
            min_tokens=options.min_tokens or 0,
            logit_bias=tuple((options.logit_bias or {}).items()),
            presence_penalty=options.presence_penalty or 0.0,
            frequency_penalty=options.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if options.repetition_penalty is None
                                else options.repetition_penalty),
            min_p=options.min_p or 0.0,
            structured_output=options.structured_output,
        )
    except ValueError as exc:  # SamplingParams names the field first in its messages
        field_name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=field_name) from exc
    timeouts = [t for t in (options.timeout_s, max_timeout_s) if t is not None]
    deadline = time.time() + min(timeouts) if timeouts else None
    return GenerationRequest(request_id, prompt_token_ids, params, options.stop, cache_salt or None,
                             time.monotonic() if arrival_time is None else arrival_time,
                             deadline=deadline, tenant=tenant)


# The same bounds for every front end (HTTP's pydantic models state them too).
MAX_TEMPERATURE = 2.0


def _check_ranges(options: SamplingOptions) -> None:
    t, p = options.temperature, options.top_p
    if t is not None and not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
        raise bad_request(f"temperature must be a number between 0 and {MAX_TEMPERATURE}, "
                          f"got {t}", param="temperature")
    if p is not None and not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise bad_request(f"top_p must be a number in (0, 1], got {p}", param="top_p")
    if options.top_k is not None and options.top_k < -1:
        raise bad_request(f"top_k must be >= -1 (0 or -1: off), got {options.top_k}",
                          param="top_k")
    if options.timeout_s is not None and not (math.isfinite(options.timeout_s)
                                              and options.timeout_s > 0):
        raise bad_request(f"timeout must be a number of seconds > 0, got {options.timeout_s}",
                          param="timeout")
    if options.max_tokens is not None and options.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {options.max_tokens}",
                          param="max_tokens")


def _check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}",
                          param="stop")
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters",
                              param="stop")


def _check_token_controls(options: SamplingOptions, vocab_size: int | None) -> None:
    named = [("stop_token_ids", list(options.stop_token_ids), MAX_STOP_TOKEN_IDS),
             ("logit_bias", list(options.logit_bias or ()), MAX_LOGIT_BIAS_TOKENS)]
    for param, ids, most in named:
        if len(ids) > most:
            raise bad_request(f"{param} may name at most {most} tokens, got {len(ids)}",
                              param=param)
        bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)),
                   None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary "
                              f"[0, {vocab_size})", param=param)
