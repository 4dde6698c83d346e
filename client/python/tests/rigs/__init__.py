"""This repository's Python test rigs (not shipped with the kvcm package): launchers for a real
kvcm-manager, real vLLM and SGLang engines, tiny model directories, wheel and capture tools,
and the clusters the engine tests build. The tests import them as `rigs.<module>`; benches put
client/python/tests on sys.path first. A double a kvcm user would want in their own tests lives
in kvcm.testing instead."""
