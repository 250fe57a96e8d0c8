"""The engines that generate for ajet (docs/engines.md): `engine.kind` in the config chooses one.

- `in_process`: ajet's own engine (`ajet.engines.in_process.HFEngine`), on the very weights the trainer updates.
- `vllm`: a vLLM OpenAI server (`vllm_server.VLLMServer`, started and owned by ajet, or servers the user runs),
  reached through `ajet.engines.remote.RemoteEngine` (one per server, behind `ajet.engines.pool.ServerPool`),
  with the full weights pushed after every update (`vllm.VLLMEngine.sync_weights`).

The `Engine` protocol they implement is `ajet.engines.base.Engine`.
"""
