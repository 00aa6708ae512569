"""Puts the GPU-layout hook (:mod:`weight_checker.testing.gpu_layout`) into
every process of a test server: on ``PYTHONPATH`` after the launcher's AMX
directory, whose ``sitecustomize`` chains to this one."""

from weight_checker.testing.gpu_layout import install

install()
