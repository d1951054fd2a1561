"""The project's own Triton kernels and their pure-torch references.

- ``reshape_and_cache``: write a step's K/V rows into the paged cache.
- ``paged_attention``: causal attention over the paged cache for a mixed
  prefill/decode batch.
- ``reference``: slow, obviously correct torch versions of both, for tests.

Import the submodules directly.  This package imports nothing itself, so that
``reference`` works without triton and the Triton kernels are only decorated
when first imported, after a test has had the chance to set TRITON_INTERPRET=1.
"""
