"""Prefill and decode workers run without Ray, each its own process serving a JSON RPC (with the
cluster handshake when given a secret): what the KV-transfer benchmark and the disaggregation
tests drive directly, the workers and transports being the production ones. ``tandem up`` and
the Helm chart run workers as Ray Serve replicas instead (services/serving/workers.py).

- ``rpc``: the framed JSON RPC (client, server, errors by name);
- ``codec``: the request and its parameters as JSON;
- ``process``: a worker process (``WorkerSpec``; ``spawn_worker`` starts
  ``python -m tandem.loadtest.rpc_workers.<role>``);
- ``prefill`` / ``decode``: each role's handlers, its client (``RemotePrefill``,
  ``RemoteDecode``) and its process entry point.
"""
