"""The parallel core: from a run's options and a device mesh to a sharded, compiled step.

mesh (axes and devices), defaults (the layout without --mesh), rules (logical names -> mesh
axes), skeleton (the model's abstract parameters and their names), checks and layout (every
divisibility, once; the shardings), context (ring attention, sequence parallelism), experts
(expert parallelism), pipeline (a package: the stage schedules) and staged (a step's loss and
gradients through them), balance (expert load balancing), kernels (attention kernels on a
mesh), optim (the optimizer), objective (the loss of a batch), step (the jitted training
step that puts them together).
"""
