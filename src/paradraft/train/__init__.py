"""Training: data (packing, targets), the generic trainer, checkpoints and resume, distributed runs, plots."""
