"""The planner: what a layout costs before it runs. theory (bytes and collectives from the
shapes), footprint (memory per device), hlo and traffic (what the compiled program really
moves), roofline (time from hardware figures), plan (measured against theory), report (the
tables it prints).
"""
