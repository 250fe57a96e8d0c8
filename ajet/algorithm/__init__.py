"""The learning signal: advantages (advantage.py), the token loss (loss.py), dynamic sampling's group
filter (sampling.py), the sample guards (guards.py) and the PPO mini-batches of an epoch (batching.py). Pure functions of tensors and samples; nothing
here imports the trainer, the proxy or a backbone."""
