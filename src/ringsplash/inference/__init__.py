"""Inference with a KV cache sharded along the sequence: ``prefill`` fills a ``KVCache``,
``decode_step`` feeds one token per row (each device attends its cache shard, the partial results
merged exactly), ``decode_steps`` several as one program, ``generate`` runs the loop (greedy or sampled)."""

from ringsplash.inference.cache import KVCache, check_cache, empty_cache
from ringsplash.inference.decode import Decoded, decode_step, decode_steps
from ringsplash.inference.generate import bucket_length, generate
from ringsplash.inference.prefill import Prefilled, cache_multiple, prefill
from ringsplash.inference.sample import filter_logits, sample

__all__ = ["Decoded", "KVCache", "Prefilled", "bucket_length", "cache_multiple", "check_cache", "decode_step",
           "decode_steps", "empty_cache", "filter_logits", "generate", "prefill", "sample"]
