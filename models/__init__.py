"""Model definitions: the registry of supported families (``registry.py``), the interface the
engine calls (``interface.py``), ``CausalLM`` and the decoder layers split into
pre-attention / attention / post-attention stages (``llama.py``, ``qwen3.py``), the built-in
``neo-tiny``, and weight loading."""
