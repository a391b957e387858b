"""Model files into a checkpoint: GGUF and Hugging Face readers, quantized weight forms, the
weight cache for fast restarts, the measured crossover of quantized kernels, and the tokenizer
export."""
