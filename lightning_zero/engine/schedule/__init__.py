"""The runtime schedule: when units gather, release and prefetch in forward and backward (``stage3``, along the
orders of ``order``), the no-grad forwards that ranks run different numbers of times (``joined``), how gradients
are reduced from backward hooks (``grads``), and what runs under ``torch.compile`` (``compiled``).

Imports ``engine.core``, ``engine.comm``, ``engine.errors`` and torch.
"""
