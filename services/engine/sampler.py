"""Token sampling: greedy, temperature, min-p, top-k, top-p, logprobs, with draws keyed by
position (the logits controls of ``logits_controls`` come first).

A sampled request's token at output position ``i`` is ``argmax(probs / E)``, where ``E`` holds
one Exp(1) variate per vocabulary entry: the exponential race, which picks token x with
probability ``probs[x]``. ``E`` is counter-based noise, a pure function of the vocabulary index
and the request's key ``position_seed(seed, i)``, computed on the logits' device with integer
tensor ops and identical on CPU and CUDA bit for bit (``exponential_noise_rows``). The draw
depends on nothing else (not the batch, the worker, the device, the step, nor what came
before), so a request continues exactly on any worker: colocated, disaggregated, after a
migration, and with or without speculation. Every sampled request has a seed: the client's, or
one the gateway (or, called directly, the engine) chose and recorded in the request.

``sample`` draws a whole batch at once on the logits' device: per-row temperature, top-k and
top-p as tensors, one stable sort for the rows that truncate, one host sync (the tokens).
A row's token does not depend on the other rows of its batch.

Speculative decoding verifies drafts by the same rule (``verify``): the target draws its own
token at each drafted position and a draft is accepted while it equals that draw, so the
emitted tokens are exactly those plain decoding emits. A draft model drafts with the same
noise (``sample`` at the same positions), so where it is close to the target its draws agree.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.device import to_device
from tandem.services.protocol.outputs import TokenLogprobs
from tandem.services.protocol.request import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF
# lowbias32's multipliers. The second exceeds 2**31, so x * it (x < 2**32) could pass 2**63:
# multiply by its negative mod 2**32 instead (x * -0x7B935975 > -2**63, no overflow; masking
# a negative int64 keeps its two's-complement low bits, i.e. the product mod 2**32).
_MUL1 = 0x7FEB352D
_MUL2_NEG = 0x846CA68B - (1 << 32)  # == -0x7B935975


def position_seed(seed: int, position: int) -> int:
    """The noise key of a request's draw at output ``position`` (SplitMix64 of both): 63 bits."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


