"""Ahead-of-time compiles for a target chip from shapes alone (`jaxserve plan`)."""
