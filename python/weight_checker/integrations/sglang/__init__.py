"""SGLang glue: a stock SGLang server serves weight_checker's digests once this
package is installed.

- :mod:`.plugin`: the ``sglang.srt.plugins`` entry point (loaded in the server,
  an in-process ``sglang.Engine`` and every scheduler, one per rank): refuses
  an SGLang it does not know, hooks every rank's weight checker, mounts the
  route on the server.
- :mod:`.worker`: what each rank answers: the Rust core's checksum and reset
  over the tensors SGLang's own checker walks, keyed by the rank's own
  parallelism.
- :mod:`.endpoint`: ``POST /weight_checker`` on the server (this package's
  route, :mod:`weight_checker.server`), over every rank behind it.
"""

import logging

# Under SGLang's logger tree, so its handler, format and level apply.
logger = logging.getLogger("sglang.srt.plugins.weight_checker")
