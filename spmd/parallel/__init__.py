"""The parallel core: from a run's options and a device mesh to a sharded, compiled step.

mesh (axes and devices), rules (logical names -> mesh axes), skeleton (the model's abstract
parameters and their names), checks and layout (every divisibility, once), context (ring
attention, sequence parallelism), experts (expert parallelism), pipeline and zero_bubble
(stage schedules), balance (expert load balancing), kernels (attention kernels), optim
(the optimizer), step (the jitted training step that puts them together).
"""
