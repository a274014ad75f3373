"""``tandem batch``: OpenAI batch files (JSONL) answered through the gateway's own HTTP API,
in-process or against a running cluster (docs/api.md, "Offline batches")."""
