"""What travels between Tandem's processes and layers, imported by each of them and importing
nothing of theirs (no torch, no Ray):

- ``block_hash``: a KV block's identity (the chained hash of its tokens), the same in the
  router and every worker.
- ``kv_events``: a worker's KV cache changes (blocks stored, removed, cleared) as the router
  reads them.
- ``bench_records``: one benchmark request's record (``tandem bench`` writes them, the planner
  reads them).
"""