# -- Counter-based noise ------------------------------------------------------------------------
#
# For vocabulary index v and key k (63 bits, lo = k mod 2**32, hi = k >> 32):
#     h = lowbias32(lowbias32(lowbias32(v) ^ lo) ^ hi)
# with Chris Wellons' lowbias32 (hash-prospector), a 32-bit bijection
#     x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16   (mod 2**32),
# i.e. two rounds of a tiny keyed permutation of 32-bit words, the key's halves xored in before
# each (the round-key structure of Philox/Threefry, with a far cheaper round: multiplies by
# constants only, no 64-bit high products, so int64 tensors hold every intermediate exactly).
# The key-independent lowbias32(v) first spreads the small indices over all 32 bits (v ^ lo
# alone would hand two keys whose lo differ in low bits only the same words, permuted). Every
# value is kept in [0, 2**32) by masking after each multiply; shifts see non-negative values
# only; no product reaches 2**63 (see _MUL2_NEG), so nothing relies on signed overflow.
# Then u = ((h >> 9) + 0.5) / 2**23, in [2**-24, 1 - 2**-24] and exact in float32 (a 24-bit
# significand), and E = -ln(u), computed in float64 and rounded to float32. For every one of
# the 2**23 possible u, -ln(u) lies at least 48 float64 ulps from a float32 rounding midpoint
# (checked exhaustively in the tests), so any float64 log accurate to a few ulps (CPU or CUDA)
# yields the same, correctly rounded, float32 E: the noise is identical bit for bit everywhere.


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on int64 values in [0, 2**32)."""
    x ^= x >> 16
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_MUL2_NEG).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def noise_hash(keys: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """The 32-bit hashes (int64 in [0, 2**32)) of vocabulary indices under each of ``keys``
    (int64 [N], values in [0, 2**63)): [N, V] on ``keys``' device, for the indices
    ``0..vocab-1`` (``vocab`` an int) or the int64 indices ``vocab`` [V]."""
    keys = keys.to(torch.int64)
    lo = (keys & _MASK32).unsqueeze(-1)
    hi = (keys >> 32).unsqueeze(-1)  # keys are non-negative
    if isinstance(vocab, int):
        index = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    else:
        index = vocab.to(device=keys.device, dtype=torch.int64, copy=True)
    x = _lowbias32_(_lowbias32_(index) ^ lo)  # [N, V]
    x ^= hi
    return _lowbias32_(x)


def _exponential(hashes: torch.Tensor) -> torch.Tensor:
    """Exp(1) variates (float32) from 32-bit hashes (int64, overwritten)."""
    hashes >>= 9
    u = hashes.mul_(2).add_(1).to(torch.float64).mul_(2.0 ** -24)  # (2m + 1) / 2**24, exact
    return u.log_().neg_().to(torch.float32)


# On a CPU the noise is made a few rows at a time: its int64 temporaries then stay in cache.
_CPU_CHUNK = 1 << 17


def exponential_noise_rows(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) variates, float32 [N, vocab_size] on ``keys``' device: row i is the noise of key
    ``keys[i]`` (a ``position_seed``). Never 0, never inf. Elementwise: a row's noise does not
    depend on the other keys."""
    if keys.device.type != "cpu" or keys.shape[0] * vocab_size <= _CPU_CHUNK:
        return _exponential(noise_hash(keys, vocab_size))
    noise = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32)
    for rows, out in zip(keys.split(max(1, _CPU_CHUNK // vocab_size)),
                         noise.split(max(1, _CPU_CHUNK // vocab_size)), strict=True):
        out.copy_(_exponential(noise_hash(rows, vocab_size)))
    return noise


def exponential_noise(seed: int, position: int, vocab_size: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) variates, one per vocabulary entry, for the draw at ``position``."""
    keys = torch.tensor([position_seed(seed, position)], dtype=torch.int64, device=device)
    return exponential_noise_rows(keys, vocab_size)[0]


# -- Batched sampling ---------------------------------------------------------------------------


def _top_k_on(top_k: int, vocab_size: int) -> bool:
    return 0 < top_k < vocab_size


def _sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(x, dim=-1, descending=True, stable=True)`` of float32 ``x`` [R, vocab]:
    by value, ties in index order. On a CPU, torch's stable sort is slow (a comparison sort per
    row); there the rows are sorted as unique int64 keys (value's rank, index), any sort of
    which is the stable one, with numpy's vectorised sort: the same permutation, 5-10x faster.
    """
    if x.device.type != "cpu":
        return torch.sort(x, dim=-1, descending=True, stable=True)
    x = x.contiguous()
    order = torch.empty(x.shape, dtype=torch.int64)
    index = torch.arange(x.shape[-1], dtype=torch.int64)
    step = max(1, _CPU_CHUNK // x.shape[-1])
    for rows, out in zip(x.split(step), order.split(step), strict=True):
        # Signed ints in the order of -x: the usual float -> int order map on the bits of
        # 0.0 - x (which is +0.0 for both zeros, equal floats); int32, so the arithmetic shift
        # is torch's defined one. Then (rank, index) as one int64, rank * 2**32 >= -2**63.
        neg = (0.0 - rows).view(torch.int32)
        rank = (neg ^ ((neg >> 31) & 0x7FFFFFFF)).to(torch.int64)
        keys = rank.mul_(1 << 32).add_(index).numpy()
        keys.sort(axis=-1)  # in place; the keys are unique, so any sort is the stable one
        torch.bitwise_and(torch.from_numpy(keys), _MASK32, out=out)
    return x.gather(-1, order), order


def _truncate(scaled: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p of float32 ``scaled`` [R, vocab] (row r by ``params[r]``): the dropped
    entries set to -inf. One stable sort of all rows."""
    vocab = scaled.shape[-1]
    sorted_logits, order = _sort_descending(scaled)
    if any(_top_k_on(p.top_k, vocab) for p in params):
        k = to_device([p.top_k if _top_k_on(p.top_k, vocab) else vocab for p in params],
                    torch.int64, scaled.device)
        kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))  # the k-th largest (ties stay)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # float32 like the logits: a top_p that rounds to 0 keeps just the best token.
        top_p = to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                        torch.float32, scaled.device)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it already reaches top_p; the best always stays.
        drop = probs.cumsum(-1).sub_(probs) >= top_p.unsqueeze(-1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(-1, order, sorted_logits)


def _min_p(scaled: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Min-p of float32 ``scaled`` [R, vocab]: a row's tokens whose probability is below its
    ``min_p`` times its most likely token's are set to -inf (``min_p`` 0: none)."""
    min_p = to_device([p.min_p for p in params], torch.float32, scaled.device).unsqueeze(-1)
    probs = scaled.softmax(-1)
    return scaled.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))


def batch_probabilities(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """The distributions [N, vocab] (float32, on the logits' device) that the non-greedy
    requests ``params`` sample from, row by row, as ``probabilities`` describes. Only the rows
    that truncate are sorted (together); a row's result does not depend on the other rows."""
    scaled = logits.float() / to_device([p.temperature for p in params], torch.float32,
                                      logits.device).unsqueeze(-1)
    if any(p.min_p > 0.0 for p in params):
        scaled = _min_p(scaled, params)
    vocab = scaled.shape[-1]
    truncating = [r for r, p in enumerate(params)
                  if _top_k_on(p.top_k, vocab) or p.top_p < 1.0]
    if len(truncating) == len(params):
        scaled = _truncate(scaled, params)
    elif truncating:
        rows = to_device(truncating, torch.int64, scaled.device)
        scaled.index_copy_(0, rows, _truncate(scaled.index_select(0, rows),
                                              [params[r] for r in truncating]))
    return scaled.softmax(-1)


def argmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first on a tie (NaN counts as largest), as
    ``argmax(dim=-1)``: ``max`` finds the same index 3x faster on a CPU (a [32, 49152] float32
    batch of logits, one thread: 0.78 ms against 2.4), our CPU kernel (where this process has
    loaded it) about 4x faster again."""
    kernels = cpu_kernels.loaded() if rows.is_cpu and rows.dtype == torch.float32 else None
    if kernels is not None and rows.dim() == 2 and rows.stride(1) == 1:
        return kernels.argmax(rows)
    return rows.max(dim=-1).indices


def sample(logits: torch.Tensor, params: Seq[SamplingParams], positions: Seq[int]
           ) -> list[int]:
    """One token per row of float32 ``logits`` [N, vocab]: row i is a draw of ``params[i]``'s
    request at output position ``positions[i]``. Greedy rows take the argmax; the sampled rows
    are drawn together on the logits' device. The one host sync is the returned list."""
    if len(params) != len(positions) or len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(params)} params, "
                         f"{len(positions)} positions")
    drawn = [r for r, p in enumerate(params) if not p.greedy]
    if not drawn:
        return argmax(logits).tolist()
    keys = []
    for r in drawn:
        seed = params[r].seed
        if seed is None:
            raise ValueError("a sampled request needs a seed (the engine assigns one)")
        keys.append(position_seed(seed, positions[r]))
    rows_params = [params[r] for r in drawn]
    keys_t = to_device(keys, torch.int64, logits.device)
    if len(drawn) == len(params):
        return _race(batch_probabilities(logits, rows_params), keys_t).tolist()
    rows = to_device(drawn, torch.int64, logits.device)
    tokens = argmax(logits)
    probs = batch_probabilities(logits.index_select(0, rows), rows_params)
    return tokens.index_copy_(0, rows, _race(probs, keys_t)).tolist()


def _race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exponential race of each row of ``probs`` [N, vocab] with its key's noise."""
    return argmax(probs / exponential_noise_rows(keys, probs.shape[-1]))


def verify(logits: torch.Tensor, params: SamplingParams, first_position: int,
           draft_tokens: list[int]) -> list[int]:
    """The tokens a step emits for a sequence that verified ``draft_tokens`` at output
    positions ``first_position``...: the drafts that equal the target's own draws, then the
    target's draw at the first mismatch (or after the last draft). ``logits`` has one row
    more than the drafts; all rows are drawn in one batched ``sample``."""
    rows = len(draft_tokens) + 1
    targets = sample(logits[:rows], [params] * rows, range(first_position, first_position + rows))
    return accept_matching(targets, draft_tokens)


def accept_matching(targets: list[int], draft_tokens: list[int]) -> list[int]:
    """``targets[i]`` is the target's token after draft i (row 0: before any)."""
    emitted: list[int] = []
    for i, draft in enumerate(draft_tokens):
        emitted.append(targets[i])
        if targets[i] != draft:
            return emitted
    emitted.append(targets[len(draft_tokens)])
    return emitted


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from (one row of float32 ``logits``):
    temperature, then min-p, then top-k (0 or >= vocab: off; ties with the k-th stay), then
    top-p (a token is dropped once the mass before it already reaches top_p; the best token
    always stays).
    The batched code of ``sample`` (``batch_probabilities``) for one row."""
    return batch_probabilities(logits.unsqueeze(0), [p])[0]


def token_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """Logprobs of the model's raw distribution (before temperature and truncation)."""
    return rows_logprobs(logits.unsqueeze(0), [token_id], top_n)[0]


def rows_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int
                  ) -> list[TokenLogprobs]:
    """``token_logprobs`` of each row of ``logits`` [rows, vocab] and its token, at once."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top_n:
        values, ids = logprobs.topk(top_n, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                              strict=True)]
    return [TokenLogprobs(t, p, top) for t, p, top in zip(token_ids, chosen.squeeze(1).tolist(),
                                                        tops, strict=True)]
