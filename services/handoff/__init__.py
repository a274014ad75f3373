"""The prefill-to-decode hand-off of a prompt's KV, both halves in one place
(docs/disaggregation.md).

- ``prefill.PrefillWorker``, the prefill side: runs the prompt ``prefill_only`` (the engine pins
  its blocks), offers them under a lease (``LeaseTable``: a TTL, the one decode worker it was
  offered to) in a signed ``KVHandle``, frees them on *release* (the decode worker has them),
  *reject* (it will not take them) or expiry.
- ``decode.DecodeWorker``, the decode side: reserves blocks (reusing those its prefix cache
  holds), pulls the rest under the lease, verifies, *releases* the lease (the answer vouches for
  what was read), commits the import; a failed pull recomputes the prompt here (or fails the
  request when configured so), a request it will not take is *rejected*.
- ``staging.TransferArea``: the blocks transfers use: the engine's own, or with tensor
  parallelism canonical staging blocks gathered from and scattered to every rank.
- ``pairing``: the settings both workers must share, checked once per pair, signed.
- ``trace``: each side's span of a request.

The transports (services/kv_transfer) only move bytes, below this package; the messages that
cross processes (``KVHandle``, ``PrefillResult``) live in services/protocol/handoff.py.
"""
