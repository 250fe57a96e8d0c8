"""The learning signal: advantages (advantage.py), the token loss (loss.py), dynamic sampling's group
filter (sampling.py) and the sample guards (guards.py). Pure functions of tensors and samples; nothing
here imports the trainer, the proxy or a backbone."""
