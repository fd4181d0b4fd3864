"""Curvature: Hutchinson estimates, the GGN of a cross-entropy, the curvature source.

Also attention that can be differentiated twice (for Hessian-vector products).
"""
