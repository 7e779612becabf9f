"""The ground floor: what every other package stands on, with no JAX program of its own.

errors (one-line user errors), schema (types and bounds of every file read), paths (claiming
outputs, locks), signals (SIGTERM/SIGINT served as clean exits), console (one line per
write, sizes), cli (argument types shared by the commands: integers read with bounds, the
flags the data commands share), hardware (the accelerators we know: memory, peak FLOP/s,
links; the host's memory and CPUs), accelerators (which backend JAX will start, decided
before it starts).
"""
