"""Quality measures of a model on a text (what `kvstate eval` prints): perplexity over sliding
windows, and against a base (fp32 weights, or a saved base file) the KL divergence and top-1
agreement token by token, as llama.cpp's `llama-perplexity --kl-divergence` reports them.

    windows.py      which tokens each window scores (no torch)
    perplexity.py   scoring a window chunk by chunk, the statistics, the base file
"""
