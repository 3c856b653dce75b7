"""The shared core every g4 package stands on: typed errors, the Gemma 4 architecture read from
config.json, the safetensors checkpoint reader, progress bars and prompt tokenization.

It imports only :mod:`g4.quantizers`; exporters, convert and serve import it (tests/test_import_graph.py).
"""
