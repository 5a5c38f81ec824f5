"""Drop-in integrations of xcp with model libraries; each imports its library only when used.

- :mod:`xcp.integrations.transformers`: Hugging Face transformers (``attn_implementation="xcp"``).
"""
