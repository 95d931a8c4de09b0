"""Dynamic context-parallel attention: pure math, one module per communication variant, the core module."""
