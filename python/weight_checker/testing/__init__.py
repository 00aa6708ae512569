"""Test support, not used at run time: start and stop local vLLM servers and
in-process engines the way the project's tests, demo and benchmarks do
(:mod:`.launch`), and make tiny models. Nothing in the runtime package
imports it."""
