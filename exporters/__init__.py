"""llm-exporters: Hugging Face LLM checkpoints to validated multi-method ExecuTorch programs."""

import logging

# Import-time noise of the pinned stack on a CPU-only host (torchao's CUDA extensions failing to
# load, a torch pytree deprecation): not actionable for users, and it buries the export's own log.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
