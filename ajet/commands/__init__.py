"""The commands: one module per way of using ajet, the top layer over the core. Each builds what its mode needs
(a `RunMode` for the ones that train: datasets, rollout source, update policy, what follows the last step) and
hands it to the one training loop, `ajet.trainer.run`; `ajet.cli` parses the command line and calls them.

    train.py    ajet --conf X.yaml                 the workflow in this process (or on Ray actors)
    serve.py    ajet serve                         clients anywhere run the episodes (ajet/serve/)
    gateway.py  ajet gateway [rollback]            a live endpoint that trains on feedback (ajet/gateway/)
    sft.py      ajet sft --from EXP_DIR            fine-tuning on a finished run's recorded samples
    export.py   ajet export --format hf            recorded samples as a Hugging Face dataset
    eval.py     ajet eval                          held-out evaluation of a model or checkpoint
    doctor.py   ajet doctor                        whether a model's chat template merges exactly
    init.py     ajet init                          a new project from a template

Imports point down only: nothing below this package imports it.
"""
