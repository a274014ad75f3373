"""What travels between Tandem's processes and layers, each message documented once here,
importing nothing of ours (no torch, no Ray):

- ``request``: ``GenerationRequest``, the request as every layer after parsing sees it, from
  the gateway through the prefill worker to the engine of the decode worker, and its
  ``SamplingParams`` (how to pick tokens, checked where they are built).
- ``outputs``: ``RequestOutput`` (a request's new tokens, logprobs, finish reason), the
  engine's stats and the errors every layer raises and maps to a client status.
- ``handoff``: the prefill-to-decode hand-off: ``KVHandle`` (the lease on a prompt's pinned
  blocks) and ``PrefillResult`` (first token + handle); and the cluster secret that guards
  it: the workers' handshake and the MACs on handles and pairings.
- ``block_hash``: a KV block's identity (the chained hash of its tokens), the same in the
  router and every worker.
- ``kv_events``: a worker's KV cache changes (blocks stored, removed, cleared) as the router
  reads them.
- ``bench_records``: one benchmark request's record (``tandem bench`` writes them, the planner
  reads them).
"""
