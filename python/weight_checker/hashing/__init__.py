"""Digests: which tensors (:mod:`.walk`), checksum / reset / compare
(:mod:`.digests`), safetensors checkpoints (:mod:`.checkpoint`), device
tensors through pinned staging (:mod:`.staging`, :mod:`.copy_engines`,
:mod:`.tensor_bytes`) and the core's DLPack fallback (:mod:`.dlpack_export`).
Everything here hashes through the compiled core ``weight_checker._core``."""
