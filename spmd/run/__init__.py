"""The run: its options (config), which model it uses and the options checked against it
(resolve), the devices and the mesh (bootstrap), where its weights come from (weights,
pretrained), the trainer (trainer: prepare, train), the step loop with its checkpoints and
logs (loop, observe), several processes (distributed), XLA's flags (xla_flags), export's
reading (export) and compile-only runs for a --target (target).
"""
