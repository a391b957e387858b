"""Model code: one module per architecture family, and the layers they share (paged attention,
quantized linear layers)."""
