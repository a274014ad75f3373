"""KV block transfer between workers: one interface, a NIXL and a plain TCP implementation."""
