"""The export pipeline (``pipeline``), the artifacts passed between stages (``artifacts``), and one module per
stage, in the order they run: load, baseline, quantize, capture, lower, emit, validate, finalize, bench."""
