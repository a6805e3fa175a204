"""Command-line tools: the parity report (``compare_runs``) and the environment doctor (``doctor``).

Both stay dependency-light (stdlib; matplotlib only for the optional parity plot).
"""
