"""Model files into a checkpoint: GGUF and Hugging Face readers, the block forms GGUF matrices
are served in, the measured crossover of quantized kernels, start-up progress lines, and the
tokenizer export."""
