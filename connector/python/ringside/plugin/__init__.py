"""What the engine plugins (ringside.vllm, ringside.sglang) share.

- :mod:`.config`: the typed configuration of both plugins (every key with
  its type, default, unit and meaning; checked at engine start).
- :mod:`.namespace`: the layout fingerprint that keeps engines whose block
  bytes differ apart.
- :mod:`.region`: a KV cache in host or GPU memory described as one sidecar
  region, from strided tensors.
- :mod:`.faults`: which sidecar errors drop the session (re-attached later)
  and which are a plain miss.
- :mod:`.stats`: the counters a plugin keeps, and their JSON file.

Nothing here imports an engine: both plugins and their unit tests use it.
"""
