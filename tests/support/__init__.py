"""Helpers shared by test files (no test file imports another): attention operands, head sizes,
meshes, masks and mask strategies, strategy runners, training set-ups."""
