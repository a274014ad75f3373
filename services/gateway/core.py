"""What both front ends share: the backend, the tokenizer, settings, metrics, and the checks;
and the choices of one request.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
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

from tandem.services.engine.grammar import Grammars
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.gateway.backend import GenerationBackend, HealthReporting, MultiWorkerStats
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.errors import GatewayError, bad_request, model_not_found
from tandem.services.gateway.inputs import SamplingOptions, build_request, check_prompt_size
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
from tandem.services.gateway.request_trace import RequestTrace
from tandem.services.gateway.tenants import FairSlots, Tenants
from tandem.services.protocol.outputs import EngineStats
from tandem.services.protocol.request import (
    DEFAULT_TENANT,
    UNKNOWN_TENANT,
    GenerationRequest,
    StructuredOutput,
)

log = logging.getLogger(__name__)

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
        log.info("%s refused for tenant %s: %d %.*r", operation, tenant, error.status,
                 MAX_LOGGED_MESSAGE, error.message)

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

    async def start(self, request: GenerationRequest, trace: RequestTrace | None = None
                    ) -> Generation:
        """Submit the request and wait for its first step (rejections raise ``GatewayError``).
        ``trace`` (the request's span) ends with the generation."""
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
                                 self.config.retry_after_s)
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
                merged.usage = delta.usage
                merged.prompt_logprobs = merged.prompt_logprobs or delta.prompt_logprobs
        finally:
            await self.aclose()
        return merged


# Choices (n > 1, best_of) ------------------------------------------------------------------

T = TypeVar("T")
_SEED_SPACE = 2**64  # seeds are 64-bit (inputs.py); seed + i wraps within them
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
                        trace: RequestTrace | None = None) -> Choices:
    """Start ``n`` choices of ``request``: choice 0 first, then the others at once. If any is
    refused (or this is cancelled), those started are closed and the refusal raised."""
    first = await gateway.start(request, trace)
    if n == 1:
        return Choices([first])
    others = await _all_or_none(
        [gateway.start(choice_request(request, i)) for i in range(1, n)], first.aclose)
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
