"""Using a trained model: decode (the key/value cache and sampling on the mesh), generation
(`spmd.generate`'s library) and evaluation (`spmd.eval`'s).
"""
