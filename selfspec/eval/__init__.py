"""Evaluation: methods (ours and transformers'), the timing harness, the runner, results records, tables and figures."""
