"""Sweeps (``-m``): each job in a child process (``job``), the summary of a sweep (``summary``), Optuna's
objective (``search``), the end-of-sweep Hydra callback (``callbacks``) and the launcher presets' resolvers
(``resolvers``)."""
