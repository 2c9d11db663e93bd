"""Model families, one file each; registry.py maps HF architecture names to classes."""
