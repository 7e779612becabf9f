"""What the tests share, by job: the parity runs and their tolerances (parity), the
command-line and fault tests' checks and drivers (commands). tests/conftest.py keeps only
pytest's set-up: JAX's environment, the session's fixtures and the tier hooks."""
