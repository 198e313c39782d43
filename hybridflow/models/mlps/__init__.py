"""Channel mixers: the dense SwiGLU MLP here; routed experts in models/moe.py."""
