"""Model definitions (the Llama family, split into pre-attention / attention / post-attention
stages), the built-in ``neo-tiny``, and weight loading."""
