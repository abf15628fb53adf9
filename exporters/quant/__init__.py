"""Quantization: the schemes ``conf/quant/`` names (``schemes``), how they are applied to the eager model
(``apply``), the tied-embedding decision (``tied``), HQQ by rows (``hqq``), and quantizing each activation once
in a captured program (``activations``)."""
