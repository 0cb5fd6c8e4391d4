"""ZeRO stages 1, 2 and 3 as PyTorch Lightning strategies."""
