"""Bounded oneDNN kernel caches: a process that runs matmuls of many shapes keeps a bounded set of compiled kernels.

On a CPU, PyTorch runs bf16 matmuls (and some float32 ones) through oneDNN, which compiles a kernel for every new
shape and keeps it in two caches of 1,024 entries each: ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's primitive
cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). Training meets a new shape at almost every step (each step's token
count differs; the decoder's batch shrinks as rows finish), and measured here one cached bf16 linear shape held
about 0.7 MB (400 shapes of a 576 x 1536 linear: +276 MB of RSS with the defaults, +19 MB with 16 entries). On
SmolLM2-135M the trainer and its decode worker each grew by ~0.35 GB over their first ten steps, the growth of the
whole run (benchmarks/JOURNAL.md, "Memory: bounded kernel caches, the defaults at 0.46x"). Both caches are bounded to
:data:`KERNEL_CACHE_ENTRIES` entries, far more than the shapes one step reuses (a layer's forward and backward take
about 15; decode about 5 per batch size), so a kernel is rebuilt only when a shape comes back after many others: an
A/B of 10-step runs measured no difference in step time. A recompiled kernel computes what the cached one did: no
value changes.

The caches read their capacity once, when the first kernel is built, from the environment: :func:`bound_kernel_caches`
sets only the variables the user has not set (``LRU_CACHE_CAPACITY=1024 ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024``
restores PyTorch's own sizes). Importing meshrl changes nothing: meshrl's own entry points call it first thing (the
``meshrl`` command line, the experiments' command lines, the memory benchmarks), and their worker processes inherit
the variables. A program that uses meshrl's Python API (``Trainer``, the TRL callback, the verl plug-in) runs with
PyTorch's sizes unless it calls ``meshrl.kernel_caches.bound_kernel_caches()`` itself, before it builds a model or
runs a matmul; a process that has built oneDNN kernels already keeps the sizes it started with.
"""

from __future__ import annotations

import os

__all__ = ["CACHE_VARIABLES", "KERNEL_CACHE_ENTRIES", "bound_kernel_caches"]

KERNEL_CACHE_ENTRIES = 128
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Set each cache-capacity variable the environment does not already set to ``entries``; return their values."""
    if entries < 1:
        raise ValueError(f"kernel cache entries must be >= 1, got {entries}")
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in CACHE_VARIABLES}
