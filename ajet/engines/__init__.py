"""The engines that generate for ajet (docs/engines.md): `engine.kind` in the config chooses one.

- `in_process`: ajet's own engine (`ajet.backbones.debug.engine.HFEngine`), on the very weights the trainer updates.
- `vllm`: a vLLM OpenAI server (`vllm_server.VLLMServer`, started and owned by ajet, or servers the user runs),
  reached through `ajet.remote_engine.RemoteEngine` (one per server, behind `ajet.backbones.server_pool.ServerPool`),
  with the full weights pushed after every update (`vllm.VLLMEngine.sync_weights`).

The `Engine` protocol they implement is `ajet.engine.Engine`.
"""
