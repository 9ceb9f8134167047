"""Low-bit weight formats (SPEC section 8)."""


def expand(weights, what):
    """(float32 weights dict, format name) for a block constructor."""
    return weights, "float32"
