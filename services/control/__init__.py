"""The control channel between workers: JSON request/response over TCP, and process helpers."""
