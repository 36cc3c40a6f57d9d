"""Training recipes, installed as `amphista_jax.train` (the folder is `train/`).

Data pipelines (`data`, `corpus`), the sharded train step (`step`), orbax checkpoints (`checkpoint`), the
resumable loop (`loop`), the draft-head trainer (`heads`), self-distillation (`distill`) and the embedded
target's pre-training recipe (`pretrain_target`). It builds on the library (`amphista_jax.*`) and is used by
the CLI; the library never imports it.
"""
