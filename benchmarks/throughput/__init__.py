"""Training throughput benchmarks (tokens/s, MFU, scaling, MLM vs BertForMaskedLM)."""
