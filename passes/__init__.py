"""Graph passes, installed as oq.passes. One family of rewrites per module."""
