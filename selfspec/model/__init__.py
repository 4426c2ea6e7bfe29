"""What everything stands on: where each architecture keeps its sublayers (``arch``), wrapping modules of one model
instance in place (``wrap``), and the skip plan (``plan``)."""
