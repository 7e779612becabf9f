"""The run: its options (config), where its weights come from (weights), the trainer
(trainer: prepare, train), the step loop with its checkpoints and logs (loop, observe),
several processes (distributed) and XLA's flags (xla_flags).
"""
