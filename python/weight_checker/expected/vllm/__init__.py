"""Expected digests through vLLM's own code: one rank's model built and
loaded by vLLM on the CPU (:mod:`.rank_model`, under vLLM's parallel state
for that rank, :mod:`.rank_groups`, and a default dtype of the calling
thread's own, :mod:`.default_dtype`), the loader's copies hashed where the
weights lie (:mod:`.deferred`, :mod:`.load_tracker`), LoRA adapters in vLLM's
slots (:mod:`.lora`), a draft model (:mod:`.draft`), a rank's parameters
located for a recompute (:mod:`.locate`), and a quantized engine's ranks
processed by vLLM after loading (:mod:`.quantized`). What both engine families use (the
rank loop, the engine a running server is, the manifest, recipe and
recompute) is one floor up, in :mod:`weight_checker.expected`."""
