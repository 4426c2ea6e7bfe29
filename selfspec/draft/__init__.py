"""The draft: sublayer skipping, low-precision kept weights, a cut head, copy drafting, fused draft steps, draft files."""
