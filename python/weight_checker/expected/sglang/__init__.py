"""Expected digests through SGLang's own code: each rank built and loaded by
SGLang's model class on the CPU and hashed over the plugin's walk
(:mod:`.digests`, ``SGLangExpectedDigests``), and the engine an SGLang server
runs, read from its ``/server_info`` with what is refused (:mod:`.server`).
:func:`weight_checker.expected_digests` with ``engine="sglang"`` (or ``like=``
an SGLang server) comes here; what both engine families use (the manifest,
recipe and transforms) is one floor up, in :mod:`weight_checker.expected`."""
