"""Drop-in integrations of xcp with model libraries; each imports its library only when used.

- :mod:`xcp.integrations.transformers`: Hugging Face transformers (``attn_implementation="xcp"``), and its
  ``generate`` over a KV cache sharded across ranks (:mod:`xcp.integrations.transformers_generate`, which
  the attention function reaches through :mod:`xcp.integrations.decoding`).
"""
