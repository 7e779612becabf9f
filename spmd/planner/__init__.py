"""The planner: what a layout costs before it runs. theory and activations (bytes and
collectives of the parameters and the activations, from the quantities counting shares),
footprint (memory per device), hlo, traffic and offsets (what the compiled program really
moves, and where), roofline (time from hardware figures), plan (measured against theory,
and --auto), report (the tables it prints), matrix (the layouts of every pair and triple
of features), targets (the accelerators --target compiles for, without one).
"""
