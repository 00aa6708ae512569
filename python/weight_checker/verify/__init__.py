"""The RL weight-update check: the workflow (:mod:`.workflow`), what it
found (:mod:`.results`), the comparison once every checksum is in
(:mod:`.compare`), how each mismatch is classed (:mod:`.classes`),
replica consistency (:mod:`.replicas`), several engines' digests
(:mod:`.engine_digests`), the one fan-out pool (:mod:`.fanout`) and the
engines it checks (:mod:`.targets`); the HTTP client sits a floor below, in
:mod:`weight_checker.httpclient`.

The public entry points are re-exported by the package root:
``weight_checker.verify``, ``verify_async``, ``replicas``.
"""
