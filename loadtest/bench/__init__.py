"""``tandem bench``: workloads, streaming clients, SLO metrics and reports for any
OpenAI-compatible server (and Tandem's gRPC API). See docs/loadtest.md."""
