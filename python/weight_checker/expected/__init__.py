"""The digests every rank of an engine must hold, computed from the weights
through vLLM's own model classes and loaders (:mod:`.digests`), fed from a
checkpoint or the trainer's tensors (:mod:`.weights`), one rank's parallel
state at a time (:mod:`.rank_groups`)."""
