"""The draft: skip plans and sublayer skipping, low-precision kept weights, a cut head, copy drafting, packed weights."""
