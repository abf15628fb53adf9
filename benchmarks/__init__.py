"""Benchmarks and profiles of the exporter, run from the top of the checkout (not part of the wheel):

    python -m benchmarks.export          ours against ExecuTorch's export_llm on the same model, same run
    python -m benchmarks.cost_curve      export cost against model size, from benchmarks.export reports
    python -m benchmarks.generate        how much of a program's decode speed exporters.generate delivers
    python -m benchmarks.speculative     speculative decoding (lookup) against plain decoding, per task
    python -m benchmarks.eager_quality   perplexity of the eager model, unquantized and quantized (no export)
    python -m benchmarks.load_memory     peak memory of loading a checkpoint, against its size
    python -m benchmarks.profile_memory  each export stage's peak RSS, and each step of emit
    python -m benchmarks.profile_ops     a program's decode time per operator (ETDump, ExecuTorch 1.5.1 runtime)
    python -m benchmarks.pyspy_summary   where an export's time goes, from a py-spy profile
    python -m benchmarks.sweep_launchers wall time of one sweep on each Hydra launcher
    python -m benchmarks.presets         the model presets (``--preset NAME`` of every tool)

Each takes ``--help``. Tables over many exports are sweeps: ``python -m exporters.llm -m +experiment=...``
with the presets in ``conf/experiment/``.
"""
